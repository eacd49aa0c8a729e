"""The CPU path's batched attention (uniform query lengths) equals the per-sequence
explicit computation (float64), for decode batches, chains and tree masks."""

from __future__ import annotations

import random

import pytest
import torch

from specserve.kernels import reference
from specserve.model.attention import AttentionMetadata


def make_case(num_seqs: int, q_len: int, tree: bool, seed: int, q_lens: list[int] | None = None):
    """q_lens: each sequence's query rows (default: q_len for all); tree masks over all of them."""
    rng = random.Random(seed)
    g = torch.Generator().manual_seed(seed)
    q_lens = q_lens or [q_len] * num_seqs
    num_seqs, width_q = len(q_lens), max(q_lens)
    block_size, hkv, hq, d = 4, 2, 4, 8
    num_blocks = 16 + sum(-(-(23 + n) // block_size) for n in q_lens)
    k_cache = torch.randn(num_blocks, block_size, hkv, d, generator=g, dtype=torch.float64)
    v_cache = torch.randn(num_blocks, block_size, hkv, d, generator=g, dtype=torch.float64)
    free = list(range(num_blocks))
    rng.shuffle(free)
    seq_lens, tables = [], []
    for n_q in q_lens:
        n = rng.randint(n_q, 23 + n_q)  # odd lengths, partial blocks
        seq_lens.append(n)
        tables.append([free.pop() for _ in range(-(-n // block_size))])
    width = max(len(t) for t in tables)
    block_tables = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
    cu = [0]
    for n_q in q_lens:
        cu.append(cu[-1] + n_q)
    mask = None
    if tree:  # row 0 the pending token; each node sees the pending token, an ancestor chain and itself
        mask = torch.zeros(cu[-1], width_q, dtype=torch.bool)
        for b, n_q in enumerate(q_lens):
            parents = [-1] + [rng.randrange(0, i) for i in range(1, n_q)]
            for t in range(n_q):
                node = t
                while node >= 0:
                    mask[cu[b] + t, node] = True
                    node = parents[node]
    meta = AttentionMetadata(
        slot_mapping=torch.zeros(cu[-1], dtype=torch.int64), block_tables=block_tables,
        cu_query_lens=torch.tensor(cu, dtype=torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32), max_query_len=width_q, max_seq_len=max(seq_lens),
        custom_mask=mask,
    )
    q = torch.randn(cu[-1], hq, d, generator=g, dtype=torch.float64)
    return q, k_cache, v_cache, meta


@pytest.mark.parametrize("q_len,tree", [(1, False), (3, False), (3, True), (5, True)])
@pytest.mark.parametrize("seed", range(3))
def test_uniform_batch_path_equals_explicit(q_len, tree, seed):
    q, k_cache, v_cache, meta = make_case(5, q_len, tree, seed)
    expected = reference.paged_attention(q, k_cache, v_cache, meta, 0.3)  # float64: per-sequence loop
    got = reference.paged_attention(q.float(), k_cache.float(), v_cache.float(), meta, 0.3)
    assert "uniform_mask" in meta.scratch, "the batched path was not taken"
    # Three rows run padded to four (the CPU's SDPA is faster so); the padded row is dropped.
    assert meta.scratch["uniform_mask"].shape[2] == (4 if q_len == 3 else q_len)
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


@pytest.mark.parametrize("q_lens,tree", [
    ([1, 1, 1, 17, 1], False),        # decoding sequences beside a prompt chunk
    ([4, 4, 3, 4, 4, 1], False),      # chains at one depth, one cut short, one plain row
    ([5, 5, 5, 2, 2, 9], True),       # trees of two sizes and a lone one
])
@pytest.mark.parametrize("seed", range(3))
def test_mixed_batch_groups_equal_explicit(q_lens, tree, seed):
    # A batch whose sequences differ in query rows runs one batched attention per row count
    # shared by two or more sequences and loops over the rest; every row must equal the
    # float64 per-sequence computation, whichever way it went.
    q, k_cache, v_cache, meta = make_case(0, 0, tree, seed, q_lens=q_lens)
    expected = reference.paged_attention(q, k_cache, v_cache, meta, 0.3)
    meta.scratch.clear()
    got = reference.paged_attention(q.float(), k_cache.float(), v_cache.float(), meta, 0.3)
    shared = {n for n in q_lens if q_lens.count(n) > 1}
    assert {k[1] for k in meta.scratch if isinstance(k, tuple) and k[0] == "uniform_mask"} == shared
    torch.testing.assert_close(got.double(), expected, atol=1e-5, rtol=1e-5)
