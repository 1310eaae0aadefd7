"""What `meshserve bench` reports: per-request timings summed up under vLLM's serving
benchmark names (`output_throughput`, `request_goodput`, `p99_ttft_ms`, ...), the printed
table, and PNG plots (latency CDFs; throughput and goodput against offered load)."""

from __future__ import annotations

import sys
from dataclasses import dataclass, field

import numpy as np

PERCENTILES = (90, 95, 99)
METRICS = {"ttft": "Time to First Token", "tpot": "Time per Output Token (excl. 1st token)",
           "itl": "Inter-token Latency", "e2el": "End-to-end Latency"}


@dataclass
class RequestResult:
    success: bool = False
    prompt_len: int = 0
    output_len: int = 0
    ttft: float = 0.0
    """Seconds from sending to the first streamed chunk."""
    itl: list[float] = field(default_factory=list)
    """Seconds between consecutive chunks."""
    latency: float = 0.0
    error: str = ""
    text: str = ""
    cached_tokens: int | None = None
    """Prompt tokens the server found in its prefix cache (its usage's
    prompt_tokens_details.cached_tokens), if it says."""

    @property
    def tpot(self) -> float | None:
        return (self.latency - self.ttft) / (self.output_len - 1) if self.output_len > 1 else None


def _stats(prefix: str, values_s: list[float]) -> dict[str, float]:
    ms = np.asarray(values_s, dtype=float) * 1000.0 if values_s else np.zeros(1)
    out = {f"mean_{prefix}_ms": float(ms.mean()), f"median_{prefix}_ms": float(np.median(ms)),
           f"std_{prefix}_ms": float(ms.std())}
    for p in PERCENTILES:
        out[f"p{p}_{prefix}_ms"] = float(np.percentile(ms, p))
    return out


def meets_slo(r: RequestResult, slo_ms: dict[str, float]) -> bool:
    values = {"ttft": r.ttft, "tpot": r.tpot if r.tpot is not None else 0.0, "e2el": r.latency}
    return r.success and all(values[k] * 1000.0 <= v for k, v in slo_ms.items())


def summarize(results: list[RequestResult], duration: float, slo_ms: dict[str, float]) -> dict:
    ok = [r for r in results if r.success]
    total_in = sum(r.prompt_len for r in ok)
    total_out = sum(r.output_len for r in ok)
    good = sum(1 for r in ok if meets_slo(r, slo_ms))
    out = {
        "duration": duration,
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "total_input_tokens": total_in,
        "total_output_tokens": total_out,
        "request_throughput": len(ok) / duration,
        "request_goodput": good / duration if slo_ms else None,
        "output_throughput": total_out / duration,
        "total_token_throughput": (total_in + total_out) / duration,
        "prefix_cache_hit_rate": None,
    }
    reported = [r for r in ok if r.cached_tokens is not None]
    if reported and sum(r.prompt_len for r in reported):
        out["prefix_cache_hit_rate"] = sum(r.cached_tokens for r in reported) / sum(r.prompt_len for r in reported)
    out |= _stats("ttft", [r.ttft for r in ok])
    out |= _stats("tpot", [r.tpot for r in ok if r.tpot is not None])
    out |= _stats("itl", [x for r in ok for x in r.itl])
    out |= _stats("e2el", [r.latency for r in ok])
    out |= {"input_lens": [r.prompt_len for r in results], "output_lens": [r.output_len for r in results],
            "ttfts": [r.ttft for r in results], "itls": [r.itl for r in results],
            "e2els": [r.latency for r in results], "errors": [r.error for r in results]}
    return out


