"""The MoE block's test pieces: random expert weights, a FusedMoE built from them (on any
tp / ep group), and the per-token float64 loop it must match."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from meshserve.comm.groups import AxisGroup
from meshserve.configs.model_info import MoEInfo
from meshserve.layers.moe import DOWN, GATE, UP, FusedMoE
from meshserve.layers.weights import MemoryTensor
from meshserve.layers.kernels import cpu_library
from meshserve.layers.matmul_plan import plan_matmuls

H, I, E = 64, 32, 8


def weights(seed: int = 0, experts: int = E):
    g = torch.Generator().manual_seed(seed)
    return {"gate": torch.randn(experts, H, generator=g) * 0.3,
            "w1": torch.randn(experts, I, H, generator=g) * 0.2,
            "w3": torch.randn(experts, I, H, generator=g) * 0.2,
            "w2": torch.randn(experts, H, I, generator=g) * 0.2}


def build(w, top_k: int = 2, renormalize: bool = True, quantization: str = "none", tp=None, ep=None,
          exchange: str = "all_to_all") -> FusedMoE:
    experts = w["gate"].shape[0]
    moe = FusedMoE(H, MoEInfo(experts, top_k, I, renormalize, (0,)), tp or AxisGroup.single("tp"),
                   ep or AxisGroup.single("ep"), torch.float32, exchange=exchange)
    moe.gate.weight.weight_loader(moe.gate.weight, MemoryTensor(w["gate"]))
    for e in range(experts):
        for name, part in (("w1", GATE), ("w3", UP), ("w2", DOWN)):
            param = moe.w2 if part == DOWN else moe.w13
            param.weight_loader(param, MemoryTensor(w[name][e]), (e, part))
    moe.pack_weight(plan_matmuls("cpu", torch.float32, quantization, cpu_library.load()))
    return moe


def reference(x, w, top_k: int, renormalize: bool) -> tuple[torch.Tensor, list[list[int]]]:
    """float64, one token and one expert at a time; ties go to the lower expert index."""
    out, chosen = torch.zeros(x.shape, dtype=torch.float64), []
    for t in range(x.shape[0]):
        xt = x[t].double()
        probs = torch.softmax(w["gate"].double() @ xt, dim=0)
        top = sorted(range(len(probs)), key=lambda e: (-float(probs[e]), e))[:top_k]
        p = probs[top]
        if renormalize:
            p = p / p.sum()
        for e, pe in zip(top, p):
            h = F.silu(w["w1"][e].double() @ xt) * (w["w3"][e].double() @ xt)
            out[t] += pe * (w["w2"][e].double() @ h)
        chosen.append(top)
    return out, chosen


def assert_close(got: torch.Tensor, want: torch.Tensor, rel: float):
    scale = want.abs().max().item()
    err = (got.double() - want).abs().max().item()
    assert err <= rel * scale, f"max error {err:.3g} > {rel:g} x {scale:.3g}"
