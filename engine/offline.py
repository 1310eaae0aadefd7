"""Offline batch generation through the same engine (the `meshserve generate` path)."""

from __future__ import annotations

from meshserve.comm.messages import Completion, SamplingParams
from meshserve.engine.engine import Engine
from meshserve.engine.admission import check_params, check_prompt


def generate(engine: Engine, prompts: list[str | list[int]], params: SamplingParams | list[SamplingParams]) -> list[Completion]:
    """Run every prompt to completion; results in prompt order."""
    per_prompt = params if isinstance(params, list) else [params] * len(prompts)
    results = [Completion(str(i)) for i in range(len(prompts))]
    for i, (prompt, p) in enumerate(zip(prompts, per_prompt)):
        ids = engine.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        check_params(p, engine.vocab_size)
        check_prompt(ids, p, engine.vocab_size, engine.memory.max_model_len)
        engine.add_request(i, str(i), ids, p, stream=True)
    while engine.has_work():
        for i, delta in engine.step():
            results[i].add(delta)
    return results
