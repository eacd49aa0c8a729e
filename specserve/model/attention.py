"""Metadata of one flattened forward: which rows belong to which sequence, where K/V go."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class AttentionMetadata:
    """See docs/INTERNALS.md. Sequence i owns query rows cu_query_lens[i]:cu_query_lens[i+1];
    its keys are its first seq_lens[i] positions, the last q_len of which are this step's tokens.
    Key k < ctx_len is visible to all its rows; key ctx_len + j to row t iff custom_mask[t, j]
    (or causally, j <= local row index, when custom_mask is None)."""

    slot_mapping: torch.Tensor  # [T] int64, -1 = do not write
    block_tables: torch.Tensor  # [B, max_blocks] int32
    cu_query_lens: torch.Tensor  # [B + 1] int32
    seq_lens: torch.Tensor  # [B] int32
    max_query_len: int
    max_seq_len: int
    custom_mask: torch.Tensor | None = None  # [T, max_query_len] bool
    # Host copies of cu_query_lens / seq_lens (the CPU path loops over sequences; building
    # them once per forward spares a device->host read in every layer).
    cu_query_lens_list: list[int] | None = None
    seq_lens_list: list[int] | None = None
    has_skipped_slots: bool = True  # any slot_mapping == -1 (the runner says when there is none)
    # Per-forward scratch of the CPU path (e.g. each sequence's visibility mask, built in the
    # first layer and reused by the others).
    scratch: dict = field(default_factory=dict, repr=False, compare=False)

    @property
    def num_seqs(self) -> int:
        return self.seq_lens.shape[0]
