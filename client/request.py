"""Building the GenerateRequest both clients send."""

from __future__ import annotations

import uuid
from collections.abc import Sequence

from meshserve.comm.messages import GenerateRequest, SamplingParams


def make_request(prompt: str | Sequence[int], *, request_id: str | None, stream: bool, max_tokens: int = 16,
                 temperature: float = 1.0, top_p: float = 1.0, top_k: int = 0, seed: int | None = None,
                 stop: str | list[str] | None = None, stop_token_ids: list[int] | None = None,
                 min_tokens: int = 0, ignore_eos: bool = False, logprobs: int | None = None,
                 skip_special_tokens: bool = True) -> GenerateRequest:
    params = SamplingParams(
        max_tokens=max_tokens, min_tokens=min_tokens, temperature=temperature, top_p=top_p, top_k=top_k, seed=seed,
        stop=[stop] if isinstance(stop, str) else list(stop or []), stop_token_ids=list(stop_token_ids or []),
        ignore_eos=ignore_eos, logprobs=logprobs, skip_special_tokens=skip_special_tokens,
    )
    rid = request_id or uuid.uuid4().hex
    if isinstance(prompt, str):
        return GenerateRequest(rid, prompt=prompt, params=params, stream=stream)
    return GenerateRequest(rid, prompt_token_ids=list(prompt), params=params, stream=stream)
