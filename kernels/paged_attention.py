"""Paged attention over the pool layout [NB, BS, Hkv, D] for the flattened batch of
docs/INTERNALS.md: prefill chunks, decode rows and the tree-verify pass in one launch.

Sequence i owns query rows cu_query_lens[i]:cu_query_lens[i+1] and keys 0..seq_lens[i]-1
(through block_tables[i]); with ctx_len = seq_len - q_len, key k < ctx_len is visible to
every row, key ctx_len + j to local row t iff custom_mask[row, j] (or j <= t, causal).

Grid: (sequence, query tile, kv head). A program takes BLOCK_Q query tokens of one sequence
and every query head of one GQA group, stacked as BLOCK_M = BLOCK_Q * GROUP_P2 rows
(row r = token r // GROUP_P2, head r % GROUP_P2), so each K/V tile read from the pool serves
the whole group — decode with Hq/Hkv = 8 fills 8 rows of the dot from one KV read.
Tiles past a sequence's q_len exit at once (the grid uses max_query_len, a host int, so no
device sync). Keys are visited BLOCK_N at a time with an online softmax (Milakov &
Gimelshein 2018, as in FlashAttention): running max m, running sum l, fp32 accumulator.
Causal tiles stop at the last key their last token can see.

Head dims that are not powers of two (80, 96) are padded to D_P2 and masked.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from specserve.model.attention import AttentionMetadata


# Triton compiles a variant per integer argument equal to 1 or divisible by 16, and per
# pointer 16-byte aligned or not. The table stride (the longest sequence's blocks) and the
# metadata views (slices of one packed buffer) change from step to step: each new variant
# would be a compile (about a second) inside a served step, booked by the controller as the
# pass's cost. These arguments gain nothing from specialising.
@triton.jit(do_not_specialize=["stride_bt", "stride_mask"],
            do_not_specialize_on_alignment=["block_tables_ptr", "cu_query_lens_ptr", "seq_lens_ptr", "mask_ptr"])
def _paged_attention_kernel(
    q_ptr,  # [T, Hq, D]
    k_cache_ptr,  # [NB, BS, Hkv, D]
    v_cache_ptr,  # [NB, BS, Hkv, D]
    out_ptr,  # [T, Hq, D]
    block_tables_ptr,  # [B, max_blocks] int32
    cu_query_lens_ptr,  # [B + 1] int32
    seq_lens_ptr,  # [B] int32
    mask_ptr,  # [T, max_query_len] int8 (only read when HAS_MASK)
    scale,
    stride_bt,  # block_tables.stride(0)
    stride_mask,  # custom_mask.stride(0)
    NUM_Q_HEADS: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    GROUP: tl.constexpr,  # Hq // Hkv
    GROUP_P2: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    D_P2: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,  # the pool's BS
    BLOCK_Q: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HAS_MASK: tl.constexpr,
    IEEE_DOT: tl.constexpr,  # fp32 inputs: exact fp32 dots, not tf32
):
    seq = tl.program_id(0)
    tile = tl.program_id(1)
    kv_head = tl.program_id(2)
    BLOCK_M: tl.constexpr = BLOCK_Q * GROUP_P2

    q_start = tl.load(cu_query_lens_ptr + seq)
    q_len = tl.load(cu_query_lens_ptr + seq + 1) - q_start
    if tile * BLOCK_Q >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    ctx_len = seq_len - q_len

    offs_m = tl.arange(0, BLOCK_M)
    local_tok = tile * BLOCK_Q + offs_m // GROUP_P2  # [BLOCK_M] row within this sequence
    head_in_group = offs_m % GROUP_P2
    row_valid = (local_tok < q_len) & (head_in_group < GROUP)
    q_head = kv_head * GROUP + head_in_group
    token = (q_start + local_tok).to(tl.int64)  # row of the flattened batch
    offs_d = tl.arange(0, D_P2)
    d_valid = offs_d < HEAD_DIM

    q_off = (token * NUM_Q_HEADS + q_head)[:, None] * HEAD_DIM + offs_d[None, :]
    q = tl.load(q_ptr + q_off, mask=row_valid[:, None] & d_valid[None, :], other=0.0)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, D_P2], dtype=tl.float32)

    if HAS_MASK:
        kv_end = seq_len
    else:  # causal: the tile's last token sees keys up to ctx_len + its local index
        kv_end = tl.minimum(seq_len, ctx_len + (tile + 1) * BLOCK_Q)

    bt_row = block_tables_ptr + seq.to(tl.int64) * stride_bt
    for start_n in range(0, kv_end, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)  # key positions
        n_valid = offs_n < kv_end
        block_id = tl.load(bt_row + offs_n // BLOCK_SIZE, mask=n_valid, other=0).to(tl.int64)
        slot = block_id * BLOCK_SIZE + offs_n % BLOCK_SIZE
        kv_off = (slot * NUM_KV_HEADS + kv_head)[:, None] * HEAD_DIM + offs_d[None, :]
        kv_mask = n_valid[:, None] & d_valid[None, :]
        k = tl.load(k_cache_ptr + kv_off, mask=kv_mask, other=0.0)  # [BLOCK_N, D_P2]
        v = tl.load(v_cache_ptr + kv_off, mask=kv_mask, other=0.0)
        k = k.to(q.dtype)
        v = v.to(q.dtype)

        if IEEE_DOT:
            s = tl.dot(q, tl.trans(k), input_precision="ieee")
        else:
            s = tl.dot(q, tl.trans(k))
        s = s * scale  # [BLOCK_M, BLOCK_N] fp32

        j = offs_n - ctx_len  # index among this step's tokens (< 0: context)
        if HAS_MASK:
            in_step = (j[None, :] >= 0) & n_valid[None, :] & row_valid[:, None]
            mask_off = token[:, None] * stride_mask + j[None, :]
            allowed = tl.load(mask_ptr + mask_off, mask=in_step, other=0) != 0
            visible = (j[None, :] < 0) | allowed
        else:
            visible = j[None, :] <= local_tok[:, None]
        visible = visible & n_valid[None, :] & row_valid[:, None]
        s = tl.where(visible, s, float("-inf"))

        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows that see nothing yet
        p = tl.exp(s - m_safe[:, None])
        alpha = tl.exp(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None]
        if IEEE_DOT:
            acc += tl.dot(p.to(v.dtype), v, input_precision="ieee")
        else:
            acc += tl.dot(p.to(v.dtype), v)
        m_i = m_new

    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    tl.store(out_ptr + q_off, out.to(out_ptr.dtype.element_ty), mask=row_valid[:, None] & d_valid[None, :])


_SUPPORTED = (torch.float16, torch.bfloat16, torch.float32)


def _num_warps(rows: int, d_p2: int) -> int:
    """8 warps for tiles of 64 query rows at head_dim 64 or more, else 4. Compiled for sm_90
    (cuobjdump --dump-resource-usage of the cubin), a 64-row tile at head_dim 128 with 4 warps
    needs 255 registers and spills 264-616 bytes to the stack (GQA 1, 4 and 8); with 8 warps it
    takes 182-222 and spills nothing. At head_dim 64 it sits at 255 with 4 warps, 173 with 8.
    Decode tiles (16 rows) do not spill with 4."""
    return 8 if rows * d_p2 >= 64 * 64 else 4


def paged_attention(
    q: torch.Tensor,  # [T, Hq, D]
    k_cache: torch.Tensor,  # [NB, BS, Hkv, D]
    v_cache: torch.Tensor,  # [NB, BS, Hkv, D]
    meta: AttentionMetadata,
    scale: float,
    block_q: int | None = None,
    block_n: int = 32,
) -> torch.Tensor:  # [T, Hq, D]
    """Triton paged attention; same contract as reference.paged_attention."""
    assert q.dim() == 3, f"paged_attention: q must be [T, Hq, D], got shape {tuple(q.shape)}"
    assert k_cache.dim() == 4, f"paged_attention: k_cache must be [NB, BS, Hkv, D], got {tuple(k_cache.shape)}"
    assert k_cache.shape == v_cache.shape, f"k_cache {tuple(k_cache.shape)} != v_cache {tuple(v_cache.shape)}"
    num_tokens, num_q_heads, head_dim = q.shape
    _, block_size, num_kv_heads, cache_head_dim = k_cache.shape
    assert cache_head_dim == head_dim, f"paged_attention: q head_dim {head_dim} != cache head_dim {cache_head_dim}"
    assert num_q_heads % num_kv_heads == 0, (
        f"paged_attention: Hq={num_q_heads} must be a multiple of Hkv={num_kv_heads}"
    )
    assert q.dtype in _SUPPORTED, f"paged_attention: q dtype {q.dtype} not in {_SUPPORTED}"
    assert k_cache.dtype == v_cache.dtype and k_cache.dtype in _SUPPORTED, (
        f"paged_attention: cache dtypes {k_cache.dtype}/{v_cache.dtype}, allowed {_SUPPORTED}"
    )
    for name, t in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache)):
        assert t.is_contiguous(), f"paged_attention: {name} must be contiguous"
        assert t.device == q.device, f"paged_attention: {name} on {t.device}, q on {q.device}"
    num_seqs = meta.seq_lens.shape[0]
    assert meta.cu_query_lens.shape == (num_seqs + 1,) and meta.cu_query_lens.dtype == torch.int32, (
        f"paged_attention: cu_query_lens must be [{num_seqs + 1}] int32"
    )
    assert meta.seq_lens.dtype == torch.int32, "paged_attention: seq_lens must be int32"
    assert meta.block_tables.dtype == torch.int32 and meta.block_tables.dim() == 2, (
        "paged_attention: block_tables must be [B, max_blocks] int32"
    )
    assert meta.block_tables.stride(1) == 1, "paged_attention: block_tables rows must be contiguous"
    mask = meta.custom_mask
    if mask is not None:
        assert mask.dtype == torch.bool and mask.dim() == 2 and mask.shape[0] == num_tokens, (
            f"paged_attention: custom_mask must be [T={num_tokens}, max_query_len] bool, "
            f"got {tuple(mask.shape)} {mask.dtype}"
        )
        assert mask.shape[1] >= meta.max_query_len and mask.stride(1) == 1, (
            "paged_attention: custom_mask needs max_query_len contiguous columns"
        )
        mask_arg, stride_mask = mask.view(torch.int8), mask.stride(0)
    else:
        mask_arg, stride_mask = meta.seq_lens, 0  # never read

    out = torch.empty_like(q)
    if num_tokens == 0 or num_seqs == 0:
        return out
    group = num_q_heads // num_kv_heads
    group_p2 = triton.next_power_of_2(group)
    if block_q is None:  # at most 64 rows (tokens x group heads) per program
        block_q = max(1, min(64 // group_p2, triton.next_power_of_2(max(meta.max_query_len, 1))))
    # tl.dot needs >= 16 rows, and tiles are powers of two
    block_q = max(triton.next_power_of_2(block_q), triton.cdiv(16, group_p2))
    grid = (num_seqs, triton.cdiv(max(meta.max_query_len, 1), block_q), num_kv_heads)
    _paged_attention_kernel[grid](
        q, k_cache, v_cache, out,
        meta.block_tables, meta.cu_query_lens, meta.seq_lens, mask_arg,
        float(scale), meta.block_tables.stride(0), stride_mask,
        NUM_Q_HEADS=num_q_heads, NUM_KV_HEADS=num_kv_heads, GROUP=group, GROUP_P2=group_p2,
        HEAD_DIM=head_dim, D_P2=max(16, triton.next_power_of_2(head_dim)),
        BLOCK_SIZE=block_size, BLOCK_Q=block_q, BLOCK_N=max(16, block_n),
        HAS_MASK=mask is not None, IEEE_DOT=q.dtype == torch.float32,
        num_warps=_num_warps(block_q * group_p2, max(16, triton.next_power_of_2(head_dim))),
    )  # fmt: skip
    return out
