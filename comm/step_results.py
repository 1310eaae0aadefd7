"""What the driver accepts as the answer to a step: the StepResult the sampling rank would
send for the plan the driver published, in shape.

The driver runs every plan on its own mirror of the sequences too, so it knows which of
them the sampling rank samples (those whose known tokens are all computed after the step,
in batch order) and how many top logprobs each asked for. A result that claims a step not
in flight, or names other sequences, or carries the wrong number of tokens, tokens outside
the vocabulary or logprobs of the wrong shape, is not from the sampling rank: the driver
drops it (comm/control.py) instead of letting it reach the scheduler.
"""

from __future__ import annotations

from dataclasses import dataclass

from meshserve.comm.messages import StepResult, TokenLogprob


@dataclass(frozen=True)
class ExpectedResult:
    step_id: int
    seq_ids: tuple[int, ...]
    """The sequences the sampling rank samples in this step, in batch order."""
    num_logprobs: tuple[int | None, ...]
    """Per sequence: the top logprobs it asked for (SamplingParams.logprobs), None for none."""
    vocab_size: int
    num_drafts: tuple[int, ...] = ()
    """Per sequence: the draft tokens it verifies (speculative decoding); empty: none does."""

    def problem(self, result: StepResult) -> str | None:
        """Why `result` cannot be the sampling rank's answer to this step, or None if it can."""
        if result.step_id != self.step_id:
            return f"step {result.step_id}, not {self.step_id}"
        if tuple(result.seq_ids) != self.seq_ids:
            return f"sequences {_few(result.seq_ids)}, but step {self.step_id} samples {_few(self.seq_ids)}"
        problem = self._counts_problem(result)
        if problem is not None:
            return problem
        outside = [t for t in result.token_ids if not 0 <= t < self.vocab_size]
        if outside:
            return f"token ids {_few(outside)} outside the vocabulary of {self.vocab_size}"
        return self._logprobs_problem(result)

    def _counts_problem(self, result: StepResult) -> str | None:
        if result.counts is None:
            if len(result.token_ids) != len(self.seq_ids):
                return f"{len(result.token_ids)} tokens for {len(self.seq_ids)} sequences"
            return None
        if not any(self.num_drafts):
            return "token counts, but no sequence verifies a draft"
        if len(result.counts) != len(self.seq_ids):
            return f"{len(result.counts)} token counts for {len(self.seq_ids)} sequences"
        for seq_id, n, drafts in zip(self.seq_ids, result.counts, self.num_drafts):
            if not 1 <= n <= drafts + 1:
                return f"sequence {seq_id}: {n} tokens after verifying {drafts} drafts"
        if len(result.token_ids) != sum(result.counts):
            return f"{len(result.token_ids)} tokens, but the counts add up to {sum(result.counts)}"
        return None

    def _logprobs_problem(self, result: StepResult) -> str | None:
        wanted = any(n is not None for n in self.num_logprobs)
        if result.logprobs is None:
            return "no logprobs, which a sequence asked for" if wanted else None
        if not wanted:
            return "logprobs no sequence asked for"
        if len(result.logprobs) != len(result.token_ids):
            return f"{len(result.logprobs)} logprobs for {len(result.token_ids)} tokens"
        for (seq_id, tokens, lps), n in zip(result.per_sequence(), self.num_logprobs):
            for token, lp in zip(tokens, lps):
                problem = self._logprob_problem(seq_id, token, n, lp)
                if problem is not None:
                    return problem
        return None

    def _logprob_problem(self, seq_id: int, token: int, n: int | None, lp: TokenLogprob | None) -> str | None:
        if (lp is None) != (n is None):
            return f"sequence {seq_id}: logprobs {'missing' if lp is None else 'it did not ask for'}"
        if lp is None:
            return None
        if lp.token_id != token or len(lp.top) != n:
            return f"sequence {seq_id}: logprobs of token {lp.token_id} with {len(lp.top)} alternatives, " \
                   f"not of token {token} with {n}"
        if any(not 0 <= t < self.vocab_size for t, _ in lp.top):
            return f"sequence {seq_id}: top logprobs name tokens outside the vocabulary of {self.vocab_size}"
        return None


def _few(ids, n: int = 8) -> str:
    ids = list(ids)
    return str(ids) if len(ids) <= n else f"[{', '.join(map(str, ids[:n]))}, ... ({len(ids)} in all)]"
