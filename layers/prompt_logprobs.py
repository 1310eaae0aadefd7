"""Prompt logprobs (vLLM's `prompt_logprobs`): each prompt token's logprob given the tokens
before it, its rank, and the top n alternatives, from the hidden states a prefill computed
anyway. The hidden state at position p predicts the token at p + 1."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from meshserve.comm.messages import PromptLogprobs, TokenLogprob

ROWS_PER_PASS = 256
"""Prompt rows whose logits are materialised at once: (256, vocab) float32 is 50 MB for
SmolLM2's 49,152 tokens, and a long prompt's whole chunk would be gigabytes."""


@dataclass
class PromptSpan:
    """Rows of a step's flat batch whose next-token logprobs one sequence asked for."""

    seq_id: int
    first_row: int
    start: int
    """The position of the token the first row predicts."""
    targets: list[int]
    """The prompt tokens the rows predict, one per row."""
    top_n: int


def prompt_span(seq_id: int, first_row: int, chunk_start: int, num_new: int, token_ids: list[int],
                prompt_len: int, top_n: int) -> PromptSpan | None:
    """The span of a chunk at positions [chunk_start, chunk_start + num_new) whose rows predict
    prompt tokens (the last prompt position predicts the first output token: not one)."""
    end = min(chunk_start + num_new, prompt_len - 1)
    if end <= chunk_start:
        return None
    return PromptSpan(seq_id, first_row, chunk_start + 1, token_ids[chunk_start + 1:end + 1], top_n)


def compute(logits_of, spans: list[PromptSpan], device: torch.device) -> list[PromptLogprobs]:
    """The spans' logprobs. `logits_of(rows) -> logits` is the model's head on those rows of
    the step's batch (a list): under tensor parallelism a collective that every rank of the
    last stage calls alike, which is why each rank calls this (and only the sampling rank
    keeps the result)."""
    rows = [s.first_row + i for s in spans for i in range(len(s.targets))]
    targets = torch.tensor([t for s in spans for t in s.targets], dtype=torch.long, device=device)
    top_n = max(s.top_n for s in spans)
    token_lp, ranks, top_lp, top_ids = [], [], [], []
    for lo in range(0, len(rows), ROWS_PER_PASS):
        logprobs = torch.log_softmax(logits_of(rows[lo:lo + ROWS_PER_PASS]).float(), dim=-1)
        mine = logprobs.gather(1, targets[lo:lo + ROWS_PER_PASS].unsqueeze(1))
        token_lp.append(mine.squeeze(1))
        ranks.append((logprobs > mine).sum(dim=1) + 1)
        if top_n:
            values, ids = logprobs.topk(top_n, dim=-1)
            top_lp.append(values)
            top_ids.append(ids)
    token_lp_l = torch.cat(token_lp).tolist()
    ranks_l = torch.cat(ranks).tolist()
    top_lp_l = torch.cat(top_lp).tolist() if top_n else None
    top_ids_l = torch.cat(top_ids).tolist() if top_n else None
    out, k = [], 0
    for s in spans:
        lps = []
        for t in s.targets:
            top = list(zip(top_ids_l[k][:s.top_n], top_lp_l[k][:s.top_n])) if s.top_n else []
            lps.append(TokenLogprob(t, token_lp_l[k], top, ranks_l[k]))
            k += 1
        out.append(PromptLogprobs(s.seq_id, s.start, lps))
    return out
