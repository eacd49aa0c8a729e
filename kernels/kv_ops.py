"""K/V slot operations on the pool layout [NB, BS, Hkv, D]: write this step's K/V into its
slots, and compact an accepted tree path (DESIGN.md §4).

A slot is block_id * BS + offset, so cache.view(NB * BS, Hkv * D) makes every slot one
contiguous row of ROW = Hkv * D elements; both kernels move whole rows.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _write_kv_kernel(
    k_ptr,  # [T, ROW]
    v_ptr,  # [T, ROW]
    k_cache_ptr,  # [NB * BS, ROW]
    v_cache_ptr,  # [NB * BS, ROW]
    slot_mapping_ptr,  # [T] int64, -1 = skip
    ROW: tl.constexpr,
    BLOCK: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + t)
    if slot < 0:
        return
    for start in tl.static_range(0, ROW, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        in_row = offs < ROW
        k = tl.load(k_ptr + t * ROW + offs, mask=in_row)
        v = tl.load(v_ptr + t * ROW + offs, mask=in_row)
        tl.store(k_cache_ptr + slot * ROW + offs, k.to(k_cache_ptr.dtype.element_ty), mask=in_row)
        tl.store(v_cache_ptr + slot * ROW + offs, v.to(v_cache_ptr.dtype.element_ty), mask=in_row)


def _row_block(row: int) -> int:
    return min(triton.next_power_of_2(row), 4096)


def write_kv(
    k: torch.Tensor,  # [T, Hkv, D]
    v: torch.Tensor,  # [T, Hkv, D]
    k_cache: torch.Tensor,  # [NB, BS, Hkv, D]
    v_cache: torch.Tensor,  # [NB, BS, Hkv, D]
    slot_mapping: torch.Tensor,  # [T] int64, -1 = skip
) -> None:
    """k_cache.view(-1, Hkv, D)[slot_mapping[t]] = k[t] (cast to the cache dtype), and v alike."""
    assert k.dim() == 3 and k.shape == v.shape, f"write_kv: k {tuple(k.shape)} / v {tuple(v.shape)} must be [T, Hkv, D]"
    assert k_cache.dim() == 4 and k_cache.shape == v_cache.shape, (
        f"write_kv: caches must be [NB, BS, Hkv, D], got {tuple(k_cache.shape)} / {tuple(v_cache.shape)}"
    )
    assert k.shape[1:] == k_cache.shape[2:], f"write_kv: k heads/dim {tuple(k.shape[1:])} != cache {tuple(k_cache.shape[2:])}"
    assert slot_mapping.dtype == torch.int64 and slot_mapping.shape == (k.shape[0],), (
        f"write_kv: slot_mapping must be [{k.shape[0]}] int64, got {tuple(slot_mapping.shape)} {slot_mapping.dtype}"
    )
    for name, t in (("k", k), ("v", v), ("k_cache", k_cache), ("v_cache", v_cache), ("slot_mapping", slot_mapping)):
        assert t.is_contiguous(), f"write_kv: {name} must be contiguous"
        assert t.device == k_cache.device, f"write_kv: {name} on {t.device}, k_cache on {k_cache.device}"
    if k.shape[0] == 0:
        return
    row = k.shape[1] * k.shape[2]
    _write_kv_kernel[(k.shape[0],)](k, v, k_cache, v_cache, slot_mapping, ROW=row, BLOCK=_row_block(row))


@triton.jit(do_not_specialize=["M"])   # the slot count changes every step
def _move_rows_kernel(
    cache_ptrs,  # [C] int64 addresses of the caches of one group (same dtype and ROW)
    slots_ptr,  # [M] int64
    tmp_ptr,  # [C, M, ROW]
    M,
    ROW: tl.constexpr,
    BLOCK: tl.constexpr,
    TO_CACHE: tl.constexpr,  # False: cache rows -> tmp (gather); True: tmp -> cache rows (scatter)
):
    m = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1).to(tl.int64)
    cache = tl.load(cache_ptrs + c).to(tl.pointer_type(tmp_ptr.dtype.element_ty))
    slot = tl.load(slots_ptr + m)
    for start in tl.static_range(0, ROW, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        if TO_CACHE:
            vals = tl.load(tmp_ptr + (c * M + m) * ROW + offs, mask=offs < ROW)
            tl.store(cache + slot * ROW + offs, vals, mask=offs < ROW)
        else:
            vals = tl.load(cache + slot * ROW + offs, mask=offs < ROW)
            tl.store(tmp_ptr + (c * M + m) * ROW + offs, vals, mask=offs < ROW)


# (device, dtype, data_ptrs) -> device tensor of the addresses; the caches live as long as
# the engine, so the table is built once per group instead of once per step.
_pointer_tables: dict[tuple, torch.Tensor] = {}


def _pointer_table(caches: list[torch.Tensor]) -> torch.Tensor:
    key = (caches[0].device, tuple(c.data_ptr() for c in caches))
    table = _pointer_tables.get(key)
    if table is None:
        table = torch.tensor(key[1], dtype=torch.int64, device=caches[0].device)
        _pointer_tables[key] = table
    return table


def copy_slots(
    caches: list[torch.Tensor],  # every [NB, BS, Hkv, D] cache of both models
    src_slots: torch.Tensor,  # [M] int64
    dst_slots: torch.Tensor,  # [M] int64
) -> None:
    """Every cache's slot dst[m] takes what slot src[m] held before the call.

    Compaction moves accepted nodes down the scratch region, so a destination can be another
    move's source (node at +5 -> +3 while node at +3 -> +1). All reads happen before any
    write: one launch gathers every source row of every cache into a temporary, a second
    launch scatters it (kernel launches on one stream are ordered). Caches of one dtype and
    row size share a launch through a table of their addresses, so compaction costs two
    launches per group (usually one group: both models in one dtype and head shape, or two).
    Destinations must be distinct.
    """
    assert src_slots.shape == dst_slots.shape and src_slots.dim() == 1, (
        f"copy_slots: src {tuple(src_slots.shape)} and dst {tuple(dst_slots.shape)} must be the same [M]"
    )
    assert src_slots.dtype == torch.int64 and dst_slots.dtype == torch.int64, "copy_slots: slots must be int64"
    num_slots = src_slots.shape[0]
    if num_slots == 0 or not caches:
        return
    groups: dict[tuple, list[torch.Tensor]] = {}
    for cache in caches:
        assert cache.dim() == 4 and cache.is_contiguous(), (
            f"copy_slots: caches must be contiguous [NB, BS, Hkv, D], got {tuple(cache.shape)}"
        )
        assert cache.device == src_slots.device == dst_slots.device, "copy_slots: caches and slots on one device"
        groups.setdefault((cache.dtype, cache.shape[2] * cache.shape[3]), []).append(cache)
    src, dst = src_slots.contiguous(), dst_slots.contiguous()
    for (dtype, row), group in groups.items():
        table = _pointer_table(group)
        tmp = torch.empty(len(group), num_slots, row, dtype=dtype, device=src.device)
        grid = (num_slots, len(group))
        _move_rows_kernel[grid](table, src, tmp, num_slots, ROW=row, BLOCK=_row_block(row), TO_CACHE=False)
        _move_rows_kernel[grid](table, dst, tmp, num_slots, ROW=row, BLOCK=_row_block(row), TO_CACHE=True)
