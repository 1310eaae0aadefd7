"""Tree-shaped drafts (Medusa's candidate trees): which of the heads' guesses a verify step
computes, the rows each may attend to, and the walk that keeps one path of them.

A shape is a set of paths: the path (i1, ..., id) is the node of depth d holding the i1-th
guess of head 1, then under it the i2-th guess of head 2, and so on; every prefix of a path
is a path too. Nodes are ordered as their paths sort (depth-first, the better guesses first),
so the chain of first guesses comes first and a node's ancestors come before it. A verify
step computes the sequence's last token (row 0) and then one row per node (node n: row n + 1)
at position last + depth; a row attends to the sequence's cached tokens and to the rows of
its own path (its ancestors and itself), nothing else of the step."""

from __future__ import annotations

from meshserve.configs.heads_file import tree_problem


class TreeShape:
    def __init__(self, paths: list[list[int]] | list[tuple[int, ...]]):
        problem = tree_problem([list(p) for p in paths])
        if problem:
            raise ValueError(problem)
        self.paths = sorted({tuple(p) for p in paths})
        index = {p: i for i, p in enumerate(self.paths)}
        self.parents = [index[p[:-1]] if len(p) > 1 else -1 for p in self.paths]
        self.depths = [len(p) for p in self.paths]
        self.depth = max(self.depths)
        self.top_k = [1 + max(p[d] for p in self.paths if len(p) > d) for d in range(self.depth)]
        """Guesses needed of each head, nearest first."""

    @property
    def chain_length(self) -> int:
        """The leading nodes that form a chain (the first guesses', depth-first first)."""
        n = 0
        while n < len(self.parents) and self.parents[n] == n - 1:
            n += 1
        return n

    def __len__(self) -> int:
        return len(self.paths)

    def tokens(self, guesses: list[list[int]]) -> list[int]:
        """Each node's token, from each head's guesses (best first)."""
        return [guesses[len(p) - 1][p[-1]] for p in self.paths]


def row_masks(parents: list[int]) -> list[int]:
    """Of a verify step's rows for one tree (row 0 the last token, node n row n + 1), the rows
    each may attend to, as a bit mask over them: itself and its ancestors."""
    masks = [1]
    for n, parent in enumerate(parents):
        masks.append(masks[parent + 1] | 1 << (n + 1))
    return masks


def accept_path(row_tokens: list[int], tokens: list[int], parents: list[int]) -> list[int]:
    """The nodes kept, root first: from row 0, the token sampled at the current row is kept
    and, where a child of the current node holds it, that child's row is next. Each kept token
    is drawn from the target given the tokens kept before it (the child's row computes exactly
    that prefix), so the output has the target's distribution however the tree was guessed."""
    children: dict[int, dict[int, int]] = {}
    for n, (token, parent) in enumerate(zip(tokens, parents)):
        children.setdefault(parent, {}).setdefault(token, n)
    path, node = [], -1
    while True:
        child = children.get(node, {}).get(row_tokens[node + 1])
        if child is None:
            return path
        path.append(child)
        node = child


def row_skips(parents: list[int]) -> list[int]:
    """Of a verify step's rows for one tree, the keys each does not attend to among the rows
    before it, bit j for the row j before it (layers.attention.set_tree_skips): the rows of
    other branches."""
    skips = []
    for r, mask in enumerate(row_masks(parents)):
        skips.append(sum(1 << (r - earlier) for earlier in range(r) if not mask >> earlier & 1))
    return skips


def tree_paths(tokens: list[int], parents: list[int]) -> list[list[int]]:
    """Each node's path of tokens, root first (its ancestors', then its own)."""
    paths: list[list[int]] = []
    for token, parent in zip(tokens, parents):
        paths.append((paths[parent] if parent >= 0 else []) + [token])
    return paths


def placed(tokens: list[int], draft: list[int], parents: list[int]) -> int:
    """Of the nodes a verify step kept (`tokens`: the kept tokens, the last the one sampled
    after them), how many lead the path in their depth's row: node n's K/V went to the row
    after the last token plus n + 1, where depth - 1 == n only along the chain of first
    guesses (nodes sort depth-first). Those count as computed; the K/V of kept nodes after
    them lie in other rows and are computed again."""
    node, count = -1, 0
    for i, token in enumerate(tokens[:-1]):
        node = next(n for n, (t, p) in enumerate(zip(draft, parents)) if p == node and t == token)
        if node != i:
            break
        count += 1
    return count
