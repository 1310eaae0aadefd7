"""The sampling rank's state of the sequences it samples, kept on the logits' device
between steps (vLLM v1's persistent batch): each sequence's temperature, top-k, top-p and
penalties in a slot of a few device tensors, written once, when the sequence is first
sampled; and for a sequence with repetition, frequency or presence penalties, its token
counts (output tokens, and every token seen), which each step's sampled tokens update on
the device. A step gathers its rows by slot, one index tensor: nothing is rebuilt from the
sequences' token lists, and a step's sampled tokens need not reach the host before the next
step samples (overlapped steps, engine/engine.py).

A sequence the driver drops (finished, preempted) or sends again in full is forgotten and
tracked afresh, from its token list, the next time it is sampled: its tokens are all known
then (a deferred token only ever follows a sampled one, which the counts already hold).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from meshserve.comm.messages import SamplingParams
from meshserve.layers.slot_pool import SlotPool

if TYPE_CHECKING:
    from meshserve.layers.sampler import SamplingRow

def penalized(params: SamplingParams) -> bool:
    """Whether `params` read the sequence's tokens (and so keep counts)."""
    return bool(params.repetition_penalty != 1.0 or params.frequency_penalty or params.presence_penalty)


@dataclass
class PenaltyRows:
    """One step's penalized rows: their indices in the logits, and per row its parameters and
    counts (the sequence's, plus the drafts before the row)."""

    rows: torch.Tensor
    counts: torch.Tensor
    """(k, vocab) int32: each output token's count."""
    seen: torch.Tensor
    """(k, vocab) bool: the tokens of the prompt and the output."""
    repetition: torch.Tensor
    frequency: torch.Tensor
    presence: torch.Tensor

    def apply(self, logits: torch.Tensor) -> None:
        """repetition_penalty, then frequency and presence penalties, in place: the same
        arithmetic as logits_processors' list-built path, on every token at once."""
        sub = logits.index_select(0, self.rows)
        repetition = self.repetition.to(logits.dtype).unsqueeze(1)
        hit = self.seen & (repetition != 1.0)
        sub = torch.where(hit, torch.where(sub > 0, sub / repetition, sub * repetition), sub)
        penalty = (self.frequency.to(logits.dtype).unsqueeze(1) * self.counts.to(logits.dtype)
                   + self.presence.to(logits.dtype).unsqueeze(1))
        sub = torch.where(self.counts > 0, sub - penalty, sub)
        logits.index_copy_(0, self.rows, sub)


@dataclass
class StepRows:
    """What a step's rows read of the state."""

    slots: torch.Tensor
    """Each row's parameter slot."""
    penalties: PenaltyRows | None


