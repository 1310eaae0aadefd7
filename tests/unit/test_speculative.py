"""Speculative decoding on one rank (meshserve.engine.speculative): the n-gram proposer
against a brute-force search, the acceptance rule, the draft policy, and the engine with
speculation against the same engine without it on a tiny random Llama (float32): greedy
output token for token (logprobs, stops, preemption, prefix caching, mixed batches; n-gram
and draft-model proposals), seeded sampling token for token, the sampled distribution of
the verified tokens against the target's own (a chi-square test), and the KV cache after
rejections, layer by layer. Medusa heads self-distilled on the tiny model: greedy and seeded
output as without speculation."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from meshserve.comm.messages import SamplingParams
from meshserve.engine.offline import generate
from meshserve.engine.sequence import Sequence
from meshserve.engine.speculative.policy import (
    PRIOR_ACCEPTANCE, PRIOR_TOKEN_SHARE, PROBE_BUDGET, PROBE_EVERY, PROBE_MAX, DraftPolicy, StepCost,
)
from meshserve.engine.speculative.proposer import MAX_CANDIDATES, NgramProposer
from meshserve.engine.speculative.verify import accept
from support.checkpoints import make_checkpoint
from support.engines import make_engine
from support.heads import self_distilled_heads

NGRAM = ["speculative.method=ngram", "speculative.adaptive=false", "speculative.prompt_lookup_min=1"]
"""Always draft what the lookup finds (a tiny random model repeats itself, which the lookup
catches from one matching token)."""


def seq_of(tokens: list[int], seq_id: int = 0, max_tokens: int = 100, temperature: float = 1.0) -> Sequence:
    return Sequence(seq_id, seq_id, list(tokens), len(tokens), SamplingParams(max_tokens=max_tokens, temperature=temperature))


# ---------------------------------------------------------------- the n-gram proposer


def brute_force(tokens: list[int], min_n: int, max_n: int, k: int) -> list[int]:
    """The longest match of the last n tokens (min_n <= n <= max_n) among the latest
    MAX_CANDIDATES earlier occurrences of the last min_n tokens, the latest on ties."""
    length = len(tokens)
    if length <= min_n:
        return []
    suffix = tokens[length - min_n:]
    ends = [e for e in range(min_n, length) if tokens[e - min_n:e] == suffix][-MAX_CANDIDATES:]
    best, best_len = None, 0
    for e in reversed(ends):
        n = min_n
        while n < max_n and e - n - 1 >= 0 and tokens[e - n - 1] == tokens[length - n - 1]:
            n += 1
        if n > best_len:
            best, best_len = e, n
    if best is None:
        return []
    extended = list(tokens)
    while len(extended) < best + k:  # a copy overlapping its own output
        extended.append(extended[len(extended) - (length - best)])
    return extended[best:best + k]


@settings(max_examples=200, deadline=None)
@given(tokens=st.lists(st.integers(0, 3), min_size=0, max_size=60), min_n=st.integers(1, 3),
       extra=st.integers(0, 3), k=st.integers(1, 6), cut=st.integers(0, 60))
def test_ngram_proposals_match_a_brute_force_search(tokens, min_n, extra, k, cut):
    """Proposed twice, before and after the sequence grows: the index kept between the two
    calls gives what a search of the whole sequence gives."""
    proposer = NgramProposer(min_n, min_n + extra)
    seq = seq_of(tokens[:cut])
    assert proposer.propose_one(seq, k) == brute_force(seq.token_ids, min_n, min_n + extra, k)
    seq.token_ids.extend(tokens[cut:])
    assert proposer.propose_one(seq, k) == brute_force(seq.token_ids, min_n, min_n + extra, k)


def test_ngram_prefers_the_longest_then_the_latest_match():
    proposer = NgramProposer(1, 3)
    # "7 8" occurs twice; "5 7 8" once, earlier: the longer match wins
    assert proposer.propose_one(seq_of([5, 7, 8, 1, 2, 9, 7, 8, 3, 4, 5, 7, 8]), 2) == [1, 2]
    # two equally long matches: the latest
    assert proposer.propose_one(seq_of([7, 8, 1, 7, 8, 2, 7, 8], seq_id=1), 1) == [2]
    assert proposer.propose_one(seq_of([1, 2, 3], seq_id=2), 4) == []  # no earlier occurrence
    assert proposer.propose_one(seq_of([4, 1, 2, 3, 1, 2, 3, 1, 2], seq_id=4), 5) == [3, 1, 2, 3, 1]  # a loop goes on
    assert proposer.propose_one(seq_of([6, 9, 9, 9], seq_id=5), 3) == [9, 9, 9]
    assert proposer.propose_one(seq_of([1, 2, 1], seq_id=3), 0) == []
    proposer.drop(0)
    assert 0 not in proposer._index


# ---------------------------------------------------------------- the acceptance rule


def test_accept_keeps_the_drafts_up_to_the_first_disagreement():
    # rows: seq A (2 drafts), seq B (no draft), seq C (3 drafts)
    rows = [5, 6, 9] + [1] + [4, 4, 8, 0]
    assert accept(rows, [[5, 6], [], [4, 7, 8]]) == [3, 1, 2]
    assert accept([2, 3], [[1]]) == [1]  # the first draft rejected: the row's own token only


# ---------------------------------------------------------------- the draft policy


def test_step_cost_fit_and_threshold():
    cost = StepCost()
    for t in [1, 2, 4, 8, 16, 32] * 3:
        cost.add(t, 0.010 + 0.001 * t)
    a, b = cost.fit()
    assert a == pytest.approx(0.010) and b == pytest.approx(0.001)
    assert cost.threshold(1) == pytest.approx(0.001 / 0.011)
    assert cost.threshold(32) == pytest.approx(0.032 / 0.042)
    assert cost.threshold(1, 0.005) == pytest.approx(0.006 / 0.011)  # proposing costs half a step per position
    same = StepCost()
    for _ in range(10):
        same.add(4, 0.02)
    assert same.fit() is None  # steps of one size say nothing about the slope: the prior splits them
    a = 0.02 / (1 + 4 * PRIOR_TOKEN_SHARE)
    assert same.threshold(1, 0.01) == pytest.approx((PRIOR_TOKEN_SHARE * a + 0.01) / (a + PRIOR_TOKEN_SHARE * a))


def test_a_costly_proposer_drafts_only_what_is_nearly_sure_and_failed_probes_back_off():
    """A draft model that costs 60% of a step per position: a sequence of middling acceptance
    drafts nothing, one whose drafts are always kept drafts in full; a sequence whose probes
    keep failing probes ever less often."""
    policy = DraftPolicy(max_tokens=8)
    for t in [1, 2, 4, 8, 16, 32] * 3:
        policy.step(t, 0.050 + 0.0005 * t)
    policy.proposed(0.060, 2)  # 30 ms per position
    sure, middling = seq_of([1, 2, 3]), seq_of([4, 5, 6])
    middling.seq_id = 1
    for _ in range(30):
        policy.verified(0, 8, 8)
        policy.verified(1, 4, 1)  # half its decided positions kept
    assert policy.sizes([sure, middling], 1) == [8, 0]
    policy.credit = 1.0  # enough for the probes below (each costs about 60% of a step)
    probes = []
    for step in range(1, 16 + 32 + 64 + 1):
        if policy.num_tokens(middling, 1):
            probes.append(step)
            policy.verified(1, 1, 0)
        policy.step(1, 0.0505)
    assert probes[0] <= 16 and [b - a for a, b in zip(probes, probes[1:])] == [32, 64]
    policy.proposed(0.200, 1)  # now 4x a step per position: even sure drafts cannot pay
    assert policy.sizes([sure], 1) == [0]
    assert sum(policy.num_tokens(sure, 1) for _ in range(PROBE_MAX)) == 1


def test_policy_drafts_eagerly_when_memory_bound_and_not_when_compute_bound():
    policy = DraftPolicy(max_tokens=8)
    seq = seq_of([1, 2, 3])
    for t in [1, 2, 4, 8, 16, 32] * 3:
        policy.cost.add(t, 0.050 + 0.0005 * t)  # reading the weights dominates
    assert policy.num_tokens(seq, 1) >= 4
    for _ in range(40):
        policy.verified(0, 4, 0)  # everything rejected
    assert policy.acceptance(0) < 0.06
    assert policy.acceptance(5, greedy=False) < 0.2  # a new sequence starts from what the others had accepted
    assert policy.acceptance(5, greedy=True) == PRIOR_ACCEPTANCE  # ... that sampled as it does
    assert policy.acceptance(0) < policy.cost.threshold(1) < 0.01  # below even the 1% a token costs here
    assert policy.num_tokens(seq, 1) == 0
    policy.cost = StepCost()
    for t in [1, 2, 4, 8, 16, 32] * 3:
        policy.cost.add(t, 0.010 + 0.001 * t)  # a token costs 9% of a one-sequence step
    assert policy.num_tokens(seq, 1) == 0
    compute_bound = DraftPolicy(max_tokens=8)
    for t in [1, 2, 4, 8, 16, 32] * 3:
        compute_bound.step(t, 0.001 + 0.002 * t)
    compute_bound.verified(0, 4, 2)
    ks = []
    for _ in range(2 * PROBE_EVERY):
        ks.append(compute_bound.num_tokens(seq, 32))
        compute_bound.step(32, 0.001 + 0.002 * 32)
    assert ks.count(1) == 2 and set(ks) == {0, 1}  # nothing but a probe now and then
    assert DraftPolicy(max_tokens=3, adaptive=False).num_tokens(seq, 64) == 3


def probe_unpredictable_text(catch_up_seconds: float, steps: int = 2000) -> tuple[int, float, float]:
    """Eight sequences whose drafts are never kept, each new to the draft (a prompt of 128
    tokens to prefill), proposing at 10 ms a position and `catch_up_seconds` a token caught
    up, in steps of 54 ms: (probes, their cost, the time)."""
    policy = DraftPolicy(max_tokens=4)
    elapsed = 0.0
    for t in [1, 2, 4, 8] * 2:
        policy.step(t, 0.050 + 0.0005 * t)
        elapsed += 0.050 + 0.0005 * t
    policy.proposed(0.020, 2)
    policy.proposed(0.020 + catch_up_seconds * 100, 2, caught_up=100)  # a prompt of 100 tokens prefilled
    assert policy.propose_seconds == pytest.approx(0.010)
    assert policy.catch_up_cost(128) == pytest.approx(128 * catch_up_seconds)
    for seq_id in range(8):
        for _ in range(10):
            policy.verified(seq_id, 1, 0)
    seqs = [seq_of([1, 2, 3], seq_id, temperature=0) for seq_id in range(8)]
    backlog = {s.seq_id: 128 for s in seqs}
    spent, probes = 0.0, 0
    for _ in range(steps):
        ks = policy.sizes(seqs, len(seqs), [backlog[s.seq_id] for s in seqs])
        for seq, k in zip(seqs, ks):
            if k:
                probes += 1
                spent += policy.cost.per_token() + policy.propose_seconds + policy.catch_up_cost(backlog[seq.seq_id])
                backlog[seq.seq_id] = 0
                policy.verified(seq.seq_id, k, 0)
            else:
                backlog[seq.seq_id] += 1
        policy.step(len(seqs), 0.054)
        elapsed += 0.054
    return probes, spent, elapsed


def test_probes_that_must_catch_up_a_draft_cost_at_most_their_budget():
    """Probing a sequence whose draft cache is behind costs its catch-up: on unpredictable
    text the probes' cost stays within PROBE_BUDGET of the time. A draft that catches up at
    a fifth of a step per token (an int4 draft on a CPU without bf16 dot products) falls
    behind faster than the credit grows and never probes; one at 0.1 ms a token probes."""
    probes, spent, elapsed = probe_unpredictable_text(0.010)
    assert probes == 0
    probes, spent, elapsed = probe_unpredictable_text(0.0001)
    assert probes >= 8 and spent <= PROBE_BUDGET * elapsed
    cheap = DraftPolicy(max_tokens=4)  # n-gram lookup: a probe costs the target a token
    for t in [1, 2, 4, 8] * 2:
        cheap.step(t, 0.050 + 0.0005 * t)
    for _ in range(40):
        cheap.verified(0, 4, 0)  # below even the 1% of a step a token costs
    probes = 0
    for _ in range(4 * PROBE_EVERY):
        if cheap.num_tokens(seq_of([1, 2, 3], temperature=0), 1):
            probes += 1
            cheap.verified(0, 1, 0)
        cheap.step(1, 0.05)
    assert probes == 2  # at 16 and 16 + 32 steps: as often as the back-off allows


def test_a_catch_up_is_costed_at_what_catch_ups_of_its_size_cost():
    """A draft's forward over hundreds of rows can run another kernel than over a few dozen
    (an int4 draft dequantizes its weights for long ones): per token, a long prompt's
    prefill says little about a short one's. Each size class keeps its own cost; one not
    seen yet takes the nearest class's."""
    policy = DraftPolicy(max_tokens=4)
    assert policy.catch_up_cost(100) == 0.0  # nothing measured: nothing to hold a draft back
    policy.proposed(0.001 * 512, 0, caught_up=512)  # 1 ms a token at 512
    assert policy.catch_up_cost(300) == pytest.approx(0.300)
    assert policy.catch_up_cost(129) == pytest.approx(0.129)  # nearest: still the long one
    policy.proposed(0.008 * 129, 0, caught_up=129)
    assert policy.catch_up_cost(129) == pytest.approx(8 * 0.129)
    assert policy.catch_up_cost(100) == pytest.approx(0.8)
    assert policy.catch_up_cost(600) == pytest.approx(0.6)
    assert policy.catch_up_cost(300) == pytest.approx(2.4)  # between the two: the dearer
    assert policy.catch_up_cost(0) == 0.0


