"""What a KV cache's first touch costs on this machine: a --gib GiB anonymous map written
once (a float32 element per 4 KB), each way in a fresh process, the ways alternating over
--rounds: in 4 KB pages (layers/host_memory.py zeros_on_touch as it is), advised for
transparent huge pages (MADV_HUGEPAGE), and torch.zeros (all of it written at allocation).
Prints the median seconds of each, with the kernel's THP settings, and writes JSON.

    python scripts/bench_cache_pages.py [--gib 1] [--rounds 3]
"""

from __future__ import annotations

import argparse
import json
import mmap
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

from meshserve.layers.host_memory import zeros_on_touch

REPO = Path(__file__).resolve().parents[1]
WAYS = ("4k", "huge", "torch.zeros")


def thp(setting: str) -> str:
    try:
        return Path(f"/sys/kernel/mm/transparent_hugepage/{setting}").read_text().strip()
    except OSError:
        return "absent"


def first_touch(way: str, nbytes: int) -> float:
    """Seconds to allocate and write every page once."""
    start = time.perf_counter()
    if way == "torch.zeros":
        cache = torch.zeros(nbytes // 4)
    else:
        if way == "4k":
            cache = zeros_on_touch((nbytes // 4,), torch.float32)
        else:
            buf = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
            buf.madvise(mmap.MADV_HUGEPAGE)
            cache = torch.frombuffer(buf, dtype=torch.float32)
        cache.view(-1, 1024)[:, 0].fill_(0.0)
    seconds = time.perf_counter() - start
    assert cache.numel() == nbytes // 4
    return seconds


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--gib", type=float, default=1.0)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--child", choices=WAYS, help=argparse.SUPPRESS)
    p.add_argument("--out", default=str(REPO / "results" / "bench_cache_pages.json"))
    args = p.parse_args()
    nbytes = int(args.gib * (1 << 30)) // (1 << 12) << 12
    if args.child:
        print(first_touch(args.child, nbytes))
        return 0
    seconds: dict[str, list[float]] = {w: [] for w in WAYS}
    for r in range(args.rounds):
        for way in WAYS[r % len(WAYS):] + WAYS[:r % len(WAYS)]:
            out = subprocess.run([sys.executable, __file__, "--child", way, "--gib", str(args.gib)], check=True,
                                 capture_output=True, text=True).stdout
            seconds[way].append(float(out.split()[-1]))
    settings = {s: thp(s) for s in ("enabled", "defrag")}
    print(f"first touch of {nbytes / (1 << 30):.2f} GiB, medians of {args.rounds} fresh processes "
          f"(THP enabled: {settings['enabled']}; defrag: {settings['defrag']}):")
    for way, xs in seconds.items():
        print(f"  {way:<12} {statistics.median(xs):6.3f} s   (runs: {', '.join(f'{x:.3f}' for x in xs)})")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"bytes": nbytes, "thp": settings, "seconds": seconds,
                                          "median": {w: statistics.median(xs) for w, xs in seconds.items()}},
                                         indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
