"""Speculative decoding on and off, in the same run: one-stream decode tokens/s and output
tokens/s at concurrency 32 of `meshserve serve` (the default model, SmolLM2-135M-Instruct;
one stream over the ZMQ client, concurrency over HTTP: streamed /v1/completions), with
`speculative.method=ngram` against without.

Workloads:
- grounded: output that copies its input (scripts/data/spec_grounded.json): code edits
  (rename one variable of a function, reply with the whole function) and summaries that
  quote their text; greedy, up to --grounded-tokens tokens, ending where the model ends;
- chat: questions of everyday chat (CHAT below, none of them in scripts/train_heads.py's
  training set), greedy, up to --chat-tokens tokens, ending where the model ends: output
  the prompt does not contain (what Medusa heads are for: `--spec speculative.method=medusa
  --spec speculative.heads=FILE`);
- random: --input-len random token ids, sampled at temperature 1.0, exactly --random-tokens
  tokens (ignore_eos): output the prompt does not predict, where proposals are rarely right
  and the adaptive draft length has to keep speculation from costing anything.

Each --topology (tp1: one rank, tp3: parallel.tensor=3, pp2: parallel.pipeline=2; SmolLM2's 9
heads and 3 KV heads cannot be split 2 ways) runs --rounds rounds; a round starts a fresh
server for each arm, both up at once, warms each up with one request of each workload (a
server that has served some traffic: the speculative arm has learned what drafting costs
and earns on such requests, as it would in service), then runs each
measurement on one arm and right after on the other (off first in even rounds, on first in
odd ones): the one-stream workloads (requests one after another; decode tokens/s = tokens
after the first over the time from the first token to the last) and, at tp1, every workload
at --concurrency over HTTP (all requests at once, --per-slot per slot, each a streamed
/v1/completions of token ids through the openai client; output tokens/s over the wall time).
Prints the medians over rounds and the median of each round's on/off ratio;
the acceptance rate and a sequence's tokens per step (the most speculation could speed it up)
from the usage (accepted and rejected draft tokens). Greedy output (grounded, chat) is
identical in both arms (checked: `same greedy output`).

    python scripts/bench_speculative.py [--topology tp1 tp3 pp2] [--rounds 3] [--set KEY=VALUE]
                                        [--json-out results/bench_speculative.json]
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
import openai

from bench_http import Served
from bench_structured import wait_ready
from meshserve.client import AsyncClient
from meshserve.configs import load_config
from meshserve.configs.cpu_features import cpu_features
from meshserve.configs.model_info import read_model_info
from meshserve.engine.tokenizer import Tokenizer
from meshserve.launcher.network import free_port

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
TOPOLOGIES = {"tp1": [], "tp3": ["parallel.tensor=3"], "pp2": ["parallel.pipeline=2"]}
SPECULATIVE = ["speculative.method=ngram"]
ARMS = ("off", "on")
SYSTEM = "You are a careful assistant. You do exactly what the user asks, and nothing more."


CHAT = [
    "What should I pack for a weekend hiking trip?", "How do I make a good cup of tea?",
    "Explain how earthquakes happen.", "Give me three tips for learning to paint.",
    "Why do penguins live in cold places?", "What are the benefits of running every morning?",
    "Describe a typical day in a big city.", "How can I read more books each year?",
]


def speculative_settings(overrides: list[str]) -> list[str]:
    """The speculative arm's settings, SPECULATIVE with `overrides` (KEY=VALUE) in their place."""
    settings = {o.split("=", 1)[0]: o for o in SPECULATIVE}
    settings.update((o.split("=", 1)[0], o) for o in overrides)
    return list(settings.values())


def chat_prompts(tokenizer: Tokenizer) -> list[list[int]]:
    return [tokenizer.apply_chat_template([{"role": "user", "content": q}]) for q in CHAT]


def grounded_prompts(tokenizer: Tokenizer) -> list[list[int]]:
    items = json.loads((HERE / "data" / "spec_grounded.json").read_text())
    return [tokenizer.apply_chat_template([{"role": "system", "content": SYSTEM},
                                           {"role": "user", "content": f"{i['instruction']}\n\n{i['text']}"}])
            for i in items]