def test_a_server_that_stopped_drafting_tries_again_after_a_while():
    """Acceptance learned from earlier sequences fades with the steps, so new sequences
    start drafting again after a long stretch in which none found it worth it."""
    policy = DraftPolicy(max_tokens=4)
    for t in [1, 2, 4, 8] * 2:
        policy.step(t, 0.050 + 0.0005 * t)
    policy.proposed(0.040, 2)  # 20 ms per position: drafts need an acceptance of 0.4
    for _ in range(20):
        policy.verified(0, 2, 0)
    assert policy.acceptance(1) < 0.1 and policy.num_tokens(seq_of([1], 1, temperature=0), 1, 50) == 0
    for _ in range(10000):
        policy.step(1, 0.05)
    assert policy.acceptance(1) > 0.5 and policy.num_tokens(seq_of([1], 2, temperature=0), 1, 50) > 0
    assert policy.acceptance(1) <= PRIOR_ACCEPTANCE


def test_sampled_sequences_do_not_start_from_the_acceptance_of_greedy_ones():
    """After greedy sequences whose drafts were all kept, a sampled sequence starts from the
    prior (a draft model would prefill its prompt on a guess), a greedy one from their record."""
    policy = DraftPolicy(max_tokens=4)
    for t in [1, 2, 4, 8] * 2:
        policy.step(t, 0.050 + 0.0005 * t)
    policy.proposed(0.040, 2)  # 20 ms per position: drafts need an acceptance of about 0.4
    greedy = [seq_of([1, 2], seq_id, temperature=0) for seq_id in range(4)]
    assert policy.sizes(greedy, 1) == [1] * 4  # the prior, 0.6: one token each
    for _ in range(20):
        for seq in greedy:
            policy.verified(seq.seq_id, 1, 1)
    assert policy.acceptance(9, greedy=True) > 0.9 and policy.acceptance(9, greedy=False) == PRIOR_ACCEPTANCE
    assert policy.num_tokens(seq_of([1, 2], 9, temperature=0), 1) == 4
    assert policy.num_tokens(seq_of([1, 2], 10, temperature=0.8), 1) == 1


