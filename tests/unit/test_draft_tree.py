"""Tree-shaped drafts (engine/speculative/tree.py): the shape's order, parents and masks,
and the acceptance walk against a brute force over root-to-node paths and, for a chain,
against the chain rule (verify.accept)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from meshserve.configs.heads_file import MAX_TREE_NODES
from meshserve.engine.speculative.tree import TreeShape, accept_path, placed, row_masks, row_skips, tree_paths
from meshserve.engine.speculative.verify import accept

MEDUSA = [[0], [1], [2], [0, 0], [0, 1], [1, 0], [0, 0, 0]]


def test_the_shape_puts_the_chain_of_first_guesses_first_and_ancestors_before_nodes():
    shape = TreeShape(MEDUSA)
    assert shape.paths[:3] == [(0,), (0, 0), (0, 0, 0)]
    assert all(shape.parents[n] < n for n in range(len(shape)))
    assert shape.depths == [len(p) for p in shape.paths] and shape.depth == 3 and shape.top_k == [3, 2, 1]
    guesses = [[10, 11, 12], [20, 21], [30]]
    assert shape.tokens(guesses) == [10, 20, 30, 21, 11, 20, 12]


@pytest.mark.parametrize("paths, message", [([], "non-empty"), ([[0, 1]], r"tree path \[0\] is missing"),
                                            ([[-1]], "non-empty")])
def test_a_bad_shape_says_what_is_wrong(paths, message):
    with pytest.raises(ValueError, match=message):
        TreeShape(paths)


def test_a_row_attends_to_its_path_only():
    shape = TreeShape(MEDUSA)
    masks = row_masks(shape.parents)
    for row, mask in enumerate(masks):
        seen = {r for r in range(len(masks)) if mask >> r & 1}
        want = {0}
        node = row - 1
        while node >= 0:
            want.add(node + 1)
            node = shape.parents[node]
        assert seen == want


trees = st.lists(st.lists(st.integers(0, 2), min_size=1, max_size=4), min_size=1, max_size=12).map(
    lambda paths: sorted({tuple(p[:i]) for p in paths for i in range(1, len(p) + 1)})).filter(
    lambda paths: len(paths) <= MAX_TREE_NODES)


@settings(max_examples=300, deadline=None)
@given(paths=trees, data=st.data())
def test_the_walk_keeps_the_longest_path_the_samples_agree_with(paths, data):
    shape = TreeShape(paths)
    tokens = shape.tokens([[10 * h + i for i in range(3)] for h in range(4)])
    rows = data.draw(st.lists(st.sampled_from(tokens + [99]), min_size=len(shape) + 1, max_size=len(shape) + 1))
    kept = accept_path(rows, tokens, shape.parents)
    for a, b in zip([-1] + kept, kept):  # each kept node is a child of the one before, holding its row's sample
        assert shape.parents[b] == a and tokens[b] == rows[a + 1]
    last = kept[-1] if kept else -1
    assert not any(shape.parents[n] == last and tokens[n] == rows[last + 1] for n in range(len(shape)))


@given(drafts=st.lists(st.integers(0, 3), max_size=6), data=st.data())
def test_a_chain_is_kept_as_the_chain_rule_keeps_it(drafts, data):
    rows = data.draw(st.lists(st.integers(0, 3), min_size=len(drafts) + 1, max_size=len(drafts) + 1))
    parents = list(range(-1, len(drafts) - 1))
    assert len(accept_path(rows, drafts, parents)) + 1 == accept(rows, [drafts])[0]


def test_placed_counts_the_kept_nodes_in_their_depths_row():
    shape = TreeShape([[0], [1], [0, 0], [1, 0], [0, 0, 0]])  # nodes (0,), (0, 0), (0, 0, 0), (1,), (1, 0)
    tokens = shape.tokens([[10, 11], [20], [30]])
    assert tokens == [10, 20, 30, 11, 20]
    assert placed([10, 20, 30, 7], tokens, shape.parents) == 3  # the chain: every node in place
    assert placed([10, 7], tokens, shape.parents) == 1
    assert placed([11, 20, 7], tokens, shape.parents) == 0  # node (1,) sits in row 4, not row 1
    assert placed([7], tokens, shape.parents) == 0
    assert shape.chain_length == 3 and TreeShape([[0], [1]]).chain_length == 1


def test_a_node_s_path_is_its_ancestors_tokens_then_its_own():
    assert tree_paths([10, 20, 11, 21], [-1, 0, -1, 2]) == [[10], [10, 20], [11], [11, 21]]


def test_row_skips_leave_out_the_rows_of_other_branches():
    # root's children 0 and 1; node 2 under node 0; node 3 under node 1
    parents = [-1, -1, 0, 1]
    skips = row_skips(parents)
    assert skips[0] == 0 and skips[1] == 0  # the last token; node 0 sees it
    assert skips[2] == 0b10  # node 1 (row 2) skips node 0 (row 1, one before it)
    assert skips[3] == 0b10  # node 2 (row 3) under node 0 skips node 1 (row 2); sees rows 1 and 0
    assert skips[4] == 0b1010  # node 3 (row 4) under node 1 skips node 2 (row 3) and node 0 (row 1)
    chain = row_skips([-1, 0, 1])
    assert chain == [0, 0, 0, 0]
