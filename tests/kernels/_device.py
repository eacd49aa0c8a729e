"""Where the kernel tests put their tensors: CUDA for native Triton, else CPU (interpreter)."""

import os

import torch

DEVICE = "cuda" if torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1" else "cpu"
INTERPRETED = DEVICE == "cpu"


def to_device(meta):
    """AttentionMetadata with its tensors on DEVICE."""
    from dataclasses import replace

    return replace(
        meta,
        slot_mapping=meta.slot_mapping.to(DEVICE),
        block_tables=meta.block_tables.to(DEVICE),
        cu_query_lens=meta.cu_query_lens.to(DEVICE),
        seq_lens=meta.seq_lens.to(DEVICE),
        custom_mask=None if meta.custom_mask is None else meta.custom_mask.to(DEVICE),
    )