def test_a_sequence_new_to_a_draft_model_drafts_only_if_that_pays_for_its_prefill():
    """Catching a draft up on a 128-token prompt costs 1.28 s here: a sampled sequence on the
    prior's guess (0.6) with 50 tokens to go would not save that much and waits (no credit
    for a probe yet); with 5,000 tokens to go it would; a greedy sequence after greedy ones
    that kept nearly every draft drafts in full. Once caught up, nothing is owed."""
    policy = DraftPolicy(max_tokens=4)
    for t in [1, 2, 4, 8] * 2:
        policy.step(t, 0.050 + 0.0005 * t)
    policy.proposed(0.010, 1)
    policy.proposed(0.010 + 0.010 * 100, 1, caught_up=100)  # 10 ms a token caught up
    short, long_ = seq_of([1, 2], 1, max_tokens=50), seq_of([1, 2], 2, max_tokens=5000)
    assert policy.sizes([], 0, []) == []  # a step with no sequence decoding
    assert policy.sizes([short, long_], 1, [128, 128]) == [0, 3]  # 0.6^3 is above the threshold, 0.21
    assert policy.num_tokens(short, 1, 0) == 3
    greedy = [seq_of([1, 2], seq_id, temperature=0) for seq_id in range(3, 6)]
    for _ in range(20):
        for seq in greedy:
            policy.verified(seq.seq_id, 1, 1)
    assert policy.num_tokens(seq_of([1, 2], 9, max_tokens=100, temperature=0), 1, 128) == 4


