"""DraftTree bookkeeping (depths, paths, verify mask, select) and the n-gram lookup: pure Python."""

from __future__ import annotations

import pytest
import torch

from specserve.drafts.ngram import NgramDrafter, lookup
from specserve.drafts.base import TreeShape
from specserve.request import Request
from specserve.sampling import SamplingParams
from specserve.scheduler import ScheduledSeq
from specserve.tree import DraftTree, fixed_tree_size

#        root
#       /    \
#      0(10)  1(11)
#     /  \      \
#   2(20) 3(21)  4(22)
#    |
#   5(30)
TREE = DraftTree(
    tokens=[10, 11, 20, 21, 22, 30],
    parents=[-1, -1, 0, 0, 1, 2],
    is_sampled=[False] * 6,
    draft_probs=torch.arange(6, dtype=torch.float32)[:, None].repeat(1, 3),
    path_probs=[0.6, 0.3, 0.4, 0.1, 0.2, 0.35],
)


def test_depths_paths_chain():
    assert TREE.depths == [1, 1, 2, 2, 2, 3]
    assert TREE.max_depth == 3
    assert TREE.num_nodes == 6
    assert not TREE.is_chain
    assert TREE.path(5) == [0, 2, 5]
    assert TREE.path(4) == [1, 4]
    assert TREE.path(0) == [0]
    chain = DraftTree.chain([7, 8, 9])
    assert chain.is_chain and chain.parents == [-1, 0, 1] and chain.depths == [1, 2, 3]
    assert chain.path(2) == [0, 1, 2]
    assert DraftTree().max_depth == 0 and DraftTree().is_chain


def test_verify_mask_is_ancestor_closure():
    mask = TREE.verify_mask()
    assert len(mask) == 7 and all(len(r) == 7 for r in mask)
    assert mask[0] == [True] + [False] * 6  # the pending token sees only itself
    for k in range(6):
        row = mask[k + 1]
        visible = {j - 1 for j in range(1, 7) if row[j]}
        assert row[0], "every node sees the pending token"
        assert visible == set(TREE.path(k)), f"node {k}"
    # A chain's mask is causal.
    cm = DraftTree.chain([1, 2, 3]).verify_mask()
    assert cm == [[j <= i for j in range(4)] for i in range(4)]


def test_select_reindexes_bfs_and_keeps_data():
    sub = TREE.select([5, 2, 0, 1])
    # BFS order by (depth, old index): 0, 1, 2, 5.
    assert sub.tokens == [10, 11, 20, 30]
    assert sub.parents == [-1, -1, 0, 2]
    assert sub.depths == [1, 1, 2, 3]
    assert sub.path_probs == [0.6, 0.3, 0.4, 0.35]
    assert sub.draft_probs[:, 0].tolist() == [0.0, 1.0, 2.0, 5.0]
    assert sub.verify_mask()[4] == [True, True, False, True, True]
    assert TREE.select([]).num_nodes == 0


def test_select_rejects_a_set_without_its_ancestors():
    with pytest.raises(AssertionError):
        TREE.select([0, 5])  # 5's parent 2 is missing


def test_select_sorts_bfs_even_when_input_indices_are_not():
    # A tree built depth-first (not BFS): select() must put parents before children.
    dfs = DraftTree(tokens=[1, 2, 3, 4], parents=[-1, 0, 1, -1], is_sampled=[False] * 4, path_probs=[1, 1, 1, 1])
    bfs = dfs.select([0, 1, 2, 3])
    assert bfs.tokens == [1, 4, 2, 3]
    assert bfs.parents == [-1, -1, 0, 2]
    assert all(p < k for k, p in enumerate(bfs.parents))


@pytest.mark.parametrize(
    "branching,depth,expected",
    [([3, 2, 1], 3, 3 + 6 + 6), ([3, 2, 1], 2, 9), ([3, 2, 1], 1, 3), ([4, 2, 2, 1], 4, 4 + 8 + 16 + 16),
     ([4, 2, 2, 1], 9, 44), ([2], 0, 0), ([1, 1, 1, 1], 4, 4)],
)
def test_fixed_tree_size(branching, depth, expected):
    assert fixed_tree_size(branching, depth) == expected


def test_ngram_lookup():
    toks = [1, 2, 3, 4, 5, 9, 2, 3, 4]
    # Longest suffix first: [2, 3, 4] occurred at index 1, followed by 5, 9, 2.
    assert lookup(toks, 1, 3, 3) == [5, 9, 2]
    assert lookup(toks, 1, 3, 1) == [5]
    # Continuation is cut at the end of the sequence.
    assert lookup(toks, 1, 3, 10) == [5, 9, 2, 3, 4]
    # No earlier occurrence of any suffix of length >= ngram_min.
    assert lookup([1, 2, 3, 4], 1, 3, 3) == []
    assert lookup([7], 1, 3, 3) == []
    # The most recent earlier occurrence wins.
    assert lookup([5, 1, 5, 2, 5], 1, 1, 1) == [2]
    # ngram_min is honoured: only a 1-gram matches here, and 2-grams are required.
    assert lookup([8, 3, 9, 3], 2, 3, 2) == []
    assert lookup([8, 3, 9, 3], 1, 3, 2) == [9, 3]
    # A longer match is preferred over a more recent shorter one.
    assert lookup([1, 2, 7, 0, 2, 8, 1, 2], 1, 2, 1) == [7]


def test_ngram_drafter_proposes_chains_within_budget():
    req = Request("a", [1, 2, 3, 4, 1, 2], SamplingParams(max_tokens=4), [])
    drafter = NgramDrafter(1, 3)
    trees = drafter.propose(
        [ScheduledSeq(req, 1, num_spec_nodes=2), ScheduledSeq(req, 1, num_spec_nodes=0)],
        TreeShape(kind="fixed", depth=4, branching=(3, 2)),
        [],
    )
    assert trees[0].tokens == [3, 4] and trees[0].is_chain and trees[0].is_sampled == [False, False]
    assert trees[1].num_nodes == 0
