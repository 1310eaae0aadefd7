"""Disaggregated prefill/decode against colocated replicas, on the same two cores, in one run:

- disagg: parallel.data=2 with disaggregation.prefill_replicas=1 (replica 0 computes the
  prompts on core 0, replica 1 decodes on core 1);
- colocated: parallel.data=2 (each replica on a core of its own does both; least-loaded
  routing).

Each round runs, on each deployment, --streams decode streams (prompts of --stream-prompt
random tokens, exactly --stream-tokens output tokens each) twice: alone ("decode only"),
and while --long-prompts prompts of --long-len random tokens arrive --long-interval
seconds apart (each generating --long-output tokens). The streams' token gaps (the time
between consecutive deltas over the tokens they carry: time per output token) give TPOT
p50 and p99; the long prompts' TTFT is printed beside. For the disaggregated deployment,
the replicas' KV-transfer gauges give the bytes and seconds per transferred request, the
part of that time the prefill steps still computed (overlap), and what the decode replica
waited for transfers (land wait, the only part on its steps).

Every run starts with the replicas' prefix caches reset (POST /reset_prefix_cache), so the
two phases of a round compute and send the same stream prompts in full. Both deployments
are up together (an idle one costs the other little); each round measures one and right
after it the other, swapping the order every round. The medians over
--rounds are printed and written to --out/summary.json.

    python scripts/bench_disagg.py [--rounds 3] [--streams 8] [--long-len 2048]
"""

from __future__ import annotations

import argparse
import json
import random
import re
import statistics
import sys
import threading
import time
from pathlib import Path

import httpx

from bench_http import Served
from meshserve.client import Client
from meshserve.configs.cpu_features import cpu_features
from meshserve.launcher.network import free_port

ARMS = {"disagg": ["parallel.data=2", "disaggregation.prefill_replicas=1"], "colocated": ["parallel.data=2"]}
KV_GAUGES = {"bytes": ("meshserve_kv_transfer_bytes", 'direction="sent"', "0"),
             "sent": ("meshserve_kv_transfers", 'outcome="sent"', "0"),
             "total_s": ("meshserve_kv_transfer_seconds", 'part="total"', "0"),
             "overlapped_s": ("meshserve_kv_transfer_seconds", 'part="overlapped"', "0"),
             "posting_s": ("meshserve_kv_transfer_seconds", 'part="posting"', "0"),
             "land_wait_s": ("meshserve_kv_transfer_seconds", 'part="land_wait"', "1"),
             "landed": ("meshserve_kv_transfers", 'outcome="landed"', "1")}


def start(name: str, sets: list[str], out_dir: Path) -> tuple[Served, str, str]:
    zmq = f"tcp://127.0.0.1:{free_port()}"
    served = Served(name, [sys.executable, "-m", "meshserve.launcher.cli", "serve", "--set", "server.http=127.0.0.1:0",
                           "--set", f"server.zmq={zmq}", *[a for s in sets for a in ("--set", s)]],
                    out_dir / f"{name}.log")
    return served, zmq, served.wait_http(None)


def kv_gauges(url: str) -> dict[str, float]:
    text = httpx.get(f"{url}/metrics", timeout=30).text
    out = {}
    for key, (name, label, replica) in KV_GAUGES.items():
        m = re.search(rf'^{name}{{(?=[^}}]*{label})(?=[^}}]*replica="{replica}")[^}}]*}} (\S+)$', text, re.M)
        out[key] = float(m.group(1)) if m else 0.0
    return out


def stream(address: str, prompt: list[int], tokens: int, gaps: list[float], ttft: list[float]) -> None:
    with Client(address, timeout=600) as client:
        start = last = time.perf_counter()
        for delta in client.generate(prompt, stream=True, max_tokens=tokens, ignore_eos=True, temperature=0):
            now = time.perf_counter()
            n = len(delta.token_ids)
            if not n:
                continue
            if last == start:
                ttft.append(now - start)
            else:
                gaps.extend([(now - last) / n] * n)
            last = now