# ---------------------------------------------------------------- the engine, greedy


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    # small weights: the model falls into loops, which the lookup catches, and out of them
    return make_checkpoint(tmp_path_factory.mktemp("spec") / "llama", "llama", seed=1, initializer_range=0.09)


PROMPTS = [[5, 6, 7, 8, 9, 10, 11, 5, 6, 7, 8, 9, 10, 11, 5, 6, 7], list(range(100, 140)) * 2, [3, 4] * 20,
           list(range(200, 260)), [9] * 7]


def assert_same(got, want, logprobs: bool = True):
    for g, w in zip(got, want):
        assert g.token_ids == w.token_ids
        assert (g.text, g.finish_reason, g.stop_reason) == (w.text, w.finish_reason, w.stop_reason)
        if logprobs:
            assert len(g.logprobs) == len(w.logprobs)
            for a, b in zip(g.logprobs, w.logprobs):
                assert a.token_id == b.token_id and abs(a.logprob - b.logprob) < 1e-4
                assert [t for t, _ in a.top] == [t for t, _ in b.top]


@pytest.mark.parametrize("overrides", [[], ["model.max_model_len=128", "cache.num_blocks=32", "cache.block_size=4"],
                                       ["scheduler.max_batched_tokens=24"]],
                         ids=["batch", "preemption", "chunked-prefill"])
def test_greedy_output_is_the_output_without_speculation(tiny, overrides):
    """Five prompts at once (prefills beside drafting decodes), one with penalties and one with
    a seed at temperature 0; with few blocks (preemption) or a small step budget. Prefix
    caching is on (the default): a prompt's second half repeats its first."""
    params = [SamplingParams(max_tokens=48, temperature=0, ignore_eos=True, logprobs=2),
              SamplingParams(max_tokens=40, temperature=0, ignore_eos=True, logprobs=0, presence_penalty=0.5,
                             repetition_penalty=1.2),
              SamplingParams(max_tokens=30, temperature=0, ignore_eos=True, logprobs=1, seed=7),
              SamplingParams(max_tokens=44, temperature=0, ignore_eos=True, logprobs=3),
              SamplingParams(max_tokens=20, temperature=0, ignore_eos=True, logprobs=1, min_tokens=5)]
    want = generate(make_engine(tiny, *overrides), PROMPTS, params)
    spec = make_engine(tiny, *NGRAM, *overrides)
    got = generate(spec, PROMPTS, params)
    assert_same(got, want)
    stats = spec.speculator.stats
    assert stats.num_accepted_tokens >= 20 and stats.num_draft_tokens > stats.num_accepted_tokens
    assert sum(c.usage.accepted_draft_tokens for c in got) == stats.num_accepted_tokens
    assert sum(c.usage.rejected_draft_tokens for c in got) == stats.num_draft_tokens - stats.num_accepted_tokens
    assert stats.accepted_per_position[0] >= stats.accepted_per_position[1]
    if "cache.num_blocks=32" in overrides:
        assert spec.scheduler.num_preemptions > 0
    assert spec.scheduler.blocks.num_free == spec.memory.num_blocks  # every block back, none lost to drafts


def test_stops_inside_accepted_drafts_end_where_they_would_without(tiny):
    """Stop tokens, stop strings and max_tokens taken from the output without speculation, so
    that they fall inside runs of accepted drafts: the same tokens, text and reasons."""
    base = make_engine(tiny)
    free = generate(base, PROMPTS[:3], SamplingParams(max_tokens=40, temperature=0, ignore_eos=True))
    params = [SamplingParams(max_tokens=40, temperature=0, ignore_eos=True, stop_token_ids=[free[0].token_ids[25]]),
              SamplingParams(max_tokens=40, temperature=0, ignore_eos=True, stop=[free[1].text[-12:-6]],
                             include_stop_str_in_output=True),
              SamplingParams(max_tokens=13, temperature=0, ignore_eos=True)]
    want = generate(base, PROMPTS[:3], params)
    got = generate(make_engine(tiny, *NGRAM), PROMPTS[:3], params)
    assert_same(got, want, logprobs=False)
    assert [c.finish_reason for c in got] == ["stop", "stop", "length"]


def test_seeded_sampling_is_the_output_without_speculation(tiny):
    """A seeded row draws from a generator keyed by the sequence's length, with or without
    drafts before it: verifying by sampling each row and keeping the matches reproduces the
    same tokens (and a second run the same again)."""
    params = [SamplingParams(max_tokens=40, temperature=t, top_p=p, top_k=k, seed=s, ignore_eos=True)
              for t, p, k, s in [(0.8, 0.9, 0, 1), (1.0, 1.0, 20, 2), (0.5, 0.95, 0, 3), (1.2, 1.0, 0, 4),
                                 (0.3, 1.0, 5, 5)]]
    want = generate(make_engine(tiny), PROMPTS, params)
    spec = make_engine(tiny, *NGRAM)
    got = generate(spec, PROMPTS, params)
    assert_same(got, want, logprobs=False)
    assert spec.speculator.stats.num_accepted_tokens > 0
    assert_same(generate(spec, PROMPTS, params), want, logprobs=False)


