"""The tensors of a GGUF file without parsing its metadata.

gguf.GGUFReader turns every metadata value into numpy arrays, one per string of the
tokenizer's vocabulary and merges: seconds for a 49k-token vocabulary, paid by every rank
of every start though the weights need none of it. This reads the header with `struct`,
steps over the metadata values (whole scalar arrays at once), and maps the tensors' bytes
as plain numpy arrays, shaped as GGUFReader shapes them (torch order; a quantized tensor's
rows as bytes), so a loader may use either.
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from functools import lru_cache

import gguf
import numpy as np
from gguf.constants import GGML_QUANT_SIZES, GGUF_DEFAULT_ALIGNMENT, GGUF_MAGIC, GGMLQuantizationType

_SCALAR_SIZES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
"""GGUF value type -> bytes (uint8, int8, uint16, int16, uint32, int32, float32, bool,
uint64, int64, float64)."""
_STRING, _ARRAY, _UINT32 = 8, 9, 4
_PLAIN = {GGMLQuantizationType.F32: np.float32, GGMLQuantizationType.F16: np.float16,
          GGMLQuantizationType.F64: np.float64, GGMLQuantizationType.I8: np.int8,
          GGMLQuantizationType.I16: np.int16, GGMLQuantizationType.I32: np.int32,
          GGMLQuantizationType.I64: np.int64}
"""Types GGUFReader maps as numbers; every other type is mapped as bytes."""


@dataclass(frozen=True)
class GGUFTensorInfo:
    """What the loader needs of a tensor: `shape` in ggml order (innermost first), as
    GGUFReader's ReaderTensor.shape, and `data` shaped as ReaderTensor.data."""
    name: str
    tensor_type: GGMLQuantizationType
    shape: tuple[int, ...]
    data: np.ndarray


class _Cursor:
    def __init__(self, buf, offset: int = 0):
        self.buf, self.offset = buf, offset

    def read(self, fmt: str):
        values = struct.unpack_from(fmt, self.buf, self.offset)
        self.offset += struct.calcsize(fmt)
        return values

    def string(self) -> bytes:
        (length,) = self.read("<Q")
        start = self.offset
        self.offset += length
        return bytes(self.buf[start:self.offset])

    def skip_value(self, vtype: int) -> None:
        if vtype in _SCALAR_SIZES:
            self.offset += _SCALAR_SIZES[vtype]
        elif vtype == _STRING:
            (length,) = self.read("<Q")
            self.offset += length
        elif vtype == _ARRAY:
            itype, count = self.read("<IQ")
            if itype in _SCALAR_SIZES:
                self.offset += _SCALAR_SIZES[itype] * count
            else:
                for _ in range(count):
                    self.skip_value(itype)
        else:
            raise ValueError(f"unknown GGUF metadata value type {vtype} at byte {self.offset}")


def _plain_index(buf) -> list[GGUFTensorInfo] | None:
    """The tensors of a little-endian GGUF v2/v3 file; None for any other file."""
    if len(buf) < 24:
        return None
    magic, version = struct.unpack_from("<II", buf, 0)
    if magic != GGUF_MAGIC or version not in (2, 3):
        return None
    cur = _Cursor(buf, 8)
    tensor_count, kv_count = cur.read("<QQ")
    alignment = GGUF_DEFAULT_ALIGNMENT
    for _ in range(kv_count):
        key = cur.string()
        (vtype,) = cur.read("<I")
        if key == b"general.alignment" and vtype == _UINT32:
            (alignment,) = cur.read("<I")
            if alignment == 0 or alignment & (alignment - 1):
                raise ValueError(f"GGUF general.alignment={alignment} is not a power of two")
        else:
            cur.skip_value(vtype)
    infos = []
    for _ in range(tensor_count):
        name = cur.string().decode()
        (n_dims,) = cur.read("<I")
        dims = cur.read(f"<{n_dims}Q")
        raw_type, offset = cur.read("<IQ")
        infos.append((name, dims, GGMLQuantizationType(raw_type), offset))
    start = -(-cur.offset // alignment) * alignment
    tensors = []
    for name, dims, qtype, offset in infos:
        shape = tuple(reversed(dims))
        n_elems = int(np.prod(dims))
        if qtype in _PLAIN:
            data = np.frombuffer(buf, _PLAIN[qtype], n_elems, start + offset)
        else:
            block, type_size = GGML_QUANT_SIZES[qtype]
            data = np.frombuffer(buf, np.uint8, n_elems * type_size // block, start + offset)
            shape = gguf.quant_shape_to_byte_shape(shape, qtype)
        tensors.append(GGUFTensorInfo(name, qtype, tuple(int(d) for d in dims), data.reshape(shape)))
    return tensors


@lru_cache(maxsize=2)
def gguf_tensors(path: str) -> list[GGUFTensorInfo]:
    """The file's tensors over a read-only memory map (kept open while arrays use it).
    A file this reader does not take (big-endian, GGUF v1) goes through gguf.GGUFReader."""
    with open(path, "rb") as f:
        buf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    tensors = _plain_index(buf)
    if tensors is not None:
        return tensors
    reader = gguf.GGUFReader(path)
    return [GGUFTensorInfo(t.name, t.tensor_type, tuple(int(d) for d in t.shape), np.asarray(t.data))
            for t in reader.tensors]
