"""The MoE block (layers.moe) against a per-token float64 loop: routing (softmax, top-k,
renormalized or not, ties to the lower expert), experts that get no tokens, one token, a
prefill-sized batch; int8 and int4 experts against the loop over their dequantized
weights; the shared expert of Qwen2-MoE; and the config errors of expert parallelism."""

from __future__ import annotations

import pytest
import torch

from meshserve.comm.groups import AxisGroup
from meshserve.configs import load_config
from meshserve.configs.errors import ConfigError
from meshserve.configs.model_info import read_model_info
from meshserve.configs.validate import check_config
from meshserve.layers.moe import route
from meshserve.layers.quant import dequantize_int4, quantize_int4, quantize_int8
from support.moe import H, assert_close, build, reference, weights

@pytest.mark.parametrize("tokens", [1, 7, 96])
@pytest.mark.parametrize("top_k,renormalize", [(2, True), (2, False), (1, False), (3, True)])
def test_block_matches_per_token_loop(tokens, top_k, renormalize):
    w = weights(seed=tokens)
    x = torch.randn(tokens, H, generator=torch.Generator().manual_seed(1))
    moe = build(w, top_k, renormalize)
    want, _ = reference(x, w, top_k, renormalize)
    assert_close(moe(x), want, 1e-5)
    assert moe.tokens_computed == tokens * top_k


def test_experts_that_get_no_tokens():
    w = weights(seed=3)
    w["gate"][3:] = -w["gate"][3:].abs()  # x > 0 below: experts 3.. always score lowest
    w["gate"][:3] = w["gate"][:3].abs()
    x = torch.rand(9, H, generator=torch.Generator().manual_seed(2)) + 0.1
    moe = build(w, top_k=2)
    want, chosen = reference(x, w, 2, True)
    assert {e for top in chosen for e in top} <= {0, 1, 2}
    assert_close(moe(x), want, 1e-5)


def test_routing_ties_go_to_the_lower_expert():
    w = weights(seed=4)
    w["gate"][5] = w["gate"][2]  # experts 2 and 5 always tie, and compute different things
    w["gate"][6] = w["gate"][2]  # and 6: three-way ties where only some fit in the top k
    x = torch.randn(16, H, generator=torch.Generator().manual_seed(5))
    weights_, ids = route(x @ w["gate"].t(), 2, False)
    probs = torch.softmax(x @ w["gate"].t(), dim=-1)
    for t in range(16):
        if 2 in ids[t].tolist() or 5 in ids[t].tolist() or 6 in ids[t].tolist():
            assert 5 not in ids[t].tolist() or 2 in ids[t].tolist(), "a tie went to the higher expert"
            assert 6 not in ids[t].tolist() or 5 in ids[t].tolist()
        assert torch.allclose(weights_[t], probs[t].sort(descending=True).values[:2])
    want, chosen = reference(x, w, 2, False)
    assert any(2 in top for top in chosen), "the case must exercise a tie"
    assert_close(build(w, top_k=2, renormalize=False)(x), want, 1e-5)


def dequantized(w, quantization: str):
    out = dict(w)
    for name in ("w1", "w3", "w2"):
        rows = []
        for m in w[name]:
            if quantization == "int8":
                codes, scale = quantize_int8(m)
                rows.append(codes.float() * scale[:, None])
            else:
                rows.append(dequantize_int4(*quantize_int4(m)))
        out[name] = torch.stack(rows)
    return out