@pytest.fixture(scope="module")
def tiny_heads(tiny, tmp_path_factory):
    return {kind: self_distilled_heads(tiny, PROMPTS, tmp_path_factory.mktemp("heads") / f"{kind}.safetensors",
                                       sequential=kind == "sequential")
            for kind in ("sequential", "medusa")}


@pytest.mark.parametrize("kind", ["sequential", "medusa"])
def test_medusa_heads_give_the_output_without_speculation(tiny, tiny_heads, kind):
    """The heads' guesses, made on the step's last hidden state (and, sequential, on the
    token sampled there) and returned with its tokens, are the next step's drafts: greedy
    (with logprobs) and seeded sampled output are the output without speculation, and
    guesses are accepted."""
    medusa = ["speculative.method=medusa", f"speculative.heads={tiny_heads[kind]}", "speculative.adaptive=false"]
    params = ([SamplingParams(max_tokens=48, temperature=0, ignore_eos=True, logprobs=2)] * len(PROMPTS)
              + [SamplingParams(max_tokens=40, temperature=0.8, top_p=0.9, seed=s, ignore_eos=True)
                 for s in range(len(PROMPTS))])
    want = generate(make_engine(tiny), PROMPTS * 2, params)
    spec = make_engine(tiny, *medusa)
    got = generate(spec, PROMPTS * 2, params)
    assert_same(got[:len(PROMPTS)], want[:len(PROMPTS)])
    assert_same(got[len(PROMPTS):], want[len(PROMPTS):], logprobs=False)
    stats = spec.speculator.stats
    assert stats.num_accepted_tokens >= 40 and stats.num_draft_tokens > stats.num_accepted_tokens
    assert len(stats.accepted_per_position) == 8 and stats.accepted_per_position[3] == 0  # three heads: 3 drafts


TREE = "speculative.tree=[[0], [1], [2], [0, 0], [0, 1], [1, 0], [0, 0, 0]]"


@pytest.mark.parametrize("kind", ["sequential", "medusa"])
def test_a_tree_of_the_heads_guesses_gives_the_output_without_speculation(tiny, tiny_heads, kind):
    """A candidate tree (speculative.tree) verified in one step, each node attending to its
    own path: greedy (with logprobs) and seeded sampled output are the output without
    speculation, and guesses are accepted."""
    base = ["speculative.method=medusa", f"speculative.heads={tiny_heads[kind]}", "speculative.adaptive=false"]
    params = ([SamplingParams(max_tokens=48, temperature=0, ignore_eos=True, logprobs=2)] * len(PROMPTS)
              + [SamplingParams(max_tokens=40, temperature=0.8, top_p=0.9, seed=s, ignore_eos=True)
                 for s in range(len(PROMPTS))])
    want = generate(make_engine(tiny), PROMPTS * 2, params)
    tree = make_engine(tiny, *base, TREE)
    got = generate(tree, PROMPTS * 2, params)
    assert_same(got[:len(PROMPTS)], want[:len(PROMPTS)])
    assert_same(got[len(PROMPTS):], want[len(PROMPTS):], logprobs=False)
    assert tree.speculator.stats.num_accepted_tokens >= 40


class ScriptedProposer:
    """The Proposer a test scripts: it keeps no state, so it catches up on nothing and
    forgets nothing; subclasses write `propose`."""

    caught_up = 0

    def received(self, seq: Sequence, guesses: list[int]) -> None:
        pass

    def backlog(self, seq: Sequence) -> int:
        return 0

    def drop(self, seq_id: int) -> None:
        pass


class BranchProposer(ScriptedProposer):
    """For the tree [[0], [1], [1, 0]]: a wrong first guess, then the right next token in the
    second branch and the right one after it below it (the output without speculation)."""

    def __init__(self, answers: dict[tuple[int, ...], list[int]]):
        self.answers = answers

    def propose(self, seqs: list[Sequence], max_tokens: list[int]) -> list[list[int]]:
        out = []
        for seq, k in zip(seqs, max_tokens):
            answer = self.answers[tuple(seq.token_ids[:seq.prompt_len])]
            made = seq.num_tokens - seq.prompt_len
            right = answer[made:made + 2]
            out.append(([(right[0] + 1) % 50] + right)[:k] if len(right) == 2 else [])
        return out


def test_kept_nodes_off_the_chain_are_computed_again_and_the_output_is_the_same(tiny, tiny_heads):
    """Every step keeps the second branch of the tree: its nodes' K/V lie in rows other than
    their depth's, so the driver counts them as not computed and the next step computes
    them at their place; greedy output is the output without speculation."""
    params = SamplingParams(max_tokens=30, temperature=0, ignore_eos=True)
    want = generate(make_engine(tiny), PROMPTS, params)
    engine = make_engine(tiny, "speculative.method=medusa", f"speculative.heads={tiny_heads['sequential']}",
                         "speculative.adaptive=false", "speculative.tree=[[0], [1], [1, 0]]")
    engine.speculator.proposer = BranchProposer({tuple(p): w.token_ids for p, w in zip(PROMPTS, want)})
    got = generate(engine, PROMPTS, params)
    assert [g.token_ids for g in got] == [w.token_ids for w in want]
    stats = engine.speculator.stats
    assert stats.num_accepted_tokens >= 20 and stats.accepted_per_position[1] == stats.accepted_per_position[0]


