"""Choosing the kernel backend (config key device.kernels, auto | torch | triton | cpu), and the
Triton backend's host-side pieces that need no kernel launch: its step metadata (vs the
torch backend's) and the flash-decoding split heuristic."""

from __future__ import annotations

import pytest
import torch

from meshserve.configs import load_config
from meshserve.configs.errors import ConfigError
from meshserve.configs.validate import check_config
from meshserve.layers.attention import build_attention_metadata
from meshserve.layers.backend import TorchBackend, resolve_backend_name, select_backend
from meshserve.layers.cpu_backend import CpuBackend
from meshserve.layers.kernels import cpu_library, triton_available

needs_triton = pytest.mark.skipif(not triton_available(), reason="triton not installed")


def test_auto_is_cpu_on_cpu_and_triton_on_cuda():
    library = cpu_library.load()
    assert resolve_backend_name("auto", "cpu", library) == ("cpu" if library else "torch")
    assert resolve_backend_name("auto", "cpu", None) == "torch"  # the C++ kernels did not build
    assert isinstance(select_backend("auto", "cpu", library), CpuBackend if library else TorchBackend)
    assert type(select_backend("torch", "cpu", library)) is TorchBackend
    assert resolve_backend_name("auto", "cuda") == ("triton" if triton_available() else "torch")
    assert resolve_backend_name("torch", "cuda") == "torch"
    assert resolve_backend_name("triton", "cpu") == "triton"  # forced (the interpreter tests do this)
    with pytest.raises(ValueError, match="unknown kernel backend 'fast'"):
        resolve_backend_name("fast", "cpu")


def test_default_model_uses_the_torch_backend(tiny_checkpoints):
    from meshserve.comm.groups import AxisGroup
    from meshserve.configs.model_info import read_model_info
    from meshserve.layers.loader import build_model

    model = build_model(read_model_info(str(tiny_checkpoints["llama"])), AxisGroup.single("tp"), torch.float32)
    assert model.backend.name == "torch"
    layer = model.model.layers[0]
    assert layer.self_attn.attn.backend is model.backend and layer.self_attn.backend is model.backend


def test_config_kernels_key(tiny_checkpoints):
    path = f"model.path={tiny_checkpoints['llama']}"
    assert load_config(None, [path]).device.kernels == "auto"
    with pytest.raises(ConfigError, match="device.kernels"):
        load_config(None, [path, "device.kernels=fast"])
    config = load_config(None, [path, "device.kernels=triton"])
    with pytest.raises(ConfigError, match="device.kernels=triton needs device.type=cuda, not cpu"):
        check_config(config)
    check_config(load_config(None, [path, "device.kernels=torch"]))
    check_config(load_config(None, [path, "device.kernels=cpu"]))
    with pytest.raises(ConfigError, match=r"device.kernels=cpu is meshserve's C\+\+ kernel for the CPU, not for "
                                          r"device.type=cuda"):
        check_config(load_config(None, [path, "device.kernels=cpu", "device.type=cuda"]))
    cuda = load_config(None, [path, "device.kernels=triton", "device.type=cuda"])
    if triton_available():
        check_config(cuda)
    else:
        with pytest.raises(ConfigError, match="triton is not installed"):
            check_config(cuda)


@needs_triton
def test_triton_metadata_matches_the_torch_one():
    from meshserve.layers.triton_backend import build_triton_metadata

    query_lens, seq_lens = [1, 7, 5, 1], [10, 7, 11, 1]
    tables = [[5, 9, 2, 30], [0, 11], [3, 7, 13], [20, 21]]  # spare blocks at the ends
    ref = build_attention_metadata(query_lens, seq_lens, tables, 4)
    meta = build_triton_metadata(query_lens, seq_lens, tables, 4, "cpu")
    assert meta.slot_mapping.tolist() == ref.slot_mapping.tolist()
    assert meta.num_tokens == ref.num_tokens == 14
    # the 5 tokens after a 6-token prefix are decode rows, each seeing the cache up to itself
    assert meta.decode_rows.tolist() == ref.decode_rows.tolist() == [0, 8, 9, 10, 11, 12, 13]
    assert meta.decode_lens.tolist() == [10, 7, 8, 9, 10, 11, 1] and meta.decode_max_len == 11
    assert meta.decode_block_tables.tolist() == [[5, 9, 2]] + [[3, 7, 13]] * 5 + [[20, 0, 0]]  # blocks in use, padded
    assert meta.prefill_starts.tolist() == [c.start for c in ref.prefills] == [1]
    assert meta.prefill_query_lens.tolist() == [7] and meta.prefill_seq_lens.tolist() == [7]
    assert meta.prefill_block_tables.tolist() == [[0, 11]]
    assert meta.max_prefill_query_len == 7
    # every part on 16 bytes (parts of odd lengths here): Triton compiles a variant of a kernel
    # per alignment of its pointers, mid-serving
    parts = [meta.slot_mapping, meta.decode_rows, meta.decode_block_tables, meta.decode_lens, meta.prefill_starts,
             meta.prefill_query_lens, meta.prefill_seq_lens, meta.prefill_block_tables]
    assert all(t.data_ptr() % 16 == 0 for t in parts)
    only_decodes = build_triton_metadata([1, 1], [3, 4], [[1], [2]], 4, "cpu")
    assert only_decodes.prefill_starts.numel() == 0 and only_decodes.prefill_block_tables.shape == (0, 0)


@needs_triton
def test_decode_splits_fill_the_gpu_only_when_needed():
    from meshserve.layers.kernels.decode_attention import choose_num_splits

    # one sequence, 3 KV heads, 132 SMs: long contexts are split, into slices of >= 4 tiles
    assert choose_num_splits(1, 3, 4096, 132, 64) == 16
    assert choose_num_splits(1, 3, 100, 132, 64) == 1
    # a full batch already fills the GPU
    assert choose_num_splits(64, 8, 4096, 132, 64) == 1
    assert choose_num_splits(4, 2, 8192, 132, 64) == 32
    assert choose_num_splits(0, 2, 0, 1, 32) == 1
