"""`meshserve bench`: a load generator for any OpenAI-compatible server, after vLLM's serving
benchmark (same method, flag and JSON key names, so figures compare with published ones).

Requests stream (SSE), so each gives its time to first token and the gaps between chunks.
Arrivals are a Poisson process at `--request-rate` (gamma-distributed gaps with
`--burstiness` != 1), or as fast as `--max-concurrency` allows. Several rates or
concurrencies make a sweep: one run each, then throughput and goodput against offered
load. Imports no torch; talks HTTP only (httpx).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import math
import random
import sys
import time
from datetime import datetime
from pathlib import Path
from urllib.parse import urlsplit

import httpx
import numpy as np
from tqdm import tqdm

from meshserve.client.bench_data import (BenchPrompt, load_jsonl, random_text_prompts, random_token_prompts,
                                         random_words)
from meshserve.client.bench_stats import RequestResult, format_result, plot, summarize
from meshserve.client.bench_workloads import Conversation, multi_turn, prefix_repetition

SLO_KEYS = ("ttft", "tpot", "e2el")


def parse_slo(specs: list[str]) -> dict[str, float]:
    """`ttft=2000,tpot=100` (or vLLM's `ttft:2000 tpot:100`) -> {"ttft": 2000.0, "tpot": 100.0} in ms."""
    out = {}
    for spec in specs:
        for item in filter(None, spec.replace(" ", ",").split(",")):
            key, sep, value = item.replace(":", "=").partition("=")
            if not sep or key not in SLO_KEYS:
                raise ValueError(f"bad SLO {item!r}: expected KEY=MS with KEY one of {', '.join(SLO_KEYS)}")
            try:
                out[key] = float(value)
            except ValueError:
                raise ValueError(f"bad SLO {item!r}: {value!r} is not a number of milliseconds") from None
    return out


def auth_headers(api_key: str | None) -> dict[str, str]:
    """The header that carries an API key (--api-key: the server's server.api_key)."""
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


def endpoint_url(url: str, endpoint: str) -> str:
    return url if urlsplit(url).path.rstrip("/").endswith("/completions") else url.rstrip("/") + endpoint


class Target:
    """The server under test: where to post, which model, completions or chat."""

    def __init__(self, url: str, model: str, chat: bool, args: argparse.Namespace):
        self.url, self.model, self.chat, self.args = url, model, chat, args
        self.adapters = getattr(args, "lora_modules", None) or []
        self._pick = random.Random(getattr(args, "seed", 0))

    def body(self, p: BenchPrompt, stream: bool = True, max_tokens: int | None = None) -> dict:
        model = self._pick.choice(self.adapters) if self.adapters else self.model
        body = {"model": model, "max_tokens": max_tokens or p.output_len, "temperature": self.args.temperature,
                "stream": stream}
        for key in ("top_p", "top_k"):
            if getattr(self.args, key, None) is not None:
                body[key] = getattr(self.args, key)
        if stream:
            body["stream_options"] = {"include_usage": True}
        if self.args.ignore_eos:
            # vLLM and meshserve read ignore_eos; llama.cpp's servers read min_tokens
            body["ignore_eos"] = True
            body["min_tokens"] = body["max_tokens"]
        if self.chat:
            is_messages = isinstance(p.prompt, list) and p.prompt and isinstance(p.prompt[0], dict)
            body["messages"] = p.prompt if is_messages else [{"role": "user", "content": p.prompt}]
        else:
            body["prompt"] = p.prompt
        return body

    async def request(self, client: httpx.AsyncClient, p: BenchPrompt) -> RequestResult:
        """One streamed request, timed chunk by chunk."""
        r = RequestResult(prompt_len=p.prompt_len or 0)
        pieces: list[str] = []
        start = last = time.perf_counter()
        try:
            async with client.stream("POST", self.url, json=self.body(p)) as resp:
                if resp.status_code != 200:
                    r.error = f"HTTP {resp.status_code}: {(await resp.aread()).decode(errors='replace')[:300]}"
                    return r
                async for line in resp.aiter_lines():
                    if not line.startswith("data:"):
                        continue
                    data = line[5:].strip()
                    if data == "[DONE]":
                        break
                    now = time.perf_counter()
                    obj = json.loads(data)
                    if "error" in obj:
                        r.error = f"stream error: {obj['error']}"
                        return r
                    if obj.get("choices"):
                        choice = obj["choices"][0]
                        piece = (choice.get("delta") or {}).get("content") if self.chat else choice.get("text")
                        # NOTE: a chunk without text is no token (a chat role, a final empty chunk);
                        # without usage in the stream, the output length is the count of the others.
                        if piece:
                            if not pieces:
                                r.ttft = now - start
                            else:
                                r.itl.append(now - last)
                            last = now
                            pieces.append(piece)
                    if obj.get("usage"):
                        r.output_len = obj["usage"].get("completion_tokens") or 0
                        r.prompt_len = obj["usage"].get("prompt_tokens") or r.prompt_len
                        details = obj["usage"].get("prompt_tokens_details") or {}
                        if details.get("cached_tokens") is not None:
                            r.cached_tokens = int(details["cached_tokens"])
            r.latency = time.perf_counter() - start
            r.output_len = r.output_len or len(pieces)
            r.text = "".join(pieces)
            r.success = bool(pieces)
            if not r.success:
                r.error = "the stream had no tokens"
        except Exception as e:  # noqa: BLE001 - a failed request is a result, not a crash
            r.error = f"{type(e).__name__}: {e}"
        return r

    async def prompt_tokens(self, client: httpx.AsyncClient, text: str) -> int:
        """The server's token count of `text` as a prompt (a one-token request's usage)."""
        resp = await client.post(self.url, json=self.body(BenchPrompt(text, 1), stream=False, max_tokens=1))
        resp.raise_for_status()
        return int(resp.json()["usage"]["prompt_tokens"])


async def resolve_model(client: httpx.AsyncClient, url: str) -> str:
    base = url.split("/v1/")[0].rstrip("/")
    resp = await client.get(base + "/v1/models")
    resp.raise_for_status()
    return resp.json()["data"][0]["id"]


async def make_prompts(client: httpx.AsyncClient, target: Target, args) -> list[BenchPrompt] | list[Conversation]:
    """The workload's requests: prompts, or conversations for `--dataset-name multi-turn`."""
    rng = np.random.default_rng(args.seed)
    if args.dataset:
        return load_jsonl(args.dataset, args.num_prompts, args.output_len)
    if args.prompt_format == "tokens":
        if target.chat or args.dataset_name != "random":
            raise ValueError("--prompt-format tokens needs a completions endpoint and --dataset-name random")
        return random_token_prompts(rng, args.num_prompts, args.input_len, args.output_len)
    # Calibrate words -> tokens on the server itself (two lengths: a template adds a constant).
    short, long = random_words(rng, 50), random_words(rng, 250)
    t_short, t_long = await target.prompt_tokens(client, short), await target.prompt_tokens(client, long)
    per_word = max(0.1, (t_long - t_short) / 200)
    overhead = max(0.0, t_short - 50 * per_word)
    if args.dataset_name == "prefix-repetition":
        return prefix_repetition(rng, args.num_prompts, args.num_prefixes, args.prefix_len, args.suffix_len,
                                 args.output_len, per_word)
    if args.dataset_name == "multi-turn":
        return multi_turn(rng, args.num_prompts, args.num_turns, args.input_len, args.output_len, per_word)
    prompts = random_text_prompts(rng, args.num_prompts, max(1, round(args.input_len - overhead)), args.output_len,
                                  per_word)
    return [BenchPrompt(p.prompt, p.output_len, args.input_len) for p in prompts]


def first_request(item: BenchPrompt | Conversation, chat: bool) -> BenchPrompt:
    return item.turn(0, chat) if isinstance(item, Conversation) else item


async def run_once(target: Target, prompts: list[BenchPrompt] | list[Conversation], rate: float,
                   concurrency: int | None, burstiness: float, seed: int, show_progress: bool,
                   timeout: float) -> tuple[list[RequestResult], float]:
    """Every prompt (or conversation: its turns one after another, holding one slot of
    `concurrency` throughout) arriving at `rate`; the results of every request."""
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency or 256)
    async with httpx.AsyncClient(timeout=httpx.Timeout(timeout, connect=60.0), limits=limits,
                                 headers=auth_headers(getattr(target.args, "api_key", None))) as client:
        gate = asyncio.Semaphore(concurrency) if concurrency else None
        total = sum(len(p.questions) if isinstance(p, Conversation) else 1 for p in prompts)
        bar = tqdm(total=total, disable=not show_progress, file=sys.stderr)
        rng = np.random.default_rng(seed + 1)

        async def requests(item: BenchPrompt | Conversation) -> list[RequestResult]:
            if not isinstance(item, Conversation):
                bar.update(1)
                return [await target.request(client, item)]
            conversation = Conversation(item.questions, item.output_len)  # a fresh history each run
            out = []
            for i in range(len(item.questions)):
                r = await target.request(client, conversation.turn(i, target.chat))
                out.append(r)
                bar.update(1)
                if not r.success:
                    break
                conversation.answered(i, r.text)
            return out

        async def one(item: BenchPrompt | Conversation) -> list[RequestResult]:
            if gate is None:
                return await requests(item)
            async with gate:
                return await requests(item)

        start = time.perf_counter()
        tasks = []
        for i, p in enumerate(prompts):
            tasks.append(asyncio.create_task(one(p)))
            if math.isfinite(rate) and i + 1 < len(prompts):
                # Poisson arrivals when burstiness == 1; gamma gaps with the same mean otherwise
                await asyncio.sleep(rng.gamma(burstiness, 1.0 / (rate * burstiness)))
        results = [r for rs in await asyncio.gather(*tasks) for r in rs]
        duration = time.perf_counter() - start
        bar.close()
    return results, duration


