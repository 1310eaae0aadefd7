"""The block tables a rank keeps between steps (engine/block_tables.py) against the lists
they stand for, over random plans: sequences that join, grow, lose their last blocks to
rejected drafts and grow others in the same plan, leave, and are sent again in full; and
the Triton backend's metadata from those rows against its metadata from the lists."""

from __future__ import annotations

import random

import numpy as np
import pytest

from meshserve.comm.messages import NewSeq, SamplingParams, SeqDelta, StepPlan
from meshserve.engine.block_tables import BlockTables
from meshserve.layers.kernels import triton_available

P = SamplingParams()


def random_plans(seed: int, steps: int = 60):
    """(plan, the step's sequences, their block lists) per step; block ids from one pool."""
    rng = random.Random(seed)
    pool = list(range(1000))
    rng.shuffle(pool)
    held: dict[int, list[int]] = {}
    next_id = 0
    for step in range(steps):
        new, running, dropped = [], [], []
        for seq_id in list(held):
            roll = rng.random()
            if roll < 0.1:
                dropped.append(seq_id)
                pool += held.pop(seq_id)
            elif roll < 0.2:  # preempted and sent again, in other blocks
                pool += held[seq_id]
                held[seq_id] = [pool.pop(0) for _ in range(rng.randint(1, 6))]
                dropped.append(seq_id)
                new.append(NewSeq(seq_id, [1], 1, list(held[seq_id]), 0, 1, P))
            elif roll < 0.4 and len(held[seq_id]) > 1:  # drafts rejected: the last blocks go, others come
                keep = rng.randint(1, len(held[seq_id]) - 1)
                pool += held[seq_id][keep:]
                added = [pool.pop() for _ in range(rng.randint(0, 3))]
                held[seq_id] = held[seq_id][:keep] + added
                running.append(SeqDelta(seq_id, [], added, 1, -1, keep))
            else:
                added = [pool.pop(0) for _ in range(rng.randint(0, 2))]
                held[seq_id] += added
                running.append(SeqDelta(seq_id, [], added, 1))
        for _ in range(rng.randint(0, 3)):
            held[next_id] = [pool.pop(0) for _ in range(rng.randint(1, 5))]
            new.append(NewSeq(next_id, [1], 1, list(held[next_id]), 0, 1, P))
            next_id += 1
        ids = [d.seq_id for d in running] + [n.seq_id for n in new]
        yield StepPlan(step, running, new, dropped), ids, [list(held[i]) for i in ids]


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_rows_hold_each_sequences_blocks_through_random_plans(seed):
    tables = BlockTables(width=4, rows=2)  # both grow as the plans need
    for plan, ids, blocks in random_plans(seed):
        tables.apply(plan)
        rows = tables.rows(ids, blocks)
        for row, want in zip(rows, blocks):
            assert row[:len(want)].tolist() == want
    assert tables.table.shape[1] > 4 and len(tables.table) > 2


@pytest.mark.skipif(not triton_available(), reason="triton not installed")
def test_triton_metadata_from_rows_equals_it_from_lists():
    from meshserve.layers.triton_backend import build_triton_metadata

    rng = random.Random(3)
    tables = BlockTables(width=8)
    for plan, ids, blocks in random_plans(4, steps=30):
        tables.apply(plan)
        rows = tables.rows(ids, blocks)
        seq_lens = [rng.randint(max(1, 4 * (len(b) - 1) + 1), 4 * len(b)) for b in blocks]
        query_lens = [rng.choice([1, 1, 2, s]) if s > 1 else 1 for s in seq_lens]
        query_lens = [min(q, s) for q, s in zip(query_lens, seq_lens)]
        a = build_triton_metadata(query_lens, seq_lens, blocks, 4, "cpu")
        b = build_triton_metadata(query_lens, seq_lens, rows, 4, "cpu")
        for field in ("slot_mapping", "decode_rows", "decode_block_tables", "decode_lens", "prefill_starts",
                      "prefill_query_lens", "prefill_seq_lens", "prefill_block_tables"):
            assert np.array_equal(getattr(a, field).numpy(), getattr(b, field).numpy()), field
        assert (a.query_start_loc, a.decode_max_len, a.max_prefill_query_len) == (
            b.query_start_loc, b.decode_max_len, b.max_prefill_query_len)
