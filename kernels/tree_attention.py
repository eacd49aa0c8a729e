"""The verify pass: the pending token(s) and every draft tree node of each sequence attend to
the sequence's paged prefix plus their own ancestors, in one launch (DESIGN.md §5).

Choice: the verify pass reuses the paged-attention kernel with a dense boolean mask
[T, max_query_len] rather than a specialised kernel reading a per-node ancestor bitmask.
The mask holds (pending + nodes)^2 bits per sequence — for a 64-node tree 4 KiB, against
megabytes of K/V the same program reads from the pool — so the bitmask would save no
bandwidth that matters, while one kernel means one thing to test and tune. Only the
key tiles that overlap this step's tokens read the mask; the context tiles never do.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from specserve.kernels.paged_attention import paged_attention
from specserve.model.attention import AttentionMetadata


def build_tree_mask(
    parents_per_seq: Sequence[Sequence[int]],  # per sequence: parent node index, -1 = root; BFS
    num_pending_per_seq: Sequence[int],  # per sequence: pending tokens before the tree
    device: torch.device | str = "cpu",
) -> torch.Tensor:  # [T, max_query_len] bool
    """Ancestor mask of the verify pass, rows in the flattened order of the batch.

    Sequence i contributes q_len_i = num_pending_i + num_nodes_i rows (pending tokens first,
    then the nodes in BFS order). Pending token j sees pending tokens 0..j (causal); node n
    sees every pending token, its ancestors and itself. Columns past q_len_i are False.
    """
    assert len(parents_per_seq) == len(num_pending_per_seq), (
        f"build_tree_mask: {len(parents_per_seq)} trees for {len(num_pending_per_seq)} sequences"
    )
    q_lens = [int(p) + len(parents) for parents, p in zip(parents_per_seq, num_pending_per_seq)]
    max_query_len = max(q_lens, default=0)
    mask = torch.zeros(sum(q_lens), max_query_len, dtype=torch.bool)
    row0 = 0
    for parents, num_pending, q_len in zip(parents_per_seq, num_pending_per_seq, q_lens):
        num_pending = int(num_pending)
        seq_mask = mask[row0 : row0 + q_len]
        seq_mask[:num_pending, :num_pending] = torch.ones(num_pending, num_pending, dtype=torch.bool).tril()
        for n, parent in enumerate(parents):
            parent = int(parent)
            assert -1 <= parent < n, f"build_tree_mask: node {n} has parent {parent}; parents must come first"
            row = num_pending + n
            if parent >= 0:  # a node sees what its parent sees, and itself
                seq_mask[row] = seq_mask[num_pending + parent]
            else:
                seq_mask[row, :num_pending] = True
            seq_mask[row, row] = True
        row0 += q_len
    return mask.to(device)


def tree_attention(
    q: torch.Tensor,  # [T, Hq, D]
    k_cache: torch.Tensor,  # [NB, BS, Hkv, D]
    v_cache: torch.Tensor,  # [NB, BS, Hkv, D]
    meta: AttentionMetadata,  # custom_mask required (build_tree_mask)
    scale: float,
) -> torch.Tensor:  # [T, Hq, D]
    """Verify-pass attention with the tree mask; the Triton paged kernel does the work."""
    assert meta.custom_mask is not None, "tree_attention: meta.custom_mask is required (see build_tree_mask)"
    return paged_attention(q, k_cache, v_cache, meta, scale)
