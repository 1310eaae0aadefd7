"""Lazy checkpoint tensors: a rank narrows a tensor to its shard *before* reading it.

`iter_checkpoint(info)` yields (Hugging Face name, CheckpointTensor) for a HF directory
(safetensors, sharded index too) or a GGUF file. A CheckpointTensor knows its shape,
can be narrowed along a dimension without reading data, and is read by `load()`:
safetensors through `get_slice`, GGUF by reading only the quantized rows (and, when
block-aligned, only the column blocks) of the shard, then dequantizing.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path
from typing import Protocol

import gguf
import numpy as np
import torch
from gguf.quants import dequantize
from safetensors import safe_open

from meshserve.configs.model_info import ModelInfo, safetensors_shards
from meshserve.layers.gguf_dequant import dequantize_rows
from meshserve.layers.gguf_index import gguf_tensors


class CheckpointTensor(Protocol):
    shape: tuple[int, ...]

    def narrow(self, dim: int, start: int, length: int) -> "CheckpointTensor": ...

    def load(self) -> torch.Tensor: ...


def _narrowed(ranges: list[tuple[int, int]], dim: int, start: int, length: int) -> list[tuple[int, int]]:
    lo, hi = ranges[dim]
    if start < 0 or length < 0 or lo + start + length > hi:
        raise ValueError(f"narrow(dim={dim}, start={start}, length={length}) outside size {hi - lo}")
    out = list(ranges)
    out[dim] = (lo + start, lo + start + length)
    return out


class MemoryTensor:
    """A tensor already in memory (tests, conversions from a live model)."""

    def __init__(self, tensor: torch.Tensor):
        self._tensor = tensor
        self.shape = tuple(tensor.shape)

    def narrow(self, dim: int, start: int, length: int) -> "MemoryTensor":
        return MemoryTensor(self._tensor.narrow(dim, start, length))

    def load(self) -> torch.Tensor:
        return self._tensor.clone()


class SafetensorsTensor:
    def __init__(self, handle, name: str, ranges: list[tuple[int, int]] | None = None):
        self._handle, self._name = handle, name
        self._ranges = ranges or [(0, n) for n in handle.get_slice(name).get_shape()]
        self.shape = tuple(hi - lo for lo, hi in self._ranges)

    def narrow(self, dim: int, start: int, length: int) -> "SafetensorsTensor":
        return SafetensorsTensor(self._handle, self._name, _narrowed(self._ranges, dim, start, length))

    def load(self) -> torch.Tensor:
        return self._handle.get_slice(self._name)[tuple(slice(lo, hi) for lo, hi in self._ranges)]


_FLOAT_TYPES = (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16, gguf.GGMLQuantizationType.BF16)


class GGUFTensor:
    """A 1-D or 2-D GGUF tensor, in torch order (rows = output features).

    `rows` selects (and may reorder) rows of the quantized data; ggml quantizes each row
    independently, so a row selection reads only those rows' bytes."""

    def __init__(self, data: np.ndarray, qtype: gguf.GGMLQuantizationType, shape: tuple[int, ...],
                 rows: np.ndarray | None = None, cols: tuple[int, int] | None = None):
        self._data, self._qtype = data, qtype
        self._full_shape = shape
        self._rows = rows
        self._cols = cols or (0, shape[-1])
        n_rows = len(rows) if rows is not None else (shape[0] if len(shape) == 2 else 1)
        width = self._cols[1] - self._cols[0]
        self.shape = (n_rows, width) if len(shape) == 2 else (width,)

    def narrow(self, dim: int, start: int, length: int) -> "GGUFTensor":
        dim = dim % len(self.shape)
        if len(self.shape) == 2 and dim == 0:
            rows = self._rows if self._rows is not None else np.arange(self._full_shape[0])
            if start < 0 or start + length > len(rows):
                raise ValueError(f"narrow(dim=0, start={start}, length={length}) outside size {len(rows)}")
            return GGUFTensor(self._data, self._qtype, self._full_shape, rows[start:start + length], self._cols)
        lo, hi = _narrowed([self._cols], 0, start, length)[0]
        return GGUFTensor(self._data, self._qtype, self._full_shape, self._rows, (lo, hi))

    def load(self) -> torch.Tensor:
        data = self._data if len(self._full_shape) == 2 else self._data.reshape(1, -1)
        if self._rows is not None:
            data = data[self._rows]
        block, type_size = gguf.GGML_QUANT_SIZES[self._qtype]
        lo, hi = self._cols
        if self._qtype in _FLOAT_TYPES:
            values = dequantize(np.ascontiguousarray(data), self._qtype)[:, lo:hi]
            out = torch.from_numpy(np.array(values, dtype=np.float32))  # a writable copy, off the mmap
        elif lo % block == 0 and hi % block == 0:
            out = dequantize_rows(data[:, lo // block * type_size: hi // block * type_size], self._qtype)
        else:
            out = dequantize_rows(data, self._qtype)[:, lo:hi].contiguous()
        return out.reshape(self.shape)


# ----------------------------------------------------------------------- HF directory


def _safetensors_files(directory: Path) -> list[Path]:
    shards = safetensors_shards(directory)  # refuses a shard outside the directory
    if shards is not None:
        return shards
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{directory}: no *.safetensors files")
    return files


def _iter_hf(info: ModelInfo, stack: ExitStack) -> Iterator[tuple[str, CheckpointTensor]]:
    for file in _safetensors_files(Path(info.path)):
        handle = stack.enter_context(safe_open(str(file), framework="pt"))
        for name in handle.keys():
            yield name, SafetensorsTensor(handle, name)


# ------------------------------------------------------------------------------ GGUF

_GGUF_LAYER = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate_inp": "mlp.gate",
    "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
    "ffn_up_shexp": "mlp.shared_expert.up_proj",
    "ffn_down_shexp": "mlp.shared_expert.down_proj",
    "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
}
_GGUF_EXPERTS = {"ffn_gate_exps": "gate_proj", "ffn_up_exps": "up_proj", "ffn_down_exps": "down_proj"}
"""3-D tensors (experts, rows, columns): one Hugging Face tensor per expert."""
_MIXTRAL_NAMES = {"mlp.gate.": "block_sparse_moe.gate.", "gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"}
_GGUF_GLOBAL = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_BLOCK = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")


def gguf_to_hf_name(name: str) -> str | None:
    m = _BLOCK.fullmatch(name)
    if m:
        layer, part, kind = m.groups()
        return f"model.layers.{layer}.{_GGUF_LAYER[part]}.{kind}" if part in _GGUF_LAYER else None
    stem, _, kind = name.rpartition(".")
    return f"{_GGUF_GLOBAL[stem]}.{kind}" if stem in _GGUF_GLOBAL else None


def unpermute_rows(num_rows: int, num_heads: int) -> np.ndarray:
    """Row order that undoes llama.cpp's Q/K permutation (interleaved -> half-split RoPE).

    llama.cpp stores each head's rows as (head_dim/2, 2) pairs; Hugging Face as (2, head_dim/2).
    The permutation stays inside a head, so narrowing by whole heads commutes with it."""
    half = num_rows // num_heads // 2
    idx = np.arange(num_rows).reshape(num_heads, half, 2)
    return idx.swapaxes(1, 2).reshape(-1)


def _iter_gguf_experts(info: ModelInfo, t) -> Iterator[tuple[str, CheckpointTensor]]:
    """A 3-D expert tensor as one 2-D tensor per expert (each expert's rows are stored
    apart, so a rank reads only its experts' bytes)."""
    layer, part = _BLOCK.fullmatch(t.name).groups()[:2]
    experts, rows, cols = (int(n) for n in reversed(t.shape))
    for e in range(experts):
        if info.architecture == "mixtral":
            name = f"model.layers.{layer}.block_sparse_moe.experts.{e}.{_MIXTRAL_NAMES[_GGUF_EXPERTS[part]]}.weight"
        else:
            name = f"model.layers.{layer}.mlp.experts.{e}.{_GGUF_EXPERTS[part]}.weight"
        yield name, GGUFTensor(t.data[e], t.tensor_type, (rows, cols))


def _iter_gguf(info: ModelInfo) -> Iterator[tuple[str, CheckpointTensor]]:
    for t in gguf_tensors(info.path):
        m = _BLOCK.fullmatch(t.name)
        if m and m.group(2) in _GGUF_EXPERTS:
            yield from _iter_gguf_experts(info, t)
            continue
        hf_name = gguf_to_hf_name(t.name)
        if hf_name is not None and info.architecture == "mixtral" and ".mlp.gate." in hf_name:
            hf_name = hf_name.replace(".mlp.gate.", ".block_sparse_moe.gate.")
        if hf_name is None:
            continue
        shape = tuple(int(n) for n in reversed(t.shape))  # ggml lists dims innermost first
        rows = None
        if info.architecture in ("llama", "mixtral") and (".q_proj." in hf_name or ".k_proj." in hf_name):
            heads = info.num_attention_heads if ".q_proj." in hf_name else info.num_key_value_heads
            rows = unpermute_rows(shape[0], heads)
        yield hf_name, GGUFTensor(t.data, t.tensor_type, shape, rows)


def iter_checkpoint(info: ModelInfo, stack: ExitStack) -> Iterator[tuple[str, CheckpointTensor]]:
    """(Hugging Face name, lazy tensor) for every tensor of the checkpoint. File handles
    stay open until `stack` closes."""
    return _iter_gguf(info) if info.format == "gguf" else _iter_hf(info, stack)
