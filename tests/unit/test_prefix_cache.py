"""Prefix caching through the whole engine on one rank: with the cache, greedy tokens equal
those without it and transformers' (a shared system prompt, multi-turn chat, a prefix
ending mid-block, a fully cached prompt, a prefix reused after its owner was preempted,
chunked prefill, the int8 KV cache), `cached_tokens` is exact, salts never share, and
the block manager's eviction, reset and counters behave as documented."""

from __future__ import annotations

import pytest

from meshserve.comm.messages import SamplingParams
from meshserve.engine.block_manager import BlockManager
from meshserve.engine.offline import generate
from meshserve.engine.scheduler import Scheduler
from meshserve.engine.sequence import Sequence
from support.engines import make_engine
from support.reference import hf_greedy, hf_model

BLOCK = 4
SYSTEM = list(range(500, 542))  # 42 tokens: 10 full blocks of 4, two tokens into the 11th
QUESTIONS = [[7, 8, 9], [11, 12, 13, 14, 15], [21]]


def greedy(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)


def engine(path, *overrides, caching: bool = True):
    return make_engine(path, f"cache.block_size={BLOCK}", f"cache.prefix_caching={str(caching).lower()}", *overrides)


def one_by_one(eng, prompts, n=8, salt=None):
    """[(token_ids, cached_tokens)] of each prompt, run after the previous one finished."""
    results = []
    for p in prompts:
        eng.add_request("r", "r", list(p), greedy(n), cache_salt=salt)
        tokens, usage = [], None
        while eng.has_work():
            for _, delta in eng.step():
                tokens += delta.token_ids
                usage = delta.usage or usage
        results.append((tokens, usage.cached_tokens))
    return results


@pytest.fixture(scope="module")
def hf(tiny_checkpoints):
    return hf_model(tiny_checkpoints["llama"])


def test_shared_system_prompt_and_multi_turn_match_transformers(tiny_checkpoints, hf):
    eng = engine(tiny_checkpoints["llama"])
    prompts = [SYSTEM + q for q in QUESTIONS]
    got = one_by_one(eng, prompts)
    # the first computes everything; the others find the system prompt's 10 full blocks
    assert [c for _, c in got] == [0, 40, 40]
    assert [t for t, _ in got] == [hf_greedy(hf, p, 8) for p in prompts]
    # multi-turn: each turn resends the history (prompt + answer) and a new question
    history = prompts[0] + got[0][0]
    turns = one_by_one(eng, [history + [31, 32], history + [31, 32]])
    # the first turn computed prompt + 7 of its 8 answer tokens: 52 tokens, 13 blocks
    assert turns[0] == (hf_greedy(hf, history + [31, 32], 8), 52)
    # the same prompt again: cached but for the block holding its last token (56 tokens: 13 blocks)
    assert turns[1] == (turns[0][0], 52)
    assert eng.scheduler.blocks.hit_tokens == 40 + 40 + 52 + 52


def test_requests_arriving_together_compute_a_shared_prefix_once(tiny_checkpoints, hf):
    """Admitted in the same step, the later requests start from the blocks the first is
    scheduled to fill: each layer stores the step's K/V before it attends."""
    eng = engine(tiny_checkpoints["llama"])
    prompts = [SYSTEM + q for q in QUESTIONS]
    got = generate(eng, prompts, greedy(8))
    assert eng.stats.steps == 8  # one prefill step for all three, then decodes
    assert [c.usage.cached_tokens for c in got] == [0, 40, 40]
    assert [c.token_ids for c in got] == [hf_greedy(hf, p, 8) for p in prompts]


def test_fully_cached_prompt_recomputes_only_its_last_block(tiny_checkpoints, hf):
    eng = engine(tiny_checkpoints["llama"])
    prompt = SYSTEM[:40]  # exactly 10 blocks
    got = one_by_one(eng, [prompt, prompt, prompt[:39]])
    want = hf_greedy(hf, prompt, 8)
    assert got[0] == (want, 0) and got[1] == (want, 36)
    assert got[2] == (hf_greedy(hf, prompt[:39], 8), 36)  # a prefix ending mid-block: 9 blocks


def test_cache_off_and_salts_share_nothing(tiny_checkpoints):
    off = engine(tiny_checkpoints["llama"], caching=False)
    assert [c for _, c in one_by_one(off, [SYSTEM, SYSTEM])] == [0, 0]
    assert off.scheduler.blocks.num_cached == 0
    on = engine(tiny_checkpoints["llama"])
    first = one_by_one(on, [SYSTEM], salt="tenant-a")
    other = one_by_one(on, [SYSTEM], salt="tenant-b") + one_by_one(on, [SYSTEM])
    same = one_by_one(on, [SYSTEM], salt="tenant-a")
    assert [c for _, c in first + other + same] == [0, 0, 0, 40]
    assert {tuple(t) for t, _ in first + other + same} == {tuple(first[0][0])}


