"""Tensor-parallel linear layers (Megatron's scheme; the group is passed in).

Every parameter carries a `weight_loader(param, checkpoint_tensor, shard_id=None)` that
narrows the checkpoint tensor to this rank's slice before reading it, so a rank reads
only its shard.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from meshserve.comm.collectives import reduce_from_tp
from meshserve.comm.groups import AxisGroup
from meshserve.configs.memory import local_num_kv_heads
from meshserve.layers.lora import LoraPart, LoraStack
from meshserve.layers.matmul_plan import MatmulPlan
from meshserve.layers.weights import CheckpointTensor
from meshserve.parallel.sequence import SequenceParallel


def _divide(numerator: int, denominator: int, what: str) -> int:
    if numerator % denominator:
        raise ValueError(f"{what}={numerator} is not divisible by tp_size={denominator}")
    return numerator // denominator


def _copy_into(param: torch.Tensor, loaded: torch.Tensor) -> None:
    if param.shape != loaded.shape:
        raise ValueError(f"checkpoint shard has shape {tuple(loaded.shape)}, parameter expects {tuple(param.shape)}")
    with torch.no_grad():
        param.copy_(loaded)


class LinearBase(nn.Module):
    def __init__(self, input_size: int, output_size: int, bias: bool, dtype: torch.dtype):
        super().__init__()
        # (output_size, input_size), as nn.Linear and checkpoints store it
        self.weight = nn.Parameter(torch.empty(output_size, input_size, dtype=dtype), requires_grad=False)
        self.weight.weight_loader = self.weight_loader
        if bias:
            self.bias = nn.Parameter(torch.empty(output_size, dtype=dtype), requires_grad=False)
            self.bias.weight_loader = self.weight_loader
        else:
            self.register_parameter("bias", None)
        self.packed = None
        """What multiplies the weight once prepared (meshserve.layers.matmul_plan), or None."""
        self.lora: LoraStack | None = None
        """Its LoRA adapters' slots (layers/lora.py), where the server serves adapters."""

    def lora_parts(self) -> list[LoraPart]:
        """The PEFT modules this layer computes, and this rank's share of each."""
        raise NotImplementedError

    def weight_loader(self, param: nn.Parameter, loaded: CheckpointTensor, shard_id=None) -> None:
        raise NotImplementedError

    def kernel(self, plan: MatmulPlan):
        """This layer's kind of product in `plan`."""
        return plan.linear

    def pack_weight(self, plan: MatmulPlan) -> None:
        """After loading: multiply by what the plan's kernel for the layers' linears prepares
        (a quantized, packed or panelled copy), which replaces the stored weight, freed."""
        if self.packed is None:
            self._replace_weight(self.kernel(plan).prepare(self.weight))

    def _replace_weight(self, product) -> None:
        """Multiply by `product` (None: the weight as stored), freeing the stored weight."""
        self.packed = product
        if product is not None:
            self.weight.data = self.weight.data.new_empty(0)

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """x W^T (no bias)."""
        return F.linear(x, self.weight) if self.packed is None else self.packed(x)


class ReplicatedLinear(LinearBase):
    """Y = XA + b with the whole A on every rank."""

    def weight_loader(self, param, loaded, shard_id=None):
        _copy_into(param, loaded.load())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.matmul(x)
        return y if self.bias is None else y + self.bias