def format_result(res: dict, title: str) -> str:
    lines = [f"{' ' + title + ' ':=^50}"]

    def row(name: str, value) -> None:
        lines.append(f"{name:<40}{value:<10.2f}" if isinstance(value, float) else f"{name:<40}{value:<10}")

    row("Successful requests:", res["completed"])
    row("Failed requests:", res["failed"])
    if res.get("max_concurrency") is not None:
        row("Maximum request concurrency:", res["max_concurrency"])
    row("Benchmark duration (s):", res["duration"])
    row("Total input tokens:", res["total_input_tokens"])
    row("Total generated tokens:", res["total_output_tokens"])
    row("Request throughput (req/s):", res["request_throughput"])
    if res.get("request_goodput") is not None:
        row("Request goodput (req/s):", res["request_goodput"])
    row("Output token throughput (tok/s):", res["output_throughput"])
    row("Total Token throughput (tok/s):", res["total_token_throughput"])
    if res.get("prefix_cache_hit_rate") is not None:
        row("Prefix cache hit rate (%):", 100.0 * res["prefix_cache_hit_rate"])
    for key, name in METRICS.items():
        lines.append(f"{name:-^50}")
        short = key.upper()
        row(f"Mean {short} (ms):", res[f"mean_{key}_ms"])
        row(f"Median {short} (ms):", res[f"median_{key}_ms"])
        for p in PERCENTILES:
            row(f"P{p} {short} (ms):", res[f"p{p}_{key}_ms"])
    lines.append("=" * 50)
    return "\n".join(lines)


def offered_load(res: dict) -> tuple[str, float]:
    """The x axis of a sweep: the request rate if finite, else the concurrency."""
    rate = res.get("request_rate")
    if isinstance(rate, (int, float)) and rate != float("inf"):
        return "request rate (req/s)", float(rate)
    return "max concurrency", float(res.get("max_concurrency") or res.get("num_prompts", 0))


def plot(runs: list[dict], stem: str) -> list[str]:
    """Latency CDFs of every run, and (for sweeps) throughput and goodput against offered
    load. Returns the PNG paths; none, with a warning on stderr, if matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("meshserve bench: no plots: matplotlib is not installed (pip install matplotlib; --no-plots "
              "says no plots are wanted)", file=sys.stderr)
        return []
    paths = []
    fig, axes = plt.subplots(1, 4, figsize=(18, 4))
    for res in runs:
        label = f"{offered_load(res)[0].split(' (')[0]} {offered_load(res)[1]:g}"
        ok = [i for i, e in enumerate(res["errors"]) if not e]
        series = {"ttft": [res["ttfts"][i] for i in ok], "itl": [x for i in ok for x in res["itls"][i]],
                  "tpot": [], "e2el": []}
        for i in ok:
            n, e2e = res["output_lens"][i], res["e2els"][i]
            series["e2el"].append(e2e)
            if n > 1:
                series["tpot"].append((e2e - res["ttfts"][i]) / (n - 1))
        for ax, key in zip(axes, ("ttft", "tpot", "itl", "e2el")):
            v = np.sort(np.asarray(series[key]) * 1000.0)
            if len(v):
                ax.plot(v, np.arange(1, len(v) + 1) / len(v), label=label)
    for ax, key in zip(axes, ("ttft", "tpot", "itl", "e2el")):
        ax.set_xlabel(f"{key.upper()} (ms)")
        ax.set_ylabel("fraction of requests" if key != "itl" else "fraction of gaps")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    paths.append(f"{stem}_latency_cdf.png")
    fig.savefig(paths[-1], dpi=100)
    plt.close(fig)
    if len(runs) > 1:
        xlabel = offered_load(runs[0])[0]
        xs = [offered_load(r)[1] for r in runs]
        fig, ax1 = plt.subplots(figsize=(7, 4.5))
        ax1.plot(xs, [r["output_throughput"] for r in runs], "o-", label="output tok/s")
        ax1.set_xlabel(xlabel)
        ax1.set_ylabel("output tokens/s")
        ax2 = ax1.twinx()
        ax2.plot(xs, [r["request_throughput"] for r in runs], "s--", color="tab:green", label="requests/s")
        if runs[0].get("request_goodput") is not None:
            ax2.plot(xs, [r["request_goodput"] for r in runs], "^--", color="tab:red", label="goodput (req/s)")
        ax2.set_ylabel("requests/s")
        fig.legend(loc="upper left", fontsize=8)
        ax1.grid(alpha=0.3)
        fig.tight_layout()
        paths.append(f"{stem}_throughput.png")
        fig.savefig(paths[-1], dpi=100)
        plt.close(fig)
    return paths
