"""Scheduled batch -> StepPlan: new sequences in full, known ones as deltas.

The driver remembers, per sequence, how many tokens and blocks the ranks hold; a
sequence the ranks do not know (new, or resumed after preemption) is sent whole. A delta
also carries the driver's computed count and how much of the block table the ranks keep:
after a speculative step, the drafts the target accepted count as computed and the blocks
only rejected drafts used are gone (meshserve.engine.speculative).
"""

from __future__ import annotations

from meshserve.comm.messages import KvOps, NewSeq, SeqDelta, StepPlan, TokenMasks
from meshserve.engine.scheduler import ScheduledBatch
from meshserve.engine.sequence import Sequence


class PlanBuilder:
    def __init__(self) -> None:
        self._step_id = 0
        self._dropped: list[int] = []

    def forget(self, seq: Sequence) -> None:
        """The ranks must drop `seq` (finished, aborted or preempted) before the next step."""
        if seq.sent_tokens:
            self._dropped.append(seq.seq_id)
        seq.sent_tokens = seq.sent_blocks = 0

    def build(self, batch: ScheduledBatch, masks: TokenMasks | None = None, kv: KvOps | None = None) -> StepPlan:
        """Call `forget` for the batch's preempted sequences first. `masks`: the grammar masks
        of the constrained sequences the step samples. `kv`: the KV transfers it starts,
        lands or ends (engine/handoff.py)."""
        running: list[SeqDelta] = []
        new: list[NewSeq] = []
        for seq, n in zip(batch.seqs, batch.num_new):
            if seq.sent_tokens:
                # sent_blocks: fewer than the ranks hold if rejected drafts gave blocks back (Scheduler.update)
                running.append(SeqDelta(seq.seq_id, seq.token_ids[seq.sent_tokens:], seq.block_ids[seq.sent_blocks:],
                                        n, seq.num_computed, seq.sent_blocks, list(seq.draft),
                                        deferred=seq.num_pending > 0))
            else:
                assert not seq.num_pending, f"seq {seq.seq_id}: a token pending, but the ranks do not know it"
                new.append(NewSeq(seq.seq_id, list(seq.token_ids), seq.prompt_len, list(seq.block_ids),
                                  seq.num_computed, n, seq.params, list(seq.draft), seq.lora_slot))
            # a deferred token is the ranks' already: its value, once known here, is not sent
            seq.sent_tokens, seq.sent_blocks = seq.num_tokens + seq.num_pending, len(seq.block_ids)
        plan = StepPlan(self._step_id, running, new, self._dropped, masks, kv, batch.lora_loads)
        self._step_id += 1
        self._dropped = []
        return plan
