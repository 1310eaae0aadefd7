"""The mixture-of-experts block (Mixtral, Qwen2-MoE, Qwen3-MoE), with expert parallelism.

    y = sum_{j < k} p_j * E_{e_j}(x),   E_e(x) = W2_e (silu(W1_e x) * W3_e x)

where (e_j, p_j) are the k experts with the highest router probability softmax(G x), their
probabilities renormalized to sum to 1 when the model says so (`norm_topk_prob`).

Sharding. Expert e lives on member e // local_num_experts of the `ep` group; inside it, each
expert's intermediate dimension is split over `tp` as a dense MLP's is (W1, W3 by rows, W2 by
columns), so every tp member returns a partial sum and one all-reduce over `tp` finishes the
block. Attention stays replicated over `ep` (every member of an ep group holds the same
tokens, and routes all of them). The exchange (parallel.expert_exchange):
- `all_to_all`: member r takes its 1/ep slice of the tokens, sends each (token, expert) pair
  to the member holding the expert (all-to-all), computes what it received, sends the
  results back (all-to-all), combines its slice, and an all-gather over `ep` gives every
  member all the tokens again: three collectives, each token sent once per remote expert.
- `all_reduce`: every member computes its experts' pairs of all the tokens (it holds them
  already) and one all-reduce over `ep` sums the results: one collective, of all tokens.

Compute. A member sorts its (token, expert) pairs by expert and multiplies each expert's
tokens in one matmul (W1 and W3 fused, as gate_up_proj) by the weight as stored, prepared or
quantized (model.quantization int8 / int4, meshserve.layers.quant); with the Triton backend,
one fused kernel (layers/kernels/fused_moe.py) does the grouped matmuls of every expert.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from meshserve.comm.collectives import all_gather_rows, all_to_all_rows, reduce_from_tp
from meshserve.comm.groups import AxisGroup
from meshserve.configs.model_info import MoEInfo
from meshserve.layers.activation import silu_and_mul
from meshserve.layers.linear import ReplicatedLinear
from meshserve.layers.matmul_plan import MatmulPlan
from meshserve.layers.weights import CheckpointTensor
from meshserve.parallel.sequence import SequenceParallel

GATE, UP, DOWN = 0, 1, 2
"""The shard ids of an expert's checkpoint tensors (with the expert's global index)."""


def route(logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(num_tokens, num_experts) router logits -> (weights float32, expert ids int64), each
    (num_tokens, top_k), most probable first.

    NOTE: ties go to the lower expert index (a stable sort), the same on every rank and
    device; torch.topk leaves their order unspecified."""
    probs = torch.softmax(logits.float(), dim=-1)
    weights, ids = torch.sort(probs, dim=-1, descending=True, stable=True)
    weights, ids = weights[:, :top_k], ids[:, :top_k]
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


def token_slices(num_tokens: int, size: int) -> list[int]:
    """How many of a step's tokens each of `size` members routes (the first ones one more)."""
    base, extra = divmod(num_tokens, size)
    return [base + (1 if r < extra else 0) for r in range(size)]