@pytest.mark.parametrize("quantization", ["int8", "int4"])
@pytest.mark.parametrize("tokens", [1, 40])
def test_quantized_experts_match_the_loop_over_their_dequantized_weights(monkeypatch, quantization, tokens):
    """With the kernels' float32 inputs forced, to float32 rounding; as served (float32
    activations rounded to bf16 for the weight-only kernels, quant.kernel_dtype), to bf16's."""
    from meshserve.layers import quant

    w = weights(seed=6)
    x = torch.randn(tokens, H, generator=torch.Generator().manual_seed(7))
    want, _ = reference(x, dequantized(w, quantization), 2, True)
    served = build(w, quantization=quantization)(x)
    assert (served.double() - want).norm() / want.norm() < 2e-2
    monkeypatch.setattr(quant, "kernel_dtype", lambda act_dtype: act_dtype)
    moe = build(w, quantization=quantization)
    assert moe.packed is not None and moe.w13.numel() == 0, "the experts were not quantized"
    assert_close(moe(x), want, 1e-4)
    full, _ = reference(x, w, 2, True)
    assert (moe(x).double() - full).abs().max() > 1e-6, "quantized experts cannot equal the float weights"


def test_shared_expert_of_qwen2_moe(tiny_checkpoints):
    """The whole Qwen2-MoE checkpoint's first block against transformers' block."""
    from transformers import AutoModelForCausalLM

    from meshserve.layers.loader import build_model

    path = tiny_checkpoints["qwen2-moe"]
    info = read_model_info(str(path))
    ours = build_model(info, AxisGroup.single("tp"), torch.float32, max_position=64)
    theirs = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    x = torch.randn(5, info.hidden_size, generator=torch.Generator().manual_seed(8))
    with torch.inference_mode():
        want = theirs.model.layers[0].mlp(x[None])[0]
        got = ours.model.layers[0].mlp(x)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("kind,overrides,message", [
    ("llama", ["parallel.expert=2"], "parallel.expert=2 splits the experts of a mixture-of-experts model, but llama "
                                     "has none (use parallel.expert=1)"),
    ("qwen3-moe", ["parallel.expert=3"], "parallel.expert=3 does not divide num_experts=8 (try 1, 2, 4 or 8)"),
    ("qwen3-moe", ["parallel.expert=2", "parallel.context=2"], "parallel.expert=2 with parallel.context=2"),
    ("qwen3-moe", ["parallel.tensor=2", "model.quantization=int4"],
     "moe_intermediate_size / parallel.tensor = 16 is not a multiple of 32"),
    ("mixtral", ["parallel.expert=8"], "parallel.expert=8 does not divide num_experts=4 (try 1, 2 or 4)"),
    ("qwen2-moe", ["model.quantization=w8a8"], "the experts of qwen2_moe would go uncalibrated"),
])
def test_expert_parallel_config_errors(tiny_checkpoints, kind, overrides, message):
    config = load_config(None, [f"model.path={tiny_checkpoints[kind]}", "model.max_model_len=256", *overrides])
    with pytest.raises(ConfigError) as e:
        check_config(config, "moe.yaml")
    assert message in str(e.value)


def test_memory_plan_counts_a_ranks_share_of_the_experts(tiny_checkpoints):
    from meshserve.configs.memory import plan_memory

    path = tiny_checkpoints["qwen3-moe"]
    info = read_model_info(str(path))
    plans = {}
    for ep in (1, 2):
        config = load_config(None, [f"model.path={path}", "model.dtype=float32", "model.max_model_len=256",
                                    f"parallel.expert={ep}"])
        plans[ep] = plan_memory(config, check_config(config), "moe.yaml").weight_bytes
    m = info.moe
    experts_bytes = len(m.sparse_layers) * m.num_experts * m.expert_parameters(info.hidden_size) * 4
    assert plans[1] - plans[2] == pytest.approx(experts_bytes / 2, rel=0.01)
    # MFU and MBU count what a token uses: top-2 of 8 experts
    from meshserve.engine.perf import ModelCost

    cost = ModelCost(info, 4)
    unused = len(m.sparse_layers) * (m.num_experts - m.num_experts_per_tok) * m.expert_parameters(info.hidden_size)
    assert info.num_parameters - info.num_active_parameters == unused
    assert cost.flops(1, 1) == pytest.approx(2 * cost.matmul_params + 4 * info.num_hidden_layers
                                             * info.num_attention_heads * info.head_dim)
    assert cost.matmul_params == info.num_active_parameters - info.vocab_size * info.hidden_size
