"""Property tests of the scheduler, block manager and step plans, in plain Python.

A simulated engine loop (random arrivals, prompt and output lengths, aborts, few KV
blocks so that preemption happens) checks after every step that a KV block is exactly one
of free, evictable (a cached prefix) or held, with its reference count equal to its
holders; that a step stays within the token and sequence budgets, schedules a sequence at
most once, serves the waiting first come first served and admits none while preempting;
that a preempted sequence holds no blocks and restarts from nothing; and that every request
ends with the tokens it asked for, or aborted. The ranks' SequenceMirror (engine/mirror.py,
the one ModelRunner uses) applies each StepPlan, received through msgpack, and must hold
the driver's token ids, block tables and computed counts. With context parallelism, the mirrors of the group's ranks must
agree with the driver on who holds which token.
"""

from __future__ import annotations

import subprocess
import sys
from dataclasses import dataclass

ENGINE_MODULES = ("meshserve.engine.scheduler", "meshserve.engine.block_manager", "meshserve.engine.plan",
                  "meshserve.engine.sequence", "meshserve.engine.mirror")


def _torch_imported_by_engine_modules() -> str:
    code = ("import sys; import " + ", ".join(ENGINE_MODULES) +
            "; print('torch' in sys.modules, sorted(m for m in sys.modules if m.split('.')[0] == 'torch')[:5])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    if out.returncode:
        raise AssertionError(f"importing {ENGINE_MODULES} failed:\n{out.stderr}")
    return out.stdout.strip()


# The scheduler is plain Python, so the driver's core runs without torch (docs/architecture.md):
# importing it must not pull in torch.
_TORCH_CHECK = _torch_imported_by_engine_modules()
assert _TORCH_CHECK.startswith("False"), f"the scheduler modules import torch: {_TORCH_CHECK}"

import pytest  # noqa: E402
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from meshserve.comm.messages import NewSeq, SamplingParams, SeqDelta, StepPlan, control_decoder, encoder  # noqa: E402
from meshserve.engine.block_manager import BlockManager  # noqa: E402
from meshserve.engine.mirror import SequenceMirror  # noqa: E402
from meshserve.engine.plan import PlanBuilder  # noqa: E402
from meshserve.engine.scheduler import ScheduledBatch, Scheduler  # noqa: E402
from meshserve.engine.sequence import Sequence, SeqStatus  # noqa: E402
from meshserve.engine.speculative.verify import accept  # noqa: E402
from meshserve.parallel.context import advance, chunk_owners, is_split, local_lens_of, rank_share  # noqa: E402


def test_scheduler_modules_import_no_torch():
    assert _TORCH_CHECK.startswith("False"), _TORCH_CHECK


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def fake_token(seq_id: int, position: int) -> int:
    """The token 'sampled' for `seq_id` at `position`: deterministic, so a recomputed
    sequence can be checked against what it must hold."""
    return (seq_id * 7919 + position * 104729) % 49152


def receive(wire: bytes) -> StepPlan:
    """A plan as a rank gets it from the control plane."""
    plan = control_decoder().decode(wire)
    assert isinstance(plan, StepPlan)
    return plan


# ---------------------------------------------------------------- the simulation


@dataclass(frozen=True)
class Req:
    arrival: int
    prompt_len: int
    max_tokens: int
    abort_after: int | None
    """Abort this many steps after arrival (None: never)."""
    abort_mid_step: bool
    """Abort between schedule() and update(), as if the abort raced the running step."""
    prompt: tuple[int, ...] | None = None
    """The prompt's tokens (None: tokens of its own). Prefix caching's scenarios draw them from
    two values, so prompts share prefixes, and blocks of the same tokens follow different ones."""
    salt: str | None = None
    priority: int = 0
    background: bool = False
    """A Batch API request (below every online one)."""


@dataclass(frozen=True)
class Scenario:
    block_size: int
    num_blocks: int
    max_num_seqs: int
    max_batched_tokens: int
    reqs: tuple[Req, ...]
    prefix_caching: bool = False
    speculate: int = 0
    """Speculative decoding: the most draft tokens per step (0: none). Each draft's length and
    how many of its tokens are right follow from the sequence and its length."""
    priority_aging: float | None = None
    """scheduler.policy priority, aging one level per this many steps (None: fcfs)."""
    background_max_seqs: int | None = None
    background_share: float | None = None


@st.composite
def scenarios(draw, allow_aborts: bool = True, prefix_caching: bool = False, speculate: bool = False,
              priority: bool = False, background: bool = False) -> Scenario:
    block_size = draw(st.sampled_from([1, 2, 4, 8]))
    num_blocks = draw(st.integers(1, 12))
    capacity = block_size * num_blocks
    # The engine refuses prompt + max_tokens > max_model_len <= capacity; the last sampled
    # token is never computed, so capacity + 1 is the true limit. Allow both edges.
    limit = capacity + draw(st.sampled_from([0, 1]))
    n = draw(st.integers(1, 10))
    reqs = []
    for _ in range(n):
        total = draw(st.integers(2, max(2, limit)))
        prompt_len = draw(st.integers(1, total - 1))
        abort_after = draw(st.none() | st.integers(0, 12)) if allow_aborts else None
        prompt, salt = None, None
        if prefix_caching:
            prompt = tuple(draw(st.lists(st.integers(0, 1), min_size=prompt_len, max_size=prompt_len)))
            salt = draw(st.sampled_from([None, None, "a"]))
        reqs.append(Req(draw(st.integers(0, 8)), prompt_len, total - prompt_len, abort_after,
                        draw(st.booleans()), prompt, salt, draw(st.integers(-2, 2)) if priority else 0,
                        draw(st.booleans()) if background else False))
    return Scenario(block_size, num_blocks, draw(st.integers(1, 5)), draw(st.integers(1, 24)), tuple(reqs),
                    prefix_caching, draw(st.integers(1, 5)) if speculate else 0,
                    draw(st.sampled_from([1.0, 4.0, 1e9])) if priority else None,
                    draw(st.none() | st.integers(1, 3)) if background else None,
                    draw(st.sampled_from([None, 0.0, 0.1, 0.5])) if background else None)


@dataclass
class Outcome:
    finished: dict[int, Sequence]
    aborted: dict[int, Sequence]
    steps: int
    preemptions: int
    max_running: int


def check_blocks(bm: BlockManager, live: list[Sequence], finished: list[Sequence]) -> None:
    """Blocks are conserved: each one is free, evictable (cached, in no block table), or in
    use, referenced exactly as often as it appears in block tables; without prefix caching
    a block is in at most one table, with it only sequences of the same salt share one."""
    holders: dict[int, list[Sequence]] = {}
    for s in live:
        assert len(s.block_ids) == len(set(s.block_ids)), f"seq {s.seq_id} holds a block twice"
        for b in s.block_ids:
            holders.setdefault(b, []).append(s)
    free, evictable = list(bm._free), list(bm._evictable)
    assert len(free) == len(set(free)), "a block is twice in the free list"
    assert not set(holders) & set(free), "a block is both free and in a block table"
    assert not set(holders) & set(evictable), "a block is both evictable and in a block table"
    assert not set(free) & set(evictable), "a block is both free and evictable"
    assert len(holders) + len(free) + len(evictable) == bm.num_blocks
    assert bm.num_free == len(free) + len(evictable)
    for b in range(bm.num_blocks):
        assert bm.ref_count(b) == len(holders.get(b, [])) >= 0, f"block {b}: reference count off"
    for b in evictable:
        assert b in bm._hash_of, f"evictable block {b} has no hash"
    for b, seqs in holders.items():
        assert bm.prefix_caching or len(seqs) == 1, f"block {b} is in two block tables"
        assert len({s.cache_salt for s in seqs}) == 1, f"block {b} is shared across salts"
    for s in finished:
        assert s.block_ids == [], f"finished seq {s.seq_id} still holds blocks"


def prompt_of(r: Req, seq_id: int) -> list[int]:
    return list(r.prompt) if r.prompt is not None else [fake_token(10_000 + seq_id, p) for p in range(r.prompt_len)]


def propose(seq: Sequence, most: int, limit: int) -> list[int]:
    """A draft for `seq` (whose last token is uncomputed): up to `most` tokens, a leading run
    of them the ones the "model" samples (fake_token), then wrong ones; lengths drawn from
    the sequence and its length, and capped as the engine caps them (max_tokens, `limit`)."""
    length = seq.num_tokens
    h = fake_token(seq.seq_id, length)
    k = min(h % (most + 1), seq.params.max_tokens - seq.num_output_tokens - 1, limit - length)
    right = (h // 7) % (k + 1) if k > 0 else 0
    return [fake_token(seq.seq_id, length + j) if j < right else fake_token(seq.seq_id, length + j) ^ 1
            for j in range(max(0, k))]


def simulate(sc: Scenario) -> Outcome:
    bm = BlockManager(sc.num_blocks, sc.block_size, prefix_caching=sc.prefix_caching)
    sched = Scheduler(bm, sc.max_num_seqs, sc.max_batched_tokens, priority_aging=sc.priority_aging,
                      background_max_seqs=sc.background_max_seqs, background_share=sc.background_share)
    kv: dict[int, tuple[int, int]] = {}
    """The "KV cache": slot -> (position, token) of what the ranks wrote there."""
    plans = PlanBuilder()
    mirror = SequenceMirror()
    enc = encoder()
    order = sorted(range(len(sc.reqs)), key=lambda i: sc.reqs[i].arrival)  # stable: ties by index
    pending = list(order)
    seqs: dict[int, Sequence] = {}
    arrival_rank: dict[int, int] = {}  # seq_id -> position in arrival order
    finished: dict[int, Sequence] = {}
    aborted: dict[int, Sequence] = {}
    max_running = 0
    # Progress bound: the head of `running` is never preempted and computes >= 1 token per
    # step, so each request needs at most prompt + max_tokens steps at the head.
    bound = max(r.arrival for r in sc.reqs) + sum(r.prompt_len + r.max_tokens for r in sc.reqs) + len(sc.reqs) + 5
    if sc.priority_aging is not None or any(r.background for r in sc.reqs):
        bound *= len(sc.reqs) + 1  # the head may lose its place to a better rank: once per later arrival
    step = 0

    def expected_tokens(seq: Sequence, n_out: int) -> list[int]:
        return seq.token_ids[:seq.prompt_len] + [fake_token(seq.seq_id, seq.prompt_len + j) for j in range(n_out)]

    def end(seq: Sequence, into: dict[int, Sequence]) -> None:
        sched.finish(seq)
        plans.forget(seq)
        assert seq.status is SeqStatus.FINISHED and seq.block_ids == []
        into[seq.seq_id] = seq

    def live() -> list[Sequence]:
        return list(sched.running) + list(sched.waiting)

    while pending or sched.has_work():
        assert step <= bound, f"no progress: {step} steps (bound {bound})"
        # Arrivals.
        while pending and sc.reqs[pending[0]].arrival <= step:
            i = pending.pop(0)
            r = sc.reqs[i]
            seq_id = len(seqs)
            seq = Sequence(seq_id, i, prompt_of(r, seq_id), r.prompt_len, SamplingParams(max_tokens=r.max_tokens),
                           cache_salt=r.salt, arrival_time=float(r.arrival), priority=r.priority,
                           background=r.background)
            seqs[seq_id] = seq
            arrival_rank[seq_id] = len(arrival_rank)
            sched.add(seq)

        def due(seq: Sequence, mid_step: bool) -> bool:
            r = sc.reqs[seq.key]
            return (r.abort_after is not None and r.abort_mid_step == mid_step
                    and step >= r.arrival + r.abort_after)

        # Aborts between steps.
        for seq in live():
            if due(seq, mid_step=False):
                end(seq, aborted)

        if not sched.has_work():
            step += 1
            continue

        running_before = set(id(s) for s in sched.running)
        made_room_before = sched.num_priority_preemptions + sched.num_background_preemptions
        head = sched.waiting[0] if sched.waiting else None
        if sc.speculate:  # as Engine._draft: the running sequences with one token to compute
            for seq in sched.running:
                seq.draft = propose(seq, sc.speculate, sc.block_size * sc.num_blocks + 1) \
                    if seq.num_uncomputed == 1 else []
        batch = sched.schedule()
        for seq in sched.running:
            if seq.draft and all(s is not seq for s in batch.seqs):
                seq.draft = []
        step += 1

        # --- invariants of the schedule
        assert batch.num_tokens <= sc.max_batched_tokens
        assert all(n >= 1 for n in batch.num_new)
        assert len(set(map(id, batch.seqs))) == len(batch.seqs), "a seq scheduled twice in one step"
        assert len(sched.running) <= sc.max_num_seqs
        max_running = max(max_running, len(sched.running))
        assert set(map(id, batch.seqs)) <= set(map(id, sched.running))
        for victim in batch.preempted:
            assert victim.status is SeqStatus.WAITING and victim in sched.waiting
            assert victim.block_ids == [] and victim.num_computed == 0
            assert all(v is not victim for v in batch.seqs)
        made_room = sched.num_priority_preemptions + sched.num_background_preemptions - made_room_before
        if len(batch.preempted) > made_room:
            assert not [s for s in sched.running if id(s) not in running_before], "admitted while preempting"
        # background: at most its seats; one admitted only when no online request waits. A
        # request preempted to make room only for a better rank (priority: online before
        # background, then priority); under fcfs only a background one, for an online one.
        assert sum(s.background for s in sched.running) == sched.num_background_running
        assert sched.num_background_running <= sched.background_max_seqs
        online = [s for s in sched.running if not s.background and id(s) in running_before] or [
            s for s in sched.waiting if not s.background]
        if sc.background_share is not None and online:
            spent = sum(n for s, n in zip(batch.seqs, batch.num_new) if s.background)
            share = sum(n for s, n in zip(batch.seqs, batch.num_new) if not s.background) * sc.background_share
            assert spent <= (max(1, int(share)) if sc.background_share else 0), "background took more than its share"
        for victim in batch.preempted[:made_room]:
            if sc.priority_aging is None:
                assert victim.background and not head.background
            else:
                assert sched.rank(victim) > sched.rank(head), "preempted for a request of no better rank"
        for seq, n in zip(batch.seqs, batch.num_new):
            assert seq.status is SeqStatus.RUNNING
            assert n <= seq.num_uncomputed + len(seq.draft)
            assert not seq.draft or n == seq.num_uncomputed + len(seq.draft) == 1 + len(seq.draft)
            # enough blocks for the tokens scheduled this step, and not more
            assert len(seq.block_ids) == ceil_div(seq.num_computed + n, sc.block_size)
        admitted = [s for s in sched.running if id(s) not in running_before]
        for s in admitted:
            assert not s.background or all(w.background for w in sched.waiting), "background admitted first"
        if sc.priority_aging is None:
            # FCFS: per class, running (in admission order) then waiting is in arrival order,
            # so nothing was admitted ahead of an earlier arrival of its class still waiting;
            # online requests wait ahead of background ones.
            for cls in (False, True):
                ranks = [arrival_rank[s.seq_id] for s in live() if s.background == cls]
                assert ranks == sorted(ranks), f"not first-come first-served: {ranks}"
                for s in admitted:
                    assert all(arrival_rank[w.seq_id] > arrival_rank[s.seq_id] for w in sched.waiting
                               if w.background == s.background)
            classes = [w.background for w in sched.waiting]
            assert classes == sorted(classes), "a background request waits ahead of an online one"
        else:
            # priority: the waiting queue in rank order, nothing admitted ahead of a better
            # rank still waiting, and a request preempted for another only by a better rank
            ranks = [sched.rank(s) for s in sched.waiting]
            assert ranks == sorted(ranks), f"waiting out of rank order: {ranks}"
            for s in admitted:
                assert all(sched.rank(w) > sched.rank(s) for w in sched.waiting)
        for s in sched.waiting:
            assert s.block_ids == [] and s.status is SeqStatus.WAITING
        check_blocks(bm, live(), list(finished.values()) + list(aborted.values()))

        # --- the control plane: driver -> ranks (as Engine.step does it)
        for victim in batch.preempted:
            plans.forget(victim)
        if not len(batch):
            continue  # Engine.step() sends no plan; pending dropped ids go with the next one
        plan = plans.build(batch)
        assert plan.num_tokens == batch.num_tokens and plan.num_seqs == len(batch)
        rank_plan = receive(enc.encode(plan))
        chunks = mirror.apply(rank_plan)
        assert [c.seq_id for c in chunks] == [s.seq_id for s in batch.seqs]
        bs, written = sc.block_size, set()
        for c, seq, want_n in zip(chunks, batch.seqs, batch.num_new):
            sid, mseq = c.seq_id, c.seq
            assert c.num_new == want_n and mseq is mirror.seqs[sid]
            assert mseq.token_ids == seq.token_ids, f"seq {sid}: rank tokens differ from the driver's"
            assert mseq.block_ids == seq.block_ids, f"seq {sid}: rank block table differs from the driver's"
            # the driver counts the step's tokens when it finishes (update), the mirror when applied
            # (a draft's once it is accepted: the next plan says how many were)
            assert c.draft == seq.draft
            assert c.start == seq.num_computed and mseq.num_computed == seq.num_computed + want_n - len(seq.draft)
            assert c.owners is None and mseq.local_lens == [] and mseq.local_positions == []
            assert mseq.prompt_len == seq.prompt_len and mseq.params == seq.params
            # the step writes its chunk (every layer stores the whole step's K/V before it attends)
            for p in range(c.start, c.start + c.num_new):
                slot = mseq.block_ids[p // bs] * bs + p % bs
                assert slot not in written, f"seq {sid}: slot {slot} written twice in one step"
                written.add(slot)
                kv[slot] = (p, c.input_ids[p - c.start])
        for c in chunks:  # then what each chunk reads, its cached prefix included, is its own sequence's
            for p in range(c.start):
                slot = c.seq.block_ids[p // bs] * bs + p % bs
                assert kv.get(slot) == (p, c.seq.token_ids[p]), f"seq {c.seq_id}: wrong K/V at position {p}"
        assert set(mirror.seqs) == {s.seq_id for s in live() if s.sent_tokens}, "rank holds stale or missing seqs"

        # --- the step "runs"; the sampling rank samples for seqs at the end of their tokens
        to_sample = [c.seq_id for c in chunks if c.sampled]
        want_sample = [s.seq_id for s, n in zip(batch.seqs, batch.num_new)
                       if s.num_computed + n - len(s.draft) == s.num_tokens]
        assert to_sample == want_sample
        assert mirror.sampled_after(rank_plan) == [(sid, seqs[sid].params, len(seqs[sid].draft))
                                                   for sid in want_sample]
        # the "model" samples fake_token at every row: after the known tokens and after each draft
        drafts = [seqs[sid].draft for sid in to_sample]
        rows = [fake_token(sid, len(mirror.seqs[sid].token_ids) + j)
                for sid, draft in zip(to_sample, drafts) for j in range(len(draft) + 1)]
        kept = dict(zip(to_sample, accept(rows, drafts)))
        new_tokens = {sid: [fake_token(sid, len(mirror.seqs[sid].token_ids) + j) for j in range(kept[sid])]
                      for sid in to_sample}
        for sid, draft in zip(to_sample, drafts):
            assert new_tokens[sid][:-1] == draft[:kept[sid] - 1], "a wrong draft token was accepted"
        drafted = {s.seq_id: len(s.draft) for s in batch.seqs}

        # Aborts that race the running step.
        for seq in live():
            if due(seq, mid_step=True):
                end(seq, aborted)

        computed_before = {s.seq_id: s.num_computed for s in batch.seqs}
        grown = [seq for seq, _ in sched.update(batch, new_tokens)]
        assert [s.seq_id for s in grown] == [sid for sid in want_sample if seqs[sid].status is SeqStatus.RUNNING]
        for seq, n in zip(batch.seqs, batch.num_new):
            if seq.status is SeqStatus.RUNNING:
                accepted = kept.get(seq.seq_id, 1) - 1
                assert seq.num_computed == computed_before[seq.seq_id] + n - drafted[seq.seq_id] + accepted
                assert not seq.draft
        for seq in grown:
            assert seq.token_ids == expected_tokens(seq, seq.num_output_tokens)
            assert seq.num_uncomputed == 1
            if seq.num_output_tokens >= seq.params.max_tokens:
                end(seq, finished)

        # --- after update: each running seq holds exactly the blocks of its computed tokens
        for seq in sched.running:
            assert len(seq.block_ids) == ceil_div(seq.num_computed, sc.block_size)
            assert 1 <= seq.num_uncomputed
        check_blocks(bm, live(), list(finished.values()) + list(aborted.values()))

    assert not sched.running and not sched.waiting
    assert bm.num_free == sc.num_blocks
    return Outcome(finished, aborted, step, sched.num_preemptions, max_running)


def check_outcome(sc: Scenario, out: Outcome) -> None:
    # Every request either finished with all its tokens kept (preempted or not) or was aborted.
    assert len(out.finished) + len(out.aborted) == len(sc.reqs)
    assert not set(out.finished) & set(out.aborted)
    for seq in out.finished.values():
        r = sc.reqs[seq.key]
        assert seq.num_output_tokens == r.max_tokens
        assert seq.prompt_len == r.prompt_len
        want = seq.token_ids[:seq.prompt_len] + [fake_token(seq.seq_id, seq.prompt_len + j) for j in range(r.max_tokens)]
        assert seq.token_ids == want
    for seq in out.aborted.values():
        assert sc.reqs[seq.key].abort_after is not None
    for i, r in enumerate(sc.reqs):
        if r.abort_after is None:
            assert any(s.key == i for s in out.finished.values()), f"request {i} never finished"


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(scenarios())
def test_engine_loop_invariants(sc):
    check_outcome(sc, simulate(sc))


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(scenarios(allow_aborts=False))
def test_every_request_finishes_without_aborts(sc):
    out = simulate(sc)
    check_outcome(sc, out)
    assert len(out.finished) == len(sc.reqs)


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(scenarios(prefix_caching=True))
def test_engine_loop_invariants_with_prefix_caching(sc):
    """Shared prefixes, salts, preemption and aborts: every step reads the K/V of its own
    tokens, blocks are conserved and reference counts exact (check_blocks)."""
    check_outcome(sc, simulate(sc))


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.booleans().flatmap(lambda cached: scenarios(prefix_caching=cached, speculate=True)))
def test_engine_loop_invariants_with_speculation(sc):
    """Drafts partly right, verified and rolled back, with preemption, aborts and prefix
    caching: the ranks' mirrors follow the driver's computed counts and block tables, each
    step reads only the K/V of accepted tokens (never a rejected draft's), the blocks only
    rejected drafts used are given back, and no draft token reaches the prefix cache."""
    check_outcome(sc, simulate(sc))


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.booleans().flatmap(lambda both: scenarios(prefix_caching=both, priority=not both, background=True)))
def test_engine_loop_invariants_with_background_requests(sc):
    """Batch API requests beside online ones, under fcfs (with prefix caching) and priority,
    with a seat limit: online requests wait ahead of them and preempt them for room, each
    class keeps its order, blocks are conserved, every request ends with its tokens."""
    check_outcome(sc, simulate(sc))


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.booleans().flatmap(lambda cached: scenarios(prefix_caching=cached, priority=True)))
def test_engine_loop_invariants_with_priorities(sc):
    """scheduler.policy priority with aging, preemption for a better rank, aborts and prefix
    caching: the waiting queue in rank order, nothing admitted past a better rank, blocks
    conserved, the mirrors in step, every request ending with its tokens."""
    check_outcome(sc, simulate(sc))


# ---------------------------------------------------------------- deterministic cases


def test_preempted_seq_resumes_and_keeps_its_tokens():
    # 4 blocks of 2 tokens; two requests of 3 + 4 tokens cannot both hold 4 blocks.
    sc = Scenario(block_size=2, num_blocks=4, max_num_seqs=4, max_batched_tokens=16,
                  reqs=(Req(0, 3, 5, None, False), Req(0, 3, 5, None, False)))
    out = simulate(sc)
    assert out.preemptions >= 1
    assert out.max_running == 2
    assert any(s.num_preemptions for s in out.finished.values())
    check_outcome(sc, out)


def test_preemption_takes_the_most_recently_admitted():
    bm = BlockManager(num_blocks=3, block_size=1)
    sched = Scheduler(bm, max_num_seqs=4, max_batched_tokens=8)
    a, b = (Sequence(i, i, [1], 1, SamplingParams(max_tokens=4)) for i in range(2))
    sched.add(a)
    sched.add(b)
    batch = sched.schedule()
    assert batch.seqs == [a, b] and bm.num_free == 1
    sched.update(batch, {0: [5], 1: [6]})
    batch = sched.schedule()  # a takes the last block; b has none left and preempts itself
    assert batch.seqs == [a] and batch.preempted == [b]
    assert list(sched.waiting) == [b] and b.num_computed == 0 and b.token_ids == [1, 6]
    assert a.block_ids and bm.num_free + len(a.block_ids) == 3


def test_token_budget_chunks_a_long_prompt():
    bm = BlockManager(num_blocks=16, block_size=4)
    sched = Scheduler(bm, max_num_seqs=4, max_batched_tokens=5)
    seq = Sequence(0, 0, list(range(12)), 12, SamplingParams(max_tokens=2))
    sched.add(seq)
    chunks = []
    while True:
        batch = sched.schedule()
        chunks.append(batch.num_new)
        grown = sched.update(batch, {0: [99]})
        if grown:
            break
    assert chunks == [[5], [5], [2]]
    assert seq.token_ids[-1] == 99 and len(seq.block_ids) == 3


def test_admission_respects_max_num_seqs_and_order():
    bm = BlockManager(num_blocks=64, block_size=4)
    sched = Scheduler(bm, max_num_seqs=2, max_batched_tokens=100)
    seqs = [Sequence(i, i, [1, 2, 3], 3, SamplingParams()) for i in range(4)]
    for s in seqs:
        sched.add(s)
    batch = sched.schedule()
    assert batch.seqs == seqs[:2]
    assert list(sched.waiting) == seqs[2:]
    sched.update(batch, {0: [7], 1: [8]})
    sched.finish(seqs[0])
    batch = sched.schedule()
    assert batch.seqs == [seqs[1], seqs[2]] and batch.num_new == [1, 3]


def test_plan_sends_new_seqs_whole_then_deltas():
    bm = BlockManager(num_blocks=8, block_size=2)
    sched = Scheduler(bm, max_num_seqs=4, max_batched_tokens=16)
    plans = PlanBuilder()
    seq = Sequence(5, 5, [1, 2, 3, 4], 4, SamplingParams(max_tokens=3))
    sched.add(seq)
    p0 = plans.build(batch := sched.schedule())
    assert [n.seq_id for n in p0.new] == [5] and p0.new[0].token_ids == [1, 2, 3, 4] and p0.running == []
    assert p0.new[0].block_ids == seq.block_ids and len(seq.block_ids) == 2 and p0.new[0].num_new == 4
    sched.update(batch, {5: [9]})
    p1 = plans.build(batch := sched.schedule())
    assert p1.new == [] and len(p1.running) == 1
    d = p1.running[0]
    assert (d.seq_id, d.new_token_ids, d.num_new) == (5, [9], 1)
    assert len(seq.block_ids) == 3 and d.new_block_ids == seq.block_ids[2:]  # a third block, for position 4
    assert p1.step_id == p0.step_id + 1
    sched.finish(seq)
    plans.forget(seq)
    plans.forget(seq)  # forgetting twice drops once
    p2 = plans.build(ScheduledBatch())
    assert p2.dropped == [5]
    assert plans.build(ScheduledBatch()).dropped == []


@pytest.mark.parametrize("num_blocks, block_size", [(1, 1), (3, 4)])
def test_single_request_filling_the_whole_cache(num_blocks, block_size):
    capacity = num_blocks * block_size
    sc = Scenario(block_size, num_blocks, 1, 3, (Req(0, 1, capacity, None, False),))
    out = simulate(sc)
    check_outcome(sc, out)
    assert out.preemptions == 0


# ---------------------------------------------------------------- context parallelism


@settings(max_examples=80, deadline=None)
@given(cp_size=st.sampled_from([2, 3, 4]), block_size=st.sampled_from([1, 2, 4]), cached_units=st.integers(0, 3),
       chunks=st.lists(st.integers(1, 20), min_size=1, max_size=10))
def test_cp_layout_depends_on_positions_alone(cp_size, block_size, cached_units, chunks):
    """A prompt that starts from a cached prefix, then is computed in these chunks: every rank
    of the group applies the same plans, agrees with the driver, and ends up holding exactly
    the positions a fresh prefill in one chunk would have given it (so a prefix computed by
    one request can be reused by another, however each was chunked)."""
    params = SamplingParams(max_tokens=1)
    unit = cp_size * block_size
    start = cached_units * unit
    prompt = [fake_token(1, p) for p in range(start + sum(chunks))]
    mirrors = [SequenceMirror(rank, cp_size, block_size) for rank in range(cp_size)]
    driver = Sequence(0, 0, list(prompt), len(prompt), params)
    blocks = BlockManager(64, block_size, cp_size)
    driver.num_computed = start
    enc = encoder()
    for step, n in enumerate(chunks):
        if step == 0:
            plan = StepPlan(step, [], [NewSeq(0, prompt, len(prompt), [0], start, n, params)], [])
        else:
            plan = StepPlan(step, [SeqDelta(0, [], [], n)], [], [])
        wire = enc.encode(plan)
        owners = chunk_owners(start, n, cp_size, block_size)
        lens_before = local_lens_of(start, cp_size, block_size)
        for m in mirrors:
            (c,) = m.apply(receive(wire))
            assert (c.start, c.num_new, c.owners) == (start, n, owners)
            assert c.held == lens_before[m.cp_rank]
            assert c.sampled == (start + n == len(prompt))
        # the share of each rank: stored tokens partition the chunk, queries are all or one's own
        shares = [rank_share(start, owners, rank, cp_size) for rank in range(cp_size)]
        assert sorted(p for s in shares for p in s.stored) == list(range(start, start + n))
        for s in shares:
            assert s.split == (len(set(owners)) == cp_size) == is_split(owners, cp_size)
            assert s.queries == (s.stored if s.split else list(range(start, start + n)))
            assert [s.queries[r] for r in s.stored_rows] == s.stored
        assert blocks.held_after(driver, n) == max(local_lens_of(start + n, cp_size, block_size))
        blocks.computed(driver, n)
        start += n
        held = [m.seqs[0] for m in mirrors]
        fresh = chunk_owners(0, start, cp_size, block_size)  # the whole prefix in one chunk
        want_lens = advance([0] * cp_size, fresh)
        assert want_lens == local_lens_of(start, cp_size, block_size)
        for rank, seq in enumerate(held):
            assert seq.num_computed == start == driver.num_computed
            assert seq.local_lens == want_lens
            assert seq.local_positions == [p for p in range(start) if fresh[p] == rank]
        # table entry j holds positions [j * unit, (j + 1) * unit): global block j * cp + r on rank r
        for rank, seq in enumerate(held):
            for k, p in enumerate(seq.local_positions):
                assert (k // block_size, k % block_size) == (p // unit, p % block_size)


def test_cp_prefix_cache_unit_is_one_table_entry():
    """With cp = 2 and blocks of 2, a table entry holds 4 positions (2 on each rank): a second
    request with the same 9-token prompt finds the first 8 cached, in 2 entries."""
    blocks = BlockManager(8, 2, cp_size=2, prefix_caching=True)
    sched = Scheduler(blocks, max_num_seqs=4, max_batched_tokens=64)
    first = Sequence(0, 0, list(range(9)), 9, SamplingParams(max_tokens=1))
    sched.add(first)
    batch = sched.schedule()
    assert len(first.block_ids) == 3  # 9 tokens: rank 0 holds 5 (positions 0-1, 4-5, 8)
    sched.update(batch, {0: [99]})
    first_blocks = list(first.block_ids)
    sched.finish(first)
    second = Sequence(1, 1, list(range(9)), 9, SamplingParams(max_tokens=1))
    sched.add(second)
    batch = sched.schedule()
    assert batch.seqs == [second] and second.block_ids[:2] == first_blocks[:2]
    assert batch.num_new == [1] and second.num_cached_tokens == 8 and blocks.hit_tokens == 8


