"""The driver's side of speculative decoding: drafts for the decoding sequences before a
step is scheduled, and the counts after it is verified."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from meshserve.engine.speculative.tree import TreeShape
from meshserve.engine.sequence import Sequence
from meshserve.engine.speculative.policy import DraftPolicy
from meshserve.engine.speculative.proposer import Proposer


@dataclass
class SpecStats:
    """vLLM's spec_decode counters."""

    num_drafts: int = 0
    """Sequence-steps that verified at least one draft token."""
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)
    """Of the drafts, how many kept their first, second, ... token."""

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Tokens per verified draft: its accepted tokens plus the one sampled after them."""
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0


class Speculator:
    def __init__(self, proposer: Proposer, policy: DraftPolicy, max_model_len: int,
                 tree: TreeShape | None = None):
        """`tree`: the heads' candidate tree (speculative.tree): a draft of k tokens is its
        first k nodes; None: drafts are chains."""
        self.proposer, self.policy, self.max_model_len = proposer, policy, max_model_len
        self.tree = tree
        self.chain = tree.chain_length if tree is not None else policy.max_tokens
        """The most drafts that still form a chain (a constrained sequence's drafts do)."""
        self.stats = SpecStats(accepted_per_position=[0] * policy.max_tokens)
        self._draft_seconds = 0.0

    def draft(self, seqs: list[Sequence]) -> None:
        """Set `draft` of each of `seqs` (running sequences with one token to compute, in the
        coming step together)."""
        ks = [max(0, min(k, seq.params.max_tokens - seq.num_output_tokens - 1,  # the token after the drafts counts too
                         self.max_model_len - seq.num_tokens))
              for seq, k in zip(seqs, self.policy.sizes(seqs, len(seqs), [self.proposer.backlog(s) for s in seqs]))]
        if not any(ks):
            drafts = [[]] * len(seqs)
        else:
            start = time.perf_counter()
            drafts = self.proposer.propose(seqs, ks)
            seconds = time.perf_counter() - start
            self._draft_seconds += seconds
            self.policy.proposed(seconds, max(map(len, drafts)), self.proposer.caught_up)
        for seq, draft in zip(seqs, drafts):
            seq.draft = draft

    def received(self, seq: Sequence, guesses: list[int]) -> None:
        """The target's step returned proposals for `seq` (Medusa heads: HeadsProposer)."""
        self.proposer.received(seq, guesses)

    def verified(self, seq: Sequence, drafted: int, accepted: int) -> None:
        seq.num_draft_tokens += drafted
        seq.num_accepted_tokens += accepted
        self.policy.verified(seq.seq_id, drafted, accepted)
        self.stats.num_drafts += 1
        self.stats.num_draft_tokens += drafted
        self.stats.num_accepted_tokens += accepted
        for j in range(accepted):
            self.stats.accepted_per_position[j] += 1

    def step_done(self, num_tokens: int, seconds: float) -> None:
        """A step of `num_tokens` took `seconds`, the proposing before it included: the model's
        share goes to the step-cost fit (the proposer's is counted apart)."""
        self.policy.step(num_tokens, seconds - self._draft_seconds, self._draft_seconds)
        self._draft_seconds = 0.0

    def drop(self, seq_id: int) -> None:
        self.proposer.drop(seq_id)
        self.policy.drop(seq_id)
