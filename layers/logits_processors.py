"""What a request's sampling parameters do to its row of logits before a token is drawn:
a grammar's token mask, logit_bias, repetition_penalty, presence/frequency penalties and
min_p. Each works in place on the batch's (num_rows, vocab_size) logits, in a few tensor
ops over the rows that use it: their token ids and parameters are gathered into one tensor
(Python lists, one pass over the rows), then the logits they touch are read and written
back with one indexed gather and one indexed write (token entries for the penalties and
logit_bias, whole rows for min_p and the mask). No op loops over the vocabulary or over
rows, and the logits of a row that uses none of them are never read.

Order (vLLM v1's, so a request samples what it would there): the mask, then logit_bias,
then repetition_penalty, then frequency and presence penalties, then min_p, which is
relative to the row's largest logit after all the others.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from itertools import chain
from typing import TYPE_CHECKING

import numpy as np
import torch

from meshserve.comm.messages import SamplingParams
from meshserve.layers.kernels.cpu_library import CpuLibrary

if TYPE_CHECKING:
    from meshserve.layers.sampler import SamplingRow
    from meshserve.layers.sampling_state import StepRows

_BITS = 32
"""Tokens per int32 word of a grammar bitmask (xgrammar's layout)."""


def uses_processors(params: SamplingParams) -> bool:
    """Whether `params` change the logits beyond temperature, top-k, top-p and min_tokens."""
    return bool(params.logit_bias or params.repetition_penalty != 1.0 or params.frequency_penalty
                or params.presence_penalty or params.min_p)


def apply_processors(logits: torch.Tensor, rows: list[SamplingRow], state: StepRows | None = None) -> None:
    """logit_bias, repetition_penalty, frequency/presence penalties and min_p, in place, on
    the rows of `logits` (num_rows, vocab_size) whose params ask for them. `state`: the
    rows' token counts kept on the device (layers/sampling_state.py), which the penalties
    then read instead of the rows' token lists."""
    apply_logit_bias(logits, rows)
    if state is None:
        apply_repetition_penalty(logits, rows)
        apply_output_penalties(logits, rows)
    elif state.penalties is not None:
        state.penalties.apply(logits)
    apply_min_p(logits, rows)


def apply_logit_bias(logits: torch.Tensor, rows: list[SamplingRow]) -> None:
    """Adds each (token id, bias) pair of a row's logit_bias to its logit. NOTE: a token
    listed twice gets both biases (accumulate=True); OpenAI's is a map, so it never is."""
    row_idx: list[int] = []
    cols: list[int] = []
    biases: list[float] = []
    for i, r in enumerate(rows):
        pairs = r.params.logit_bias
        if pairs:
            row_idx.extend([i] * len(pairs))
            cols.extend(t for t, _ in pairs)
            biases.extend(b for _, b in pairs)
    if not row_idx:
        return
    device = logits.device
    logits.index_put_((torch.tensor(row_idx, device=device), torch.tensor(cols, device=device)),
                      torch.tensor(biases, dtype=logits.dtype, device=device), accumulate=True)


def apply_repetition_penalty(logits: torch.Tensor, rows: list[SamplingRow]) -> None:
    """vLLM's (CTRL's) repetition_penalty p over the prompt and the output: each distinct
    token of the sequence has its logit divided by p if positive, multiplied by p otherwise."""
    chosen = [i for i, r in enumerate(rows) if r.params.repetition_penalty != 1.0]
    if not chosen:
        return
    lengths = [rows[i].num_tokens for i in chosen]
    penalties = [rows[i].params.repetition_penalty for i in chosen]
    row_idx, cols = _gather_tokens(chosen, lengths, (rows[i].token_ids[:rows[i].num_tokens] for i in chosen),
                                   logits.device)
    penalty = torch.tensor(penalties, dtype=logits.dtype, device=logits.device).repeat_interleave(
        torch.tensor(lengths, device=logits.device))
    values = logits[row_idx, cols]
    # NOTE: a token present several times is written several times, each write with the value
    # computed from its logit before any write, so every distinct token is penalized once.
    logits[row_idx, cols] = torch.where(values > 0, values / penalty, values * penalty)


def apply_output_penalties(logits: torch.Tensor, rows: list[SamplingRow]) -> None:
    """OpenAI's frequency and presence penalties over the output so far: a token the output
    holds `count` times loses frequency_penalty * count + presence_penalty."""
    chosen = [i for i, r in enumerate(rows)
              if (r.params.frequency_penalty or r.params.presence_penalty) and r.num_output_tokens > 0]
    if not chosen:
        return
    device, vocab = logits.device, logits.shape[1]
    lengths = [rows[i].num_output_tokens for i in chosen]
    outputs = (rows[i].token_ids[rows[i].prompt_len:rows[i].num_tokens] for i in chosen)
    row_idx, cols = _gather_tokens(chosen, lengths, outputs, device)
    keys, counts = torch.unique(row_idx * vocab + cols, return_counts=True)
    row_idx, cols = keys // vocab, keys % vocab
    frequency = torch.tensor([r.params.frequency_penalty for r in rows], dtype=logits.dtype, device=device)
    presence = torch.tensor([r.params.presence_penalty for r in rows], dtype=logits.dtype, device=device)
    logits[row_idx, cols] -= frequency[row_idx] * counts.to(logits.dtype) + presence[row_idx]


def apply_min_p(logits: torch.Tensor, rows: list[SamplingRow]) -> None:
    """min_p: a sampled row keeps the tokens whose probability after temperature T is at
    least min_p times its most likely token's, i.e. logit >= max_logit + T * log(min_p).
    Greedy rows are left alone (their argmax is always kept)."""
    chosen = [i for i, r in enumerate(rows) if r.params.min_p > 0.0 and not r.params.greedy]
    if not chosen:
        return
    device = logits.device
    offsets = torch.tensor([rows[i].params.temperature * math.log(rows[i].params.min_p) for i in chosen],
                           dtype=logits.dtype, device=device)
    index = torch.tensor(chosen, device=device)
    sub = logits.index_select(0, index)
    floor = sub.amax(dim=-1, keepdim=True) + offsets.unsqueeze(1)
    # NOTE: torch.where, not masked_fill: faster on the CPU for a batch of vocabulary-wide rows.
    logits.index_copy_(0, index, torch.where(sub < floor, float("-inf"), sub))


def unpack_bitmask(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """xgrammar's int32 (k, words) bitmask as a bool (k, vocab_size) tensor of the allowed
    tokens: bit j of word w allows token 32 * w + j. Tokens past the mask's 32 * words are
    not allowed (a grammar allows only the tokens it knows)."""
    shifts = torch.arange(_BITS, dtype=torch.int32, device=bitmask.device)
    # (k, words, 32): an arithmetic shift of a negative word still leaves bit j at the bottom
    allowed = ((bitmask.unsqueeze(-1) >> shifts) & 1).bool().flatten(1)
    if allowed.shape[1] < vocab_size:
        allowed = torch.nn.functional.pad(allowed, (0, vocab_size - allowed.shape[1]), value=False)
    return allowed[:, :vocab_size]


def check_bitmask(bitmask: torch.Tensor, bitmask_rows: Sequence[int] | torch.Tensor | None,
                  num_rows: int) -> torch.Tensor:
    """`bitmask_rows` as an int64 tensor of row indices, after checking it matches `bitmask`."""
    if bitmask.dtype != torch.int32 or bitmask.dim() != 2:
        raise ValueError(f"bitmask: an int32 (k, words) tensor, got {bitmask.dtype} of shape {tuple(bitmask.shape)}")
    if bitmask_rows is None:
        raise ValueError("bitmask_rows: the row of the logits each bitmask row applies to is required with bitmask")
    index = torch.as_tensor(bitmask_rows, dtype=torch.long)
    if index.dim() != 1 or len(index) != bitmask.shape[0]:
        raise ValueError(f"bitmask_rows: one row index per bitmask row ({bitmask.shape[0]}), got shape "
                         f"{tuple(index.shape)}")
    if len(index) and (int(index.min()) < 0 or int(index.max()) >= num_rows):
        raise ValueError(f"bitmask_rows: indices {index.tolist()} outside the batch's {num_rows} rows")
    return index


def native_masking(logits: torch.Tensor, library: CpuLibrary | None) -> bool:
    """Whether grammar masks apply in the C++ op (cpu_sample.cpp): contiguous float32 rows on
    the CPU, the library built."""
    return (library is not None and logits.device.type == "cpu" and logits.dtype == torch.float32
            and logits.dim() == 2 and logits.is_contiguous())


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, index: torch.Tensor,
                        fallback: torch.Tensor, library: CpuLibrary | None = None) -> None:
    """Sets the logits of the tokens `bitmask` disallows to -inf, in place, on the rows
    `index` of `logits`. A row left with no finite logit (the grammar allows only what
    min_tokens bans) becomes a one-hot at `fallback` (k,), its token then whatever the
    sampling parameters, so every path draws it and the C++ op never sees an empty row.
    `library`: the C++ CPU kernels, which mask float32 rows in one pass; None: torch ops."""
    index = index.to(logits.device)
    if native_masking(logits, library):
        alive = library.ops.mask_rows(logits, bitmask.to(torch.int32), index)
        if not bool(alive.all()):
            dead = ~alive
            one_hot = torch.full((int(dead.sum()), logits.shape[1]), float("-inf"), dtype=logits.dtype)
            logits.index_copy_(0, index[dead], one_hot.scatter_(1, fallback[dead].unsqueeze(1), 0.0))
        return
    allowed = unpack_bitmask(bitmask.to(logits.device), logits.shape[1])
    masked = torch.where(allowed, logits.index_select(0, index), float("-inf"))
    dead = masked.amax(dim=-1) == float("-inf")
    # NOTE: one host sync, cheaper than building the one-hot rows at every masked step.
    if bool(dead.any()):
        one_hot = torch.full_like(masked, float("-inf")).scatter_(1, fallback.to(logits.device).unsqueeze(1), 0.0)
        masked = torch.where(dead.unsqueeze(1), one_hot, masked)
    logits.index_copy_(0, index, masked)


def _gather_tokens(chosen: list[int], lengths: list[int], token_lists: Iterable[list[int]], device: torch.device
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """(row index, token id) int64 tensors of the tokens in `token_lists`, one list per row
    of `chosen`, `lengths` long. NOTE: numpy reads a list of ints many times faster than
    torch.tensor."""
    flat = np.fromiter(chain.from_iterable(token_lists), dtype=np.int64, count=sum(lengths))
    cols = torch.from_numpy(flat).to(device)
    row_idx = torch.tensor(chosen, device=device).repeat_interleave(torch.tensor(lengths, device=device))
    return row_idx, cols
