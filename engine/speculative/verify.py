"""Which proposed tokens the target keeps: the acceptance rule, on the sampling rank.

A sequence with drafts d_1..d_k is computed with them in one step, and the sampling rank
samples one token at each of its k + 1 rows: t_j after the known tokens and d_1..d_{j-1},
each row with its own parameters and randomness (a seeded row as it would without drafts:
its generator is keyed by the sequence's length there). The output is t_1, and t_{j+1} for
as long as t_j == d_j: the accepted drafts and then one token the target chose itself.

Why this is exactly the target's distribution: a proposer gives one token per position, a
proposal distribution q = 1 at d_j. Rejection sampling (Leviathan et al. 2023, Chen et al.
2023) accepts d_j with probability min(1, p(d_j) / q(d_j)) = p(d_j) and otherwise samples
from the residual max(0, p - q), normalized: p without d_j. Drawing t_j ~ p and accepting
when t_j == d_j does both at once: d_j is kept with probability p(d_j), and a rejected row's
t_j is p conditioned on t_j != d_j. Each row's p is the target's given the tokens before it,
and a row is used only if every draft before it was kept, so every output token is sampled
from the target given the actual output so far. Greedy rows accept while the argmax agrees.
"""

from __future__ import annotations


def accept(row_tokens: list[int], drafts: list[list[int]]) -> list[int]:
    """Tokens kept per sequence. `row_tokens`: the sampled token of every row, the rows of
    each sequence together (1 + len(its drafts) of them); `drafts`: each sequence's drafts."""
    counts = []
    row = 0
    for draft in drafts:
        kept = 1
        while kept <= len(draft) and row_tokens[row + kept - 1] == draft[kept - 1]:
            kept += 1
        counts.append(kept)
        row += len(draft) + 1
    return counts
