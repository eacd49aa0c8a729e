"""Fused per-row kernels for the GPU forward: fewer launches per layer.

A small-batch decode step on a GPU is bound by its kernel launches (benchmarks/RESULTS.md,
"On a GPU"), about 17 of them elementwise per layer (RMSNorm as four, the residual adds, RoPE
as five, the q/k copies, SiLU and its product). These kernels do that work in four launches
a layer:

- `add_rms_norm`: residual += x, then out = w * norm(residual), one program per row;
- `rope_write_kv`: q and k rotated out of the fused qkv projection's output, k and v written
  to their pool slots, q returned contiguous, one program per (token, head);
- `silu_mul`: silu(gate) * up out of the fused gate/up projection's output.

Each rounds where the torch ops it replaces round (bf16/fp16: the residual sum, the
normalised row before the weight, each RoPE product, the SiLU before the product), so a
16-bit model computes what the eager ops compute, up to the float32 reduction order inside
the norm and, in RoPE, a rare element one rounding away (Triton may contract the two
products into an FMA or fold a rounding), by no more than one rounding of each product. Every program reads one row, so a row's result does
not depend on the batch, which is what keeps greedy speculation exact.
On the CPU the model keeps its torch ops (kernels/ops.py dispatches).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _add_rms_norm_kernel(
    x_ptr,  # [T, N]
    res_ptr,  # [T, N] (read when HAS_RES)
    w_ptr,  # [N]
    out_ptr,  # [T, N]
    res_out_ptr,  # [T, N] (written when HAS_RES)
    N,
    eps,
    HAS_RES: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    in_row = cols < N
    x = tl.load(x_ptr + row * N + cols, mask=in_row, other=0.0)
    if HAS_RES:
        r = tl.load(res_ptr + row * N + cols, mask=in_row, other=0.0)
        h = (x.to(tl.float32) + r.to(tl.float32)).to(x.dtype)   # the sum, rounded like torch's add
        tl.store(res_out_ptr + row * N + cols, h, mask=in_row)
    else:
        h = x
    hf = h.to(tl.float32)
    inv = 1.0 / tl.sqrt(tl.sum(hf * hf, axis=0) / N + eps)
    normed = (hf * inv).to(x.dtype)   # the HF models round the normalised row before the weight
    w = tl.load(w_ptr + cols, mask=in_row, other=0.0)
    out = (w.to(tl.float32) * normed.to(tl.float32)).to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + row * N + cols, out, mask=in_row)


def _warps(block: int) -> int:
    return 4 if block <= 2048 else (8 if block <= 8192 else 16)


def add_rms_norm(
    x: torch.Tensor,  # [T, N]
    residual: torch.Tensor | None,  # [T, N] or None
    weight: torch.Tensor,  # [N]
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(weight * rms_norm(h), h) with h = residual + x (h = x without a residual); new tensors."""
    assert x.dim() == 2 and x.is_contiguous(), f"add_rms_norm: x must be a contiguous [T, N], got {tuple(x.shape)}"
    T, N = x.shape
    assert weight.shape == (N,) and weight.is_contiguous(), f"add_rms_norm: weight must be [{N}]"
    if residual is not None:
        assert residual.shape == x.shape and residual.is_contiguous() and residual.dtype == x.dtype, (
            f"add_rms_norm: residual {tuple(residual.shape)} {residual.dtype} must match x {tuple(x.shape)} {x.dtype}"
        )
    out = torch.empty_like(x)
    res_out = torch.empty_like(x) if residual is not None else x
    if T:
        block = triton.next_power_of_2(N)
        _add_rms_norm_kernel[(T,)](
            x, residual if residual is not None else x, weight, out, res_out, N, float(eps),
            HAS_RES=residual is not None, BLOCK=block, num_warps=_warps(block),
        )  # fmt: skip
    return out, res_out


