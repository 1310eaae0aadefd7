"""The cost of constrained decoding: decode throughput with a JSON schema against without
one on `meshserve serve` (the default model, SmolLM2-135M-Instruct, over the ZMQ client),
and the grammar compile time per schema, cold and cached.

Throughput: at each --concurrency, --requests requests (the same prompts and seeds in both
arms, temperature 0.7) each ask for --max-tokens tokens, once unconstrained (ignore_eos) and
once under LONG_SCHEMA, an object whose array of records must hold at least 1,024 items, so
neither arm can stop early and both decode the same number of tokens (checked and printed).
One server stays up; a warm-up request of each arm runs first (it also compiles LONG_SCHEMA,
so compiling is not in the figures); each repetition runs every concurrency with both arms,
the unconstrained one first in even repetitions, second in odd ones. The constrained outputs
are checked against LONG_SCHEMA's grammar in this process, after the clock stops (column
`off-schema`: outputs that are not a prefix of a valid one). Prints the medians over
--repeats of output tokens/s (all output tokens over the run's wall time), TTFT p50 and time
per output token p50, and the median of each repetition's constrained/unconstrained tokens/s
(the target: at least 0.90 at concurrency 32).

Compile time: in this process, a GrammarCompiler for the same tokenizer compiles each of
SCHEMAS (and LONG_SCHEMA) once (cold) and again (from its cache), --repeats times with a new
compiler each time; xgrammar's tokenizer table, built once per compiler, is timed apart.

    python scripts/bench_structured.py [--concurrency 1 32] [--requests 32] [--max-tokens 128]
                                       [--repeats 3] [--json-out results/bench_structured.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time
from pathlib import Path

from bench_http import Served
from meshserve.client import AsyncClient
from meshserve.configs import load_config
from meshserve.configs.model_info import ModelInfo, read_model_info
from meshserve.engine.structured import Grammar, GrammarCompiler, GrammarSpec
from meshserve.engine.tokenizer import Tokenizer
from meshserve.launcher.network import free_port

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
ARMS = ("unconstrained", "constrained")
TEMPERATURE = 0.7
TARGET_RATIO = 0.90
"""Constrained/unconstrained tokens/s at concurrency 32 that counts as cheap enough."""

LONG_SCHEMA: dict = {
    "type": "object",
    "properties": {
        "readings": {
            "type": "array",
            "minItems": 1024,
            "items": {
                "type": "object",
                "properties": {
                    "sensor": {"type": "string", "maxLength": 12},
                    "value": {"type": "integer", "minimum": 0, "maximum": 999},
                    "ok": {"type": "boolean"},
                },
                "required": ["sensor", "value", "ok"],
                "additionalProperties": False,
            },
        },
    },
    "required": ["readings"],
    "additionalProperties": False,
}
"""The throughput arm's schema: 1,024 records of a dozen tokens or more each, far beyond any
--max-tokens, so a request ends only at max_tokens, as the ignore_eos arm does."""

SCHEMAS: dict[str, dict] = {
    "invoice": {  # nested object, array of objects, bounded numbers, a pattern
        "type": "object",
        "properties": {
            "invoice_no": {"type": "string", "pattern": "^INV-[0-9]{6}$"},
            "customer": {
                "type": "object",
                "properties": {"name": {"type": "string", "maxLength": 40},
                               "vat_id": {"type": "string", "pattern": "^[A-Z]{2}[0-9]{8,12}$"},
                               "address": {"type": "object",
                                           "properties": {"street": {"type": "string"}, "city": {"type": "string"},
                                                          "postcode": {"type": "string", "pattern": "^[0-9]{5}$"}},
                                           "required": ["city"]}},
                "required": ["name", "address"],
            },
            "lines": {"type": "array", "minItems": 1, "maxItems": 20,
                      "items": {"type": "object",
                                "properties": {"description": {"type": "string", "maxLength": 60},
                                               "quantity": {"type": "integer", "minimum": 1, "maximum": 1000},
                                               "unit_price": {"type": "number", "minimum": 0},
                                               "tax_rate": {"enum": [0, 7, 19]}},
                                "required": ["description", "quantity", "unit_price"]}},
            "currency": {"type": "string", "enum": ["EUR", "USD", "GBP"]},
            "paid": {"type": "boolean"},
        },
        "required": ["invoice_no", "customer", "lines", "currency"],
    },
    "user_profile": {  # optional and nullable fields, a date pattern, an enum array
        "type": "object",
        "properties": {
            "username": {"type": "string", "pattern": "^[a-z][a-z0-9_]{2,15}$"},
            "display_name": {"type": ["string", "null"], "maxLength": 30},
            "birth_date": {"type": "string", "pattern": "^(19|20)[0-9]{2}-[01][0-9]-[0-3][0-9]$"},
            "roles": {"type": "array", "items": {"enum": ["admin", "editor", "viewer"]}, "maxItems": 3},
            "settings": {"type": "object",
                         "properties": {"theme": {"enum": ["light", "dark"]},
                                        "font_size": {"type": "integer", "minimum": 8, "maximum": 32}}},
        },
        "required": ["username", "roles"],
        "additionalProperties": False,
    },
    "search_results": {  # an array of objects with a score in [0, 1] and a URL pattern
        "type": "object",
        "properties": {
            "query": {"type": "string"},
            "results": {"type": "array", "maxItems": 10,
                        "items": {"type": "object",
                                  "properties": {"title": {"type": "string", "maxLength": 80},
                                                 "url": {"type": "string",
                                                         "pattern": "^https://[a-z0-9.-]+/[a-z0-9/-]*$"},
                                                 "score": {"type": "number", "minimum": 0, "maximum": 1}},
                                  "required": ["title", "url", "score"]}},
            "total": {"type": "integer", "minimum": 0},
        },
        "required": ["query", "results"],
    },
    "tool_call": {  # a function call: a name enum and per-tool arguments (anyOf)
        "type": "object",
        "properties": {
            "name": {"enum": ["get_weather", "book_flight"]},
            "arguments": {"anyOf": [
                {"type": "object", "properties": {"city": {"type": "string"},
                                                  "unit": {"enum": ["celsius", "fahrenheit"]}},
                 "required": ["city"], "additionalProperties": False},
                {"type": "object", "properties": {"origin": {"type": "string", "pattern": "^[A-Z]{3}$"},
                                                  "destination": {"type": "string", "pattern": "^[A-Z]{3}$"},
                                                  "passengers": {"type": "integer", "minimum": 1, "maximum": 9}},
                 "required": ["origin", "destination"], "additionalProperties": False}]},
        },
        "required": ["name", "arguments"],
        "additionalProperties": False,
    },
    "review": {  # a flat object: an enum, a bounded rating, short strings
        "type": "object",
        "properties": {
            "sentiment": {"enum": ["positive", "negative", "neutral"]},
            "rating": {"type": "integer", "minimum": 1, "maximum": 5},
            "summary": {"type": "string", "maxLength": 120},
            "pros": {"type": "array", "items": {"type": "string", "maxLength": 30}, "maxItems": 5},
            "cons": {"type": "array", "items": {"type": "string", "maxLength": 30}, "maxItems": 5},
        },
        "required": ["sentiment", "rating", "summary"],
    },
}
"""The compile-time schemas, shaped as applications send them."""

SUBJECTS = ("the greenhouse", "the server room", "a wind farm", "the cold store", "a river gauge",
            "the bakery ovens", "a bee hive", "the data centre", "a weather balloon", "the city buses")


def machine() -> dict:
    """The CPU's model name, core count and the ISA extensions that change the kernels
    (what `grep -o -w 'avx512f\\|amx_bf16' /proc/cpuinfo` shows)."""
    text = Path("/proc/cpuinfo").read_text()
    model = next((line.split(":", 1)[1].strip() for line in text.splitlines() if line.startswith("model name")), "")
    flags = set(next((line.split(":", 1)[1].split() for line in text.splitlines() if line.startswith("flags")), []))
    return {"cpu": model, "cores": os.cpu_count(), "isa": [f for f in ("avx512f", "amx_bf16") if f in flags]}


def prompts(n: int) -> list[str]:
    """`n` prompts asking for sensor readings as JSON (so the constrained arm's schema fits
    what is asked); they differ in their subject and in a request number."""
    return [f"Request {i}: list the sensor readings of {SUBJECTS[i % len(SUBJECTS)]} as JSON, "
            f"one record per sensor with its name, value and status." for i in range(n)]


def request_params(arm: str, seed: int, max_tokens: int) -> dict:
    """The keywords of one request of `arm`: sampled, seeded, and unable to stop before
    max_tokens (ignore_eos without a schema; LONG_SCHEMA's 1,024 items with one)."""
    params = {"max_tokens": max_tokens, "temperature": TEMPERATURE, "seed": seed}
    if arm == "unconstrained":
        return params | {"ignore_eos": True}
    return params | {"structured_outputs": {"json": LONG_SCHEMA}}


async def one_request(client: AsyncClient, prompt: str, params: dict) -> dict:
    """Stream one request; its output token ids, TTFT, mean time per output token after
    the first (None with fewer than two), finish reason and text."""
    started = time.perf_counter()
    first = last = None
    token_ids, text, finish = [], "", None
    async for delta in await client.generate(prompt, stream=True, **params):
        now = time.perf_counter()
        if delta.token_ids and first is None:
            first = now
        token_ids += delta.token_ids
        text += delta.text
        finish = delta.finish_reason or finish
        last = now
    n = len(token_ids)
    return {"token_ids": token_ids, "ttft_s": None if first is None else first - started,
            "tpot_s": (last - first) / (n - 1) if first is not None and n > 1 else None,
            "finish_reason": finish, "text": text}


async def run_arm(address: str, arm: str, texts: list[str], seeds: list[int], concurrency: int,
                  max_tokens: int, grammar: Grammar) -> dict:
    """All of `texts` as `arm`'s requests, at most `concurrency` in flight; the run's
    figures (summarize_run), the constrained arm's outputs checked against `grammar` after
    the clock stops."""
    gate = asyncio.Semaphore(concurrency)

    async def gated(client, text, seed):
        async with gate:
            return await one_request(client, text, request_params(arm, seed, max_tokens))

    async with AsyncClient(address) as client:
        started = time.perf_counter()
        results = await asyncio.gather(*(gated(client, t, s) for t, s in zip(texts, seeds)))
        wall = time.perf_counter() - started
    violations = sum(not conforms(grammar, r["token_ids"]) for r in results) if arm == "constrained" else None
    return summarize_run(results, wall, max_tokens) | {"violations": violations}


def conforms(grammar: Grammar, token_ids: list[int]) -> bool:
    """Whether `token_ids` are a prefix of an output `grammar` allows: the check that the
    constraint was applied at all (a truncated output is not valid JSON, but must be a prefix)."""
    matcher = grammar.matcher()
    return all(matcher.accept_token(t) for t in token_ids)


def summarize_run(results: list[dict], wall_s: float, max_tokens: int) -> dict:
    """One run's figures: output tokens/s over `wall_s`, TTFT and TPOT medians, and how many
    tokens the requests produced (each should have produced exactly max_tokens)."""
    tokens = [len(r["token_ids"]) for r in results]
    ttfts = [r["ttft_s"] for r in results if r["ttft_s"] is not None]
    tpots = [r["tpot_s"] for r in results if r["tpot_s"] is not None]
    return {"requests": len(results), "output_tokens": sum(tokens), "min_tokens": min(tokens),
            "max_tokens": max(tokens), "short_requests": sum(t != max_tokens for t in tokens),
            "finish_reasons": sorted({str(r["finish_reason"]) for r in results}),
            "wall_s": wall_s, "tokens_per_s": sum(tokens) / wall_s,
            "ttft_ms_p50": 1000 * statistics.median(ttfts) if ttfts else None,
            "tpot_ms_p50": 1000 * statistics.median(tpots) if tpots else None,
            "sample_text": results[0]["text"][:120]}


def median_of(runs: list[dict], key: str) -> float | None:
    values = [r[key] for r in runs if r[key] is not None]
    return statistics.median(values) if values else None


def summarize_arm(runs: list[dict]) -> dict:
    """Medians over the repetitions of one arm at one concurrency; token counts summed, so a
    single short request in any repetition shows."""
    return {"tokens_per_s": median_of(runs, "tokens_per_s"), "ttft_ms_p50": median_of(runs, "ttft_ms_p50"),
            "tpot_ms_p50": median_of(runs, "tpot_ms_p50"), "output_tokens": sum(r["output_tokens"] for r in runs),
            "requests": sum(r["requests"] for r in runs), "short_requests": sum(r["short_requests"] for r in runs),
            "min_tokens": min(r["min_tokens"] for r in runs), "max_tokens": max(r["max_tokens"] for r in runs),
            "violations": None if runs[0]["violations"] is None else sum(r["violations"] for r in runs)}


def paired_ratio(constrained: list[dict], unconstrained: list[dict]) -> float:
    """The median over repetitions of constrained/unconstrained tokens/s, each repetition's
    pair measured back to back, so drift on a shared machine cancels within a pair."""
    return statistics.median(c["tokens_per_s"] / u["tokens_per_s"] for c, u in zip(constrained, unconstrained))


def arm_order(repeat: int) -> tuple[str, ...]:
    """Unconstrained first in even repetitions, constrained first in odd ones."""
    return ARMS if repeat % 2 == 0 else ARMS[::-1]


def wait_ready(server: Served, timeout: float = 600) -> str:
    """The ZMQ address of the server's ready line, once it prints it."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if server.proc.poll() is not None:
            raise RuntimeError(f"{server.name} exited with {server.proc.returncode}; see {server.log}")
        line = next((line for line in server.lines if line.startswith("meshserve ready")), None)
        if line is not None:
            return line.split("zmq=", 1)[1].split()[0]
        time.sleep(0.5)
    raise RuntimeError(f"{server.name} did not come up within {timeout:.0f} s; see {server.log}")


def measure_throughput(address: str, args, grammar: Grammar) -> dict[int, dict[str, list[dict]]]:
    """Every repetition's run of each arm at each concurrency, after one warm-up request per
    arm; `grammar`: LONG_SCHEMA's, to check the constrained outputs with."""
    for arm in ARMS:
        print(f"# warm-up: {arm}", file=sys.stderr, flush=True)
        asyncio.run(run_arm(address, arm, prompts(1), [0], 1, args.max_tokens, grammar))
    texts = prompts(args.requests)
    runs: dict[int, dict[str, list[dict]]] = {c: {arm: [] for arm in ARMS} for c in args.concurrency}
    for repeat in range(args.repeats):
        seeds = [1000 * (repeat + 1) + i for i in range(args.requests)]
        for c in args.concurrency:
            for arm in arm_order(repeat):
                print(f"# repeat {repeat} concurrency {c}: {arm}", file=sys.stderr, flush=True)
                runs[c][arm].append(asyncio.run(run_arm(address, arm, texts, seeds, c, args.max_tokens, grammar)))
    return runs


def model_tokenizer(overrides: list[str]) -> tuple[ModelInfo, Tokenizer]:
    """The served model's info and tokenizer, as the server loads them."""
    config = load_config(None, overrides)
    info = read_model_info(config.model.path)
    return info, Tokenizer(info, config.model.tokenizer)


def new_compiler(info: ModelInfo, tokenizer: Tokenizer) -> GrammarCompiler:
    """A GrammarCompiler as the server builds one (engine/serving/frontends.py)."""
    return GrammarCompiler(tokenizer, info.vocab_size)


def compile_times(info: ModelInfo, tokenizer: Tokenizer, repeats: int) -> dict:
    """Cold and cached GrammarCompiler.compile time of each schema (medians over `repeats`
    fresh compilers), and the tokenizer table each compiler builds once."""
    specs = {name: GrammarSpec("json", json.dumps(schema)) for name, schema in
             {**SCHEMAS, "long_schema": LONG_SCHEMA}.items()}
    table_s, cold, cached = [], {name: [] for name in specs}, {name: [] for name in specs}
    for _ in range(repeats):
        compiler = new_compiler(info, tokenizer)
        started = time.perf_counter()
        compiler.warm_up()  # the one-off tokenizer table, timed apart
        table_s.append(time.perf_counter() - started)
        for name, spec in specs.items():
            for times in (cold[name], cached[name]):
                started = time.perf_counter()
                compiler.compile(spec)
                times.append(time.perf_counter() - started)
    per_schema = {name: {"cold_ms": 1000 * statistics.median(cold[name]),
                         "cached_ms": 1000 * statistics.median(cached[name])} for name in specs}
    return {"tokenizer_table_ms": 1000 * statistics.median(table_s), "per_schema": per_schema,
            "cold_ms_median": statistics.median(s["cold_ms"] for s in per_schema.values()),
            "cached_ms_median": statistics.median(s["cached_ms"] for s in per_schema.values())}


def fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def print_report(host: dict, args, table: dict, ratios: dict, compiles: dict) -> None:
    """The throughput table, the ratios against the target and the compile times."""
    print(f"\n{host['cpu']} ({host['cores']} cores; {' '.join(host['isa']) or 'no avx512f/amx_bf16'})")
    print(f"SmolLM2-135M-Instruct over ZMQ, {args.requests} requests x {args.max_tokens} tokens per run, temperature "
          f"{TEMPERATURE}, medians of {args.repeats}; config: {' '.join(args.overrides) or 'default'}")
    print(f"{'conc':>4}  {'arm':<14}{'out tok/s':>10}{'TTFT p50 ms':>13}{'TPOT p50 ms':>13}{'tokens':>9}{'short':>7}"
          f"{'off-schema':>12}")
    for c, arms in table.items():
        for arm, r in arms.items():
            print(f"{c:>4}  {arm:<14}{r['tokens_per_s']:>10.1f}{fmt(r['ttft_ms_p50'], '.0f'):>13}"
                  f"{fmt(r['tpot_ms_p50'], '.1f'):>13}{r['output_tokens']:>9}{r['short_requests']:>7}"
                  f"{fmt(r['violations'], 'd'):>12}")
    for c, ratio in ratios.items():
        verdict = f" (target >= {TARGET_RATIO:.2f}: {'met' if ratio >= TARGET_RATIO else 'missed'})" if c == 32 else ""
        print(f"concurrency {c}: constrained/unconstrained tokens/s x{ratio:.3f}{verdict}")
    print(f"\ngrammar compile (in process, medians of {args.repeats} fresh compilers): tokenizer table "
          f"{compiles['tokenizer_table_ms']:.0f} ms once per compiler")
    print(f"{'schema':<16}{'cold ms':>10}{'cached ms':>11}")
    for name, s in compiles["per_schema"].items():
        print(f"{name:<16}{s['cold_ms']:>10.2f}{s['cached_ms']:>11.4f}")
    print(f"{'median':<16}{compiles['cold_ms_median']:>10.2f}{compiles['cached_ms_median']:>11.4f}")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 32])
    p.add_argument("--requests", type=int, default=32,
                   help="requests per run, the same at every concurrency (a concurrency above it acts as it)")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="meshserve config override (repeatable)")
    p.add_argument("--json-out", default=str(REPO / "results" / "bench_structured.json"))
    args = p.parse_args()

    out = Path(args.json_out)
    out.parent.mkdir(parents=True, exist_ok=True)
    info, tokenizer = model_tokenizer(args.overrides)
    grammar = new_compiler(info, tokenizer).compile(GrammarSpec("json", json.dumps(LONG_SCHEMA)))
    server = Served("meshserve", [
        sys.executable, "-m", "meshserve.launcher.cli", "serve", "--set", f"server.zmq=tcp://127.0.0.1:{free_port()}",
        "--set", "server.http=null", *[a for o in args.overrides for a in ("--set", o)]], out.with_suffix(".log"))
    try:
        runs = measure_throughput(wait_ready(server), args, grammar)
    finally:
        server.stop()
    print("# compiling grammars in process", file=sys.stderr, flush=True)
    compiles = compile_times(info, tokenizer, args.repeats)

    table = {c: {arm: summarize_arm(arms[arm]) for arm in ARMS} for c, arms in runs.items()}
    ratios = {c: paired_ratio(arms["constrained"], arms["unconstrained"]) for c, arms in runs.items()}
    host = machine()
    print_report(host, args, table, ratios, compiles)
    out.write_text(json.dumps({"machine": host, "requests": args.requests, "max_tokens": args.max_tokens,
                               "temperature": TEMPERATURE, "repeats": args.repeats, "overrides": args.overrides,
                               "long_schema": LONG_SCHEMA, "medians": table, "ratios": ratios,
                               "target_ratio_c32": TARGET_RATIO, "runs": runs, "compile": compiles}, indent=1))
    print(f"\nwrote {out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