def run(address: str, args, seed: int, with_long: bool) -> dict:
    rng = random.Random(seed)
    streams = [[rng.randrange(100, 40000) for _ in range(args.stream_prompt)] for _ in range(args.streams)]
    longs = [[rng.randrange(100, 40000) for _ in range(args.long_len)] for _ in range(args.long_prompts)]
    gaps: list[float] = []
    stream_ttft: list[float] = []
    long_ttft: list[float] = []
    threads = [threading.Thread(target=stream, args=(address, p, args.stream_tokens, gaps, stream_ttft))
               for p in streams]
    for t in threads:
        t.start()
    if with_long:
        time.sleep(args.warmup)
        longs_t = []
        for p in longs:
            t = threading.Thread(target=stream, args=(address, p, args.long_output, [], long_ttft))
            t.start()
            longs_t.append(t)
            time.sleep(args.long_interval)
        threads += longs_t
    for t in threads:
        t.join()
    gaps.sort()
    return {"tpot_p50_ms": 1000 * statistics.median(gaps), "tpot_p99_ms": 1000 * gaps[int(0.99 * (len(gaps) - 1))],
            "tokens": len(gaps), "long_ttft_p50_s": statistics.median(long_ttft) if long_ttft else None}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--streams", type=int, default=8)
    parser.add_argument("--stream-prompt", type=int, default=64)
    parser.add_argument("--stream-tokens", type=int, default=160)
    parser.add_argument("--long-prompts", type=int, default=3)
    parser.add_argument("--long-len", type=int, default=2048)
    parser.add_argument("--long-output", type=int, default=4)
    parser.add_argument("--long-interval", type=float, default=2.0)
    parser.add_argument("--warmup", type=float, default=1.0, help="seconds of streaming before the first long prompt")
    parser.add_argument("--set", dest="overrides", action="append", default=[], help="config override for both")
    parser.add_argument("--out", type=Path, default=Path("results/disagg"))
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    common = ["model.max_model_len=4096", *args.overrides]
    servers = {name: start(name, sets + common, args.out) for name, sets in ARMS.items()}
    runs: dict[str, list[dict]] = {f"{arm}/{phase}": [] for arm in ARMS for phase in ("decode_only", "with_long")}
    transfers: dict[str, list[dict]] = {"decode_only": [], "with_long": []}
    try:
        for name, (_, address, _) in servers.items():  # warm-up: one of each, not measured
            run(address, argparse.Namespace(**{**vars(args), "streams": 2, "stream_tokens": 8, "long_prompts": 1,
                                               "long_interval": 0.0, "warmup": 0.0}), 0, True)
        for r in range(args.rounds):
            order = list(ARMS) if r % 2 == 0 else list(reversed(ARMS))
            for arm in order:
                _, address, url = servers[arm]
                for phase in ("decode_only", "with_long"):
                    httpx.post(f"{url}/reset_prefix_cache", timeout=60).raise_for_status()  # same prompts, cold
                    before = kv_gauges(url) if arm == "disagg" else None
                    result = run(address, args, seed=1000 + r, with_long=phase == "with_long")
                    if before is not None:
                        after = kv_gauges(url)
                        transfers[phase].append({k: after[k] - before[k] for k in before})
                    runs[f"{arm}/{phase}"].append(result)
                    print(f"# round {r} {arm} {phase}: {json.dumps(result)}", file=sys.stderr, flush=True)
    finally:
        for served, _, _ in servers.values():
            served.stop()
    summary = summarize(runs, transfers, args)
    (args.out / "summary.json").write_text(json.dumps({"summary": summary, "runs": runs, "transfers": transfers},
                                                      indent=1))
    print(json.dumps(summary, indent=1))


def summarize(runs: dict[str, list[dict]], transfers: dict[str, list[dict]], args) -> dict:
    def med(key: str, field: str) -> float:
        return statistics.median(x[field] for x in runs[key])

    out: dict = {"machine": cpu_features().describe(), "rounds": args.rounds, "streams": args.streams,
                 "long_prompts": args.long_prompts, "long_len": args.long_len}
    for key in runs:
        out[key] = {f: med(key, f) for f in ("tpot_p50_ms", "tpot_p99_ms")}
        if key.endswith("with_long"):
            out[key]["long_ttft_p50_s"] = med(key, "long_ttft_p50_s")
    out["disagg_p99_over_decode_only_p99"] = statistics.median(
        w["tpot_p99_ms"] / d["tpot_p99_ms"] for w, d in zip(runs["disagg/with_long"], runs["disagg/decode_only"]))
    out["colocated_p99_over_decode_only_p99"] = statistics.median(
        w["tpot_p99_ms"] / d["tpot_p99_ms"] for w, d in zip(runs["colocated/with_long"], runs["disagg/decode_only"]))
    # the long prompts' transfers: each round's with_long phase less its decode-only one (the same streams)
    longs = [{k: w[k] - d[k] for k in w} for w, d in zip(transfers["with_long"], transfers["decode_only"])]
    n = sum(t["sent"] for t in longs)
    if n:
        total = sum(t["total_s"] for t in longs)
        out["kv_transfer_long_prompt"] = {
            "requests": n, "mib_per_request": sum(t["bytes"] for t in longs) / n / 2 ** 20,
            "ms_per_request": 1000 * total / n,
            "overlapped_fraction": sum(t["overlapped_s"] for t in longs) / total if total else None,
            "posting_ms_per_request": 1000 * sum(t["posting_s"] for t in longs) / n,
            "decode_land_wait_ms_per_request": 1000 * sum(t["land_wait_s"] for t in longs) / n}
    d = [t for t in transfers["decode_only"] if t["sent"]]
    if d:
        n = sum(t["sent"] for t in d)
        out["kv_transfer_stream_prompt"] = {"requests": n, "kib_per_request": sum(t["bytes"] for t in d) / n / 1024,
                                            "ms_per_request": 1000 * sum(t["total_s"] for t in d) / n}
    return out


if __name__ == "__main__":
    main()
