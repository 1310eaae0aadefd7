"""The driver's bookkeeping of disaggregated prefill/decode, without ranks: a decode
replica's scheduler reserves a handed-off request's blocks (its cached prefix reused) and
computes nothing for it; its blocks join the prefix cache only once its KV has landed;
ending it while its KV travels frees them. The plan ops (engine/handoff.py) name the blocks
to receive, announce a prefill's sends once, and end every transfer the ranks know,
including a prefill refused before any plan carried it."""

from __future__ import annotations

import pytest

from meshserve.comm.messages import KvHandoff, KvReserved, SamplingParams
from meshserve.engine.admission import RequestError
from meshserve.engine.block_manager import BlockManager
from meshserve.engine.handoff import Handoffs
from meshserve.engine.scheduler import Scheduler
from meshserve.engine.sequence import Sequence, SeqStatus

BLOCK = 4


def seq(i: int, tokens: list[int], handoff: KvHandoff | None = None) -> Sequence:
    return Sequence(i, f"k{i}", list(tokens), len(tokens), SamplingParams(max_tokens=4), handoff=handoff)


def run_prefill(sched: Scheduler, s: Sequence) -> None:
    sched.add(s)
    batch = sched.schedule()
    sched.update(batch, {s.seq_id: [99]})


def test_a_decode_request_reserves_its_blocks_computes_nothing_and_is_cached_once_landed():
    blocks = BlockManager(16, BLOCK, prefix_caching=True)
    sched = Scheduler(blocks, max_num_seqs=4, max_batched_tokens=64)
    prefix = list(range(100, 108))  # two full blocks
    run_prefill(sched, seq(0, prefix + [1, 2, 3]))
    handoffs = Handoffs("decode", BLOCK)
    b = seq(1, prefix + [4, 5, 6, 7, 8, 9], KvHandoff(5, 0, "decode"))
    sched.add(b)
    free_before = blocks.num_free
    batch = sched.schedule()
    assert batch.reserved == [b] and b not in batch.seqs and b.status is SeqStatus.RECEIVING
    assert b.num_computed == 8 and len(b.block_ids) == 4 and blocks.num_free == free_before - 2
    reply = handoffs.reserved(b, "req")
    assert reply == KvReserved("req", 8)
    ops = handoffs.take()
    (receive,) = ops.receive
    assert (receive.transfer, receive.peer, receive.first_block, receive.num_blocks) == (5, 0, 2, 2)
    assert receive.block_ids == b.block_ids[2:] and handoffs.take() is None
    # its blocks are not offered to the prefix cache before the KV is there
    c = seq(2, prefix + [4, 5, 6, 7, 8, 9, 10])
    assert len(blocks.match(c)) == 2
    sched.landed(b, 42)
    assert b.status is SeqStatus.RUNNING and b.num_computed == b.prompt_len and b.token_ids[-1] == 42
    assert len(blocks.match(c)) == 3  # now its third (full) block is found
    handoffs.landed(5)
    handoffs.ended(b)
    assert handoffs.take() is None  # landed: nothing left for the ranks to end
    batch = sched.schedule()
    assert batch.num_new[batch.seqs.index(b)] == 1  # it computes its first token, nothing of its prompt


def test_ending_a_receiving_request_frees_its_blocks_and_ends_its_receives():
    blocks = BlockManager(8, BLOCK, prefix_caching=True)
    sched = Scheduler(blocks, max_num_seqs=4, max_batched_tokens=64)
    handoffs = Handoffs("decode", BLOCK)
    b = seq(1, list(range(10)), KvHandoff(9, 0, "decode"))
    sched.add(b)
    sched.schedule()
    handoffs.reserved(b, "req")
    handoffs.take()
    sched.finish(b)
    handoffs.ended(b)
    assert blocks.num_free == 8 and not sched.receiving
    (end,) = handoffs.take().end
    assert end.transfer == 9 and end.block_ids


def test_a_full_cache_leaves_a_decode_request_waiting_in_order():
    blocks = BlockManager(4, BLOCK)
    sched = Scheduler(blocks, max_num_seqs=4, max_batched_tokens=64)
    big = seq(1, list(range(20)), KvHandoff(1, 0, "decode"))  # 5 blocks of 4
    sched.add(big)
    assert not sched.schedule().reserved and sched.waiting[0] is big


def test_prefill_sends_are_announced_once_and_every_transfer_is_ended():
    handoffs = Handoffs("prefill", BLOCK)
    p = seq(3, list(range(30)), KvHandoff(7, 1, "prefill", first_block=2))
    handoffs.scheduled(p)
    handoffs.scheduled(p)
    (send,) = handoffs.take().send
    assert (send.transfer, send.peer, send.first_block, send.num_blocks, send.seq_id) == (7, 1, 2, 6, 3)
    handoffs.ended(p)
    assert handoffs.take().end == [send]
    never = seq(4, list(range(9)), KvHandoff(8, 1, "prefill"))
    handoffs.ended(never)  # aborted before any plan carried it
    handoffs.refused(KvHandoff(9, 1, "prefill"), 5)
    ends = handoffs.take().end
    assert [(e.transfer, e.num_blocks, e.seq_id) for e in ends] == [(8, 3, -1), (9, 2, -1)]


def test_a_handoff_must_match_the_replica():
    with pytest.raises(RequestError, match="not a replica of a disaggregated deployment"):
        Handoffs(None, BLOCK).check(KvHandoff(1, 0, "decode"))
    with pytest.raises(RequestError, match="prefill replica"):
        Handoffs("prefill", BLOCK).check(KvHandoff(1, 0, "decode"))
    Handoffs(None, BLOCK).check(None)
