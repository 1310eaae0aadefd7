"""Priority scheduling (scheduler.policy priority): the waiting queue by priority aged by
arrival, a running request of a worse rank preempted for a better one that finds no room
(and only for a better one), the starvation bound, and through the engine: a high-priority
request overtakes queued low-priority ones and its output is what it is alone; fcfs refuses
a priority. The scheduler's invariants under priorities are in test_scheduler_props.py."""

from __future__ import annotations

import pytest

from meshserve.comm.messages import SamplingParams
from meshserve.engine.admission import RequestError
from meshserve.engine.block_manager import BlockManager
from meshserve.engine.scheduler import Scheduler
from meshserve.engine.sequence import Sequence, SeqStatus
from support.engines import make_engine


def seq(seq_id: int, prompt_len: int, priority: int, arrival: float) -> Sequence:
    return Sequence(seq_id, seq_id, list(range(1, prompt_len + 1)), prompt_len, SamplingParams(max_tokens=8),
                    arrival_time=arrival, priority=priority)


def test_a_better_rank_preempts_the_worst_running_request_and_is_admitted_in_the_same_step():
    sched = Scheduler(BlockManager(4, 2), max_num_seqs=4, max_batched_tokens=64, priority_aging=100.0)
    low, worse = seq(0, 3, priority=1, arrival=0.0), seq(1, 3, priority=2, arrival=0.0)
    sched.add(low)
    sched.add(worse)
    sched.launched(sched.schedule())  # both admitted: 2 blocks each, none free
    assert sched.running == [low, worse] and sched.blocks.num_free == 0
    high = seq(2, 3, priority=0, arrival=1.0)
    sched.add(high)
    batch = sched.schedule()
    assert batch.preempted == [worse] and high in batch.seqs and low in batch.seqs
    assert worse.status is SeqStatus.WAITING and list(sched.waiting) == [worse]
    assert sched.num_priority_preemptions == 1


def test_no_preemption_for_a_rank_no_better():
    sched = Scheduler(BlockManager(4, 2), max_num_seqs=4, max_batched_tokens=64, priority_aging=100.0)
    first = seq(0, 7, priority=0, arrival=0.0)  # 4 blocks
    sched.add(first)
    sched.launched(sched.schedule())
    same = seq(1, 3, priority=0, arrival=1.0)
    sched.add(same)
    batch = sched.schedule()
    assert not batch.preempted and batch.seqs == [first] and list(sched.waiting) == [same]


def test_waiting_order_is_priority_aged_by_arrival():
    """One level per priority_aging seconds: a priority-1 request that arrived at 0 ranks
    ahead of a priority-0 one that arrived later than 10 s after it (aging 10 s), and behind
    one that arrived sooner."""
    sched = Scheduler(BlockManager(64, 2), max_num_seqs=1, max_batched_tokens=64, priority_aging=10.0)
    old_low = seq(0, 2, priority=1, arrival=0.0)
    late_high = seq(1, 2, priority=0, arrival=10.5)
    soon_high = seq(2, 2, priority=0, arrival=9.5)
    fresh_urgent = seq(3, 2, priority=-5, arrival=40.0)
    for s in (old_low, late_high, soon_high, fresh_urgent):
        sched.add(s)
    assert list(sched.waiting) == [fresh_urgent, soon_high, old_low, late_high]


def run(engine, requests, late=()):
    """requests: [(prompt, priority)], added at once; `late`: more, added after the first
    step. -> the keys in the order they finished, and each one's tokens."""
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    order, out = [], {k: [] for k in range(len(requests) + len(late))}

    def collect(replies):
        for key, delta in replies:
            out[key].extend(delta.token_ids)
            if delta.finish_reason is not None:
                order.append(key)

    for key, (prompt, priority) in enumerate(requests):
        engine.add_request(key, str(key), prompt, params, priority=priority)
    collect(engine.step())
    for key, (prompt, priority) in enumerate(late, start=len(requests)):
        engine.add_request(key, str(key), prompt, params, priority=priority)
    while engine.has_work():
        collect(engine.step())
    return order, out


def test_through_the_engine_a_high_priority_request_preempts_and_overtakes(tiny_checkpoints):
    """max_num_seqs=1: the first low-priority request runs; a high-priority one arrives,
    preempts it and finishes first; every request's tokens are what they are alone."""
    path = tiny_checkpoints["llama"]
    prompts = [[5 + i, 17, 29, 41, 53] for i in range(4)]
    engine = make_engine(path, "scheduler.policy=priority", "scheduler.max_num_seqs=1")
    order, out = run(engine, [(prompts[0], 5), (prompts[1], 5), (prompts[2], 5)], late=[(prompts[3], -1)])
    assert order == [3, 0, 1, 2] and engine.scheduler.num_priority_preemptions == 1
    alone = make_engine(path)
    for key in range(4):
        assert out[key] == run(alone, [(prompts[key], 0)])[1][0], f"request {key}'s tokens changed"
    with pytest.raises(RequestError, match=r"priority=2: this server schedules first come, first served"):
        alone.add_request(9, "9", prompts[0], SamplingParams(max_tokens=1), priority=2)
