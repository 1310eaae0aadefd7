"""Token sampling for a batch of sequences, each with its own parameters.

Greedy rows take the argmax. On the CPU, random rows sample in one C++ op
(cpu_sample.cpp): temperature, top-k and top-p cut without a full sort, then the inverse
CDF of the kept weights at one uniform number per row. Elsewhere (or without a C++
compiler) they sample in torch ops with the exponential-race trick (argmax of p / E,
E ~ Exp(1), as gpt-fast's `multinomial_sample_one_no_sync`), one argmax and no host sync.
A seeded row draws its randomness from a generator seeded by (seed, sequence length): the
same request with the same seed samples the same tokens whatever else shares its batch.

Before any of that, in place: min_tokens bans the stop tokens, the logprobs are taken (raw,
as vLLM's default), then a grammar's token mask, logit_bias, the penalties and min_p
(layers/logits_processors.py). A batch where no row uses these pays one pass over its rows.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from meshserve.comm.messages import SamplingParams, TokenLogprob
from meshserve.layers.kernels.cpu_library import CpuLibrary
from meshserve.layers.logits_processors import (apply_processors, apply_token_bitmask, check_bitmask,
                                                uses_processors)
from meshserve.layers.sampling_state import SamplingState, StepRows

_MIX = 0x9E3779B97F4A7C15


@dataclass
class SamplingRow:
    params: SamplingParams
    num_tokens: int
    """Length of the sequence before the sampled token is appended."""
    prompt_len: int
    token_ids: list[int]
    """The sequence's prompt and output so far (its first num_tokens): the caller's list,
    not a copy, read by the penalties."""
    seq_id: int = -1
    """The sequence, for a Sampler with a SamplingState (-1: none; the lists are read)."""
    base: int = -1
    """The sequence's own tokens (-1: num_tokens); a speculative row's drafts lie between
    this and num_tokens."""

    @property
    def num_output_tokens(self) -> int:
        return self.num_tokens - self.prompt_len


@dataclass
class SampledRows:
    """A batch's sampled tokens (and the logprobs its rows asked for) where the sampler
    left them, on the logits' device: reading them on the host waits for the step that
    sampled them, so a caller that need not wait yet (overlapped steps) reads them later."""

    tokens: torch.Tensor
    """(rows,) int64."""
    wants: list[int | None]
    """Per row, the top logprobs it asked for (None: no logprobs)."""
    logprobs: tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None] | None = None
    """The sampled tokens' logprobs (rows,), and the top max(wants) values and ids (rows, k)
    (None when k is 0); None when no row asked."""
    _ready: torch.cuda.Event | None = None

    def start_copy(self) -> None:
        """Start copying to pinned host memory behind the device's queued work (CUDA); the
        lists then wait for that copy alone, not for work queued after it."""
        if self.tokens.device.type != "cuda":
            return
        self.tokens = _to_pinned(self.tokens)
        if self.logprobs is not None:
            self.logprobs = tuple(None if t is None else _to_pinned(t) for t in self.logprobs)
        self._ready = torch.cuda.Event()
        self._ready.record()

    def to_lists(self) -> tuple[list[int], list[TokenLogprob | None] | None]:
        """The tokens, and each row's TokenLogprob (None for rows that asked none), on the host."""
        if self._ready is not None:
            self._ready.synchronize()
        tokens = self.tokens.tolist()
        if self.logprobs is None:
            return tokens, None
        chosen, values, ids = (None if t is None else t.tolist() for t in self.logprobs)
        out: list[TokenLogprob | None] = []
        for i, (token, n) in enumerate(zip(tokens, self.wants)):
            if n is None:
                out.append(None)
                continue
            top = list(zip(ids[i][:n], values[i][:n])) if n else []
            out.append(TokenLogprob(token, chosen[i], top))
        return tokens, out


def _to_pinned(x: torch.Tensor) -> torch.Tensor:
    host = torch.empty(x.shape, dtype=x.dtype, pin_memory=True)
    host.copy_(x, non_blocking=True)
    return host


