"""Proposals from a draft model: a small checkpoint with the target's tokenizer (or the
target's own weights, quantized), run greedily on the driver, in its own small KV cache.

Where it runs: on the driver (global rank 0), whole (no tensor or pipeline split), between
the target's steps. The draft is a fraction of the target's cost, so the other ranks' wait
for it is short; with pipeline micro-batches, the drafts of one micro-batch are made while
the others are in flight on the later stages.

Each step, for the sequences that ask: one batched forward catches the draft's cache up
with the sequence (its tokens since the draft last saw it: the accepted proposals and the
target's own token, or the whole prompt the first time) and proposes the first token; each
further forward proposes one more, for the sequences that want it. The draft keeps a copy
of every sequence it proposes for (its tokens, blocks and computed count, in a
BlockManager of its own); what the target rejected is cut off the copy before the next
round, its blocks given back. The rounds run through the same ModelRunner as any rank's
steps, driven with StepPlans that send every sequence whole (in-process, so nothing is
encoded).
"""

from __future__ import annotations

from meshserve.comm.messages import NewSeq, SamplingParams, SeqDelta, StepPlan
from meshserve.engine.block_manager import BlockManager
from meshserve.engine.model_runner import ModelRunner
from meshserve.engine.sequence import Sequence

GREEDY = SamplingParams(max_tokens=1, temperature=0.0)
STEADY_CATCH_UP = 2
"""Tokens a copy computes before its first proposal in a step like any other: the last
proposal (which the draft never ran) and the target's token after the accepted ones. More
is a prefill (a new or preempted sequence, or one the draft cache had dropped)."""


class DraftModelProposer:
    def __init__(self, runner: ModelRunner):
        self.runner = runner
        memory = runner.memory
        self.blocks = BlockManager(memory.num_blocks, memory.block_size)
        self._copies: dict[int, Sequence] = {}
        self._synced: dict[int, int] = {}
        """Tokens of each sequence the copy shared with it when last caught up."""
        self._dropped: list[int] = []
        self._step = 0
        self.caught_up = 0
        """Tokens the copies computed in the last `propose` beyond STEADY_CATCH_UP each."""

    def propose(self, seqs: list[Sequence], max_tokens: list[int]) -> list[list[int]]:
        wanted = [(seq, k) for seq, k in zip(seqs, max_tokens) if k > 0]
        copies = [(c, k) for c, k in ((self._catch_up(seq), k) for seq, k in wanted) if c is not None]
        self.caught_up = sum(max(0, c.num_uncomputed - STEADY_CATCH_UP) for c, _ in copies)
        drafts: dict[int, list[int]] = {c.seq_id: [] for c, _ in copies}
        for round_ in range(max((k for _, k in copies), default=0)):
            batch = [c for c, k in copies if k > round_ and len(drafts[c.seq_id]) == round_ and self._room(c)]
            if not batch:
                break
            for copy, token in zip(batch, self._forward(batch, whole=round_ == 0)):
                copy.token_ids.append(token)
                drafts[copy.seq_id].append(token)
        return [drafts.get(seq.seq_id, []) for seq in seqs]

    def backlog(self, seq: Sequence) -> int:
        copy = self._copies.get(seq.seq_id)
        computed = 0 if copy is None else min(copy.num_computed, self._shared(copy, seq), seq.num_tokens - 1)
        return max(0, seq.num_tokens - computed - STEADY_CATCH_UP)

    def drop(self, seq_id: int) -> None:
        copy = self._copies.pop(seq_id, None)
        self._synced.pop(seq_id, None)
        if copy is not None:
            self.blocks.release(copy)
            self._dropped.append(seq_id)

    def _catch_up(self, seq: Sequence) -> Sequence | None:
        """The draft's copy of `seq`, cut back to what it shares with it (the proposals the
        target rejected go) and extended with its new tokens; None if the draft cache cannot
        hold it (then it gets no proposal this step)."""
        copy = self._copies.get(seq.seq_id)
        if copy is None:
            copy = Sequence(seq.seq_id, seq.key, [], seq.prompt_len, GREEDY)
            self._copies[seq.seq_id] = copy
        shared, tokens = self._shared(copy, seq), seq.token_ids
        del copy.token_ids[shared:]
        copy.token_ids.extend(tokens[shared:])
        self._synced[seq.seq_id] = len(tokens)
        # At least the last token is computed again: its logits propose the first draft (a
        # sequence proposed for but then not scheduled comes back with no new token).
        keep = min(shared, len(tokens) - 1)
        if copy.num_computed > keep:
            copy.num_computed = keep
            self.blocks.trim(copy)
        return copy if self._room(copy) else None

    def _shared(self, copy: Sequence, seq: Sequence) -> int:
        """How many leading tokens `copy` and `seq` have in common."""
        shared = self._synced.get(seq.seq_id, 0)  # tokens both had then are still the same
        tokens = seq.token_ids
        while shared < min(len(copy.token_ids), len(tokens)) and copy.token_ids[shared] == tokens[shared]:
            shared += 1
        return shared

    def _room(self, copy: Sequence) -> bool:
        """Grow `copy`'s blocks for its uncomputed tokens; if the cache is full, drop its state
        (it starts over from its prompt next time) and say no."""
        n = copy.num_uncomputed
        if self.blocks.can_grow(copy, n):
            self.blocks.grow(copy, n)
            return True
        self.drop(copy.seq_id)
        return False

    def _forward(self, copies: list[Sequence], whole: bool) -> list[int]:
        """One forward of the draft over every copy's uncomputed tokens; the greedy token
        after each. `whole`: the first round of a step sends each copy whole (the runner's
        mirror may hold proposals the target rejected); later rounds send the token added."""
        if whole:
            new = [NewSeq(c.seq_id, c.token_ids, c.prompt_len, c.block_ids, c.num_computed, c.num_uncomputed, GREEDY)
                   for c in copies]
            plan = StepPlan(self._step, [], new, self._dropped)
        else:
            running = [SeqDelta(c.seq_id, c.token_ids[-1:], c.block_ids[c.sent_blocks:], 1, c.num_computed,
                                c.sent_blocks) for c in copies]
            plan = StepPlan(self._step, running, [], self._dropped)
        result = self.runner.execute(plan)
        self._step += 1
        self._dropped = []
        for c in copies:
            c.num_computed = c.num_tokens
            c.sent_blocks = len(c.block_ids)
        tokens = dict(zip(result.seq_ids, result.token_ids))
        return [tokens[c.seq_id] for c in copies]
