"""Kernel microbenchmarks (GPU): paged attention decode/prefill/tree-verify against a plain
torch equivalent, with achieved bandwidth; tree_accept against its reference; the fused
per-row kernels (kernels/fused.py) against the torch ops they replace, device and host time.

    python benchmarks/bench_kernels.py [--dtype float16] [--quick]

Every figure is printed with the device and the commit (STYLE.md 8). Bandwidth counts the
bytes a kernel must at least move (K/V of every visible position once per kv head, q and
out); the ceiling line is a measured device-to-device copy, so "% of copy" says how close
the kernel gets to what this GPU really streams. On a machine without CUDA the script says
so and exits 0.
"""

from __future__ import annotations

import argparse
import subprocess
import sys

import torch


def commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    except OSError:
        return "unknown"


def time_ms(fn, warmup=3, iters=20) -> float:
    """Median of CUDA-event timings, in ms."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


def copy_ceiling_gbs() -> float:
    """Measured device-to-device copy bandwidth (read + write), GB/s."""
    src = torch.empty(256 * 2**20, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    ms = time_ms(lambda: dst.copy_(src))
    return 2 * src.numel() / ms / 1e6


def make_batch(q_lens, ctx_lens, num_q_heads, num_kv_heads, head_dim, block_size, dtype, tree_mask=None):
    from specserve.model.attention import AttentionMetadata

    seq_lens = [c + q for c, q in zip(ctx_lens, q_lens)]
    blocks = [(s + block_size - 1) // block_size for s in seq_lens]
    num_blocks = sum(blocks)
    perm = torch.randperm(num_blocks)
    table = torch.zeros(len(seq_lens), max(blocks), dtype=torch.int32)
    i = 0
    for s, n in enumerate(blocks):
        table[s, :n] = perm[i : i + n].int()
        i += n
    cu = torch.tensor([0] + list(q_lens)).cumsum(0).int()
    meta = AttentionMetadata(
        slot_mapping=torch.zeros(int(cu[-1]), dtype=torch.int64, device="cuda"),
        block_tables=table.cuda(),
        cu_query_lens=cu.cuda(),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device="cuda"),
        max_query_len=max(q_lens),
        max_seq_len=max(seq_lens),
        custom_mask=None if tree_mask is None else tree_mask.cuda(),
    )
    q = torch.randn(int(cu[-1]), num_q_heads, head_dim, dtype=dtype, device="cuda")
    k = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, dtype=dtype, device="cuda")
    v = torch.randn_like(k)
    return q, k, v, meta


def torch_equivalent(q, k_cache, v_cache, meta, scale):
    """What one would write without a paged kernel: gather each sequence's K/V into a dense
    tensor and call SDPA with an explicit mask, one sequence at a time."""
    from specserve.kernels.reference import gather_kv

    out = torch.empty_like(q)
    cu = meta.cu_query_lens.tolist()
    group = q.shape[1] // k_cache.shape[2]
    for i, seq_len in enumerate(meta.seq_lens.tolist()):
        start, end = cu[i], cu[i + 1]
        q_len = end - start
        k = gather_kv(k_cache, meta.block_tables[i], seq_len).repeat_interleave(group, 1).transpose(0, 1)
        v = gather_kv(v_cache, meta.block_tables[i], seq_len).repeat_interleave(group, 1).transpose(0, 1)
        visible = torch.ones(q_len, seq_len, dtype=torch.bool, device=q.device)
        if meta.custom_mask is not None:
            visible[:, seq_len - q_len :] = meta.custom_mask[start:end, :q_len]
        else:
            visible[:, seq_len - q_len :] = visible[:, seq_len - q_len :].tril()
        o = torch.nn.functional.scaled_dot_product_attention(
            q[start:end].transpose(0, 1), k, v, attn_mask=visible, scale=scale
        )
        out[start:end] = o.transpose(0, 1)
    return out


def bench_attention(name, q_lens, ctx_lens, heads, head_dim, block_size, dtype, ceiling, tree_mask=None):
    from specserve.kernels.paged_attention import paged_attention

    num_q_heads, num_kv_heads = heads
    q, k, v, meta = make_batch(q_lens, ctx_lens, num_q_heads, num_kv_heads, head_dim, block_size, dtype, tree_mask)
    scale = head_dim**-0.5
    err = (paged_attention(q, k, v, meta, scale).float() - torch_equivalent(q, k, v, meta, scale).float()).abs().max()
    ms = time_ms(lambda: paged_attention(q, k, v, meta, scale))
    ms_torch = time_ms(lambda: torch_equivalent(q, k, v, meta, scale), iters=5)
    kv_bytes = 2 * sum(c + ql for c, ql in zip(ctx_lens, q_lens)) * num_kv_heads * head_dim * k.element_size()
    io_bytes = 2 * q.numel() * q.element_size()
    gbs = (kv_bytes + io_bytes) / ms / 1e6
    print(
        f"{name:<34} B={len(q_lens):<4} T={q.shape[0]:<6} kernel {ms:8.3f} ms  torch {ms_torch:8.3f} ms  "
        f"x{ms_torch / ms:6.1f}  {gbs:7.1f} GB/s ({100 * gbs / ceiling:4.1f}% of copy)  max|err| {err:.1e}"
    )


def bench_tree_accept(batch, vocab, depth, width):
    from specserve.kernels.reference import tree_accept_reference
    from specserve.kernels.tree_accept import tree_accept

    num_nodes = depth * width
    parents = torch.tensor([[-1 if n < width else n - width for n in range(num_nodes)]] * batch, dtype=torch.int32)
    probs = torch.softmax(torch.randn(batch, num_nodes + 1, vocab, device="cuda"), -1)
    argmax = probs.argmax(-1)
    draft = torch.softmax(torch.randn(batch, num_nodes, vocab, device="cuda"), -1)
    tokens = argmax[:, :num_nodes].clone()  # mostly-accepting trees: the expensive walks
    args = [probs, argmax, draft, tokens, parents.cuda(),
            torch.ones(batch, num_nodes, dtype=torch.bool, device="cuda"),
            torch.full((batch,), num_nodes, dtype=torch.int32, device="cuda"),
            torch.zeros(batch, dtype=torch.bool, device="cuda"),
            torch.rand(batch, num_nodes + 1, device="cuda")]  # fmt: skip
    workspace = torch.empty(batch, vocab, device="cuda")
    got = tree_accept(*args)
    want = tree_accept_reference(*[a.cpu() for a in args])
    same = all(torch.equal(g.cpu(), w) for g, w in zip(got, want))
    ms = time_ms(lambda: tree_accept(*args, workspace=workspace))
    ms_ref = time_ms(lambda: tree_accept_reference(*args), warmup=1, iters=3)
    print(
        f"tree_accept B={batch:<3} V={vocab:<7} nodes={num_nodes:<3} kernel {ms:8.3f} ms  "
        f"reference {ms_ref:9.1f} ms  x{ms_ref / ms:8.0f}  equal={same}"
    )


def host_ms(fn, iters=200) -> float:
    """Host time per call, in ms, of a launch sequence the device keeps up with: what a
    host-bound step pays for it (CUDA events time the device instead)."""
    import time

    for _ in range(10):
        fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(iters):
        fn()
    host = (time.perf_counter() - start) / iters * 1e3
    torch.cuda.synchronize()
    return host


def bench_fused(tokens: int, dtype, device: str = "cuda") -> None:
    """kernels/fused.py against the torch ops of the op-by-op forward, Llama-8B shapes (hidden
    4096, 32/8 heads of 128, MLP 14336): device ms (CUDA events) and host ms per call."""
    import torch.nn.functional as F

    from specserve.kernels import fused
    from specserve.kernels import ops as kops
    from specserve.model.llama import RMSNorm, apply_rope, rope_full_tables

    H, hq, hkv, d, inter = 4096, 32, 8, 128, 14336
    x = torch.randn(tokens, H, device=device, dtype=dtype)
    res = torch.randn(tokens, H, device=device, dtype=dtype)
    norm = RMSNorm(H, 1e-5).to(device=device, dtype=dtype)
    gate_up = torch.randn(tokens, 2 * inter, device=device, dtype=dtype)
    qkv = torch.randn(tokens, (hq + 2 * hkv) * d, device=device, dtype=dtype)
    angles = torch.rand(tokens, d // 2, device=device) * 6
    cos, sin = rope_full_tables(angles.cos(), angles.sin(), dtype)
    k_cache = torch.zeros(1024, 16, hkv, d, device=device, dtype=dtype)
    v_cache = torch.zeros_like(k_cache)
    slots = torch.randperm(1024 * 16, device=device)[:tokens]

    def torch_norm():
        h = res + x
        return norm.forward(h), h

    def torch_rope():
        q, k, v = qkv.split([hq * d, hkv * d, hkv * d], dim=-1)
        q, k = apply_rope(torch.cat([q.reshape(tokens, hq, d), k.reshape(tokens, hkv, d)], dim=1), cos, sin
                          ).split_with_sizes([hq, hkv], dim=1)
        q, k = q.contiguous(), k.contiguous()
        kops.write_kv(k, v.reshape(tokens, hkv, d).contiguous(), k_cache, v_cache, slots)
        return q

    def torch_silu():
        g, u = gate_up.chunk(2, dim=-1)
        return F.silu(g) * u

    cases = [("add + RMSNorm", torch_norm, lambda: fused.add_rms_norm(x, res, norm.weight, 1e-5)),
             ("RoPE + KV write", torch_rope, lambda: fused.rope_write_kv(qkv, cos, sin, k_cache, v_cache, slots, hq)),
             ("SiLU * up", torch_silu, lambda: fused.silu_mul(gate_up))]
    for name, eager, fused_fn in cases:
        print(f"fused {name:16s} T={tokens:<5d} device: torch {time_ms(eager):7.4f} ms  fused {time_ms(fused_fn):7.4f} ms"
              f"   host: torch {host_ms(eager):7.4f} ms  fused {host_ms(fused_fn):7.4f} ms")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", default="float16", choices=["float16", "bfloat16", "float32"])
    parser.add_argument("--quick", action="store_true", help="smaller shapes")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("bench_kernels: CUDA is not available on this machine; nothing to measure.")
        return 0
    from specserve.tree import ancestor_mask

    dtype = getattr(torch, args.dtype)
    torch.manual_seed(0)
    ceiling = copy_ceiling_gbs()
    print(f"device {torch.cuda.get_device_name()}  commit {commit()}  torch {torch.__version__}  dtype {args.dtype}")
    print(f"measured copy ceiling {ceiling:.0f} GB/s")
    scale = 4 if args.quick else 1
    llama8b = ((32, 8), 128)  # Hq, Hkv, head_dim
    for batch in (1, 8, 32, 128):
        ctx = 4096 // scale
        bench_attention(f"decode ctx={ctx} llama8b", [1] * batch, [ctx] * batch, *llama8b, 16, dtype, ceiling)
    for batch, q_len in ((1, 2048 // scale), (4, 512 // scale)):
        bench_attention(f"prefill q={q_len} llama8b", [q_len] * batch, [0] * batch, *llama8b, 16, dtype, ceiling)
    bench_attention("mixed 2 prefill+30 decode", [256] * 2 + [1] * 30, [0] * 2 + [2048 // scale] * 30,
                    *llama8b, 16, dtype, ceiling)  # fmt: skip
    for batch in (1, 16):  # verify: 1 pending + a 4-deep, width-4 tree per sequence
        one = ancestor_mask([-1] + [0 if n < 4 else n - 3 for n in range(16)])   # root row, then the nodes
        mask = torch.tensor(one * batch, dtype=torch.bool, device="cuda")
        bench_attention(f"tree verify 1+16 nodes ctx={2048 // scale}", [17] * batch, [2048 // scale] * batch,
                        *llama8b, 16, dtype, ceiling, tree_mask=mask)  # fmt: skip
    for batch, vocab in ((1, 32000), (16, 128256), (64, 151936 // scale)):
        bench_tree_accept(batch, vocab, depth=4, width=2)
    if dtype != torch.float32:
        for tokens in (1, 64, 2048 // scale):
            bench_fused(tokens, dtype)
    return 0


if __name__ == "__main__":
    sys.exit(main())