class SamplingState:
    def __init__(self, vocab_size: int, device: torch.device | str):
        self.vocab_size, self.device = vocab_size, torch.device(device)
        self._params = SlotPool()
        self.temperature = torch.empty(0, dtype=torch.float32, device=self.device)
        self.top_k = torch.empty(0, dtype=torch.long, device=self.device)
        self.top_p = torch.empty(0, dtype=torch.float32, device=self.device)
        self._counted = SlotPool()
        self.repetition = torch.empty(0, dtype=torch.float32, device=self.device)
        self.frequency = torch.empty(0, dtype=torch.float32, device=self.device)
        self.presence = torch.empty(0, dtype=torch.float32, device=self.device)
        self.counts = torch.empty(0, vocab_size, dtype=torch.int32, device=self.device)
        self.seen = torch.empty(0, vocab_size, dtype=torch.bool, device=self.device)

    def __len__(self) -> int:
        return len(self._params.of)

    @property
    def num_counted(self) -> int:
        """Sequences whose token counts are kept."""
        return len(self._counted.of)

    def forget(self, seq_ids) -> None:
        for seq_id in seq_ids:
            self._params.drop(seq_id)
            self._counted.drop(seq_id)

    def step(self, rows: list[SamplingRow]) -> StepRows:
        """The step's rows, each naming its sequence (`seq_id`): a sequence first seen is
        tracked from its row (parameters, and tokens if penalized); a row's drafts (its
        tokens between `base` and `num_tokens`) count as if they were its sequence's."""
        slots = []
        penalty_rows, penalty_slots, extra_rows, extra_tokens = [], [], [], []
        for i, r in enumerate(rows):
            p, base = r.params, r.base if r.base >= 0 else r.num_tokens
            slot = self._params.of.get(r.seq_id)
            if slot is None:
                slot = self._track(r.seq_id, p)
            slots.append(slot)
            if not penalized(p):
                continue
            counted = self._counted.of.get(r.seq_id)
            if counted is None:
                counted = self._count(r.seq_id, p, r.token_ids[:base], r.prompt_len)
            penalty_rows.append(i)
            penalty_slots.append(counted)
            for token in r.token_ids[base:r.num_tokens]:  # drafts before this row: as if they were its own
                extra_rows.append(len(penalty_rows) - 1)
                extra_tokens.append(token)
        index = torch.tensor(slots, dtype=torch.long, device=self.device)
        if not penalty_rows:
            return StepRows(index, None)
        counted = torch.tensor(penalty_slots, dtype=torch.long, device=self.device)
        counts, seen = self.counts.index_select(0, counted), self.seen.index_select(0, counted)
        if extra_rows:
            at = (torch.tensor(extra_rows, dtype=torch.long, device=self.device),
                  torch.tensor(extra_tokens, dtype=torch.long, device=self.device))
            counts.index_put_(at, torch.ones(len(extra_rows), dtype=torch.int32, device=self.device), accumulate=True)
            seen[at] = True
        rows = torch.tensor(penalty_rows, dtype=torch.long, device=self.device)
        return StepRows(index, PenaltyRows(rows, counts, seen, self.repetition[counted], self.frequency[counted],
                                           self.presence[counted]))

    def record(self, seq_ids: list[int], tokens: torch.Tensor | list[list[int]]) -> None:
        """The tokens the step appended to each sequence: `tokens` (one per sequence, on the
        device, read there), or per sequence a list (a speculative step's accepted tokens)."""
        slots, picked, flat = [], [], []
        for i, seq_id in enumerate(seq_ids):
            slot = self._counted.of.get(seq_id)
            if slot is None:
                continue
            if isinstance(tokens, torch.Tensor):
                slots.append(slot)
                picked.append(i)
            else:
                slots += [slot] * len(tokens[i])
                flat += tokens[i]
        if not slots:
            return
        where = torch.tensor(slots, dtype=torch.long, device=self.device)
        if isinstance(tokens, torch.Tensor):
            values = tokens.to(self.device, torch.long)[torch.tensor(picked, dtype=torch.long, device=self.device)]
        else:
            values = torch.tensor(flat, dtype=torch.long, device=self.device)
        self.counts.index_put_((where, values), torch.ones(len(slots), dtype=torch.int32, device=self.device),
                               accumulate=True)
        self.seen[where, values] = True

    def _track(self, seq_id: int, p: SamplingParams) -> int:
        slot, grew = self._params.take(seq_id)
        if grew:
            size = self._params.size
            self.temperature = _grown(self.temperature, size)
            self.top_k = _grown(self.top_k, size)
            self.top_p = _grown(self.top_p, size)
        self.temperature[slot] = p.temperature
        self.top_k[slot] = p.top_k
        self.top_p[slot] = p.top_p
        return slot

    def _count(self, seq_id: int, p: SamplingParams, token_ids: list[int], prompt_len: int) -> int:
        slot, grew = self._counted.take(seq_id)
        if grew:
            size = self._counted.size
            self.repetition, self.frequency = _grown(self.repetition, size), _grown(self.frequency, size)
            self.presence = _grown(self.presence, size)
            self.counts, self.seen = _grown(self.counts, size), _grown(self.seen, size)
        if any(t < 0 for t in token_ids):
            raise RuntimeError(f"seq {seq_id}: counting tokens not known yet (a deferred token)")
        self.repetition[slot] = p.repetition_penalty
        self.frequency[slot] = p.frequency_penalty
        self.presence[slot] = p.presence_penalty
        self.counts[slot] = 0
        self.seen[slot] = False
        known = torch.tensor(token_ids, dtype=torch.long, device=self.device)
        self.seen[slot, known] = True
        output = known[prompt_len:]
        self.counts[slot].index_put_((output,), torch.ones(len(output), dtype=torch.int32, device=self.device),
                                     accumulate=True)
        return slot


def _grown(x: torch.Tensor, size: int) -> torch.Tensor:
    out = torch.zeros((size, *x.shape[1:]), dtype=x.dtype, device=x.device)
    out[:len(x)] = x
    return out
