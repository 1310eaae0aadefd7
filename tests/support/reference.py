"""Hugging Face transformers as the oracle, and a direct run of meshserve's model."""

from __future__ import annotations

from pathlib import Path

import torch

from meshserve.comm.groups import AxisGroup
from meshserve.configs.model_info import read_model_info
from meshserve.layers.attention import build_attention_metadata
from meshserve.layers.loader import build_model


@torch.inference_mode()
def hf_model(path: Path | str, dtype: torch.dtype = torch.float32):
    from transformers import AutoModelForCausalLM

    p = Path(path)
    if p.is_file():
        return AutoModelForCausalLM.from_pretrained(str(p.parent), gguf_file=p.name, dtype=dtype).eval()
    return AutoModelForCausalLM.from_pretrained(str(p), dtype=dtype).eval()


@torch.inference_mode()
def hf_logits(model, token_ids: list[int]) -> torch.Tensor:
    """(len, vocab) float32 logits of one prompt."""
    return model(torch.tensor([token_ids])).logits[0].float()


@torch.inference_mode()
def hf_greedy(model, token_ids: list[int], max_new_tokens: int) -> list[int]:
    """Greedy continuation with the KV cache, exactly max_new_tokens long (it does not stop
    at EOS: compare up to the first EOS where the engine honours it)."""
    out = model(torch.tensor([token_ids]), use_cache=True)
    tokens = [int(out.logits[0, -1].argmax())]
    while len(tokens) < max_new_tokens:
        out = model(torch.tensor([[tokens[-1]]]), cache=out.cache, use_cache=True)
        tokens.append(int(out.logits[0, -1].argmax()))
    return tokens


@torch.inference_mode()
def meshserve_logits(path: Path | str, prompts: list[list[int]], dtype: torch.dtype = torch.float32,
                     block_size: int = 16, chunk: int | None = None, tp: AxisGroup | None = None,
                     quantization: str = "none", calibration: list[int] | None = None) -> list[torch.Tensor] | None:
    """Prefill all `prompts` in one flat batch through meshserve's model (this rank's share of `tp`) and
    return each prompt's (len, vocab) logits. With `chunk`, each prompt is prefilled in
    chunks of that many tokens over several steps, attending to its cached prefix. The
    products are the engine's on this CPU (the C++ kernels' fastest build where it builds)."""
    from meshserve.layers.kernels import cpu_library

    info = read_model_info(str(path))
    model = build_model(info, tp or AxisGroup.single("tp"), dtype, max_position=1024, quantization=quantization,
                        calibration=calibration, library=cpu_library.load())
    blocks_per_seq = -(-max(len(p) for p in prompts) // block_size)
    kv_heads = model.model.layers[0].self_attn.local_num_kv_heads
    shape = (blocks_per_seq * len(prompts), block_size, kv_heads, info.head_dim)
    caches = [(torch.zeros(shape, dtype=dtype), torch.zeros(shape, dtype=dtype)) for _ in model.model.layers]
    tables = [list(range(i * blocks_per_seq, (i + 1) * blocks_per_seq)) for i in range(len(prompts))]
    done = [0] * len(prompts)
    out: list[list[torch.Tensor]] = [[] for _ in prompts]
    while any(d < len(p) for d, p in zip(done, prompts)):
        live = [i for i, p in enumerate(prompts) if done[i] < len(p)]
        q = [min(chunk or len(prompts[i]), len(prompts[i]) - done[i]) for i in live]
        ids = torch.tensor([t for i, n in zip(live, q) for t in prompts[i][done[i]:done[i] + n]])
        pos = torch.tensor([t for i, n in zip(live, q) for t in range(done[i], done[i] + n)])
        meta = build_attention_metadata(q, [done[i] + n for i, n in zip(live, q)], [tables[i] for i in live], block_size)
        hidden, _ = model(ids, pos, caches, meta)
        logits = model.compute_logits(hidden)
        start = 0
        for i, n in zip(live, q):
            if logits is not None:
                out[i].append(logits[start:start + n])
            start += n
            done[i] += n
    return [torch.cat(parts) for parts in out] if tp is None or tp.rank == 0 else None
