"""Offline batch generation through the same engine (the `meshserve generate` path)."""

from __future__ import annotations

from meshserve.comm.messages import Completion, SamplingParams
from meshserve.engine.engine import Engine
from meshserve.engine.admission import check_params, check_prompt
from meshserve.engine.structured import Grammar


def generate(engine: Engine, prompts: list[str | list[int]], params: SamplingParams | list[SamplingParams],
             grammars: list[Grammar | None] | None = None) -> list[Completion]:
    """Run every prompt to completion; results in prompt order. `grammars`: per prompt, the
    compiled constraint its output follows (engine/structured.py), or None."""
    per_prompt = params if isinstance(params, list) else [params] * len(prompts)
    grammars = grammars or [None] * len(prompts)
    results = [Completion(str(i)) for i in range(len(prompts))]
    for i, (prompt, p) in enumerate(zip(prompts, per_prompt)):
        ids = engine.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        check_params(p, engine.vocab_size)
        check_prompt(ids, p, engine.vocab_size, engine.memory.max_model_len)
        engine.add_request(i, str(i), ids, p, stream=True, grammar=grammars[i])
    while engine.has_work():
        for i, delta in engine.step():
            results[i].add(delta)
    return results
