"""Triton paged attention (and the tree-verify entry point) == the torch reference."""

from __future__ import annotations

import pytest
import torch

from specserve.kernels import reference
from specserve.kernels.paged_attention import paged_attention
from specserve.model.attention import AttentionMetadata
from specserve.tree import ancestor_mask

from ._device import DEVICE, INTERPRETED, to_device

TOL = {torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}


def make_case(ctx_and_q_lens, num_q_heads, num_kv_heads, head_dim, block_size, dtype, seed, custom_mask=None):
    """Random q and pool for sequences given as (ctx_len, q_len), blocks shuffled in the pool."""
    gen = torch.Generator().manual_seed(seed)
    seq_lens = [c + q for c, q in ctx_and_q_lens]
    blocks_per_seq = [(s + block_size - 1) // block_size for s in seq_lens]
    num_blocks = sum(blocks_per_seq) + 3  # a few blocks nobody owns
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    max_blocks = max(blocks_per_seq)
    block_tables = torch.zeros(len(seq_lens), max_blocks, dtype=torch.int32)
    slot_mapping, i = [], 0
    for s, (n, (ctx, q_len)) in enumerate(zip(blocks_per_seq, ctx_and_q_lens)):
        block_tables[s, :n] = torch.tensor(perm[i : i + n], dtype=torch.int32)
        i += n
        for pos in range(ctx, ctx + q_len):
            slot_mapping.append(int(block_tables[s, pos // block_size]) * block_size + pos % block_size)
    q_lens = [q for _, q in ctx_and_q_lens]
    cu = torch.tensor([0] + q_lens, dtype=torch.int32).cumsum(0, dtype=torch.int32)
    num_tokens = int(cu[-1])
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slot_mapping, dtype=torch.int64),
        block_tables=block_tables,
        cu_query_lens=cu,
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        max_query_len=max(q_lens),
        max_seq_len=max(seq_lens),
        custom_mask=custom_mask,
    )
    q = torch.randn(num_tokens, num_q_heads, head_dim, generator=gen).to(dtype)
    k_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=gen).to(dtype)
    v_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=gen).to(dtype)
    return q, k_cache, v_cache, meta


def check(q, k_cache, v_cache, meta, dtype, fn=paged_attention):
    scale = q.shape[-1] ** -0.5
    want = reference.paged_attention(q.double(), k_cache.double(), v_cache.double(), meta, scale)
    got = fn(q.to(DEVICE), k_cache.to(DEVICE), v_cache.to(DEVICE), to_device(meta), scale).cpu()
    assert got.dtype == dtype and got.shape == q.shape
    torch.testing.assert_close(got.double(), want, atol=TOL[dtype], rtol=TOL[dtype])


MIXED = [(0, 7), (5, 1), (13, 1), (3, 5), (0, 1), (17, 19)]  # prefill, decode, chunked prefill


