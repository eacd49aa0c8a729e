"""Device dispatch: Triton kernels on CUDA, the torch references everywhere else."""

from __future__ import annotations

import torch

from specserve.kernels import reference
from specserve.model.attention import AttentionMetadata


def _use_triton(t: torch.Tensor) -> bool:
    return t.is_cuda


def on_triton(t: torch.Tensor) -> bool:
    """Whether `t`'s forward runs on the Triton kernels (and the fused ones below)."""
    return _use_triton(t)


# The fused per-row kernels (kernels/fused.py): the model calls them only where on_triton
# holds; on the CPU it keeps its torch ops.
def add_rms_norm(x, residual, weight, eps: float):
    from specserve.kernels import fused

    return fused.add_rms_norm(x, residual, weight, eps)


def silu_mul(gate_up):
    from specserve.kernels import fused

    return fused.silu_mul(gate_up)


def rope_write_kv(qkv, cos, sin, k_cache, v_cache, slot_mapping, num_q_heads: int):
    from specserve.kernels import fused

    return fused.rope_write_kv(qkv, cos, sin, k_cache, v_cache, slot_mapping, num_q_heads)


def write_kv(k, v, k_cache, v_cache, slot_mapping, has_skipped_slots: bool = True) -> None:
    if _use_triton(k):
        from specserve.kernels import kv_ops

        return kv_ops.write_kv(k, v, k_cache, v_cache, slot_mapping)
    return reference.write_kv(k, v, k_cache, v_cache, slot_mapping, has_skipped_slots)


def paged_attention(q, k_cache, v_cache, meta: AttentionMetadata, scale: float) -> torch.Tensor:
    if _use_triton(q):
        from specserve.kernels import paged_attention as pa

        # The op-by-op forward splits q out of the joint RoPE tensor (a strided view, which the
        # torch reference reads as it is); the kernel wants rows it can index densely
        # (tests/kernels/test_engine_on_kernels.py).
        return pa.paged_attention(q.contiguous(), k_cache, v_cache, meta, scale)
    return reference.paged_attention(q, k_cache, v_cache, meta, scale)


def copy_slots(caches, src_slots, dst_slots) -> None:
    if caches and _use_triton(caches[0]):
        from specserve.kernels import kv_ops

        return kv_ops.copy_slots(caches, src_slots, dst_slots)
    return reference.copy_slots(caches, src_slots, dst_slots)


def tree_accept(
    target_probs,  # [B, N+1, V] float32
    target_argmax,  # [B, N+1] int64
    draft_probs,  # [B, N, V] float32
    tokens,  # [B, N] int64
    parents,  # [B, N] int32
    is_sampled,  # [B, N] bool
    num_nodes,  # [B] int32
    is_greedy,  # [B] bool
    uniforms,  # [B, N+1] float32
    max_depth: int | None = None,
):
    """-> (accepted [B, max_depth] int32, num_accepted [B] int32, bonus [B] int64); see
    kernels/tree_accept.py. max_depth defaults to N."""
    args = (target_probs, target_argmax, draft_probs, tokens, parents, is_sampled, num_nodes, is_greedy, uniforms)
    if _use_triton(target_probs):
        from specserve.kernels import tree_accept as ta

        return ta.tree_accept(*args, max_depth=max_depth)
    return reference.tree_accept_reference(*args, max_depth=max_depth)
