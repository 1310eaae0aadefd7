"""Proposers: guess the tokens that follow a sequence, on the driver, before a step.

A proposer returns token ids only. Verification treats each proposal as a point mass, for
which rejection sampling needs no proposal probabilities (meshserve.engine.speculative.verify),
so a proposer may be a lookup, a tree or a model alike.
"""

from __future__ import annotations

from typing import Protocol

from meshserve.engine.sequence import Sequence


class Proposer(Protocol):
    def propose(self, seqs: list[Sequence], max_tokens: list[int]) -> list[list[int]]:
        """For each of `seqs`, up to its `max_tokens` tokens likely to follow its token_ids
        (none: no guess; a sequence asked for 0 gets none). One call per step, so a model
        can propose for the whole batch at once."""

    def drop(self, seq_id: int) -> None:
        """`seq_id` finished: forget what was kept for it."""

    @property
    def caught_up(self) -> int:
        """Tokens the last `propose` computed beyond a step's usual one or two before its
        first proposals (a draft model's first call for a sequence prefills its prompt, and
        one that sat out steps catches up on them): a cost the draft policy must not take for
        the price of each proposed position. 0 for a proposer that keeps no model state."""

    def backlog(self, seq: Sequence) -> int:
        """The tokens `propose` would catch up on for `seq` now (what `caught_up` would count)."""


MAX_CANDIDATES = 8
"""Earlier occurrences of the last `min_n` tokens examined per proposal, most recent first."""


class _Index:
    """Where each `min_n`-gram of one sequence ended, for the tokens indexed so far."""

    def __init__(self) -> None:
        self.ends: dict[tuple[int, ...], list[int]] = {}
        self.indexed = 0
        """n-grams ending before this position are in `ends`."""


class NgramProposer:
    """Prompt lookup (vLLM's `ngram` method, llama.cpp's lookup decoding): find the latest
    earlier place where the sequence's last n tokens occurred, n from `max_n` down to `min_n`
    (the longest match wins, then the latest), and propose what followed it there, continued
    periodically past the sequence's end (a loop repeats). Model-free,
    so it pays off on output that copies its input: code edits, quoting summaries, extraction.

    Each sequence's index grows with its tokens (a dict from `min_n`-gram to where it ended),
    so a proposal costs O(new tokens + MAX_CANDIDATES * max_n), not a scan of the context."""

    def __init__(self, min_n: int, max_n: int):
        if not 1 <= min_n <= max_n:
            raise ValueError(f"n-gram sizes must satisfy 1 <= min_n <= max_n, got {min_n}, {max_n}")
        self.min_n, self.max_n = min_n, max_n
        self._index: dict[int, _Index] = {}

    def propose(self, seqs: list[Sequence], max_tokens: list[int]) -> list[list[int]]:
        return [self.propose_one(seq, k) for seq, k in zip(seqs, max_tokens)]

    def propose_one(self, seq: Sequence, max_tokens: int) -> list[int]:
        tokens = seq.token_ids
        length = len(tokens)
        if max_tokens <= 0 or length <= self.min_n:
            return []
        index = self._index.setdefault(seq.seq_id, _Index())
        n = self.min_n
        # n-grams ending before the last position: the suffix itself must not match itself
        for end in range(max(index.indexed, n), length):
            index.ends.setdefault(tuple(tokens[end - n:end]), []).append(end)
        index.indexed = max(index.indexed, length)
        candidates = index.ends.get(tuple(tokens[length - n:]))
        if not candidates:
            return []
        best_end, best_len = -1, 0
        for end in reversed(candidates[-MAX_CANDIDATES:]):
            matched = n
            while (matched < self.max_n and end - matched - 1 >= 0
                   and tokens[end - matched - 1] == tokens[length - matched - 1]):
                matched += 1
            if matched > best_len:
                best_end, best_len = end, matched
                if matched == self.max_n:
                    break
        # what followed there, copied past the sequence's end from the copy itself (as LZ77
        # copies overlap): a run of one token, or a loop shorter than max_tokens, continues
        proposal = tokens[best_end:best_end + max_tokens]
        while len(proposal) < max_tokens:
            proposal.append(proposal[len(proposal) - (length - best_end)])
        return proposal

    def drop(self, seq_id: int) -> None:
        self._index.pop(seq_id, None)

    caught_up = 0

    def backlog(self, seq: Sequence) -> int:
        return 0
