"""A Batch API job beside online traffic: the online TTFT with and without a job running, and
how fast the job goes in the capacity the online load leaves.

One server (server.batch.data_dir on a temporary directory) serves both arms, alternating
from round to round: `online` is a closed loop of --concurrency clients streaming
--requests completions of new random-word prompts; `online+batch` is the same load started
once a --batch-requests job (new prompts too) is in progress. After the online load the job
runs on alone to its end. Prints and writes (results/bench_batch.json) the medians over
rounds of the online TTFT p50/p99 and tokens/s per arm, their ratios, and the job's
requests and tokens per second while the online load ran and over its whole run.

    python scripts/bench_batch.py [--concurrency 8] [--batch-requests 500] [--rounds 3]
"""

from __future__ import annotations

import argparse
import asyncio
import io
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx
import openai

from meshserve.configs.cpu_features import cpu_features

from bench_http import meshserve_server, rotating_rounds
from bench_priority import prompts, run_load

REPO = Path(__file__).resolve().parent.parent
FINISHED = ("completed", "failed", "cancelled", "expired")


def job_file(texts: list[str], max_tokens: int) -> bytes:
    return b"".join(json.dumps({"custom_id": f"b{i}", "method": "POST", "url": "/v1/completions", "body": {
        "prompt": text, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}}).encode() + b"\n"
        for i, text in enumerate(texts))


def counts(oai: openai.OpenAI, job_id: str):
    job = oai.batches.retrieve(job_id)
    return job, job.request_counts.completed + job.request_counts.failed


def run_arm(url: str, oai: openai.OpenAI, args, with_batch: bool, salt: str) -> dict:
    texts = prompts(args.requests, args.prompt_words, salt)
    if not with_batch:
        return asyncio.run(run_load(url, texts, args.concurrency, args.max_tokens, False))
    upload = oai.files.create(file=("batch.jsonl", io.BytesIO(job_file(
        prompts(args.batch_requests, args.batch_prompt_words, "batch" + salt), args.batch_max_tokens))),
        purpose="batch")
    job = oai.batches.create(input_file_id=upload.id, endpoint="/v1/completions", completion_window="24h")
    started = time.perf_counter()
    while counts(oai, job.id)[1] < 1:  # the job's requests are in the engine: the load is steady
        time.sleep(0.05)
    online_start, answered_before = time.perf_counter(), counts(oai, job.id)[1]
    result = asyncio.run(run_load(url, texts, args.concurrency, args.max_tokens, False))
    online_s = time.perf_counter() - online_start
    answered_during = counts(oai, job.id)[1] - answered_before
    while (state := counts(oai, job.id))[0].status not in FINISHED:
        time.sleep(0.2)
    total_s = time.perf_counter() - started
    assert state[0].status == "completed" and state[0].request_counts.failed == 0, state[0]
    return result | {"batch_req_s_during_online": answered_during / online_s,
                     "batch_tok_s_during_online": answered_during * args.batch_max_tokens / online_s,
                     "batch_total_s": total_s,
                     "batch_tok_s_overall": args.batch_requests * args.batch_max_tokens / total_s}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--requests", type=int, default=96, help="online requests per run")
    p.add_argument("--prompt-words", type=int, default=60)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--batch-requests", type=int, default=500)
    p.add_argument("--batch-prompt-words", type=int, default=40)
    p.add_argument("--batch-max-tokens", type=int, default=16)
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="server config overrides (e.g. scheduler.background_max_seqs=8)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--out", type=Path, default=REPO / "results" / "bench_batch.json")
    args = p.parse_args()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    data = tempfile.mkdtemp(prefix="bench-batch-")
    server = meshserve_server("batch", ["model.max_model_len=1024", f"server.batch.data_dir={data}", *args.overrides],
                              args.out.with_suffix(".log"))
    try:
        url = server.wait_http(None)
        with openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=600) as oai:
            runs = rotating_rounds(["online", "online+batch"], args.rounds, lambda name, r: run_arm(
                url, oai, args, name == "online+batch", f"{name}{r}{time.time_ns()}"))
        metrics = httpx.get(f"{url}/metrics", timeout=30).text
    finally:
        server.stop()
    keys = ("tok_s", "low_ttft_p50_ms", "low_ttft_p99_ms")
    med = {n: {k: statistics.median(run[k] for run in each) for k in keys} for n, each in runs.items()}
    batch_keys = ("batch_req_s_during_online", "batch_tok_s_during_online", "batch_total_s", "batch_tok_s_overall")
    med["online+batch"] |= {k: statistics.median(run[k] for run in runs["online+batch"]) for k in batch_keys}
    alone, both = med["online"], med["online+batch"]
    ratios = {"online_ttft_p99_with_batch_over_without": both["low_ttft_p99_ms"] / alone["low_ttft_p99_ms"],
              "online_ttft_p50_with_batch_over_without": both["low_ttft_p50_ms"] / alone["low_ttft_p50_ms"],
              "online_tok_s_with_batch_over_without": both["tok_s"] / alone["tok_s"]}
    print(f"# {cpu_features().describe()}; online c={args.concurrency}, {args.requests} x {args.max_tokens} tokens; "
          f"job {args.batch_requests} x {args.batch_max_tokens} tokens; {' '.join(args.overrides) or 'defaults'}; "
          f"medians of {args.rounds} rounds")
    print(f"{'arm':<14}{'online tok/s':>13}{'TTFT p50':>10}{'TTFT p99':>10}  (ms)")
    for name, m in med.items():
        print(f"{name:<14}{m['tok_s']:>13.1f}{m['low_ttft_p50_ms']:>10.0f}{m['low_ttft_p99_ms']:>10.0f}")
    print(f"job while the online load ran: {both['batch_req_s_during_online']:.2f} req/s, "
          f"{both['batch_tok_s_during_online']:.1f} tok/s; whole job: {both['batch_total_s']:.1f} s, "
          f"{both['batch_tok_s_overall']:.1f} tok/s")
    for k, v in ratios.items():
        print(f"{k}: {v:.2f}")
    preempted = [line for line in metrics.splitlines() if line.startswith("meshserve_num_preemptions")]
    args.out.write_text(json.dumps({"cpu": cpu_features().describe(), "args": vars(args) | {"out": str(args.out)},
                                    "runs": runs, "medians": med, "ratios": ratios, "preemptions": preempted},
                                   indent=2))
    print(f"wrote {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