@pytest.mark.parametrize("tree, message", [
    ("[[0], [0, 0], [0, 0, 0], [0, 0, 0, 0]]", r"a tree 4 deep needs 4 heads, the heads file has 3"),
    ("[[0, 1]]", r"tree path \[0\] is missing"),
    ("[" + ", ".join(f"[{i}]" for i in range(16)) + "]", "a tree of 16 nodes; at most 15"),
])
def test_a_bad_tree_is_a_config_error(tiny, tiny_heads, tree, message):
    from meshserve.configs import ConfigError

    with pytest.raises(ConfigError, match=message):
        make_engine(tiny, "speculative.method=medusa", f"speculative.heads={tiny_heads['sequential']}",
                    f"speculative.tree={tree}")


def test_heads_for_another_model_are_a_config_error(tiny, tmp_path):
    from meshserve.configs import ConfigError
    from meshserve.configs.model_info import read_model_info
    from meshserve.layers.medusa import MedusaHeads

    def heads(hidden: int, vocab: int):
        path = tmp_path / f"h{hidden}-{vocab}.safetensors"
        MedusaHeads(hidden, 2, torch.arange(5), torch.zeros(5, hidden), vocab).save(path)
        return ["speculative.method=medusa", f"speculative.heads={path}"]

    vocab = read_model_info(str(tiny)).vocab_size
    with pytest.raises(ConfigError, match=r"heads for hidden_size=32, the model has 64"):
        make_engine(tiny, *heads(32, vocab))
    with pytest.raises(ConfigError, match=rf"heads for a vocabulary of 77 tokens, the model has {vocab}"):
        make_engine(tiny, *heads(64, 77))


class FixedProposer(ScriptedProposer):
    """Proposes the same tokens after the first output token."""

    def __init__(self, tokens: list[int]):
        self.tokens = tokens

    def propose(self, seqs: list[Sequence], max_tokens: list[int]) -> list[list[int]]:
        return [self.tokens[:k] if seq.num_output_tokens == 1 else [] for seq, k in zip(seqs, max_tokens)]


def chi_square_sf(x: float, dof: int) -> float:
    """P(X >= x) for X ~ chi-square with `dof` degrees of freedom."""
    return float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64),
                                         torch.tensor(x / 2, dtype=torch.float64)))


def test_sampled_tokens_follow_the_targets_distribution(tiny):
    """Temperature 1, top_k 2: the joint distribution of a request's first three tokens, the
    second and third verified drafts (a fixed proposal, right part of the time), against the target's
    exact one (products of its top-2 probabilities, renormalized, from greedy runs with
    logprobs). Pearson's chi-square over the 8 outcomes; the test fails when p < 1e-4, its
    false-alarm rate."""
    prompt = [11, 12, 13, 14]
    base = make_engine(tiny)

    def top2(tokens):  # the target's top-2 next tokens and their renormalized probabilities
        (c,) = generate(base, [tokens], SamplingParams(max_tokens=1, temperature=0, logprobs=2, ignore_eos=True))
        ids, lps = zip(*c.logprobs[0].top)
        z = sum(math.exp(v) for v in lps)
        return {t: math.exp(v) / z for t, v in zip(ids, lps)}

    exact: dict[tuple[int, int, int], float] = {}
    for t1, p1 in top2(prompt).items():
        for t2, p2 in top2(prompt + [t1]).items():
            for t3, p3 in top2(prompt + [t1, t2]).items():
                exact[(t1, t2, t3)] = p1 * p2 * p3
    likely = max(exact, key=exact.get)
    spec = make_engine(tiny, *NGRAM, "scheduler.max_num_seqs=256")
    spec.speculator.proposer = FixedProposer([likely[1], likely[2]])
    n = 3000
    # 4 tokens: the drafts (the second and third) are capped to leave room for the one after
    params = SamplingParams(max_tokens=4, temperature=1.0, top_k=2, ignore_eos=True)
    counts = dict.fromkeys(exact, 0)
    for c in generate(spec, [prompt] * n, params):
        counts[tuple(c.token_ids[:3])] += 1
    stats = spec.speculator.stats
    assert stats.accepted_per_position[1] > 0 and 0 < stats.num_accepted_tokens < stats.num_draft_tokens
    chi2 = sum((counts[o] - n * p) ** 2 / (n * p) for o, p in exact.items())
    assert min(n * p for p in exact.values()) >= 5, "too few samples per outcome for the chi-square test"
    p_value = chi_square_sf(chi2, len(exact) - 1)
    assert p_value > 1e-4, f"chi2 {chi2:.1f} (p {p_value:.2g}): {counts} vs {exact}"


class TreeOfBoth(ScriptedProposer):
    """For the tree [[0], [0, 0], [1], [1, 0]] after a request's first token t1: both of
    the target's top-2 tokens for t2 as the two branches, each with the likeliest t3 after
    it (`branches[t1]`)."""

    def __init__(self, branches: dict[int, list[int]]):
        self.branches = branches

    def propose(self, seqs: list[Sequence], max_tokens: list[int]) -> list[list[int]]:
        return [self.branches[seq.token_ids[seq.prompt_len]][:k] if seq.num_output_tokens == 1 else []
                for seq, k in zip(seqs, max_tokens)]


