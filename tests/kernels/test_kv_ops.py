"""Triton write_kv / copy_slots == the torch references."""

from __future__ import annotations

import pytest
import torch

from specserve.kernels import kv_ops, reference

from ._device import DEVICE


# (k/v dtype, cache dtype). fp32 -> bf16 is left out: the interpreter rounds it toward zero
# where torch and the GPU round to nearest even.
DTYPES = [(torch.float32, torch.float32), (torch.float16, torch.float16), (torch.bfloat16, torch.bfloat16),
          (torch.float32, torch.float16)]  # fmt: skip


@pytest.mark.parametrize("dtypes", DTYPES, ids=lambda d: f"{d[0]}->{d[1]}".replace("torch.", ""))
@pytest.mark.parametrize("heads_dim", [(2, 16), (3, 10)])
def test_write_kv_equals_reference(dtypes, heads_dim):
    in_dtype, dtype = dtypes
    gen = torch.Generator().manual_seed(0)
    num_kv_heads, head_dim = heads_dim
    num_blocks, block_size, num_tokens = 5, 4, 11
    k = torch.randn(num_tokens, num_kv_heads, head_dim, generator=gen).to(in_dtype)
    v = torch.randn(num_tokens, num_kv_heads, head_dim, generator=gen).to(in_dtype)
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:num_tokens]
    slots[[2, 7]] = -1  # padding rows are skipped
    caches = [torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=gen).to(dtype) for _ in range(2)]
    want = [c.clone() for c in caches]
    old = caches[0].clone().view(-1, num_kv_heads, head_dim)
    reference.write_kv(k, v, want[0], want[1], slots)
    on_device = [c.to(DEVICE) for c in caches]
    kv_ops.write_kv(k.to(DEVICE), v.to(DEVICE), on_device[0], on_device[1], slots.to(DEVICE))
    caches = [c.cpu() for c in on_device]
    assert torch.equal(caches[0], want[0]) and torch.equal(caches[1], want[1])
    # written rows hold k; every other slot (including the skipped rows') kept its old value
    rows = caches[0].view(-1, num_kv_heads, head_dim)
    keep = slots >= 0
    assert torch.equal(rows[slots[keep]], k[keep].to(dtype))
    untouched = torch.ones(num_blocks * block_size, dtype=torch.bool)
    untouched[slots[keep]] = False
    assert torch.equal(rows[untouched], old[untouched])


def test_copy_slots_overlapping_chains_and_two_models():
    """Compaction where destinations are other moves' sources, across caches of two models
    with different head shapes and dtypes (two launch groups)."""
    gen = torch.Generator().manual_seed(1)
    target = [torch.randn(6, 4, 2, 16, generator=gen) for _ in range(4)]  # 2 layers x (k, v)
    draft = [torch.randn(6, 4, 1, 8, generator=gen).half() for _ in range(2)]
    caches = target + draft
    # accepted nodes at positions +3, +5, +6 of a sequence move to +1, +2, +3 (slots 9.. in block 2)
    src = torch.tensor([12, 14, 15, 7], dtype=torch.int64)
    dst = torch.tensor([10, 11, 12, 14], dtype=torch.int64)  # 12 and 14 are also sources
    before = [c.clone() for c in caches]
    want = [c.clone() for c in caches]
    reference.copy_slots(want, src, dst)
    on_device = [c.to(DEVICE) for c in caches]
    kv_ops.copy_slots(on_device, src.to(DEVICE), dst.to(DEVICE))
    caches = [c.cpu() for c in on_device]
    for w, c in zip(want, caches):
        assert torch.equal(w, c)
    # every destination holds what its source held before the call, in every cache
    for old, new in zip(before, caches):
        old_rows, new_rows = old.view(-1, *old.shape[2:]), new.view(-1, *new.shape[2:])
        assert torch.equal(new_rows[dst], old_rows[src])


def test_copy_slots_empty_is_a_no_op():
    cache = torch.randn(2, 4, 1, 16)
    kept = cache.clone()
    kv_ops.copy_slots([cache], torch.zeros(0, dtype=torch.int64), torch.zeros(0, dtype=torch.int64))
    assert torch.equal(cache, kept)
