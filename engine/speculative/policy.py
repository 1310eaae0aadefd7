"""How many tokens each sequence drafts in a step, so that speculation never slows serving.

A step's time grows with its tokens: t = a + b * T (a: reading the weights and the fixed
costs, b: each token's compute). A draft token that is accepted with probability q adds q
output tokens for b seconds, which raises throughput while q > b * out / t, the share of the
step's time one more token costs relative to what a token yields now. With B decoding
sequences that threshold is b * B / (a + b * B): small while steps are bound by reading the
weights (one stream: draft eagerly), close to 1 once they are bound by compute (a large
batch: only drafts that are nearly sure). A sequence's j-th draft is kept with probability
about alpha^j, alpha its acceptance rate so far, so it drafts the largest k with alpha^k
above the threshold.

`StepCost` fits a and b to the recent steps' (tokens, seconds); `DraftPolicy` keeps each
sequence's acceptance (a running count that forgets, from a prior) and picks k.
"""

from __future__ import annotations

from collections import deque

from meshserve.engine.sequence import Sequence

WINDOW = 64
"""Steps the cost fit looks back over."""
PRIOR_TOKEN_SHARE = 0.05
"""b / a before the fit has seen steps of different sizes: one more token costs 5% of a step."""
PRIOR_ACCEPTANCE, PRIOR_WEIGHT = 0.6, 1.0
"""A sequence's acceptance before it has verified anything, worth this many drafts."""
FORGET = 0.9
"""Per verified step, the weight left on a sequence's older acceptance counts (about the
last 10 steps count; a sequence that never has a draft accepted falls to an acceptance of
PRIOR_ACCEPTANCE * PRIOR_WEIGHT / 11 = 0.055)."""
PROBE_EVERY = 16
"""A sequence that drafts nothing (its acceptance too low) tries one token this often."""


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

    def threshold(self, batch: int) -> float:
        """The acceptance probability a draft token needs to pay for itself at `batch`
        decoding sequences."""
        fit = self.fit()
        a, b = fit if fit is not None else (1.0, PRIOR_TOKEN_SHARE)
        return b * batch / (a + b * batch)


class DraftPolicy:
    def __init__(self, max_tokens: int, adaptive: bool = True):
        self.max_tokens = max_tokens
        self.adaptive = adaptive
        self.cost = StepCost()
        self._accepted: dict[int, float] = {}
        self._tried: dict[int, float] = {}
        self._idle: dict[int, int] = {}

    def acceptance(self, seq_id: int) -> float:
        """The chance that a sequence's next draft token is kept, given the one before was."""
        tried = self._tried.get(seq_id, 0.0)
        return (self._accepted.get(seq_id, 0.0) + PRIOR_ACCEPTANCE * PRIOR_WEIGHT) / (tried + PRIOR_WEIGHT)

    def num_tokens(self, seq: Sequence, batch: int) -> int:
        """How many tokens `seq` drafts in a step of `batch` decoding sequences."""
        if not self.adaptive:
            return self.max_tokens
        alpha, theta = self.acceptance(seq.seq_id), self.cost.threshold(batch)
        k, p = 0, alpha
        while k < self.max_tokens and p > theta:
            k += 1
            p *= alpha
        if k == 0:
            idle = self._idle.get(seq.seq_id, 0) + 1
            self._idle[seq.seq_id] = idle
            if idle % PROBE_EVERY == 0:
                k = 1
        return k

    def verified(self, seq_id: int, drafted: int, accepted: int) -> None:
        """`seq_id` kept `accepted` of the `drafted` tokens it proposed in a step."""
        tried = accepted + (1 if accepted < drafted else 0)  # positions that were decided
        self._accepted[seq_id] = self._accepted.get(seq_id, 0.0) * FORGET + accepted
        self._tried[seq_id] = self._tried.get(seq_id, 0.0) * FORGET + tried

    def drop(self, seq_id: int) -> None:
        for d in (self._accepted, self._tried, self._idle):
            d.pop(seq_id, None)