def random_prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(1000, vocab) for _ in range(length)] for _ in range(n)]


async def one_request(client: AsyncClient, prompt: list[int], params: dict) -> dict:
    """Stream one request: its tokens, the time of its first and last token, and its usage."""
    first = last = None
    tokens, usage = [], None
    async for delta in await client.generate(prompt, stream=True, **params):
        now = time.perf_counter()
        if delta.token_ids and first is None:
            first = now
        tokens += delta.token_ids
        last = now
        usage = delta.usage or usage
    return {"tokens": tokens, "first": first, "last": last, "accepted": usage.accepted_draft_tokens,
            "rejected": usage.rejected_draft_tokens}


async def run(address: str, prompts: list[list[int]], params: dict, concurrency: int) -> dict:
    """All of `prompts`, at most `concurrency` at once."""
    gate = asyncio.Semaphore(concurrency)

    async def gated(client, prompt):
        async with gate:
            return await one_request(client, prompt, params)

    async with AsyncClient(address) as client:
        started = time.perf_counter()
        results = await asyncio.gather(*(gated(client, p) for p in prompts))
        wall = time.perf_counter() - started
    tokens = sum(len(r["tokens"]) for r in results)
    decode_tokens = sum(len(r["tokens"]) - 1 for r in results if len(r["tokens"]) > 1)
    decode_s = sum(r["last"] - r["first"] for r in results if len(r["tokens"]) > 1)
    accepted, rejected = sum(r["accepted"] for r in results), sum(r["rejected"] for r in results)
    verified = accepted + rejected
    return {"requests": len(results), "output_tokens": tokens, "wall_s": wall, "output_tok_s": tokens / wall,
            "decode_tok_s": decode_tokens / decode_s if decode_s else None,
            "accepted": accepted, "rejected": rejected,
            "acceptance_rate": accepted / verified if verified else None,
            "outputs": [r["tokens"] for r in results]}


async def one_http_request(client: openai.AsyncOpenAI, model: str, prompt: list[int], params: dict) -> dict:
    """Stream one /v1/completions request: its text, its completion tokens and the accepted and
    rejected draft tokens of its usage."""
    extra = {k: v for k, v in params.items() if k not in ("max_tokens", "temperature")}
    stream = await client.completions.create(model=model, prompt=prompt, max_tokens=params["max_tokens"],
                                             temperature=params["temperature"], stream=True,
                                             stream_options={"include_usage": True}, extra_body=extra)
    text, usage = [], None
    async for chunk in stream:
        text += [c.text for c in chunk.choices]
        usage = chunk.usage or usage
    details = usage.completion_tokens_details
    return {"text": "".join(text), "tokens": usage.completion_tokens,
            "accepted": details.accepted_prediction_tokens or 0 if details else 0,
            "rejected": details.rejected_prediction_tokens or 0 if details else 0}


async def run_http(url: str, prompts: list[list[int]], params: dict, concurrency: int) -> dict:
    """All of `prompts` over HTTP (the openai client), at most `concurrency` at once: output
    tokens/s over the wall time."""
    gate = asyncio.Semaphore(concurrency)
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=None,
                                  http_client=httpx.AsyncClient(timeout=None, limits=limits)) as client:
        model = (await client.models.list()).data[0].id

        async def gated(prompt):
            async with gate:
                return await one_http_request(client, model, prompt, params)

        started = time.perf_counter()
        results = await asyncio.gather(*(gated(p) for p in prompts))
        wall = time.perf_counter() - started
    tokens = sum(r["tokens"] for r in results)
    accepted, rejected = sum(r["accepted"] for r in results), sum(r["rejected"] for r in results)
    verified = accepted + rejected
    return {"requests": len(results), "output_tokens": tokens, "wall_s": wall, "output_tok_s": tokens / wall,
            "accepted": accepted, "rejected": rejected,
            "acceptance_rate": accepted / verified if verified else None,
            "outputs": [r["text"] for r in results]}