def combine(pairs: torch.Tensor, order: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """sum_j weights[t, j] * out[t, j] from the pairs' outputs in sorted `order`
    (pairs[i] belongs to flat pair order[i]); (pairs, hidden) -> (num_tokens, hidden).

    NOTE: a gather back to (token, slot) order and one batched product, not index_add_:
    its CPU kernel is far slower at these sizes."""
    num_tokens, k = weights.shape
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(order.numel(), device=order.device)
    per_slot = pairs[inverse].view(num_tokens, k, pairs.shape[-1])  # (num_tokens, k, hidden)
    return torch.bmm(weights.to(pairs.dtype).unsqueeze(1), per_slot).squeeze(1)


class Router(ReplicatedLinear):
    """The gate G (num_experts x hidden), whole on every rank. Never quantized: a coarser
    router would send tokens to other experts."""

    def kernel(self, plan: MatmulPlan):
        return plan.router


class FusedMoE(nn.Module):
    """Router, top-k, the experts of this rank and the combine. `forward` all-reduces over
    `tp`; `partial` leaves that to the caller (a shared expert adds its own partial sum
    first). With ep > 1, `partial` exchanges tokens over `ep` (all-to-all, then all-gather).
    Where sequence parallelism splits the step (`sp`), `forward` all-gathers the rows of its
    input first and reduce-scatters the sum."""

    sp: SequenceParallel | None = None

    def __init__(self, hidden_size: int, moe: MoEInfo, tp: AxisGroup, ep: AxisGroup, dtype: torch.dtype,
                 backend=None, exchange: str = "all_to_all"):
        """`exchange` (parallel.expert_exchange), with ep > 1: `all_to_all` sends each pair's
        token to its expert's rank and back; `all_reduce` has every rank compute its
        experts' pairs of all the (replicated) tokens and sums the results over `ep`."""
        super().__init__()
        if moe.num_experts % ep.size:
            raise ValueError(f"num_experts={moe.num_experts} is not divisible by ep_size={ep.size}")
        if moe.intermediate_size % tp.size:
            raise ValueError(f"moe_intermediate_size={moe.intermediate_size} is not divisible by tp_size={tp.size}")
        self.tp, self.ep, self.exchange = tp, ep, exchange
        self.hidden_size, self.top_k, self.renormalize = hidden_size, moe.num_experts_per_tok, moe.norm_topk_prob
        self.local_num_experts = moe.num_experts // ep.size
        self.expert_start = ep.rank * self.local_num_experts
        self.local_intermediate_size = moe.intermediate_size // tp.size
        self.gate = Router(hidden_size, moe.num_experts, bias=False, dtype=dtype)
        e, i = self.local_num_experts, self.local_intermediate_size
        self.w13 = nn.Parameter(torch.empty(e, 2 * i, hidden_size, dtype=dtype), requires_grad=False)
        """(local_num_experts, 2 * local_intermediate_size, hidden): W1 (gate) rows, then W3 (up)."""
        self.w2 = nn.Parameter(torch.empty(e, hidden_size, i, dtype=dtype), requires_grad=False)
        """(local_num_experts, hidden, local_intermediate_size): W2 (down)."""
        self.w13.weight_loader = self.w2.weight_loader = self.weight_loader
        self.act = silu_and_mul if backend is None else backend.silu_and_mul
        self.fused = getattr(backend, "fused_moe", None)
        """The backend's fused kernel (Triton), used while the weights are stored as loaded."""
        self.packed: list[tuple] | None = None
        """Per local expert, (W13 multiply, W2 multiply) once packed or quantized."""
        self.tokens_computed = 0
        """(token, expert) pairs this rank's experts computed: its share of the expert load."""

    def holds(self, expert: int) -> bool:
        return self.expert_start <= expert < self.expert_start + self.local_num_experts

    def weight_loader(self, param: nn.Parameter, loaded: CheckpointTensor, shard_id: tuple[int, int]) -> None:
        """`shard_id` (expert, GATE | UP | DOWN): narrows the expert's tensor to this tp
        rank's slice of the intermediate dimension; experts of other ep ranks are skipped
        unread."""
        expert, part = shard_id
        if not self.holds(expert):
            return
        e, i = expert - self.expert_start, self.local_intermediate_size
        if part == DOWN:
            target, source = param[e], loaded.narrow(1, self.tp.rank * i, i)
        else:
            target, source = param[e, part * i:(part + 1) * i], loaded.narrow(0, self.tp.rank * i, i)
        tensor = source.load()
        if tuple(tensor.shape) != tuple(target.shape):
            raise ValueError(f"expert {expert}: checkpoint shard has shape {tuple(tensor.shape)}, "
                             f"parameter expects {tuple(target.shape)}")
        with torch.no_grad():
            target.copy_(tensor)

    def pack_weight(self, plan: MatmulPlan) -> None:
        """After loading: per expert, what the plan's kernel for the layers prepares (a
        quantized or packed copy) where it prepares one (unless the backend's fused kernel
        takes them unquantized); the stored weights are then freed."""
        if self.packed is not None or (self.fused is not None and not plan.quantization.quantized):
            return  # the fused kernel reads the weights as loaded
        kernel = plan.linear
        packed = [(kernel.prepare(self.w13[e]), kernel.prepare(self.w2[e])) for e in range(self.local_num_experts)]
        if all(a is not None and b is not None for a, b in packed):
            self.packed = packed
            self.w13.data = self.w13.data.new_empty(0)
            self.w2.data = self.w2.data.new_empty(0)

    def use_sequence_parallel(self, sp: SequenceParallel) -> None:
        self.sp = sp

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """All-reduces the output over `tp`. (num_tokens, hidden) -> (num_tokens, hidden)."""
        if self.sp is None:
            return reduce_from_tp(self.partial(x), self.tp)
        return self.sp.reduce(self.partial(self.sp.gather(x)))

    def partial(self, x: torch.Tensor) -> torch.Tensor:
        """This tp rank's partial sum of the block's output for every token (exchanges
        tokens over `ep` when it has several members)."""
        weights, ids = route(self.gate(x), self.top_k, self.renormalize)  # every token's, on every rank
        if self.ep.size == 1:
            return self.experts(x, ids, weights)
        owner = ids // self.local_num_experts  # (num_tokens, k): the ep rank of each pair's expert
        if self.exchange == "all_reduce":
            mine = torch.where(owner == self.ep.rank, ids - self.expert_start, -1)
            return reduce_from_tp(self.experts(x, mine, weights), self.ep)
        counts = token_slices(x.shape[0], self.ep.size)
        bounds = [sum(counts[:r]) for r in range(self.ep.size + 1)]
        return all_gather_rows(self._dispatch_and_combine(x, ids, owner, weights, bounds), counts, self.ep)

    def _dispatch_and_combine(self, x: torch.Tensor, ids: torch.Tensor, owner: torch.Tensor, weights: torch.Tensor,
                              bounds: list[int]) -> torch.Tensor:
        """All-to-all over `ep`, twice: each (token, expert) pair of this rank's slice of the
        tokens (bounds[rank]:bounds[rank + 1]) goes to the member holding the expert, and its
        result comes back to be combined here. Every rank routed every token, so the
        sizes and the experts of what arrives are known here without exchanging them."""
        me, size, k = self.ep.rank, self.ep.size, self.top_k
        start, end = bounds[me], bounds[me + 1]
        mine = owner[start:end].flatten()
        order = torch.argsort(mine, stable=True)  # this slice's pairs, grouped by owner
        send = torch.bincount(mine, minlength=size).tolist()
        arriving = [ids[bounds[r]:bounds[r + 1]].flatten() for r in range(size)]
        arriving = [a[a // self.local_num_experts == me] - self.expert_start for a in arriving]
        recv = [len(a) for a in arriving]
        got = all_to_all_rows(x[start:end][order // k], send, recv, self.ep)
        local_ids = torch.cat(arriving).unsqueeze(1)  # each sender's pairs in its (stable) order
        done = self.experts(got, local_ids, torch.ones(local_ids.shape, dtype=torch.float32, device=x.device))
        back = all_to_all_rows(done, recv, send, self.ep)  # (pairs, hidden), in `order`
        return combine(back, order, weights[start:end])

    def experts(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """sum_j weights[t, j] * E_{ids[t, j]}(x[t]) with this rank's experts (local ids; -1:
        an expert of another rank, which adds nothing here), as a partial sum over `tp`.
        x (n, hidden); ids, weights (n, k)."""
        if self.fused is not None and self.packed is None:
            self.tokens_computed += int((ids >= 0).sum())
            return self.fused(x, self.w13, self.w2, ids, weights)
        k = ids.shape[1]
        flat = ids.flatten()
        order = torch.argsort(flat, stable=True)  # -1 first, then by expert
        counts = torch.bincount(flat + 1, minlength=self.local_num_experts + 1).tolist()
        skip = counts[0]
        self.tokens_computed += len(flat) - skip
        grouped = x[order[skip:] // k]  # (pairs, hidden), grouped by expert
        out = x.new_zeros((len(flat), x.shape[1]))
        start = skip
        for e, n in enumerate(counts[1:]):
            if n:
                out[start:start + n] = self._expert(e, grouped[start - skip:start - skip + n])
                start += n
        return combine(out, order, weights)

    def _expert(self, e: int, x: torch.Tensor) -> torch.Tensor:
        if self.packed is not None:
            up, down = self.packed[e]
            return down(self.act(up(x)))
        return F.linear(self.act(F.linear(x, self.w13[e])), self.w2[e])
