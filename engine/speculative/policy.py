"""How many tokens each sequence drafts in a step, so that speculation never slows serving.

A step's time grows with its tokens: t = a + b * T (a: reading the weights and the fixed
costs, b: each token's compute). Proposing costs c per position (a draft model's forward,
shared by the B decoding sequences; nearly nothing for n-gram lookup). A draft token that
is accepted with probability q adds q output tokens for b + c / B seconds, which raises
throughput (B tokens per a + b * B seconds) while q > (b * B + c) / (a + b * B): small while
steps are bound by reading the weights and proposals are cheap (one stream, n-gram: draft
eagerly), close to 1 once steps are bound by compute (a large batch: only drafts that are
nearly sure) or when proposing costs about a step (a draft model as slow as the model). A
sequence's j-th draft is kept with probability about alpha^j, alpha its acceptance rate so
far, so it drafts the largest k with alpha^k above the threshold.

A sequence that drafts nothing tries one token now and then (a probe), in case its text
turned predictable. A probe costs the target one more token, the proposer one position and,
for a proposer that keeps state (a draft model's KV cache), catching up on every token the
sequence made since it last proposed for it, or prefilling its whole prompt: as much as a
few steps. So probes draw on a credit that every step adds PROBE_BUDGET of its time to:
however unpredictable the traffic, probing costs at most that share of the time. Likewise a
sequence that would draft but must first be caught up (new to a draft model) drafts only if
its expected saving over its remaining tokens pays the catch-up back.

`StepCost` fits a and b to the recent steps' (tokens, seconds); `DraftPolicy` keeps the
proposer's costs (per position, and per token caught up, by the size of the catch-up: a
draft's forward over a few rows and over hundreds can take different kernels, several
times apart per token), each sequence's acceptance (a running count that forgets, from a
prior), the probe credit, and picks k.
"""

from __future__ import annotations

from collections import deque

from meshserve.engine.sequence import Sequence

WINDOW = 64
"""Steps the cost fit looks back over."""
PRIOR_TOKEN_SHARE = 0.05
"""b / a before the fit has seen steps of different sizes: the share of a step that one more
token is assumed to cost."""
PRIOR_ACCEPTANCE, PRIOR_WEIGHT = 0.6, 1.0
"""The acceptance assumed before anything is verified, worth this many drafts. A sequence
starts from the acceptance of the sequences before it that sample as it does (greedy, or
at a temperature: all their verified drafts, forgetting slowly: GLOBAL_FORGET per draft),
worth PRIOR_WEIGHT drafts. Greedy and sampled sequences keep apart: a proposal is kept with
the target's probability of it when sampling, always when it is the target's argmax when
greedy, so greedy acceptance overstates what a sampled sequence can expect, and a draft
model's first proposal for a sequence costs a prefill of its prompt."""
GLOBAL_FORGET = 0.99
FORGET = 0.9
"""Per verified step, the weight left on a sequence's older acceptance counts (about the
last 10 steps count; a sequence that never has a draft accepted falls to an acceptance of
prior * PRIOR_WEIGHT / 11, at most 0.09)."""
PROBE_EVERY, PROBE_MAX = 16, 512
"""A sequence that drafts nothing (its acceptance too low) tries one token after this many
steps; each probe that fails doubles the wait (up to PROBE_MAX), one that is kept resets it;
PROBE_MAX while proposing costs more than it could ever save."""
COST_WEIGHT = 0.2
"""Weight of the latest measurement in the proposer's costs (running means)."""
PROBE_BUDGET, CREDIT_STEPS = 0.01, 2048
"""Probes may cost this share of the time spent in steps; unspent credit is kept up to this
many (mean) steps' worth."""
STEP_FORGET = 0.9995
"""Per step, the weight left on the acceptance of earlier sequences: while nothing is
verified (no sequence found drafting worth it), the prior new sequences start from drifts
back to PRIOR_ACCEPTANCE over several thousand steps, so that a server does not stop drafting
for good after a stretch of unpredictable traffic."""


