"""The host's cost of a decode step's inputs for the Triton backend (what a GPU waits for
unless steps overlap): the attention metadata (`build_triton_metadata`: slots, block tables
padded, lengths, packed into one tensor), from the sequences' block lists and from the rows
of the runner's persistent tables (engine/block_tables.py: the step's gather included), and
the token ids and positions, per batch size and context length. Microseconds per step,
medians over --repeats builds on this CPU (the device copy itself is not included: on CPU
there is none).

    python scripts/bench_step_inputs.py [--batches 1 32 128] [--contexts 512 2048] [--repeats 200]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from meshserve.engine.block_tables import BlockTables
from meshserve.layers.triton_backend import build_triton_metadata

REPO = Path(__file__).resolve().parents[1]
BLOCK = 16


def median_us(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 32, 128])
    ap.add_argument("--contexts", type=int, nargs="+", default=[512, 2048])
    ap.add_argument("--repeats", type=int, default=200)
    ap.add_argument("--out", default=str(REPO / "results" / "bench_step_inputs.json"))
    args = ap.parse_args()
    rows = []
    print(f"{'batch':>6}{'context':>9}{'from lists us':>15}{'from rows us':>14}{'ids+positions us':>18}")
    for context in args.contexts:
        for batch in args.batches:
            blocks = -(-context // BLOCK)
            order = torch.randperm(batch * blocks).tolist()
            tables = [order[i * blocks:(i + 1) * blocks] for i in range(batch)]
            seq_lens = [context - i % 7 for i in range(batch)]
            ids = list(range(batch))

            def inputs():
                positions = [s - 1 for s in seq_lens]
                return torch.tensor(ids, dtype=torch.long), torch.tensor(positions, dtype=torch.long)

            kept = BlockTables(blocks)
            kept.rows(ids, tables)  # written once; a decode step adds no block most of the time

            def from_rows():
                return build_triton_metadata([1] * batch, seq_lens, kept.rows(ids, tables), BLOCK, "cpu")

            meta = median_us(lambda: build_triton_metadata([1] * batch, seq_lens, tables, BLOCK, "cpu"), args.repeats)
            kept_us = median_us(from_rows, args.repeats)
            small = median_us(inputs, args.repeats)
            rows.append({"batch": batch, "context": context, "metadata_from_lists_us": meta,
                         "metadata_from_rows_us": kept_us, "ids_positions_us": small})
            print(f"{batch:>6}{context:>9}{meta:>15.1f}{kept_us:>14.1f}{small:>18.1f}")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(rows, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
