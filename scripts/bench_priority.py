"""Priority scheduling under load: the TTFT of a 10% high-priority share of requests against
the low-priority rest, with scheduler.policy=priority and with fcfs, side by side in one run.

Two servers stay up (fcfs and priority, the same model and limits), and the rounds rotate
between them. Each run is a closed loop of --concurrency clients streaming --requests
completions of new random-word prompts (no prefix-cache hits across runs), every tenth one
"high" (priority 0, the others 1; fcfs servers get no priority field, and the same tenth is
counted as high). scheduler.max_num_seqs below the concurrency makes requests queue, which
is where an order of service matters. Prints and writes (results/bench_priority.json) the
medians over rounds of each share's TTFT p50/p99, the output tokens/s, and the ratios.

    python scripts/bench_priority.py [--concurrency 32] [--max-num-seqs 8] [--rounds 3]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import time
from pathlib import Path

import httpx

from meshserve.configs.cpu_features import cpu_features

from bench_http import meshserve_server, rotating_rounds

REPO = Path(__file__).resolve().parent.parent
WORDS = ("river stone apple quiet number garden silver window morning engine paper candle harbor pencil "
         "meadow violin thunder lantern orbit velvet").split()


def prompts(n: int, words: int, salt: str) -> list[str]:
    rng = random.Random(salt)
    return [f"{salt}-{i}: " + " ".join(rng.choice(WORDS) for _ in range(words)) for i in range(n)]


def percentile(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(round(q / 100 * (len(values) - 1))))]


async def one(http: httpx.AsyncClient, prompt: str, max_tokens: int, priority: int | None) -> tuple[float, int]:
    """(TTFT in s, output tokens) of one streamed completion."""
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}
    if priority is not None:
        body["priority"] = priority
    start, first, tokens = time.perf_counter(), None, 0
    async with http.stream("POST", "/v1/completions", json=body) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
            if first is None and chunk.get("choices") and chunk["choices"][0].get("text"):
                first = time.perf_counter()
    return (first or time.perf_counter()) - start, tokens


async def run_load(url: str, texts: list[str], concurrency: int, max_tokens: int, with_priority: bool) -> dict:
    todo = list(enumerate(texts))
    ttft: dict[str, list[float]] = {"high": [], "low": []}
    tokens = 0

    async def client(http: httpx.AsyncClient) -> None:
        nonlocal tokens
        while todo:
            i, text = todo.pop(0)
            share = "high" if i % 10 == 0 else "low"
            seconds, n = await one(http, text, max_tokens, (0 if share == "high" else 1) if with_priority else None)
            ttft[share].append(seconds)
            tokens += n

    start = time.perf_counter()
    async with httpx.AsyncClient(base_url=url, timeout=600) as http:
        await asyncio.gather(*(client(http) for _ in range(concurrency)))
    wall = time.perf_counter() - start
    return {"tok_s": tokens / wall, **{f"{share}_ttft_p{q}_ms": 1000 * percentile(v, q)
                                       for share, v in ttft.items() for q in (50, 99)}}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--requests", type=int, default=160)
    p.add_argument("--prompt-words", type=int, default=60)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--max-num-seqs", type=int, default=8)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--out", type=Path, default=REPO / "results" / "bench_priority.json")
    args = p.parse_args()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    common = [f"scheduler.max_num_seqs={args.max_num_seqs}", "model.max_model_len=1024"]
    servers = {"fcfs": meshserve_server("fcfs", common, args.out.with_suffix(".fcfs.log")),
               "priority": meshserve_server("priority", common + ["scheduler.policy=priority"],
                                            args.out.with_suffix(".priority.log"))}
    try:
        urls = {name: s.wait_http(None) for name, s in servers.items()}

        def run(name: str, r: int) -> dict:
            texts = prompts(args.requests, args.prompt_words, f"{name}{r}{time.time_ns()}")
            return asyncio.run(run_load(urls[name], texts, args.concurrency, args.max_tokens, name == "priority"))

        runs = rotating_rounds(list(servers), args.rounds, run)
    finally:
        for s in servers.values():
            s.stop()
    keys = ("tok_s", "high_ttft_p50_ms", "high_ttft_p99_ms", "low_ttft_p50_ms", "low_ttft_p99_ms")
    med = {n: {k: statistics.median(run[k] for run in each) for k in keys} for n, each in runs.items()}
    print(f"# {cpu_features().describe()}; c={args.concurrency}, {args.requests} requests x {args.max_tokens} tokens, "
          f"10% high priority, max_num_seqs={args.max_num_seqs}; medians of {args.rounds} rounds")
    print(f"{'policy':<10}{'tok/s':>8}{'high p50':>10}{'high p99':>10}{'low p50':>10}{'low p99':>10}  (TTFT ms)")
    for name, m in med.items():
        print(f"{name:<10}{m['tok_s']:>8.1f}{m['high_ttft_p50_ms']:>10.0f}{m['high_ttft_p99_ms']:>10.0f}"
              f"{m['low_ttft_p50_ms']:>10.0f}{m['low_ttft_p99_ms']:>10.0f}")
    pr, fc = med["priority"], med["fcfs"]
    ratios = {"high_p99_priority_over_fcfs": pr["high_ttft_p99_ms"] / fc["high_ttft_p99_ms"],
              "high_p99_over_low_p99_priority": pr["high_ttft_p99_ms"] / pr["low_ttft_p99_ms"],
              "low_p99_priority_over_fcfs": pr["low_ttft_p99_ms"] / fc["low_ttft_p99_ms"],
              "tok_s_priority_over_fcfs": pr["tok_s"] / fc["tok_s"]}
    for k, v in ratios.items():
        print(f"{k}: {v:.2f}")
    args.out.write_text(json.dumps({"cpu": cpu_features().describe(), "args": vars(args) | {"out": str(args.out)},
                                    "runs": runs, "medians": med, "ratios": ratios}, indent=2))
    print(f"wrote {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