class StepCost:
    """t = a + b * T over the last WINDOW steps, by least squares."""

    def __init__(self) -> None:
        self._steps: deque[tuple[int, float]] = deque(maxlen=WINDOW)

    def add(self, num_tokens: int, seconds: float) -> None:
        if num_tokens > 0 and seconds > 0:
            self._steps.append((num_tokens, seconds))

    def fit(self) -> tuple[float, float] | None:
        """(a, b), or None before the steps vary in size (or if they say nothing sensible)."""
        n = len(self._steps)
        if n < 4:
            return None
        mean_t = sum(t for t, _ in self._steps) / n
        mean_s = sum(s for _, s in self._steps) / n
        var = sum((t - mean_t) ** 2 for t, _ in self._steps)
        if var < n * 0.25:  # every step the same size: the slope is unknown
            return None
        b = sum((t - mean_t) * (s - mean_s) for t, s in self._steps) / var
        a = mean_s - b * mean_t
        if b <= 0 or a <= 0:
            return None
        return a, b

    def line(self) -> tuple[float, float] | None:
        """(a, b) from the fit or, before the steps vary in size, from the mean step with one
        more token taken to cost PRIOR_TOKEN_SHARE of a step; None before any step."""
        fit = self.fit()
        if fit is not None or not self._steps:
            return fit
        mean_t = sum(t for t, _ in self._steps) / len(self._steps)
        mean_s = sum(s for _, s in self._steps) / len(self._steps)
        a = mean_s / (1.0 + PRIOR_TOKEN_SHARE * mean_t)
        return a, PRIOR_TOKEN_SHARE * a

    def per_token(self) -> float:
        """The cost of one more token in a step (0 before any step)."""
        line = self.line()
        return 0.0 if line is None else line[1]

    def threshold(self, batch: int, propose_seconds: float = 0.0) -> float:
        """The acceptance probability a draft token needs to pay for itself at `batch`
        decoding sequences, proposing costing `propose_seconds` per position."""
        return threshold(self.line(), batch, propose_seconds)


def threshold(line: tuple[float, float] | None, batch: int, propose_seconds: float) -> float:
    """StepCost.threshold for the step-time line (a, b) already worked out."""
    if line is None:
        return PRIOR_TOKEN_SHARE * batch / (1.0 + PRIOR_TOKEN_SHARE * batch)
    a, b = line
    return (b * batch + propose_seconds) / (a + b * batch)