async def bench(args: argparse.Namespace) -> list[dict]:
    slo = parse_slo(args.slo or [])
    url = endpoint_url(args.url, args.endpoint)
    chat = url.rstrip("/").endswith("chat/completions")
    async with httpx.AsyncClient(timeout=httpx.Timeout(args.timeout, connect=60.0),
                                 headers=auth_headers(getattr(args, "api_key", None))) as client:
        model = args.model or await resolve_model(client, url)
        target = Target(url, model, chat, args)
        prompts = await make_prompts(client, target, args)
        first = first_request(prompts[0], chat)
        warm = await target.request(client, BenchPrompt(first.prompt, min(4, first.output_len)))
        if not warm.success:
            raise RuntimeError(f"the test request failed: {warm.error}")
    runs = []
    for rate in args.request_rate:
        for concurrency in args.max_concurrency:
            results, duration = await run_once(target, prompts, rate, concurrency, args.burstiness, args.seed,
                                               not args.disable_tqdm, args.timeout)
            res = {"date": datetime.now().strftime("%Y%m%d-%H%M%S"), "backend": "openai-chat" if chat else "openai",
                   "url": url, "model_id": model, "dataset_name": args.dataset_name, "num_prompts": len(prompts),
                   "request_rate": rate if math.isfinite(rate) else "inf", "burstiness": args.burstiness,
                   "max_concurrency": concurrency, "goodput_slo_ms": slo or None}
            res |= summarize(results, duration, slo)
            title = f"Serving Benchmark Result (rate {res['request_rate']}, concurrency {concurrency or 'inf'})"
            print(format_result(res, title), flush=True)
            runs.append(res)
    return runs


def run(args: argparse.Namespace) -> int:
    """The `meshserve bench` command (arguments from launcher/cli.py)."""
    logging.getLogger("httpx").setLevel(logging.WARNING)  # not a line per request
    try:
        runs = asyncio.run(bench(args))
    except (ValueError, RuntimeError, httpx.HTTPError, OSError) as e:
        print(f"meshserve bench: {e}", file=sys.stderr)
        return 1
    if args.output:
        out = Path(args.output)
        out.parent.mkdir(parents=True, exist_ok=True)
        payload = runs[0] if len(runs) == 1 else {"runs": runs}
        out.write_text(json.dumps(payload, indent=1))
        if not args.no_plots:
            for path in plot(runs, str(out.with_suffix(""))):
                print(f"wrote {path}", file=sys.stderr)
        print(f"wrote {out}", file=sys.stderr)
    return 0 if all(r["completed"] for r in runs) else 1
