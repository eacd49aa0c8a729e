"""Slow, obviously-correct torch versions of every kernel.

They are the ground truth the Triton kernels are tested against, and the CPU path.
"""

from __future__ import annotations

import torch

from specserve.model.attention import AttentionMetadata


def write_kv(
    k: torch.Tensor,  # [T, Hkv, D]
    v: torch.Tensor,  # [T, Hkv, D]
    k_cache: torch.Tensor,  # [NB, BS, Hkv, D]
    v_cache: torch.Tensor,  # [NB, BS, Hkv, D]
    slot_mapping: torch.Tensor,  # [T] int64, -1 = skip
) -> None:
    keep = slot_mapping >= 0
    slots = slot_mapping[keep]
    k_cache.view(-1, *k_cache.shape[2:])[slots] = k[keep].to(k_cache.dtype)
    v_cache.view(-1, *v_cache.shape[2:])[slots] = v[keep].to(v_cache.dtype)


def gather_kv(cache: torch.Tensor, block_table: torch.Tensor, seq_len: int) -> torch.Tensor:
    """The first seq_len positions of one sequence: [seq_len, Hkv, D]."""
    block_size = cache.shape[1]
    num_blocks = (seq_len + block_size - 1) // block_size
    blocks = cache[block_table[:num_blocks].long()]  # [n, BS, Hkv, D]
    return blocks.reshape(-1, *cache.shape[2:])[:seq_len]


def paged_attention(
    q: torch.Tensor,  # [T, Hq, D]
    k_cache: torch.Tensor,  # [NB, BS, Hkv, D]
    v_cache: torch.Tensor,  # [NB, BS, Hkv, D]
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:  # [T, Hq, D]
    out = torch.empty_like(q)
    num_q_heads, num_kv_heads = q.shape[1], k_cache.shape[2]
    group = num_q_heads // num_kv_heads
    cu = meta.cu_query_lens.tolist()
    seq_lens = meta.seq_lens.tolist()
    for i, seq_len in enumerate(seq_lens):
        start, end = cu[i], cu[i + 1]
        q_len = end - start
        if q_len == 0:
            continue
        ctx_len = seq_len - q_len
        k = gather_kv(k_cache, meta.block_tables[i], seq_len)  # [S, Hkv, D]
        v = gather_kv(v_cache, meta.block_tables[i], seq_len)
        k = k.repeat_interleave(group, dim=1).transpose(0, 1).to(q.dtype)  # [Hq, S, D]
        v = v.repeat_interleave(group, dim=1).transpose(0, 1).to(q.dtype)
        qi = q[start:end].transpose(0, 1)  # [Hq, q_len, D]
        scores = torch.matmul(qi, k.transpose(1, 2)) * scale  # [Hq, q_len, S]
        visible = torch.ones(q_len, seq_len, dtype=torch.bool, device=q.device)
        if meta.custom_mask is not None:
            visible[:, ctx_len:] = meta.custom_mask[start:end, :q_len]
        else:
            visible[:, ctx_len:] = torch.ones(q_len, q_len, dtype=torch.bool, device=q.device).tril()
        scores = scores.masked_fill(~visible, float("-inf"))
        probs = torch.softmax(scores.float(), dim=-1).to(q.dtype)
        out[start:end] = torch.matmul(probs, v).transpose(0, 1)
    return out


def copy_slots(
    caches: list[torch.Tensor],  # each [NB, BS, Hkv, D]
    src_slots: torch.Tensor,  # [M] int64
    dst_slots: torch.Tensor,  # [M] int64
) -> None:
    """Compaction: every cache's slot dst[m] takes slot src[m]. All reads happen before writes."""
    for cache in caches:
        flat = cache.view(-1, *cache.shape[2:])
        flat[dst_slots] = flat[src_slots].clone()