def test_chunked_prefill_and_int8_cache_with_a_cached_prefix(tiny_checkpoints):
    prompts = [SYSTEM + q for q in QUESTIONS]
    for overrides in (["scheduler.max_batched_tokens=8"], ["cache.dtype=int8"]):
        want = one_by_one(engine(tiny_checkpoints["llama"], *overrides, caching=False), prompts)
        got = one_by_one(engine(tiny_checkpoints["llama"], *overrides), prompts)
        assert [t for t, _ in got] == [t for t, _ in want], overrides
        assert [c for _, c in got] == [0, 40, 40], overrides


def test_a_prefix_survives_its_owner_being_preempted(tiny_checkpoints, hf):
    """24 blocks of 4: the owner of the system prompt is preempted by an earlier request,
    which then finishes; the owner, resuming, finds its own blocks in the cache but for the
    one evicted for the earlier request, and a third request finds the system prompt's."""
    eng = engine(tiny_checkpoints["llama"], "cache.num_blocks=24", "model.max_model_len=96")
    long = list(range(3000, 3040))
    prompts = [long, SYSTEM + [7], SYSTEM + [8]]
    budgets = [10, 40, 8]
    params = [greedy(n) for n in budgets]
    eng.add_request(0, "0", prompts[0], params[0])
    eng.add_request(1, "1", prompts[1], params[1])
    results = {0: [], 1: [], 2: []}
    usage = {}
    step = 0
    while eng.has_work() or 2 not in usage:
        if step == 6:
            eng.add_request(2, "2", prompts[2], params[2])
        for key, delta in eng.step():
            results[key] += delta.token_ids
            if delta.usage:
                usage[key] = delta.usage.cached_tokens
        step += 1
    assert eng.scheduler.num_preemptions > 0
    assert [results[i] for i in range(3)] == [hf_greedy(hf, p, n) for p, n in zip(prompts, budgets)]
    assert usage[2] == 40 and usage[0] == usage[1] == 0  # cached_tokens: the first admission's
    assert eng.scheduler.blocks.hit_tokens == 44 + 40  # the owner resumed from 11 of its 12 blocks


# ---------------------------------------------------------------- the block manager alone


def admitted(sched: Scheduler, seq: Sequence):
    sched.add(seq)
    return sched.schedule()


def test_eviction_takes_free_blocks_first_then_the_least_recently_used():
    blocks = BlockManager(6, 2, prefix_caching=True)
    sched = Scheduler(blocks, max_num_seqs=4, max_batched_tokens=64)
    a = Sequence(0, 0, [1, 2, 3, 4, 5], 5, greedy(1))
    batch = admitted(sched, a)
    sched.update(batch, {0: [9]})
    sched.finish(a)  # 2 full blocks cached (evictable), its third freed
    assert (blocks.num_evictable, blocks.num_cached, blocks.num_free) == (2, 2, 6)
    b = Sequence(1, 1, [7, 7, 7, 7, 7], 5, greedy(1))
    admitted(sched, b)  # 3 blocks: free ones, nothing evicted
    assert blocks.num_evictable == 2 and not set(b.block_ids) & {0, 1}
    c = Sequence(2, 2, [1, 2, 5, 5, 6], 5, greedy(1))  # shares a's first block only
    admitted(sched, c)
    # c takes a's first block from the cache, the last free block, then evicts a's second
    assert c.num_cached_tokens == 2 and c.block_ids[0] == 0 and set(c.block_ids[1:]) == {1, 2}
    assert blocks.num_evictable == 0 and blocks.ref_count(0) == 1
    assert blocks.num_cached == 1 + 2 + 1  # a's first block; b's two and c's second, scheduled to be filled


def test_reset_forgets_cached_blocks_and_keeps_running_ones():
    blocks = BlockManager(8, 2, prefix_caching=True)
    sched = Scheduler(blocks, max_num_seqs=4, max_batched_tokens=64)
    a = Sequence(0, 0, [1, 2, 3, 4, 5], 5, greedy(3))
    sched.update(admitted(sched, a), {0: [9]})
    held = list(a.block_ids)
    assert blocks.num_cached == 2 and blocks.reset_prefix_cache() == 2
    assert a.block_ids == held and blocks.num_cached == 0 and blocks.num_free == 8 - len(held)
    b = Sequence(1, 1, [1, 2, 3, 4, 5], 5, greedy(1))
    admitted(sched, b)
    assert b.num_cached_tokens == 0
    sched.finish(a)
    sched.finish(b)
    # what was scheduled after the reset is cached again: a's third block, b's two full ones
    assert blocks.num_free == 8 and blocks.num_evictable == blocks.num_cached == 3
