"""Tree verification: walk each sequence's draft tree, accept what the target agrees with,
pick the bonus token. One Triton program per sequence.

Definitions (as in vLLM's rejection sampler, generalised to trees):

- *accepted* tokens: the draft tree nodes on the path the walk takes from the root;
- *bonus* token: the one token the target contributes after the last accepted node — drawn
  from the residual distribution when that node's children were all rejected (the
  "recovered" token of a chain sampler), or from the node's own target distribution when it
  is a leaf, so every step emits num_accepted + 1 tokens.

Greedy sequences (temperature 0): from the root follow the child whose token equals the
target's argmax at the current node; the bonus is the argmax at the last accepted node.

Stochastic sequences, lossless (Leviathan et al. 2023, "Fast Inference from Transformers via
Speculative Decoding", Thm. 1; SpecInfer, Miao et al. 2023, multi-step speculative
sampling, Alg. 2). At the current node with target distribution p, children are tried in
node-index order:

- child x drawn from the draft distribution q:  accept with probability min(1, p(x)/q(x));
  on rejection p <- norm(max(p - q, 0)). The rejected draw's law is removed from p, so the
  next child (drawn independently from its own q) is tested against what is left.
- child x chosen deterministically (top-k, q = one-hot(x)): accept with probability p(x);
  on rejection p(x) <- 0 and renormalise — the same rule with q = one-hot.
- all children rejected: bonus ~ p (the residual). Reached a leaf: bonus ~ its target row.

By induction over the children, P(emit x) = p(x) at every node, hence the emitted sequence
has exactly the target's distribution (checked statistically in tests/kernels).

Numerics: the residual lives in a [B, V] fp32 workspace, unnormalised, with its mass
m = sum(p). The test u < p(x) / (m q(x)) is computed as u * q(x) * m < p(x); the bonus is
the first token whose running sum of p exceeds u * m. If a rejection would leave zero mass
(p == q up to rounding, so rejection had probability 0) p is left as it was.
kernels/reference.py:tree_accept_reference is the same algorithm in plain torch.

Walk: parents come before children (BFS), so a single scan over node indices with
"parent == current node" visits the current node's children in order, and after an
acceptance the new node's children all come later in the scan. No stack, no break.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _copy_row(dst_ptr, src_ptr, V, BLOCK_V: tl.constexpr):
    """dst[:V] = src[:V]; returns sum(src)."""
    total = tl.zeros([BLOCK_V], dtype=tl.float32)
    for start in range(0, V, BLOCK_V):
        offs = start + tl.arange(0, BLOCK_V)
        vals = tl.load(src_ptr + offs, mask=offs < V, other=0.0)
        tl.store(dst_ptr + offs, vals, mask=offs < V)
        total += vals
    return tl.sum(total, axis=0)


@triton.jit(do_not_specialize=["N", "MAX_DEPTH"])   # per-step sizes: no compile per new value class
def _tree_accept_kernel(
    target_probs_ptr,  # [B, N+1, V] fp32
    target_argmax_ptr,  # [B, N+1] int64
    draft_probs_ptr,  # [B, N, V] fp32
    tokens_ptr,  # [B, N] int64
    parents_ptr,  # [B, N] int32
    is_sampled_ptr,  # [B, N] int8
    num_nodes_ptr,  # [B] int32
    is_greedy_ptr,  # [B] int8
    uniforms_ptr,  # [B, N+1] fp32
    workspace_ptr,  # [B, V] fp32: the residual p of the current node, unnormalised
    accepted_ptr,  # [B, MAX_DEPTH] int32, pre-filled with -1
    num_accepted_ptr,  # [B] int32
    bonus_ptr,  # [B] int64
    N,
    V,
    MAX_DEPTH,
    BLOCK_V: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    n = tl.load(num_nodes_ptr + b)
    greedy = tl.load(is_greedy_ptr + b) != 0
    probs_b = target_probs_ptr + b * (N + 1) * V
    work = workspace_ptr + b * V

    # Residual of the root: its unmodified target row, mass m = sum(p). Greedy rows need none.
    mass = tl.full([], 0.0, tl.float32)
    if not greedy:
        mass = _copy_row(work, probs_b, V, BLOCK_V)
        tl.debug_barrier()
    cur = tl.full([], -1, tl.int32)  # current node, -1 = root
    row = tl.full([], 0, tl.int32)  # its row in target_probs / target_argmax
    depth = tl.full([], 0, tl.int32)

    for c in range(0, n):
        parent = tl.load(parents_ptr + b * N + c)
        if parent == cur:
            x = tl.load(tokens_ptr + b * N + c)
            u = tl.load(uniforms_ptr + b * (N + 1) + c)
            sampled = tl.load(is_sampled_ptr + b * N + c) != 0
            ok = tl.full([], 0, tl.int1)
            p_x = tl.full([], 0.0, tl.float32)
            if not greedy:  # greedy rows never touch probabilities (callers may pass V = 1 dummies)
                p_x = tl.load(work + x)
                # Every warp reads work[x] before any of them rewrites the row below (the
                # rejection's one-hot store, or the accepted node's copy); on a GPU a warp
                # running behind would otherwise read the new value and branch differently.
                tl.debug_barrier()
            if greedy:
                ok = x == tl.load(target_argmax_ptr + b * (N + 1) + row)
            elif sampled:
                # accept w.p. min(1, p(x)/q(x)), p normalised by the mass m
                q_row = draft_probs_ptr + (b * N + c) * V
                q_x = tl.load(q_row + x)
                test = u * q_x * mass
                ok = test < p_x
                if test >= p_x:
                    # p <- max(p - m q, 0): first its mass, then (if positive) write it
                    part = tl.zeros([BLOCK_V], dtype=tl.float32)
                    for start in range(0, V, BLOCK_V):
                        offs = start + tl.arange(0, BLOCK_V)
                        p = tl.load(work + offs, mask=offs < V, other=0.0)
                        q = tl.load(q_row + offs, mask=offs < V, other=0.0)
                        part += tl.maximum(p - q * mass, 0.0)
                    residual_mass = tl.sum(part, axis=0)
                    if residual_mass > 0:
                        for start in range(0, V, BLOCK_V):
                            offs = start + tl.arange(0, BLOCK_V)
                            p = tl.load(work + offs, mask=offs < V, other=0.0)
                            q = tl.load(q_row + offs, mask=offs < V, other=0.0)
                            tl.store(work + offs, tl.maximum(p - q * mass, 0.0), mask=offs < V)
                        mass = residual_mass
                        tl.debug_barrier()
            else:
                # q = one-hot(x): accept w.p. p(x); on rejection p(x) <- 0
                test = u * mass
                ok = test < p_x
                if test >= p_x:
                    if mass - p_x > 0:
                        tl.store(work + x, 0.0)
                        mass = mass - p_x
                        tl.debug_barrier()
            if ok:
                tl.store(accepted_ptr + b * MAX_DEPTH + depth, c, mask=depth < MAX_DEPTH)
                depth += 1
                cur = c
                row = c + 1
                if not greedy:
                    mass = _copy_row(work, probs_b + row.to(tl.int64) * V, V, BLOCK_V)
                    tl.debug_barrier()

    tl.store(num_accepted_ptr + b, depth)
    if greedy:
        tl.store(bonus_ptr + b, tl.load(target_argmax_ptr + b * (N + 1) + row))
    else:
        # inverse CDF over the residual: first token whose running sum exceeds u * m
        threshold = tl.load(uniforms_ptr + b * (N + 1) + N) * mass
        running = tl.full([], 0.0, tl.float32)
        first = tl.full([], 2147483647, tl.int32)
        last_positive = tl.full([], -1, tl.int32)
        for start in range(0, V, BLOCK_V):
            offs = start + tl.arange(0, BLOCK_V)
            p = tl.load(work + offs, mask=offs < V, other=0.0)
            cdf = running + tl.cumsum(p, axis=0)
            hit = tl.min(tl.where((cdf > threshold) & (offs < V), offs, 2147483647), axis=0)
            first = tl.minimum(first, hit)
            last_positive = tl.maximum(last_positive, tl.max(tl.where(p > 0, offs, -1), axis=0))
            running += tl.sum(p, axis=0)
        token = tl.where(first < V, first, last_positive)
        tl.store(bonus_ptr + b, token.to(tl.int64))


def tree_accept(
    target_probs: torch.Tensor,  # [B, N+1, V] float32
    target_argmax: torch.Tensor,  # [B, N+1] int64
    draft_probs: torch.Tensor,  # [B, N, V] float32
    tokens: torch.Tensor,  # [B, N] int64
    parents: torch.Tensor,  # [B, N] int32, -1 = child of root, BFS order
    is_sampled: torch.Tensor,  # [B, N] bool
    num_nodes: torch.Tensor,  # [B] int32
    is_greedy: torch.Tensor,  # [B] bool
    uniforms: torch.Tensor,  # [B, N+1] float32 in [0, 1)
    max_depth: int | None = None,
    workspace: torch.Tensor | None = None,  # [B, V] float32, reused across steps if given
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Returns (accepted [B, max_depth] int32 node indices, -1 padded; num_accepted [B] int32;
    bonus [B] int64). max_depth defaults to N; it must be >= the deepest tree's depth (deeper
    acceptances are counted in num_accepted but not stored)."""
    batch, max_nodes = tokens.shape
    vocab = target_probs.shape[-1]
    max_depth = max_nodes if max_depth is None else max_depth
    device = target_probs.device

    def check(name, t, shape, dtype):
        assert t.dtype == dtype, f"tree_accept: {name} must be {dtype}, got {t.dtype}"
        assert tuple(t.shape) == shape, f"tree_accept: {name} must have shape {shape}, got {tuple(t.shape)}"
        assert t.is_contiguous(), f"tree_accept: {name} must be contiguous"
        assert t.device == device, f"tree_accept: {name} is on {t.device}, target_probs on {device}"

    check("target_probs", target_probs, (batch, max_nodes + 1, vocab), torch.float32)
    check("target_argmax", target_argmax, (batch, max_nodes + 1), torch.int64)
    check("draft_probs", draft_probs, (batch, max_nodes, vocab), torch.float32)
    check("tokens", tokens, (batch, max_nodes), torch.int64)
    check("parents", parents, (batch, max_nodes), torch.int32)
    check("is_sampled", is_sampled, (batch, max_nodes), torch.bool)
    check("num_nodes", num_nodes, (batch,), torch.int32)
    check("is_greedy", is_greedy, (batch,), torch.bool)
    check("uniforms", uniforms, (batch, max_nodes + 1), torch.float32)
    assert max_depth >= 1 or max_nodes == 0, f"tree_accept: max_depth must be >= 1, got {max_depth}"
    if workspace is None:
        workspace = torch.empty(batch, vocab, dtype=torch.float32, device=device)
    check("workspace", workspace, (batch, vocab), torch.float32)

    accepted = torch.full((batch, max(max_depth, 1)), -1, dtype=torch.int32, device=device)[:, :max_depth]
    num_accepted = torch.empty(batch, dtype=torch.int32, device=device)
    bonus = torch.empty(batch, dtype=torch.int64, device=device)
    if batch == 0:
        return accepted, num_accepted, bonus
    is_sampled, is_greedy = is_sampled.view(torch.int8), is_greedy.view(torch.int8)
    if max_nodes == 0:
        # No sequence has a tree: the node tensors are empty and never read, but the launcher
        # wants real device pointers, so hand it same-typed tensors that exist.
        draft_probs, tokens, parents, is_sampled = target_probs, target_argmax, num_nodes, is_greedy
    _tree_accept_kernel[(batch,)](
        target_probs, target_argmax, draft_probs, tokens, parents,
        is_sampled, num_nodes, is_greedy, uniforms,
        workspace, accepted, num_accepted, bonus,
        max_nodes, vocab, max_depth,
        BLOCK_V=min(triton.next_power_of_2(max(vocab, 1)), 1024),
    )  # fmt: skip
    return accepted, num_accepted, bonus