class DraftPolicy:
    def __init__(self, max_tokens: int, adaptive: bool = True):
        self.max_tokens = max_tokens
        self.adaptive = adaptive
        self.cost = StepCost()
        self.propose_seconds = 0.0
        """The proposer's running cost per proposed position."""
        self._catch_up: dict[int, float] = {}
        """The proposer's running cost per token caught up on (Proposer.caught_up), by the
        catch-up's size class (its tokens' bit length: 1, 2-3, 4-7, ...)."""
        self.credit = 0.0
        """Seconds that probes may still spend."""
        self._mean_step = 0.0
        self._accepted: dict[int, float] = {}
        self._tried: dict[int, float] = {}
        self._idle: dict[int, int] = {}
        self._probe_gap: dict[int, int] = {}
        self._probing: set[int] = set()
        self._greedy: dict[int, bool] = {}
        self._all = {True: [0.0, 0.0], False: [0.0, 0.0]}
        """Greedy or not: the accepted and decided positions of all sequences' drafts."""

    def acceptance(self, seq_id: int, greedy: bool = True) -> float:
        """The chance that a sequence's next draft token is kept, given the one before was
        (`greedy`: how a sequence not seen yet samples)."""
        all_accepted, all_tried = self._all[self._greedy.get(seq_id, greedy)]
        prior = (all_accepted + PRIOR_ACCEPTANCE * PRIOR_WEIGHT) / (all_tried + PRIOR_WEIGHT)
        tried = self._tried.get(seq_id, 0.0)
        return (self._accepted.get(seq_id, 0.0) + prior * PRIOR_WEIGHT) / (tried + PRIOR_WEIGHT)

    def sizes(self, seqs: list[Sequence], batch: int, backlogs: list[int] | None = None) -> list[int]:
        """How many tokens each of `seqs` drafts in a step of `batch` decoding sequences;
        `backlogs`: the tokens the proposer would catch up on for each (Proposer.backlog)."""
        if not self.adaptive or not seqs:
            return [self.max_tokens] * len(seqs)
        line = self.cost.line()  # one fit per step: the threshold, a probe's cost and a token's time
        theta = threshold(line, batch, self.propose_seconds)
        probe = (0.0 if line is None else line[1]) + self.propose_seconds
        token_seconds = 0.0 if line is None else (line[0] + line[1] * batch) / batch
        for seq in seqs:
            self._greedy[seq.seq_id] = seq.params.greedy
        return [self._size(seq, theta, token_seconds, self.catch_up_cost(backlog), probe)
                for seq, backlog in zip(seqs, backlogs or [0] * len(seqs))]

    def num_tokens(self, seq: Sequence, batch: int, backlog: int = 0) -> int:
        return self.sizes([seq], batch, [backlog])[0]

    def _size(self, seq: Sequence, theta: float, token_seconds: float, catch_up: float, probe: float) -> int:
        """k for `seq`: the drafts that pay at threshold `theta`, where a token of the step
        takes `token_seconds` and the proposer must first catch up for `catch_up` seconds
        (then drafting must pay that back over the sequence's remaining tokens, else the
        sequence waits for a probe, which costs `probe` seconds besides)."""
        seq_id = seq.seq_id
        alpha = self.acceptance(seq_id)
        k, p, surplus = 0, alpha, 0.0
        while k < self.max_tokens and p > theta:
            k += 1
            surplus += p - theta  # tokens gained, less what proposing and verifying them costs
            p *= alpha
        if k and catch_up > 0:
            steps = (seq.params.max_tokens - seq.num_output_tokens) / (1.0 + surplus + k * theta)
            if surplus * token_seconds * steps < catch_up:
                k = 0
        if k == 0:
            idle = self._idle.get(seq_id, 0) + 1
            self._idle[seq_id] = idle
            # Proposing that costs more than a step per position cannot pay whatever the
            # acceptance: only the longest wait, to measure the proposer again.
            due = idle >= (PROBE_MAX if theta >= 1.0 else self._probe_gap.get(seq_id, PROBE_EVERY))
            if due and probe + catch_up <= self.credit:  # else it waits for the credit
                self.credit -= probe + catch_up
                self._idle[seq_id] = 0
                self._probing.add(seq_id)
                k = 1
        return k

    def catch_up_cost(self, tokens: int) -> float:
        """What catching the proposer up on `tokens` tokens costs: at the per-token cost seen
        for catch-ups of that size class, else of the nearest class seen (0 before any)."""
        if tokens <= 0 or not self._catch_up:
            return 0.0
        size = tokens.bit_length()
        nearest = min(self._catch_up, key=lambda c: (abs(c - size), c))  # a tie: the smaller, dearer per token
        return self._catch_up[nearest] * tokens

    def proposed(self, seconds: float, positions: int, caught_up: int = 0) -> None:
        """The proposer took `seconds` for drafts of up to `positions` tokens, having caught
        up on `caught_up` tokens first (Proposer.caught_up)."""
        if caught_up > 0:
            per = max(0.0, seconds - positions * self.propose_seconds) / caught_up
            size = caught_up.bit_length()
            self._catch_up[size] = _running(self._catch_up.get(size, 0.0), per)
        elif positions > 0:
            self.propose_seconds = _running(self.propose_seconds, seconds / positions)

    def step(self, num_tokens: int, seconds: float, proposing: float = 0.0) -> None:
        """A step of `num_tokens` took the model `seconds`, after `proposing` seconds of
        drafts: the cost fit, the probe credit and the forgetting of old acceptance."""
        self.cost.add(num_tokens, seconds)
        total = seconds + proposing
        self._mean_step = _running(self._mean_step, total)
        self.credit = min(self.credit + PROBE_BUDGET * total, PROBE_BUDGET * CREDIT_STEPS * self._mean_step)
        for counts in self._all.values():
            counts[0] *= STEP_FORGET
            counts[1] *= STEP_FORGET

    def verified(self, seq_id: int, drafted: int, accepted: int) -> None:
        """`seq_id` kept `accepted` of the `drafted` tokens it proposed in a step."""
        tried = accepted + (1 if accepted < drafted else 0)  # positions that were decided
        self._accepted[seq_id] = self._accepted.get(seq_id, 0.0) * FORGET + accepted
        self._tried[seq_id] = self._tried.get(seq_id, 0.0) * FORGET + tried
        counts = self._all[self._greedy.get(seq_id, True)]
        counts[0] = counts[0] * GLOBAL_FORGET + accepted
        counts[1] = counts[1] * GLOBAL_FORGET + tried
        if seq_id in self._probing:
            self._probing.discard(seq_id)
            gap = self._probe_gap.get(seq_id, PROBE_EVERY)
            self._probe_gap[seq_id] = PROBE_EVERY if accepted else min(2 * gap, PROBE_MAX)

    def drop(self, seq_id: int) -> None:
        for d in (self._accepted, self._tried, self._idle, self._probe_gap, self._greedy):
            d.pop(seq_id, None)
        self._probing.discard(seq_id)


def _running(mean: float, value: float) -> float:
    """A running mean that starts at its first value."""
    return mean + COST_WEIGHT * (value - mean) if mean else value