@pytest.mark.parametrize("heads", [(4, 2), (2, 2), (8, 1)], ids=["gqa4:2", "mha", "mqa8:1"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_mixed_prefill_decode_batch(heads, dtype):
    check(*make_case(MIXED, *heads, head_dim=16, block_size=4, dtype=dtype, seed=0), dtype)


def test_decode_only_long_context_odd_block_size():
    lens = [(37, 1), (1, 1), (64, 1)]
    check(*make_case(lens, 4, 2, head_dim=32, block_size=5, dtype=torch.float32, seed=1), torch.float32)


@pytest.mark.parametrize("head_dim", [24, 8])
def test_head_dim_not_power_of_two_or_below_16(head_dim):
    lens = [(6, 3), (0, 9), (11, 1)]
    check(*make_case(lens, 4, 2, head_dim=head_dim, block_size=8, dtype=torch.float32, seed=2), torch.float32)


@pytest.mark.skipif(
    INTERPRETED,
    reason="the Triton 3.9 interpreter's tl.dot returns garbage for bf16 operands (checked with a "
    "bare 16x16 dot); the kernel's bf16 path is exercised on a GPU",
)
def test_bfloat16():
    check(*make_case([(5, 3), (9, 1)], 4, 2, 16, 4, torch.bfloat16, seed=3), torch.bfloat16)


def test_small_query_tiles_span_several_programs():
    q, k, v, meta = make_case([(3, 21), (0, 2)], 2, 2, 16, 4, torch.float32, seed=4)
    scale = 0.25
    want = reference.paged_attention(q, k, v, meta, scale)
    got = paged_attention(q.to(DEVICE), k.to(DEVICE), v.to(DEVICE), to_device(meta), scale, block_q=8, block_n=16).cpu()
    torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)


TREES = [
    ([-1, -1, 0, 0, 1, 2, 5], 1),  # top-2 tree behind one pending token
    ([-1], 1),  # one node
    ([], 1),  # plain decode row inside the verify batch
    ([-1, 0, 1, 2], 2),  # chain behind two pending tokens
    ([-1, -1, -1, 0, 1, 1], 3),
]


def build_tree_mask(parents_per_seq, num_pending_per_seq) -> torch.Tensor:
    """[T, max_q] verify mask of sequences of pending tokens then a tree each, from the engine's
    one builder (tree.ancestor_mask): the pending tokens form a chain, the tree hangs off the
    last of them."""
    blocks = []
    for parents, pending in zip(parents_per_seq, num_pending_per_seq):
        chain = list(range(-1, pending - 1))
        blocks.append(ancestor_mask(chain + [pending - 1 if p < 0 else pending + p for p in parents]))
    width = max(len(b) for b in blocks)
    return torch.tensor([row + [False] * (width - len(row)) for b in blocks for row in b])


def test_build_tree_mask():
    mask = build_tree_mask([[-1, -1, 0, 2], []], [2, 1])
    rows = [
        [1, 0, 0, 0, 0, 0],  # pending 0
        [1, 1, 0, 0, 0, 0],  # pending 1
        [1, 1, 1, 0, 0, 0],  # node 0
        [1, 1, 0, 1, 0, 0],  # node 1 (sibling of 0: does not see it)
        [1, 1, 1, 0, 1, 0],  # node 2, child of 0
        [1, 1, 1, 0, 1, 1],  # node 3, child of 2
        [1, 0, 0, 0, 0, 0],  # the second sequence's pending token
    ]
    assert mask.tolist() == [[bool(x) for x in r] for r in rows]


@pytest.mark.parametrize("heads", [(4, 2), (2, 2)], ids=["gqa4:2", "mha"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_tree_attention_custom_mask(heads, dtype):
    parents = [p for p, _ in TREES]
    pending = [n for _, n in TREES]
    mask = build_tree_mask(parents, pending)
    ctx = [11, 0, 6, 4, 9]
    lens = [(c, n + len(p)) for c, (p, n) in zip(ctx, TREES)]
    check(*make_case(lens, *heads, 16, 4, dtype, seed=5, custom_mask=mask), dtype, fn=paged_attention)


def test_tree_attention_equals_each_branch_run_as_a_chain():
    """A node's output under the tree mask equals causal attention over its root path."""
    parents, pending, ctx = [-1, -1, 0, 1, 2], 1, 6
    q, k, v, meta = make_case([(ctx, pending + 5)], 2, 1, 16, 4, torch.float32, seed=6,
                              custom_mask=build_tree_mask([parents], [pending]))  # fmt: skip
    out = paged_attention(q.to(DEVICE), k.to(DEVICE), v.to(DEVICE), to_device(meta), 0.25).cpu()
    path = [0, 1, 3, 5]  # pending token, node 0, node 2, node 4 (rows in this step)
    # rebuild a pool holding the path contiguously and attend causally
    table = meta.block_tables[0].tolist()
    flat_k, flat_v = k.view(-1, 1, 16), v.view(-1, 1, 16)
    slots = [table[p // 4] * 4 + p % 4 for p in list(range(ctx)) + [ctx + r for r in path]]
    chain = AttentionMetadata(
        slot_mapping=torch.zeros(0, dtype=torch.int64), block_tables=torch.tensor([[0, 1, 2]], dtype=torch.int32),
        cu_query_lens=torch.tensor([0, 4], dtype=torch.int32), seq_lens=torch.tensor([10], dtype=torch.int32),
        max_query_len=4, max_seq_len=10)  # fmt: skip
    chain_k = torch.zeros(3 * 4, 1, 16)
    chain_v = torch.zeros(3 * 4, 1, 16)
    chain_k[:10], chain_v[:10] = flat_k[slots], flat_v[slots]
    want = reference.paged_attention(q[path], chain_k.view(3, 4, 1, 16), chain_v.view(3, 4, 1, 16), chain, 0.25)
    torch.testing.assert_close(out[path], want, atol=1e-5, rtol=1e-5)
