"""Continuous batching at iteration level. Plain Python: no torch.

There is no prefill phase: each step gives every scheduled sequence a number of new
tokens to compute (its whole uncomputed tail, or a chunk of it when the token budget
runs short), so chunked prefill and mixed prefill + decode steps need no special path.

Order is first-come first-served (scheduler.policy fcfs): running sequences first, in
admission order, then waiting ones. A waiting sequence starts from the longest prefix of its
blocks found in the prefix cache (meshserve.engine.block_manager), which costs no token
budget. When blocks run out, the most recently admitted running sequence is preempted by
recompute: its blocks are freed and it returns to the front of the waiting queue with its
tokens kept, to be prefilled again later.

With scheduler.policy priority, the waiting queue is ordered by each request's `priority`
(lower first, as vLLM's) aged by its wait: a request gains one level per
scheduler.priority_aging seconds waited, so its rank is priority + arrival / aging, fixed
once it arrives. That bounds starvation: a request is never overtaken, nor preempted, by one
that arrived more than (its priority - the other's) x priority_aging seconds after it. When
the best waiting request cannot be admitted (no blocks, or max_num_seqs running), running
requests of a worse rank are preempted for it, the worst first; a preempted request waits
in its own place in that order.

Background requests (the Batch API's, Sequence.background) form a class below every online
request under either policy: they wait behind every online request, they get a step's tokens
after the online ones and, while any online request runs or waits, at most
scheduler.background_share of the online tokens (so a step takes that much longer at most),
never more than scheduler.background_step_tokens in a step (an online request that arrives
waits for at most such a step), they take at most scheduler.background_max_seqs seats, and
an online request that finds no room (no blocks, or no seat) preempts a running background
request, the most recently admitted first, before any online one.

Disaggregated decode (meshserve.engine.handoff): a request whose prompt another replica
computes is admitted as any other, in order, but computes nothing: its blocks are reserved
(those the prefix cache holds reused) and it waits in `receiving`, holding them, until its
KV has landed; it then runs as a sequence whose prompt is computed.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from meshserve.configs.roles import ReplicaRole
from meshserve.comm.messages import LoraLoad
from meshserve.engine.speculative.tree import placed
from meshserve.engine.block_manager import BlockManager
from meshserve.engine.lora.registry import LoraRegistry
from meshserve.engine.sequence import Sequence, SeqStatus


@dataclass
class ScheduledBatch:
    seqs: list[Sequence] = field(default_factory=list)
    num_new: list[int] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)
    reserved: list[Sequence] = field(default_factory=list)
    """Disaggregated decode: sequences whose blocks were reserved this step (none computes)."""
    launched: bool = False
    """Scheduler.launched has counted it."""
    samples: list[bool] = field(default_factory=list)
    """Per sequence (set by Scheduler.launched): whether the step samples a token of it."""
    lora_loads: list[LoraLoad] = field(default_factory=list)
    """Adapters the ranks load before the step: its admitted sequences' that no slot held."""

    @property
    def num_tokens(self) -> int:
        return sum(self.num_new)

    def __len__(self) -> int:
        return len(self.seqs)