def argmax(x: torch.Tensor, library: CpuLibrary | None = None) -> torch.Tensor:
    """Each row's index of its largest value (the first, on ties). Float32 rows on the CPU
    take one C++ pass of `library` (cpu_norm_act.cpp), which ignores NaNs where torch would
    pick them."""
    if library is not None and x.device.type == "cpu" and x.dtype == torch.float32 and x.dim() == 2 and x.shape[1]:
        return library.ops.argmax_rows(x.contiguous())
    return x.argmax(dim=-1)


def native_sampling(logits: torch.Tensor, library: CpuLibrary | None) -> bool:
    """Whether `logits` sample in the C++ op: float32 rows on the CPU, the library built."""
    return (library is not None and logits.device.type == "cpu" and logits.dtype == torch.float32
            and logits.dim() == 2 and logits.shape[1] > 0)


def _row_seed(seed: int, num_tokens: int) -> int:
    return (seed * _MIX + num_tokens) % (1 << 63)


class Sampler:
    def __init__(self, eos_token_ids: tuple[int, ...], seed: int | None = None, library: CpuLibrary | None = None,
                 state: SamplingState | None = None):
        """`library`: the C++ CPU kernels that sample, mask and take the argmax of float32
        rows on the CPU (cpu_library.load); None: torch ops. `state`: the sequences'
        parameters and token counts kept on the device between steps, read for rows that
        name their sequence (the caller records each step's tokens in it)."""
        self.eos_token_ids = list(eos_token_ids)
        self.library = library
        self.state = state
        self.generator = torch.Generator()
        if seed is None:
            self.generator.seed()
        else:
            self.generator.manual_seed(seed)

    def __call__(self, logits: torch.Tensor, rows: list[SamplingRow], bitmask: torch.Tensor | None = None,
                 bitmask_rows: Sequence[int] | torch.Tensor | None = None
                 ) -> tuple[list[int], list[TokenLogprob | None] | None]:
        """`sample`, read on the host."""
        return self.sample(logits, rows, bitmask, bitmask_rows).to_lists()

    def sample(self, logits: torch.Tensor, rows: list[SamplingRow], bitmask: torch.Tensor | None = None,
               bitmask_rows: Sequence[int] | torch.Tensor | None = None) -> SampledRows:
        """One token per row of `logits` (modified in place), and the logprobs the rows ask
        for, taken before the mask, logit_bias and penalties. `bitmask`: a grammar's allowed
        tokens, int32 (k, ceil(vocab_size / 32)) in xgrammar's layout, for the rows
        `bitmask_rows` of `logits`. A -inf logit is never drawn while its row has a finite
        one; a masked row left with none takes the argmax of its logits as given (the
        model's choice, over the grammar and min_tokens)."""
        # logits: (num_rows, vocab_size) float32
        mask_rows = None
        if bitmask is not None and bitmask.shape[0]:
            mask_rows = check_bitmask(bitmask, bitmask_rows, logits.shape[0]).to(logits.device)
            fallback = argmax(logits, self.library)[mask_rows]  # every row's: cheaper than copying the masked ones
        state = None
        if self.state is not None and rows and all(r.seq_id >= 0 for r in rows):
            state = self.state.step(rows)
        self._apply_min_tokens(logits, rows)
        want_logprobs = any(r.params.logprobs is not None for r in rows)
        logprobs = torch.log_softmax(logits, dim=-1) if want_logprobs else None
        if mask_rows is not None:
            apply_token_bitmask(logits, bitmask, mask_rows, fallback, self.library)
        if any(uses_processors(r.params) for r in rows):
            apply_processors(logits, rows, state)
        if all(r.params.greedy for r in rows):
            tokens = argmax(logits, self.library)
        else:
            tokens = self._sample(logits, rows, state)
        wants = [r.params.logprobs for r in rows]
        if logprobs is None:
            return SampledRows(tokens, wants)
        chosen = logprobs.gather(1, tokens.view(-1, 1)).view(-1)
        k = max((n for n in wants if n is not None), default=0)
        values, ids = logprobs.topk(k) if k else (None, None)
        return SampledRows(tokens, wants, (chosen, values, ids))

    def _apply_min_tokens(self, logits: torch.Tensor, rows: list[SamplingRow]) -> None:
        for i, r in enumerate(rows):
            if r.num_output_tokens < r.params.min_tokens:
                banned = list(r.params.stop_token_ids) + ([] if r.params.ignore_eos else self.eos_token_ids)
                if banned:
                    logits[i, banned] = float("-inf")

    def _sample(self, logits: torch.Tensor, rows: list[SamplingRow], state: StepRows | None) -> torch.Tensor:
        if native_sampling(logits, self.library):
            return self._sample_native(logits, rows, state)
        return self._sample_torch(logits, rows, state)

    def _knobs(self, rows: list[SamplingRow], state: StepRows | None, device: torch.device
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Each row's temperature, top_k and top_p: gathered from the state's slots, else
        built from the rows."""
        if state is not None:
            s = self.state
            return s.temperature[state.slots], s.top_k[state.slots], s.top_p[state.slots]
        params = [r.params for r in rows]
        return (torch.tensor([p.temperature for p in params], dtype=torch.float32, device=device),
                torch.tensor([p.top_k for p in params], dtype=torch.long, device=device),
                torch.tensor([p.top_p for p in params], dtype=torch.float32, device=device))

    def _sample_native(self, logits: torch.Tensor, rows: list[SamplingRow], state: StepRows | None) -> torch.Tensor:
        uniform = torch.rand(len(rows), generator=self.generator, dtype=torch.float64)
        for i, r in enumerate(rows):
            if r.params.seed is not None:
                g = torch.Generator().manual_seed(_row_seed(r.params.seed, r.num_tokens))
                uniform[i] = torch.rand(1, generator=g, dtype=torch.float64)
        temperature, top_k, top_p = self._knobs(rows, state, logits.device)
        return self.library.ops.sample_rows(logits.contiguous(), temperature, top_k, top_p, uniform)

    def _sample_torch(self, logits: torch.Tensor, rows: list[SamplingRow], state: StepRows | None) -> torch.Tensor:
        """The torch-op path; its greedy rows take the argmax afterwards (the C++ op takes
        it itself for temperature 0)."""
        tokens = self._race(logits, rows, state)
        greedy = [r.params.greedy for r in rows]
        if any(greedy):
            tokens = torch.where(torch.tensor(greedy, device=logits.device), argmax(logits, self.library), tokens)
        return tokens

    def _race(self, logits: torch.Tensor, rows: list[SamplingRow], state: StepRows | None) -> torch.Tensor:
        temperature, top_k_t, top_p_t = self._knobs(rows, state, logits.device)
        temps = torch.where(temperature == 0, 1.0, temperature)
        scaled = logits / temps.unsqueeze(1)
        top_k = [r.params.top_k for r in rows]
        if any(top_k):
            k_max = min(max(top_k), scaled.shape[-1])
            kth = scaled.topk(k_max, dim=-1).values
            limited = top_k_t > 0
            k = torch.where(limited, top_k_t.clamp(max=k_max), k_max) - 1
            threshold = kth.gather(1, k.unsqueeze(1))
            scaled = scaled.masked_fill(limited.unsqueeze(1) & (scaled < threshold), float("-inf"))
        if any(r.params.top_p < 1.0 for r in rows):
            sorted_logits, order = scaled.sort(dim=-1, descending=True)
            probs = sorted_logits.softmax(dim=-1)
            # drop a token when the tokens ranked above it already reach top_p
            drop = (probs.cumsum(dim=-1) - probs) > top_p_t.unsqueeze(1)
            # rows without top-p keep every token (a float32 cumsum can pass 1.0 in the tail)
            drop &= (top_p_t < 1.0).unsqueeze(1)
            scaled = scaled.scatter(1, order, sorted_logits.masked_fill(drop, float("-inf")))
        probs = scaled.softmax(dim=-1)
        noise = torch.empty_like(probs).exponential_(generator=self.generator)
        for i, r in enumerate(rows):
            if r.params.seed is not None:
                g = torch.Generator(device=logits.device).manual_seed(_row_seed(r.params.seed, r.num_tokens))
                noise[i].exponential_(generator=g)
        return argmax(probs / noise, self.library)
