"""Prompts for `meshserve bench`: random ones of a given length, or a JSONL file.

Random prompts need no tokenizer on the client: as token ids (`--prompt-format tokens`,
for servers that take token-id prompts) or as text of random common words whose count is
calibrated against the server's own `usage.prompt_tokens` (`--prompt-format text`, for any
OpenAI-compatible server). Imports no torch.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

# Common English words; most are one token (with their leading space) in Llama-family tokenizers.
WORDS = """the of and to in is was for on that with as by at from his it an were are which this be or
have had not but one all new first their more after who its two also has year time people been other would
world she her they city some state over only out when into during there three many him most school then
these used can made may where such them team through part both between known later war under while since
day could game most life season began name work well being four back family second him however until
made five against small area high end held long left best music early great each home country found film
john group own before same both town river named place music national around series three off album
song set play like house few last north south west east church water red black white land power march
""".split()

TOKEN_ID_RANGE = (1000, 30000)
"""Random token ids come from here: above the special tokens of Llama-family vocabularies,
below the smallest of them (32000)."""


@dataclass(frozen=True)
class BenchPrompt:
    prompt: str | list[int]
    output_len: int
    prompt_len: int | None = None
    """Tokens in the prompt if known before sending (the server's usage says it after)."""


def random_words(rng: np.random.Generator, n: int) -> str:
    return " ".join(WORDS[i] for i in rng.integers(0, len(WORDS), n))


def random_token_prompts(rng: np.random.Generator, num: int, input_len: int, output_len: int) -> list[BenchPrompt]:
    lo, hi = TOKEN_ID_RANGE
    return [BenchPrompt([int(t) for t in rng.integers(lo, hi, input_len)], output_len, input_len) for _ in range(num)]


def random_text_prompts(rng: np.random.Generator, num: int, input_len: int, output_len: int,
                        tokens_per_word: float) -> list[BenchPrompt]:
    """Random-word prompts of about `input_len` tokens, given the server's tokens per word."""
    words = max(1, round(input_len / tokens_per_word))
    return [BenchPrompt(random_words(rng, words), output_len) for _ in range(num)]


def load_jsonl(path: str | Path, num: int, default_output_len: int) -> list[BenchPrompt]:
    """`num` prompts from a JSONL file, cycling through it if it has fewer. Each line is an
    object with `prompt` (text or token ids) and optionally `output_len` (or `max_tokens`)."""
    rows = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{lineno}: not JSON ({e})") from None
            prompt = obj.get("prompt") if isinstance(obj, dict) else None
            if not isinstance(prompt, (str, list)) or not prompt:
                raise ValueError(f"{path}:{lineno}: expected an object with a non-empty `prompt`")
            out = obj.get("output_len", obj.get("max_tokens", default_output_len))
            if not isinstance(out, int) or out < 1:
                raise ValueError(f"{path}:{lineno}: output_len must be a positive integer, got {out!r}")
            rows.append(BenchPrompt(prompt, out, len(prompt) if isinstance(prompt, list) else None))
    if not rows:
        raise ValueError(f"{path}: no prompts")
    return [rows[i % len(rows)] for i in range(num)]
