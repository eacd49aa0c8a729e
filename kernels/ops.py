"""Device dispatch: Triton kernels on CUDA, the torch references everywhere else."""

from __future__ import annotations

import torch

from specserve.kernels import reference
from specserve.model.attention import AttentionMetadata


def _use_triton(t: torch.Tensor) -> bool:
    return t.is_cuda


def write_kv(k, v, k_cache, v_cache, slot_mapping) -> None:
    if _use_triton(k):
        from specserve.kernels import kv_ops

        return kv_ops.write_kv(k, v, k_cache, v_cache, slot_mapping)
    return reference.write_kv(k, v, k_cache, v_cache, slot_mapping)


def paged_attention(q, k_cache, v_cache, meta: AttentionMetadata, scale: float) -> torch.Tensor:
    if _use_triton(q):
        from specserve.kernels import paged_attention as pa

        return pa.paged_attention(q, k_cache, v_cache, meta, scale)
    return reference.paged_attention(q, k_cache, v_cache, meta, scale)


def copy_slots(caches, src_slots, dst_slots) -> None:
    if caches and _use_triton(caches[0]):
        from specserve.kernels import kv_ops

        return kv_ops.copy_slots(caches, src_slots, dst_slots)
    return reference.copy_slots(caches, src_slots, dst_slots)