def test_sampled_tokens_through_a_tree_follow_the_targets_distribution(tiny, tiny_heads):
    """As the chain's chi-square test, with a tree holding both likely second tokens, each
    with a third under it: whichever second token the target samples, a branch holds it."""
    prompt = [11, 12, 13, 14]
    base = make_engine(tiny)

    def top2(tokens):
        (c,) = generate(base, [tokens], SamplingParams(max_tokens=1, temperature=0, logprobs=2, ignore_eos=True))
        ids, lps = zip(*c.logprobs[0].top)
        z = sum(math.exp(v) for v in lps)
        return {t: math.exp(v) / z for t, v in zip(ids, lps)}

    exact: dict[tuple[int, int, int], float] = {}
    branches: dict[int, list[int]] = {}
    for t1, p1 in top2(prompt).items():
        seconds = top2(prompt + [t1])
        nodes = []
        for t2, p2 in seconds.items():
            thirds = top2(prompt + [t1, t2])
            nodes += [t2, max(thirds, key=thirds.get)]
            for t3, p3 in thirds.items():
                exact[(t1, t2, t3)] = p1 * p2 * p3
        branches[t1] = nodes
    spec = make_engine(tiny, "speculative.method=medusa", f"speculative.heads={tiny_heads['sequential']}",
                       "speculative.adaptive=false", "speculative.tree=[[0], [0, 0], [1], [1, 0]]",
                       "scheduler.max_num_seqs=256")
    spec.speculator.proposer = TreeOfBoth(branches)
    n = 3000
    params = SamplingParams(max_tokens=4, temperature=1.0, top_k=2, ignore_eos=True)
    counts = dict.fromkeys(exact, 0)
    for c in generate(spec, [prompt] * n, params):
        counts[tuple(c.token_ids[:3])] += 1
    stats = spec.speculator.stats
    assert stats.accepted_per_position[1] > 0 and 0 < stats.num_accepted_tokens < stats.num_draft_tokens
    chi2 = sum((counts[o] - n * p) ** 2 / (n * p) for o, p in exact.items())
    assert min(n * p for p in exact.values()) >= 5, "too few samples per outcome for the chi-square test"
    p_value = chi_square_sf(chi2, len(exact) - 1)
    assert p_value > 1e-4, f"chi2 {chi2:.1f} (p {p_value:.2g}): {counts} vs {exact}"


# ---------------------------------------------------------------- rollback