def workloads(tokenizer: Tokenizer, vocab: int, args) -> dict[str, tuple[list[list[int]], dict]]:
    grounded = grounded_prompts(tokenizer)[:args.grounded_requests]
    return {"grounded": (grounded, {"max_tokens": args.grounded_tokens, "temperature": 0.0}),
            "chat": (chat_prompts(tokenizer)[:args.chat_requests], {"max_tokens": args.chat_tokens, "temperature": 0.0}),
            "random": (random_prompts(args.random_requests, args.input_len, vocab, 0),
                       {"max_tokens": args.random_tokens, "temperature": 1.0, "ignore_eos": True})}


def serve(name: str, overrides: list[str], log: Path) -> tuple[Served, str, str]:
    """A server answering on ZMQ and HTTP: it, its ZMQ address and its base URL."""
    server = Served(name, [sys.executable, "-m", "meshserve.launcher.cli", "serve", "--set", "server.http=127.0.0.1:0",
                           "--set", f"server.zmq=tcp://127.0.0.1:{free_port()}",
                           *[a for o in overrides for a in ("--set", o)]], log)
    address = wait_ready(server)
    return server, address, server.wait_http(None)


def measure_round(topology: str, warm_up: list[tuple], loads: dict, args, out_dir: Path, round_: int) -> dict:
    """Both arms' servers, up at once (an idle server costs the other nothing), each warmed
    up with every (prompts, params) of `warm_up`; then every measurement of `loads` on one arm and
    right after on the other (off first in even rounds), so that the machine's drift falls
    on both arms of each ratio alike. Returns {arm: results}."""
    order = ARMS if round_ % 2 == 0 else ARMS[::-1]
    servers: dict[str, tuple[Served, str, str]] = {}
    try:
        for arm in order:
            overrides = [*args.overrides, *TOPOLOGIES[topology],
                         *(SPECULATIVE + args.spec_overrides if arm == "on" else [])]
            print(f"# {topology} round {round_}: starting speculation {arm} ...", file=sys.stderr, flush=True)
            servers[arm] = serve(f"{topology}-{arm}", overrides, out_dir / f"{topology}_{arm}_{round_}.log")
            for prompts, params in warm_up:
                asyncio.run(run(servers[arm][1], prompts, params, 1))
        results = {arm: {"one_stream": {}} for arm in order}
        for name, (prompts, params) in loads.items():
            for arm in order:
                results[arm]["one_stream"][name] = run_sync(servers[arm][1], prompts, params, 1)
        if topology == "tp1" and args.concurrency:
            for name, (prompts, params) in loads.items():
                n = args.concurrency * args.per_slot
                many = (prompts * -(-n // len(prompts)))[:n]
                for arm in order:
                    results[arm].setdefault("concurrent", {})[name] = asyncio.run(
                        run_http(servers[arm][2], many, params, args.concurrency))
    finally:
        for server, _, _ in servers.values():
            server.stop()
    return results


def run_sync(address: str, prompts, params, concurrency) -> dict:
    return asyncio.run(run(address, prompts, params, concurrency))


def median(values) -> float | None:
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def summarize(rounds: list[dict], section: str, workload: str, key: str) -> dict:
    """Medians over rounds of each arm's `key`, the median of the rounds' on/off ratios, the
    acceptance over all rounds, a sequence's tokens per step (each of its steps makes one
    token and keeps its accepted drafts: a bound on the speed-up, since a step with drafts
    costs at least one without), and whether greedy output was the same in both arms."""
    off = [r["off"][section][workload] for r in rounds]
    on = [r["on"][section][workload] for r in rounds]
    accepted = sum(r["accepted"] for r in on)
    rejected = sum(r["rejected"] for r in on)
    drafts_verified = accepted + rejected
    output = sum(r["output_tokens"] for r in on)
    same = all(a["outputs"] == b["outputs"] for a, b in zip(off, on)) if workload != "random" else None
    return {"off": median(r[key] for r in off), "on": median(r[key] for r in on),
            "ratio": median(b[key] / a[key] for a, b in zip(off, on) if a[key] and b[key]),
            "ratios": [b[key] / a[key] for a, b in zip(off, on) if a[key] and b[key]],
            "acceptance_rate": accepted / drafts_verified if drafts_verified else None,
            "accepted_tokens": accepted, "draft_tokens": drafts_verified, "output_tokens": output,
            "tokens_per_step": output / (output - accepted) if output > accepted else None,
            "same_greedy_output": same}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--topology", nargs="+", default=["tp1", "tp3", "pp2"], choices=list(TOPOLOGIES))
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--concurrency", type=int, default=32, help="0: no concurrent runs")
    p.add_argument("--per-slot", type=int, default=1, help="requests per concurrency slot")
    p.add_argument("--grounded-tokens", type=int, default=256)
    p.add_argument("--grounded-requests", type=int, default=None, help="the first N grounded prompts (default: all 10)")
    p.add_argument("--workloads", nargs="+", default=["grounded", "random"], choices=["grounded", "chat", "random"])
    p.add_argument("--chat-tokens", type=int, default=128)
    p.add_argument("--chat-requests", type=int, default=None, help="the first N chat questions (default: all 8)")
    p.add_argument("--random-tokens", type=int, default=128)
    p.add_argument("--random-requests", type=int, default=4)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="config override of both arms (repeatable)")
    p.add_argument("--spec", dest="spec_overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="config override of the speculative arm (repeatable), e.g. speculative.num_speculative_tokens=4")
    p.add_argument("--json-out", default=str(REPO / "results" / "bench_speculative.json"))
    args = p.parse_args()

    out = Path(args.json_out)
    out.parent.mkdir(parents=True, exist_ok=True)
    logs = out.parent / "bench_speculative_logs"
    logs.mkdir(exist_ok=True)
    config = load_config(None, args.overrides)
    info = read_model_info(config.model.path)
    tokenizer = Tokenizer(info, config.model.tokenizer)
    loads = workloads(tokenizer, info.vocab_size, args)
    loads = {name: loads[name] for name in args.workloads}
    warm = {"grounded": lambda prompts: prompts[:1],
            "chat": lambda _: [tokenizer.apply_chat_template([{"role": "user", "content": "Say hello."}])],
            "random": lambda _: random_prompts(1, args.input_len, info.vocab_size, seed=1)}  # not a prompt measured
    warm_up = [(warm[name](prompts), params) for name, (prompts, params) in loads.items()]
    report: dict = {"cpu": cpu_features().describe(), "overrides": args.overrides,
                    "speculative": speculative_settings(args.spec_overrides), "args": vars(args), "topologies": {}}
    for topology in args.topology:
        rounds = []
        for r in range(args.rounds):
            rounds.append(measure_round(topology, warm_up, loads, args, logs, r))
        summary = {"one_stream": {w: summarize(rounds, "one_stream", w, "decode_tok_s") for w in loads}}
        if "concurrent" in rounds[0]["off"]:
            summary["concurrent"] = {w: summarize(rounds, "concurrent", w, "output_tok_s") for w in loads}
        report["topologies"][topology] = summary
        out.write_text(json.dumps(report, indent=1))
    print(f"\nSmolLM2-135M-Instruct, {report['cpu']}; speculative arm: {' '.join(report['speculative'])}"
          f"{'; both: ' + ' '.join(args.overrides) if args.overrides else ''}; medians of {args.rounds} rounds")
    print(f"{'topology':<9}{'run':<13}{'workload':<10}{'off tok/s':>10}{'on tok/s':>10}{'on/off':>8}"
          f"{'accept':>8}{'tok/step':>9}{'same':>6}")
    for topology, summary in report["topologies"].items():
        for section, label in (("one_stream", "1 stream"), ("concurrent", f"c={args.concurrency} http")):
            for workload, s in summary.get(section, {}).items():
                acc = f"{s['acceptance_rate']:.2f}" if s["acceptance_rate"] is not None else "-"
                per_step = f"{s['tokens_per_step']:.2f}" if s["tokens_per_step"] is not None else "-"
                same = {True: "yes", False: "NO", None: "-"}[s["same_greedy_output"]]
                print(f"{topology:<9}{label:<13}{workload:<10}{s['off']:>10.1f}{s['on']:>10.1f}"
                      f"{s['ratio']:>8.2f}{acc:>8}{per_step:>9}{same:>6}")
    print(f"\nwrote {out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
