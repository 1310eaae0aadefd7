"""A step's result as the sampling rank leaves it: tokens still on the device, read on the
host only when the driver asks (overlapped steps read them while the next step runs)."""

from __future__ import annotations

from meshserve.comm.messages import PromptLogprobs, StepResult
from meshserve.layers.sampler import SampledRows


class PendingResult:
    def __init__(self, step_id: int, seq_ids: list[int], sampled: SampledRows,
                 prompt_logprobs: list[PromptLogprobs] | None = None, proposals: list[list[int]] | None = None):
        """`sampled`: one row per sequence of `seq_ids` (no drafts: those are verified on the
        host at once). Its copy to the host starts now, behind the step. `proposals`: as
        StepResult's."""
        self.step_id, self.seq_ids, self.sampled, self.prompt_logprobs = step_id, seq_ids, sampled, prompt_logprobs
        self.proposals = proposals
        sampled.start_copy()
        self._result: StepResult | None = None

    def resolve(self) -> StepResult:
        """The StepResult, read once (waiting for the step's sampling, not for later steps)."""
        if self._result is None:
            tokens, logprobs = self.sampled.to_lists()
            self._result = StepResult(self.step_id, self.seq_ids, tokens, logprobs, self.prompt_logprobs,
                                      proposals=self.proposals)
        return self._result


def resolved(result: StepResult | PendingResult | None) -> StepResult | None:
    """`result` on the host."""
    return result.resolve() if isinstance(result, PendingResult) else result