def test_the_cache_holds_exactly_the_accepted_tokens(tiny):
    """Step an engine with speculation and one without side by side: whenever both have
    computed the same number of tokens of a sequence, its K/V at those positions agree layer
    by layer, and it holds exactly the blocks those tokens need (rejected drafts' given back)."""
    prompts, params = PROMPTS[:3], SamplingParams(max_tokens=60, temperature=0, ignore_eos=True)
    spec, base = make_engine(tiny, *NGRAM), make_engine(tiny)
    for engine in (spec, base):
        for i, p in enumerate(prompts):
            engine.add_request(i, str(i), p, params)
    compared, rejected = 0, 0
    while spec.has_work():
        spec.step()
        rejected = spec.speculator.stats.num_draft_tokens - spec.speculator.stats.num_accepted_tokens
        for key, state in spec.requests.items():
            seq = state.seq
            other = base.requests[key].seq
            while other.num_computed < seq.num_computed:
                base.step()
            if other.num_computed != seq.num_computed:
                continue
            assert len(seq.block_ids) == -(-seq.num_computed // spec.memory.block_size)
            for (k1, v1), (k2, v2) in zip(spec.executor.runner.kv_caches, base.executor.runner.kv_caches):
                for cache1, cache2 in ((k1, k2), (v1, v2)):
                    a = gather(cache1, seq.block_ids, seq.num_computed)
                    b = gather(cache2, other.block_ids, other.num_computed)
                    torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
            compared += 1
    assert compared >= 10 and rejected > 0


def gather(cache: torch.Tensor, block_ids: list[int], n: int) -> torch.Tensor:
    """The first `n` positions of a sequence in a paged cache (blocks, block_size, heads, dim)."""
    return torch.cat([cache[b] for b in block_ids])[:n] if n else cache[:0, 0]


# ---------------------------------------------------------------- the draft model


@pytest.fixture(scope="module")
def other_draft(tmp_path_factory):
    """Another random model of the same vocabulary: it agrees with `tiny` only now and then."""
    return make_checkpoint(tmp_path_factory.mktemp("draft") / "llama", "llama", seed=2, initializer_range=0.09,
                           num_hidden_layers=1)


@pytest.mark.parametrize("which", ["itself", "other", "small-cache", "preemption"])
def test_draft_model_greedy_output_is_the_output_without_speculation(tiny, other_draft, which):
    """The model as its own draft (every greedy proposal kept), another model (some kept), a
    draft cache too small for every sequence (those it cannot hold get no proposal, and start
    over once there is room), and the model's int8 build as its draft with too few blocks for
    the model (preemption): the output of the model without speculation."""
    draft = other_draft if which in ("other", "small-cache") else tiny
    overrides = ["speculative.method=draft", f"speculative.model={draft}", "speculative.adaptive=false",
                 "speculative.num_speculative_tokens=4"]
    target = ["model.max_model_len=128", "cache.num_blocks=32", "cache.block_size=4"] if which == "preemption" else []
    if which == "small-cache":
        overrides.append("speculative.draft_memory=64KiB")
    if which == "preemption":
        overrides.append("speculative.quantization=int8")
    params = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True, logprobs=1) for n in (30, 24, 28, 20, 16)]
    want = generate(make_engine(tiny, *target), PROMPTS, params)
    spec = make_engine(tiny, *target, *overrides)
    got = generate(spec, PROMPTS, params)
    assert_same(got, want)
    stats = spec.speculator.stats
    assert stats.num_draft_tokens > 0
    if which == "itself":
        assert stats.num_accepted_tokens == stats.num_draft_tokens
    elif which != "preemption":
        assert stats.num_accepted_tokens < stats.num_draft_tokens
    if which == "preemption":
        assert spec.scheduler.num_preemptions > 0 and stats.num_accepted_tokens > 0
    proposer = spec.speculator.proposer
    if which == "small-cache":
        size = proposer.blocks.block_size
        assert proposer.blocks.num_blocks < sum(-(-(len(p) + q.max_tokens) // size) for p, q in zip(PROMPTS, params))
    assert not proposer._copies and proposer.blocks.num_free == proposer.blocks.num_blocks  # all dropped


def test_the_draft_prefill_is_not_taken_for_the_cost_of_proposing(tiny):
    """A draft model's first proposal for a sequence prefills its prompt; the policy's cost
    per position comes only from the calls that catch up a token or two, the prefill goes to
    the cost per token caught up, and the draft's backlog says beforehand what it catches up."""
    spec = make_engine(tiny, "speculative.method=draft", f"speculative.model={tiny}",
                       "speculative.adaptive=false", "speculative.num_speculative_tokens=3")
    proposer, policy = spec.speculator.proposer, spec.speculator.policy
    calls, costs = [], []
    propose, proposed = proposer.propose, policy.proposed

    def watched_propose(seqs, ks):
        fresh = [seq.seq_id not in proposer._copies for seq in seqs]
        backlog = sum(proposer.backlog(seq) for seq, k in zip(seqs, ks) if k)
        drafts = propose(seqs, ks)
        calls.append((any(fresh), proposer.caught_up == 0))
        assert proposer.caught_up == backlog
        return drafts

    def watched_proposed(seconds, positions, caught_up=0):
        costs.append(caught_up)
        proposed(seconds, positions, caught_up)

    proposer.propose, policy.proposed = watched_propose, watched_proposed
    generate(spec, PROMPTS[:1], SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))
    assert calls[0] == (True, False)  # the prompt's prefill
    assert len(calls) > 2 and all(steady for _, steady in calls[1:])  # every draft kept: 2 tokens to catch up
    assert costs[0] == len(PROMPTS[0]) + 1 - 2 and not any(costs[1:])  # the prompt and its first token
    assert policy.catch_up_cost(costs[0]) > 0 and policy.propose_seconds > 0


def test_a_draft_model_of_another_vocabulary_is_a_config_error(tiny, tmp_path):
    from meshserve.configs import load_config
    from meshserve.configs.errors import ConfigError
    from meshserve.configs.validate import check_config

    small = make_checkpoint(tmp_path / "small-vocab", "llama", vocab_size=1000)
    config = load_config(None, [f"model.path={tiny}", "speculative.method=draft", f"speculative.model={small}"])
    with pytest.raises(ConfigError, match="vocabulary of 1000 tokens, the model 49152"):
        check_config(config)
    with pytest.raises(Exception, match="needs speculative.model"):
        load_config(None, ["speculative.method=draft"])


def test_speculation_with_context_parallelism_is_a_config_error(tiny):
    from meshserve.configs import load_config
    from meshserve.configs.errors import ConfigError
    from meshserve.configs.validate import check_config

    config = load_config(None, [f"model.path={tiny}", "parallel.context=2", "speculative.method=ngram"])
    with pytest.raises(ConfigError, match="speculative.method=ngram with parallel.context=2"):
        check_config(config)
    with pytest.raises(Exception, match="prompt_lookup_min=4 exceeds"):
        load_config(None, ["speculative.prompt_lookup_min=4", "speculative.prompt_lookup_max=2"])


# ---------------------------------------------------------------- metrics and usage


def test_metrics_and_usage_count_the_drafts(tiny):
    """vLLM's spec_decode counters, the acceptance gauges and the OpenAI usage shape agree
    with the speculator's own counts and with each request's usage."""
    from meshserve.engine.serving.metrics import EngineMetrics
    from meshserve.engine.serving.openai_shapes import draft_tokens, usage_dict

    spec = make_engine(tiny, *NGRAM)
    metrics = EngineMetrics()
    metrics.attach(spec)
    got = generate(spec, PROMPTS, SamplingParams(max_tokens=40, temperature=0, ignore_eos=True))
    stats = spec.speculator.stats

    def value(name, labels=None):
        return metrics.registry.get_sample_value(name, labels or {})

    assert value("meshserve_spec_decode_num_drafts_total") == stats.num_drafts > 0
    assert value("meshserve_spec_decode_num_draft_tokens_total") == stats.num_draft_tokens
    assert value("meshserve_spec_decode_num_accepted_tokens_total") == stats.num_accepted_tokens > 0
    for pos, n in enumerate(stats.accepted_per_position):
        assert (value("meshserve_spec_decode_num_accepted_tokens_per_pos_total", {"position": str(pos)}) or 0) == n
    assert value("meshserve_spec_decode_acceptance_rate") == pytest.approx(
        stats.num_accepted_tokens / stats.num_draft_tokens)
    assert value("meshserve_spec_decode_mean_accepted_length") == pytest.approx(
        1 + stats.num_accepted_tokens / stats.num_drafts)
    assert value("meshserve_generation_tokens_total") == sum(len(c.token_ids) for c in got)
    accepted, rejected = draft_tokens(c.usage for c in got)
    assert (accepted, accepted + rejected) == (stats.num_accepted_tokens, stats.num_draft_tokens)
    assert usage_dict(10, 40, 0, (accepted, rejected))["completion_tokens_details"] == {
        "accepted_prediction_tokens": accepted, "rejected_prediction_tokens": rejected}
    assert "completion_tokens_details" not in usage_dict(10, 40, 0)