@triton.jit
def _silu_mul_kernel(
    gu_ptr,  # [T, 2 * I]: gate then up
    out_ptr,  # [T, I]
    I,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    in_row = cols < I
    g = tl.load(gu_ptr + row * 2 * I + cols, mask=in_row, other=0.0)
    u = tl.load(gu_ptr + row * 2 * I + I + cols, mask=in_row, other=0.0)
    gf = g.to(tl.float32)
    s = (gf / (1.0 + tl.exp(-gf))).to(g.dtype)   # F.silu, rounded to the model dtype
    tl.store(out_ptr + row * I + cols, (s.to(tl.float32) * u.to(tl.float32)).to(out_ptr.dtype.element_ty),
             mask=in_row)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:  # [T, 2I] -> [T, I]
    """F.silu(gate) * up of the fused gate/up projection's output (gate first)."""
    assert gate_up.dim() == 2 and gate_up.is_contiguous() and gate_up.shape[1] % 2 == 0, (
        f"silu_mul: gate_up must be a contiguous [T, 2I], got {tuple(gate_up.shape)}"
    )
    T, two_i = gate_up.shape
    inter = two_i // 2
    out = torch.empty((T, inter), dtype=gate_up.dtype, device=gate_up.device)
    if T:
        block = min(triton.next_power_of_2(inter), 2048)
        _silu_mul_kernel[(T, triton.cdiv(inter, block))](gate_up, out, inter, BLOCK=block, num_warps=4)
    return out


@triton.jit
def _rope_write_kv_kernel(
    qkv_ptr,  # [T, (HQ + 2 * HKV) * D]
    cos_ptr,  # [T, D]: [cos, cos] in the model dtype
    sin_ptr,  # [T, D]: [-sin, sin] in the model dtype
    q_out_ptr,  # [T, HQ, D]
    k_cache_ptr,  # [NB * BS, HKV * D]
    v_cache_ptr,  # [NB * BS, HKV * D]
    slot_mapping_ptr,  # [T] int64, -1 = skip
    HQ: tl.constexpr,
    HKV: tl.constexpr,
    D: tl.constexpr,
    D_P2: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)   # q heads, then k heads, then v heads
    d = tl.arange(0, D_P2)
    in_head = d < D
    src = qkv_ptr + t * (HQ + 2 * HKV) * D + h * D
    x = tl.load(src + d, mask=in_head, other=0.0)
    if h < HQ + HKV:
        # x * cos + roll(x, D/2) * sin, each product rounded as the torch ops round it
        xr = tl.load(src + (d + D // 2) % D, mask=in_head, other=0.0)
        c = tl.load(cos_ptr + t * D + d, mask=in_head, other=0.0)
        s = tl.load(sin_ptr + t * D + d, mask=in_head, other=0.0)
        a = (x.to(tl.float32) * c.to(tl.float32)).to(x.dtype)
        b = (xr.to(tl.float32) * s.to(tl.float32)).to(x.dtype)
        x = (a.to(tl.float32) + b.to(tl.float32)).to(x.dtype)
    if h < HQ:
        tl.store(q_out_ptr + (t * HQ + h) * D + d, x, mask=in_head)
    else:
        slot = tl.load(slot_mapping_ptr + t)
        if slot >= 0:
            if h < HQ + HKV:
                tl.store(k_cache_ptr + slot * HKV * D + (h - HQ) * D + d,
                         x.to(k_cache_ptr.dtype.element_ty), mask=in_head)
            else:
                tl.store(v_cache_ptr + slot * HKV * D + (h - HQ - HKV) * D + d,
                         x.to(v_cache_ptr.dtype.element_ty), mask=in_head)


def rope_write_kv(
    qkv: torch.Tensor,  # [T, (Hq + 2 Hkv) * D]
    cos: torch.Tensor,  # [T, 1, D] or [T, D] (rope_full_tables)
    sin: torch.Tensor,  # [T, 1, D] or [T, D]
    k_cache: torch.Tensor,  # [NB, BS, Hkv, D]
    v_cache: torch.Tensor,  # [NB, BS, Hkv, D]
    slot_mapping: torch.Tensor,  # [T] int64, -1 = skip
    num_q_heads: int,
) -> torch.Tensor:  # [T, Hq, D]
    """The rotated q (contiguous); the rotated k and the v of every token written to its slot."""
    assert k_cache.dim() == 4 and k_cache.shape == v_cache.shape and k_cache.is_contiguous() and v_cache.is_contiguous(), (
        f"rope_write_kv: caches must be contiguous [NB, BS, Hkv, D], got {tuple(k_cache.shape)}"
    )
    _, _, hkv, d = k_cache.shape
    T = qkv.shape[0]
    assert qkv.dim() == 2 and qkv.is_contiguous() and qkv.shape[1] == (num_q_heads + 2 * hkv) * d, (
        f"rope_write_kv: qkv must be a contiguous [T, {(num_q_heads + 2 * hkv) * d}], got {tuple(qkv.shape)}"
    )
    cos, sin = cos.reshape(T, d), sin.reshape(T, d)
    assert cos.is_contiguous() and sin.is_contiguous() and cos.dtype == qkv.dtype, "rope_write_kv: tables as rope_full_tables"
    assert slot_mapping.dtype == torch.int64 and slot_mapping.shape == (T,), "rope_write_kv: slot_mapping must be [T] int64"
    q = torch.empty((T, num_q_heads, d), dtype=qkv.dtype, device=qkv.device)
    if T:
        _rope_write_kv_kernel[(T, num_q_heads + 2 * hkv)](
            qkv, cos, sin, q, k_cache, v_cache, slot_mapping,
            HQ=num_q_heads, HKV=hkv, D=d, D_P2=triton.next_power_of_2(d), num_warps=1 if d <= 64 else 2,
        )  # fmt: skip
    return q
