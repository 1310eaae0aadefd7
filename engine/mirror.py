"""A rank's copy of the sequences the driver schedules, changed only by StepPlans.

Every rank applies every plan, in order, so every mirror holds the driver's token ids,
block tables and computed counts without asking it. All of a plan's bookkeeping happens
here, when it is applied: the computed counts (and, with context parallelism, which rank
holds which token) advance at once, and each chunk returned remembers where it started,
which is all the model runner needs to build its batch.

Plain Python, no torch: the scheduler's property tests (tests/unit/test_scheduler_props.py)
drive this very class, not a copy of it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from meshserve.comm.messages import SamplingParams, StepPlan
from meshserve.parallel.context import advance, chunk_owners, owned_positions

DEFERRED = -1
"""A token id the mirror holds for a deferred token (SeqDelta.deferred) until the sampling
rank writes the sampled value over it; elsewhere it stays, and only its device copy is read."""


@dataclass
class MirrorSeq:
    """A rank's copy of one sequence: what comm.messages.NewSeq carries beyond one step."""

    token_ids: list[int]
    prompt_len: int
    block_ids: list[int]
    num_computed: int
    """Tokens whose K/V are in the cache once the last applied plan has run."""
    params: SamplingParams
    local_lens: list[int] = field(default_factory=list)
    """Context parallelism: tokens each rank of the group holds (empty without it)."""
    local_positions: list[int] = field(default_factory=list)
    """Context parallelism: positions of the tokens this rank holds, ascending (empty without it)."""
    lora_slot: int = -1
    """The slot of its LoRA adapter (-1: none)."""

    @property
    def fully_computed(self) -> bool:
        """Every known token is computed: the sampling rank samples the next one."""
        return self.num_computed == len(self.token_ids)


@dataclass(frozen=True)
class ScheduledChunk:
    """One sequence's part of a step: positions [start, start + num_new)."""

    seq_id: int
    seq: MirrorSeq
    start: int
    """`seq.num_computed` before this step."""
    num_new: int
    sampled: bool
    """The chunk ends at the last known token, so the sampling rank samples after it."""
    owners: list[int] | None = None
    """Context parallelism: the rank that stores each of the chunk's tokens (None without it)."""
    held: int = 0
    """Context parallelism: tokens of the sequence this rank held before the chunk."""
    draft: list[int] = field(default_factory=list)
    """Speculative decoding: the chunk's last len(draft) tokens are these proposed ones, not
    yet the sequence's; the sampling rank samples after each of them too."""
    deferred: bool = False
    """The chunk is the one token the previous step sampled (SeqDelta.deferred): its input
    comes from the device."""

    @property
    def input_ids(self) -> list[int]:
        """The chunk's tokens: the known ones, then the drafts."""
        known = self.seq.token_ids[self.start:self.start + self.num_new - len(self.draft)]
        return known + self.draft if self.draft else known


class SequenceMirror:
    def __init__(self, cp_rank: int = 0, cp_size: int = 1, block_size: int = 16):
        """`cp_rank`, `cp_size`: this rank's place in its context-parallel group, which
        with `block_size` decides the tokens whose K/V it stores (meshserve.parallel.context)."""
        self.cp_rank, self.cp_size, self.block_size = cp_rank, cp_size, block_size
        self.seqs: dict[int, MirrorSeq] = {}

    def apply(self, plan: StepPlan) -> list[ScheduledChunk]:
        """Everything `plan` changes: forget its dropped sequences, extend the running
        ones, add the new ones, and count the step's tokens as computed. Returns the
        step's chunks in batch order (running, then new)."""
        for seq_id in plan.dropped:
            self.seqs.pop(seq_id, None)
        chunks = []
        for d in plan.running:
            seq = self.seqs[d.seq_id]
            seq.token_ids.extend(d.new_token_ids)
            if d.deferred:
                seq.token_ids.append(DEFERRED)
            if d.num_blocks >= 0:
                del seq.block_ids[d.num_blocks:]
            seq.block_ids.extend(d.new_block_ids)
            if d.num_computed >= 0:  # past what this mirror counted: drafts accepted in the last step
                seq.num_computed = d.num_computed
            chunks.append(self._compute(d.seq_id, seq, d.num_new, d.draft, d.deferred))
        for n in plan.new:
            seq = MirrorSeq(list(n.token_ids), n.prompt_len, list(n.block_ids), n.num_computed, n.params,
                            lora_slot=n.lora_slot)
            if self.cp_size > 1:  # a cached prefix lies where a fresh prefill would have put it
                owners = chunk_owners(0, n.num_computed, self.cp_size, self.block_size)
                seq.local_lens = advance([0] * self.cp_size, owners)
                seq.local_positions = owned_positions(0, owners, self.cp_rank)
            self.seqs[n.seq_id] = seq
            chunks.append(self._compute(n.seq_id, seq, n.num_new, n.draft))
        return chunks

    def _compute(self, seq_id: int, seq: MirrorSeq, num_new: int, draft: list[int],
                 deferred: bool = False) -> ScheduledChunk:
        start = seq.num_computed
        owners, held = None, 0
        if self.cp_size > 1:  # (speculative decoding is refused with context parallelism)
            owners = chunk_owners(start, num_new, self.cp_size, self.block_size)
            held = seq.local_lens[self.cp_rank]
            seq.local_positions.extend(owned_positions(start, owners, self.cp_rank))
            seq.local_lens = advance(seq.local_lens, owners)
        seq.num_computed = start + num_new - len(draft)  # the drafts count once they are accepted
        return ScheduledChunk(seq_id, seq, start, num_new, seq.fully_computed, owners, held, list(draft), deferred)

    def sampled_after(self, plan: StepPlan) -> list[tuple[int, SamplingParams, int]]:
        """(seq_id, params, drafts verified) of the sequences of `plan`, the last plan
        applied, that the sampling rank samples, in batch order (the chunks `apply` marked
        `sampled`)."""
        ids = [(d.seq_id, len(d.draft)) for d in plan.running] + [(n.seq_id, len(n.draft)) for n in plan.new]
        return [(i, self.seqs[i].params, k) for i, k in ids if self.seqs[i].fully_computed]