class Scheduler:
    def __init__(self, block_manager: BlockManager, max_num_seqs: int, max_batched_tokens: int,
                 loras: LoraRegistry | None = None, priority_aging: float | None = None,
                 background_max_seqs: int | None = None, background_share: float | None = None,
                 background_step_tokens: int | None = None):
        """`loras`: the adapters served and their slots; a sequence takes its adapter's slot
        when admitted, and waits, in order, while every slot holds an adapter in use.
        `priority_aging`: the priority policy's seconds per level of aging (None: fcfs).
        `background_max_seqs`: the most background sequences running at once (None:
        max_num_seqs). `background_share`: while any online sequence runs or waits, a step gives
        background sequences at most this share of its online tokens (at least one token
        if above 0; 0: none; None: no share limit). `background_step_tokens`: the most tokens
        of any step background sequences take (None: the step's budget)."""
        self.blocks = block_manager
        self.tree_parents: list[int] | None = None
        """speculative.tree's node parents (engine/speculative/tree.py), set by the engine: a
        sequence's draft of k tokens is its first k nodes."""
        self.priority_aging = priority_aging
        self.background_max_seqs = max_num_seqs if background_max_seqs is None else background_max_seqs
        self.num_background_running = 0
        self.background_share = background_share
        self.background_step_tokens = background_step_tokens or max_batched_tokens
        self.loras = loras
        self.max_num_seqs = max_num_seqs
        self.max_batched_tokens = max_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.receiving: list[Sequence] = []
        """Disaggregated decode: admitted, their KV on its way from a prefill replica."""
        self.num_preemptions = 0
        self.num_priority_preemptions = 0
        """Of those, the preemptions that made room for a request of a better rank."""
        self.num_background_preemptions = 0
        """And those of background requests that made room for an online one."""

    def rank(self, seq: Sequence) -> tuple[bool, float, int]:
        """The priority policy's order (lower first): online before background, then
        priority aged by arrival, then arrival."""
        return seq.background, seq.priority + seq.arrival_time / self.priority_aging, seq.seq_id

    def add(self, seq: Sequence) -> None:
        seq.status = SeqStatus.WAITING
        self._enqueue(seq, front=False)

    def _enqueue(self, seq: Sequence, front: bool) -> None:
        """Into the waiting queue: at its rank (priority policy), else at the back (a new
        request) or the front (a preempted one)."""
        if self.priority_aging is None:
            if seq.background and not front:
                self.waiting.append(seq)
            elif not seq.background and front:
                self.waiting.appendleft(seq)
            else:  # the front of the background requests
                at = next((i for i, other in enumerate(self.waiting) if other.background), len(self.waiting))
                self.waiting.insert(at, seq)
            return
        rank = self.rank(seq)
        at = next((i for i, other in enumerate(self.waiting) if self.rank(other) > rank), len(self.waiting))
        self.waiting.insert(at, seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self, busy: frozenset[int] = frozenset(), max_seqs: int | None = None,
                 ahead: frozenset[int] = frozenset()) -> ScheduledBatch:
        """One step's batch. `busy`: ids of sequences in a step still in flight (pipeline
        micro-batches, overlapped steps): they are never preempted, and scheduled only if
        in `ahead` (overlapped steps: their next tokens, the pending one included, follow
        the step in flight). `max_seqs`: this step's share of sequences (default max_num_seqs)."""
        batch = ScheduledBatch()
        budget = self.max_batched_tokens
        cap = max_seqs or self.max_num_seqs
        self._make_room(busy, batch)
        short = False
        """Blocks ran out for a running sequence this step."""
        running = self.running if not self.num_background_running else sorted(self.running, key=_is_background)
        background_left: int | None = None
        """Background tokens this step may still take (set at the first background sequence,
        when the online sequences, which come first, have theirs)."""
        for seq in running if running is not self.running else list(running):
            if budget <= 0 or len(batch) >= cap:
                break
            if seq.status is not SeqStatus.RUNNING or (seq.seq_id in busy and seq.seq_id not in ahead):
                continue  # preempted a moment ago, or in flight
            if seq.background and background_left is None:
                background_left = self._background_budget(self.max_batched_tokens - budget)
            most = min(budget, background_left) if seq.background else budget
            if most <= 0:
                continue  # a background sequence holds its blocks and waits for a step with room
            n = min(seq.num_uncomputed + len(seq.draft), most)
            if seq.draft and not self.blocks.can_grow(seq, n):
                n = min(seq.num_uncomputed, most)  # drafts never cost another sequence its blocks
            del seq.draft[max(0, n - seq.num_uncomputed):]
            while not self.blocks.can_grow(seq, n):
                victim = self._victim(busy, batch)
                if victim is None:
                    break  # what would free blocks is in flight: this one waits a step
                self.running.remove(victim)
                self._preempt(victim)
                batch.preempted.append(victim)
                short = True
                if victim is seq:
                    break
            if seq.status is SeqStatus.RUNNING and self.blocks.can_grow(seq, n):
                self.blocks.grow(seq, n)
                batch.seqs.append(seq)
                batch.num_new.append(n)
                budget -= n
                if seq.background:
                    background_left -= n
        # Admit only when no running sequence was preempted for blocks: memory is short this step.
        while (not short and self.waiting and budget > 0 and len(batch) < cap
               and len(self.running) + len(self.receiving) < self.max_num_seqs):
            seq = self.waiting[0]
            if any(seq is p for p in batch.preempted):
                break  # preempted this step to make room: not back in the same step
            if seq.background and background_left is None:
                background_left = self._background_budget(self.max_batched_tokens - budget)
            if seq.background and (self.num_background_running >= self.background_max_seqs
                                   or background_left <= 0):
                break
            if seq.handoff is not None and seq.handoff.role == ReplicaRole.DECODE and seq.num_preemptions == 0:
                if not self._reserve(seq):
                    break
                batch.reserved.append(seq)
                continue
            # a request that asks for prompt logprobs computes its whole prompt: they come from it
            cached = self.blocks.match(seq) if seq.params.prompt_logprobs is None else []
            n = min(seq.num_tokens - len(cached) * self.blocks.unit, budget,
                    background_left if seq.background else budget)
            if not self.blocks.can_admit(seq, cached, n) or not self._place_adapter(seq, batch):
                break
            self.waiting.popleft()
            self.blocks.admit(seq, cached, n)
            seq.status = SeqStatus.RUNNING
            self.running.append(seq)
            self.num_background_running += seq.background
            batch.seqs.append(seq)
            batch.num_new.append(n)
            budget -= n
            if seq.background:
                background_left -= n
        return batch

    def _background_budget(self, online_tokens: int) -> int:
        """The tokens this step may give background sequences, `online_tokens` given to online
        ones: at most background_step_tokens, which bounds how long an online request that
        arrives meanwhile waits for the step; and while an online sequence runs or waits,
        background_share of the online tokens (at least one with a share above 0), which
        bounds what background work adds to the step's time."""
        if self.background_share is None:
            return self.background_step_tokens
        online = len(self.running) > self.num_background_running or (self.waiting and not self.waiting[0].background)
        if not online:
            return self.background_step_tokens
        share = max(1, int(self.background_share * online_tokens)) if self.background_share > 0 else 0
        return min(share, self.background_step_tokens)

    def _place_adapter(self, seq: Sequence, batch: ScheduledBatch) -> bool:
        """Give `seq` its adapter's slot (kept through preemption); False if none is free."""
        if seq.lora is None or seq.lora_slot >= 0:
            return True
        placed = self.loras.acquire(seq.lora)
        if placed is None:
            return False
        seq.lora_slot, load = placed
        if load is not None:
            batch.lora_loads.append(load)
        return True

    def _reserve(self, seq: Sequence) -> bool:
        """Admit a disaggregated decode sequence into `receiving`: its cached prefix and
        blocks for the rest of its prompt. False if they do not fit now."""
        cached = self.blocks.match(seq)
        n = seq.num_tokens - len(cached) * self.blocks.unit
        if not self.blocks.can_admit(seq, cached, n):
            return False
        self.waiting.popleft()
        self.blocks.admit(seq, cached, n, register=False)
        seq.status = SeqStatus.RECEIVING
        self.receiving.append(seq)
        return True

    def landed(self, seq: Sequence, first_token: int) -> None:
        """`seq`'s prompt KV arrived: it runs with its prompt computed and `first_token`
        (sampled by the prefill replica) to compute next."""
        self.receiving.remove(seq)
        self.blocks.computed(seq, seq.num_tokens - seq.num_computed)
        self.blocks.register(seq)
        seq.token_ids.append(first_token)
        seq.status = SeqStatus.RUNNING
        self.running.append(seq)
        self.num_background_running += seq.background

    def _victim(self, busy: frozenset[int], batch: ScheduledBatch) -> Sequence | None:
        """The running sequence to preempt for blocks, neither in flight nor already in this
        batch: a background one first; the most recently admitted (fcfs), or the one of the
        worst rank (priority)."""
        free = (s for s in reversed(self.running) if s.seq_id not in busy and not any(b is s for b in batch.seqs))
        if self.priority_aging is not None:
            return max(free, key=self.rank, default=None)
        if not self.num_background_running:
            return next(free, None)
        free = list(free)
        return next((s for s in free if s.background), free[0] if free else None)

    def _make_room(self, busy: frozenset[int], batch: ScheduledBatch) -> None:
        """While the best waiting sequence cannot be admitted, preempt a running one below it:
        under priority, of the worst rank if that rank is worse than its; under fcfs, a
        background sequence for an online one."""
        if self.priority_aging is None and not self.num_background_running:
            return
        while self.waiting and self.running:
            head = self.waiting[0]
            if head.handoff is not None or self._fits(head):
                return
            victim = self._victim(busy, batch)
            if victim is None or (self.rank(victim) <= self.rank(head) if self.priority_aging is not None
                                  else head.background or not victim.background):
                return
            self.running.remove(victim)
            self._preempt(victim)
            batch.preempted.append(victim)
            if victim.background:
                self.num_background_preemptions += 1
            else:
                self.num_priority_preemptions += 1

    def _fits(self, seq: Sequence) -> bool:
        """Whether waiting `seq` has a seat and the blocks of its first chunk now."""
        if len(self.running) + len(self.receiving) >= self.max_num_seqs:
            return False
        cached = self.blocks.match(seq) if seq.params.prompt_logprobs is None else []
        n = min(seq.num_tokens - len(cached) * self.blocks.unit, self.max_batched_tokens)
        return self.blocks.can_admit(seq, cached, n)

    def _preempt(self, seq: Sequence) -> None:
        self.num_background_running -= seq.background
        self.blocks.release(seq)
        seq.draft = []
        seq.status = SeqStatus.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self._enqueue(seq, front=True)

    def launched(self, batch: ScheduledBatch) -> None:
        """A step was submitted: its known tokens count as computed from now on (drafts
        only once verified, in `update`), and each sequence it samples has a token pending
        until `update`. So the next step, scheduled while this one runs (overlapped steps),
        sees every sequence as this step leaves it."""
        batch.launched = True
        for seq, n in zip(batch.seqs, batch.num_new):
            if seq.draft:
                batch.samples.append(True)
                continue
            self.blocks.computed(seq, n)
            batch.samples.append(seq.num_uncomputed == 0)
            if seq.num_uncomputed == 0:
                seq.num_pending += 1

    def update(self, batch: ScheduledBatch, sampled: dict[int, list[int]]) -> list[tuple[Sequence, list[int]]]:
        """Record a finished step, `launched` before: each sequence it sampled appends its
        tokens (a speculative one its accepted drafts, then the one sampled after them;
        its computed count advances by those drafts, and the blocks only rejected drafts
        used are given back). Returns those sequences with their new tokens."""
        if not batch.launched:
            self.launched(batch)
        grown = []
        for seq, n, samples in zip(batch.seqs, batch.num_new, batch.samples):
            if seq.status is not SeqStatus.RUNNING:
                continue  # finished (aborted, or stopped by a token of the step before) while it ran
            tokens = sampled.get(seq.seq_id, [])
            if not seq.draft:
                if samples:
                    seq.num_pending -= 1
                    seq.token_ids.extend(tokens)
                    self.blocks.register(seq)  # a block the next step computed while this token was pending
                    grown.append((seq, tokens))
                continue
            drafted = len(seq.draft)
            accepted = len(tokens) - 1
            if self.tree_parents is not None:  # kept nodes off the chain of first guesses are computed again
                accepted = placed(tokens, seq.draft, self.tree_parents[:drafted])
            seq.draft = []
            self.blocks.computed(seq, n - drafted + accepted)
            if accepted < drafted and self.blocks.trim(seq):
                seq.sent_blocks = min(seq.sent_blocks, len(seq.block_ids))  # the next plan tells the ranks
            seq.token_ids.extend(tokens)
            grown.append((seq, tokens))
        return grown

    def finish(self, seq: Sequence) -> None:
        """Remove `seq` from the queues and free its blocks (finished or aborted)."""
        if seq.status is SeqStatus.RUNNING:
            self.running.remove(seq)
            self.num_background_running -= seq.background
        elif seq.status is SeqStatus.RECEIVING:
            self.receiving.remove(seq)
        elif seq.status is SeqStatus.WAITING:
            self.waiting.remove(seq)
        self.blocks.release(seq)
        if seq.lora_slot >= 0:
            self.loras.release(seq.lora.key)
            seq.lora_slot = -1
        seq.status = SeqStatus.FINISHED


def _is_background(seq: Sequence) -> bool:
    return seq.background
