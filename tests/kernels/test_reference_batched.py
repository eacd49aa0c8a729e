"""The CPU path's batched attention (uniform query lengths) equals the per-sequence
explicit computation (float64), for decode batches, chains and tree masks."""

from __future__ import annotations

import random

import pytest
import torch

from specserve.kernels import reference
from specserve.model.attention import AttentionMetadata


def make_case(num_seqs: int, q_len: int, tree: bool, seed: int):
    rng = random.Random(seed)
    g = torch.Generator().manual_seed(seed)
    block_size, hkv, hq, d, num_blocks = 4, 2, 4, 8, 64
    k_cache = torch.randn(num_blocks, block_size, hkv, d, generator=g, dtype=torch.float64)
    v_cache = torch.randn(num_blocks, block_size, hkv, d, generator=g, dtype=torch.float64)
    free = list(range(num_blocks))
    rng.shuffle(free)
    seq_lens, tables = [], []
    for _ in range(num_seqs):
        n = rng.randint(q_len, 23)  # odd lengths, partial blocks
        seq_lens.append(n)
        tables.append([free.pop() for _ in range(-(-n // block_size))])
    width = max(len(t) for t in tables)
    block_tables = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
    mask = None
    if tree:  # row 0 the pending token; each node sees the pending token, an ancestor chain and itself
        mask = torch.zeros(num_seqs * q_len, q_len, dtype=torch.bool)
        for b in range(num_seqs):
            parents = [-1] + [rng.randrange(0, i) for i in range(1, q_len)]
            for t in range(q_len):
                node = t
                while node >= 0:
                    mask[b * q_len + t, node] = True
                    node = parents[node]
    meta = AttentionMetadata(
        slot_mapping=torch.zeros(num_seqs * q_len, dtype=torch.int64), block_tables=block_tables,
        cu_query_lens=torch.arange(0, (num_seqs + 1) * q_len, q_len, dtype=torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32), max_query_len=q_len, max_seq_len=max(seq_lens),
        custom_mask=mask,
    )
    q = torch.randn(num_seqs * q_len, hq, d, generator=g, dtype=torch.float64)
    return q, k_cache, v_cache, meta


@pytest.mark.parametrize("q_len,tree", [(1, False), (3, False), (5, True)])
@pytest.mark.parametrize("seed", range(3))
def test_uniform_batch_path_equals_explicit(q_len, tree, seed):
    q, k_cache, v_cache, meta = make_case(5, q_len, tree, seed)
    expected = reference.paged_attention(q, k_cache, v_cache, meta, 0.3)  # float64: per-sequence loop
    got = reference.paged_attention(q.float(), k_cache.float(), v_cache.float(), meta, 0.3)
    assert "uniform_mask" in meta.scratch, "the batched path was not taken"
    torch.testing.assert_close(got.double(), expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("q_len,tree", [(2, False), (4, True), (9, True)])
@pytest.mark.parametrize("seed", range(3))
def test_few_rows_path_equals_explicit(q_len, tree, seed):
    # One sequence with a few query rows (a verified tree, a draft catch-up) takes the stacked
    # matmul path with its additive mask; it must equal the float64 explicit computation.
    q, k_cache, v_cache, meta = make_case(1, q_len, tree, seed)
    expected = reference.paged_attention(q, k_cache, v_cache, meta, 0.3)
    meta.scratch.clear()
    got = reference.paged_attention(q.float(), k_cache.float(), v_cache.float(), meta, 0.3)
    assert ("bias", 0) in meta.scratch, "the few-rows path was not taken"
    torch.testing.assert_close(got.double(), expected, atol=1e-5, rtol=1e-5)
    meta.scratch.clear()  # the scratch belongs to one forward, in one dtype
    half = reference.paged_attention(q.bfloat16(), k_cache.bfloat16(), v_cache.bfloat16(), meta, 0.3)
    torch.testing.assert_close(half.double(), expected, atol=3e-2, rtol=3e-2)
