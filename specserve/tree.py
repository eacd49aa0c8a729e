"""DraftTree: the tokens a drafter proposes for one sequence, as a tree rooted at the
sequence's pending token (the last token, whose KV the target has not computed yet).

Nodes are in BFS order, parents before children. Node k sits at depth d (1 = child of the
root); in the verify pass its RoPE position is `num_tokens - 1 + d` and its KV is written to
the scratch slot of position `num_tokens + k`, right after the pending token.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class DraftTree:
    tokens: list[int] = field(default_factory=list)  # [n] node token ids
    parents: list[int] = field(default_factory=list)  # [n] parent node index, -1 = the root
    is_sampled: list[bool] = field(default_factory=list)  # [n] drawn from draft_probs (else chosen deterministically)
    draft_probs: torch.Tensor | None = None  # [n, V] distribution each sampled node was drawn from
    path_probs: list[float] = field(default_factory=list)  # [n] draft probability of the path to each node

    @property
    def num_nodes(self) -> int:
        return len(self.tokens)

    @property
    def depths(self) -> list[int]:
        depths: list[int] = []
        for p in self.parents:
            depths.append(1 if p < 0 else depths[p] + 1)
        return depths

    @property
    def max_depth(self) -> int:
        return max(self.depths, default=0)

    @property
    def is_chain(self) -> bool:
        return all(p == k - 1 for k, p in enumerate(self.parents))

    def path(self, node: int) -> list[int]:
        """Node indices from depth 1 down to `node`."""
        out = []
        while node >= 0:
            out.append(node)
            node = self.parents[node]
        return out[::-1]

    def verify_mask(self) -> list[list[bool]]:
        """[(1 + n), (1 + n)] visibility among the verify rows: row 0 is the pending token (the
        root), row 1 + k is node k."""
        return ancestor_mask([-1] + [p + 1 for p in self.parents])

    def select(self, keep: list[int]) -> DraftTree:
        """The subtree of the nodes in `keep` (which must be closed under taking parents),
        re-indexed in BFS order."""
        keep_set = set(keep)
        for k in keep:
            assert self.parents[k] < 0 or self.parents[k] in keep_set, "select() needs an ancestor-closed set"
        depths = self.depths
        order = sorted(keep, key=lambda k: (depths[k], k))
        new_index = {old: new for new, old in enumerate(order)}
        probs = None
        if self.draft_probs is not None:
            probs = self.draft_probs[torch.tensor(order, dtype=torch.long)] if order else self.draft_probs[:0]
        return DraftTree(
            tokens=[self.tokens[k] for k in order],
            parents=[new_index[self.parents[k]] if self.parents[k] >= 0 else -1 for k in order],
            is_sampled=[self.is_sampled[k] for k in order],
            draft_probs=probs,
            path_probs=[self.path_probs[k] for k in order] if self.path_probs else [],
        )

    @staticmethod
    def chain(tokens: list[int], is_sampled: bool = False, draft_probs: torch.Tensor | None = None) -> DraftTree:
        return DraftTree(
            tokens=list(tokens),
            parents=list(range(-1, len(tokens) - 1)),
            is_sampled=[is_sampled] * len(tokens),
            draft_probs=draft_probs,
        )


def fixed_tree_size(branching: list[int], depth: int) -> int:
    """Nodes of a fixed tree cut at `depth`: every node at depth d has branching[d-1] children."""
    total, width = 0, 1
    for b in branching[:depth]:
        width *= b
        total += width
    return total


def ancestor_mask(parents: list[int]) -> list[list[bool]]:
    """[n, n] visibility among n rows of a tree, parents[i] < i (-1: none): row i sees itself
    and its ancestors. The one builder of tree attention masks (verify pass and draft levels)."""
    mask = []
    for i, p in enumerate(parents):
        row = mask[p][:] if p >= 0 else [False] * len(parents)
        row[i] = True
        mask.append(row)
    return mask