class ColumnParallelLinear(LinearBase):
    """Y = XA + b, A = [A_1 ... A_p] split along its output columns; rank i holds A_i and
    returns Y_i = XA_i + b_i (its slice of the output). No communication, but where its
    input is the residual stream's and sequence parallelism splits the step (`sp`): the
    all-gather of every rank's rows of X."""

    sp: SequenceParallel | None = None

    def __init__(self, input_size: int, output_size: int, tp: AxisGroup, bias: bool = False,
                 dtype: torch.dtype = torch.float32):
        self.tp = tp
        self.input_size, self.output_size = input_size, output_size
        self.local_output_size = _divide(output_size, tp.size, "output_size")
        super().__init__(input_size, self.local_output_size, bias, dtype)

    def weight_loader(self, param, loaded, shard_id=None):
        n = self.local_output_size
        _copy_into(param, loaded.narrow(0, self.tp.rank * n, n).load())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # (num_tokens, input_size) -> (num_tokens, local_output_size)
        if self.sp is not None:
            x = self.sp.gather(x)
        y = self.matmul(x)
        y = y if self.bias is None else y + self.bias
        return y if self.lora is None else self.lora.apply(y, x)


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel outputs stored as one matrix (gate and up of the MLP), so
    one matmul computes them. Rank i holds [A_1,i ; A_2,i ; ...]."""

    def __init__(self, input_size: int, output_sizes: list[int], tp: AxisGroup, bias: bool = False,
                 dtype: torch.dtype = torch.float32, may_fuse_silu_mul: bool = False):
        self.output_sizes = output_sizes
        super().__init__(input_size, sum(output_sizes), tp, bias, dtype)
        self.may_fuse_silu_mul = may_fuse_silu_mul and len(output_sizes) == 2 and not bias
        self.applies_silu_mul = False
        """Set once prepared with the activation fused (the MLP's gate/up, where the plan's kernel
        has the fused product): the output is then silu(gate) * up, half the width."""

    def pack_weight(self, plan: MatmulPlan) -> None:
        if self.packed is None and self.may_fuse_silu_mul:
            fused = self.kernel(plan).silu_mul_product(self.weight)
            if fused is not None:
                self._replace_weight(fused)
                self.applies_silu_mul = True
                return
        super().pack_weight(plan)

    def shard(self, shard_id: int) -> tuple[int, int, int]:
        """(offset in this rank's output, size, start in the checkpoint's) of output `shard_id`."""
        size = _divide(self.output_sizes[shard_id], self.tp.size, f"output_sizes[{shard_id}]")
        return sum(self.output_sizes[:shard_id]) // self.tp.size, size, self.tp.rank * size

    def weight_loader(self, param, loaded, shard_id=None):
        offset, size, start = self.shard(shard_id)
        _copy_into(param.narrow(0, offset, size), loaded.narrow(0, start, size).load())

    def lora_parts(self) -> list[LoraPart]:
        return [LoraPart(m, *self.shard(i)) for i, m in enumerate(("gate_proj", "up_proj"))]


class QKVParallelLinear(ColumnParallelLinear):
    """Q, K and V projections in one column-parallel matrix, split by heads.

    Query heads are always sharded. KV heads are sharded when tp <= num_kv_heads and
    replicated when tp > num_kv_heads: then tp / num_kv_heads consecutive ranks share one
    KV head, which keeps each rank's query heads next to the KV head they attend with."""

    def __init__(self, hidden_size: int, head_dim: int, num_heads: int, num_kv_heads: int, tp: AxisGroup,
                 bias: bool = False, dtype: torch.dtype = torch.float32):
        self.head_dim = head_dim
        self.num_heads, self.num_kv_heads = num_heads, num_kv_heads
        self.local_num_heads = _divide(num_heads, tp.size, "num_attention_heads")
        self.local_num_kv_heads = local_num_kv_heads(num_kv_heads, tp.size)
        if tp.size > num_kv_heads and tp.size % num_kv_heads:
            raise ValueError(f"tp_size={tp.size} is not a multiple of num_key_value_heads={num_kv_heads}")
        local_output_size = (self.local_num_heads + 2 * self.local_num_kv_heads) * head_dim
        super().__init__(hidden_size, local_output_size * tp.size, tp, bias, dtype)

    @property
    def local_sizes(self) -> tuple[int, int, int]:
        q = self.local_num_heads * self.head_dim
        kv = self.local_num_kv_heads * self.head_dim
        return q, kv, kv

    def shard(self, shard_id: str) -> tuple[int, int, int]:
        """(offset in this rank's output, size, start in the checkpoint's) of "q", "k" or "v"."""
        q, kv, _ = self.local_sizes
        if shard_id == "q":
            return 0, q, self.tp.rank * q
        kv_head = self.tp.rank * self.local_num_kv_heads if self.tp.size <= self.num_kv_heads \
            else self.tp.rank // (self.tp.size // self.num_kv_heads)
        return q if shard_id == "k" else q + kv, kv, kv_head * self.head_dim

    def weight_loader(self, param, loaded, shard_id=None):
        offset, size, start = self.shard(shard_id)
        _copy_into(param.narrow(0, offset, size), loaded.narrow(0, start, size).load())

    def lora_parts(self) -> list[LoraPart]:
        return [LoraPart(f"{s}_proj", *self.shard(s)) for s in "qkv"]


class RowParallelLinear(LinearBase):
    """Y = XA + b, A = [A_1; ...; A_p] split along its input rows, X = [X_1 ... X_p]
    already split by columns (the output of a column-parallel layer). Rank i computes
    X_i A_i; the sum over ranks is all-reduced over `tp`, and b is added once, after it.

    All-reduces the output over `tp`; where sequence parallelism splits the step (`sp`),
    reduce-scatters it instead (each rank gets its rows of the sum)."""

    sp: SequenceParallel | None = None

    def __init__(self, input_size: int, output_size: int, tp: AxisGroup, bias: bool = False,
                 dtype: torch.dtype = torch.float32, lora_module: str = ""):
        """`lora_module`: the PEFT target this layer is (o_proj, down_proj)."""
        self.tp = tp
        self.lora_module = lora_module
        self.input_size, self.output_size = input_size, output_size
        self.local_input_size = _divide(input_size, tp.size, "input_size")
        super().__init__(self.local_input_size, output_size, bias, dtype)

    def weight_loader(self, param, loaded, shard_id=None):
        if param.dim() == 1:  # bias: whole, added after the reduction
            _copy_into(param, loaded.load())
            return
        n = self.local_input_size
        _copy_into(param, loaded.narrow(1, self.tp.rank * n, n).load())

    def lora_parts(self) -> list[LoraPart]:
        n = self.local_input_size
        return [LoraPart(self.lora_module, 0, n, self.tp.rank * n)]

    def partial(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's share of the output, before the all-reduce (its LoRA deltas' share in it)."""
        y = self.matmul(x)
        return y if self.lora is None else self.lora.apply(y, x)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # (num_tokens, local_input_size) -> (num_tokens or this rank's rows, output_size)
        partial = self.partial(x)
        y = reduce_from_tp(partial, self.tp) if self.sp is None else self.sp.reduce(partial)
        return y if self.bias is None else y + self.bias
