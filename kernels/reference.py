"""Slow, obviously-correct torch versions of every kernel.

They are the ground truth the Triton kernels are tested against, and the CPU path.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from specserve.model.attention import AttentionMetadata


# Query rows per sequence up to which the CPU path uses stacked matmuls instead of SDPA (its
# additive mask is [Hkv, rows * group, S], built once per forward, so it must stay small).
_SMALL_Q = 64


def write_kv(
    k: torch.Tensor,  # [T, Hkv, D]
    v: torch.Tensor,  # [T, Hkv, D]
    k_cache: torch.Tensor,  # [NB, BS, Hkv, D]
    v_cache: torch.Tensor,  # [NB, BS, Hkv, D]
    slot_mapping: torch.Tensor,  # [T] int64, -1 = skip
    has_skipped_slots: bool = True,  # False: the caller knows no slot is -1 (spares a check per layer)
) -> None:
    if has_skipped_slots and bool((slot_mapping < 0).any()):
        keep = slot_mapping >= 0
        slot_mapping, k, v = slot_mapping[keep], k[keep], v[keep]
    k_cache.view(-1, *k_cache.shape[2:]).index_copy_(0, slot_mapping, k.to(k_cache.dtype))
    v_cache.view(-1, *v_cache.shape[2:]).index_copy_(0, slot_mapping, v.to(v_cache.dtype))


def gather_kv(cache: torch.Tensor, block_table: torch.Tensor, seq_len: int) -> torch.Tensor:
    """The first seq_len positions of one sequence: [seq_len, Hkv, D]. block_table may be the
    padded int32 row or already the int64 ids of exactly the blocks needed."""
    block_size = cache.shape[1]
    num_blocks = (seq_len + block_size - 1) // block_size
    if block_table.dtype != torch.int64 or block_table.shape[0] != num_blocks:
        block_table = block_table[:num_blocks].long()
    blocks = cache.index_select(0, block_table)  # [n, BS, Hkv, D]
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
    cu = meta.cu_query_lens_list if meta.cu_query_lens_list is not None else meta.cu_query_lens.tolist()
    seq_lens = meta.seq_lens_list if meta.seq_lens_list is not None else meta.seq_lens.tolist()
    num_seqs = len(seq_lens)
    if num_seqs > 1 and q.dtype != torch.float64 and cu[-1] == num_seqs * (cu[1] - cu[0]) and all(
        cu[i + 1] - cu[i] == cu[1] for i in range(num_seqs)
    ):
        return _uniform_batch_attention(q, k_cache, v_cache, meta, scale, seq_lens, cu[1])
    looped = range(num_seqs)
    if num_seqs > 2 and q.dtype != torch.float64:
        # A mixed batch: sequences with the same few query rows (the decoding ones beside a
        # prompt chunk, chains of one length beside others) still go through one batched
        # attention per row count; only the rest loop one by one.
        grouping = meta.scratch.get("row_groups")   # the same in every layer
        if grouping is None:
            groups: dict[int, list[int]] = {}
            for i in range(num_seqs):
                q_len = cu[i + 1] - cu[i]
                if 0 < q_len <= _SMALL_Q:
                    groups.setdefault(q_len, []).append(i)
            groups = {q_len: seqs for q_len, seqs in groups.items() if len(seqs) > 1}
            batched = {i for seqs in groups.values() for i in seqs}
            grouping = meta.scratch["row_groups"] = (groups, [i for i in range(num_seqs) if i not in batched])
        groups, looped = grouping
        for q_len, seqs in groups.items():
            _uniform_batch_attention(q, k_cache, v_cache, meta, scale, seq_lens, q_len, seqs=seqs, out=out)
    for i in looped:
        seq_len = seq_lens[i]
        start, end = cu[i], cu[i + 1]
        q_len = end - start
        if q_len == 0:
            continue
        ctx_len = seq_len - q_len
        blocks = meta.scratch.get(("blocks", i))  # int64 ids of the blocks needed, once per forward
        if blocks is None:
            block_size = k_cache.shape[1]
            blocks = meta.scratch[("blocks", i)] = meta.block_tables[i, : (seq_len + block_size - 1) // block_size].long()
        k = gather_kv(k_cache, blocks, seq_len)  # [S, Hkv, D]
        v = gather_kv(v_cache, blocks, seq_len)
        if k.dtype != q.dtype:
            k, v = k.to(q.dtype), v.to(q.dtype)
        if q_len == 1 and q.dtype != torch.float64:
            # Decode: one query sees every key, so no mask. The query heads of one KV head form
            # a [group, D] block, so two small matmuls do it without repeating K/V (cheaper than
            # SDPA at these sizes). float64 keeps the explicit path below.
            qg = q[start].view(num_kv_heads, group, -1)  # [Hkv, G, D]
            probs = torch.softmax(torch.bmm(qg, k.permute(1, 2, 0)) * scale, dim=-1)  # [Hkv, G, S]
            out[start] = torch.bmm(probs, v.transpose(0, 1)).view(num_q_heads, -1)
            continue
        visible = meta.scratch.get(("visible", i))  # [q_len, S]: the same in every layer
        if visible is None:
            visible = torch.ones(q_len, seq_len, dtype=torch.bool, device=q.device)
            if meta.custom_mask is not None:
                visible[:, ctx_len:] = meta.custom_mask[start:end, :q_len]
            else:
                visible[:, ctx_len:] = torch.ones(q_len, q_len, dtype=torch.bool, device=q.device).tril()
            meta.scratch[("visible", i)] = visible
        if q.dtype != torch.float64 and q_len <= _SMALL_Q:
            # A few rows (a verified tree, a draft catch-up): the decode path's two matmuls
            # with the rows of one KV head's query group stacked, plus an additive mask built
            # once per forward. On the CPU about half the time of SDPA with a boolean mask.
            bias = meta.scratch.get(("bias", i))  # [Hkv, q_len * G, S]
            if bias is None:
                bias = torch.zeros(q_len, seq_len, dtype=q.dtype, device=q.device).masked_fill_(~visible, float("-inf"))
                bias = bias.repeat_interleave(group, dim=0)[None].expand(num_kv_heads, -1, -1).contiguous()
                meta.scratch[("bias", i)] = bias
            qg = q[start:end].view(q_len, num_kv_heads, group, -1).transpose(0, 1).reshape(num_kv_heads, q_len * group, -1)
            scores = torch.baddbmm(bias, qg, k.permute(1, 2, 0), alpha=scale)  # [Hkv, q_len * G, S]
            probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
            o = torch.bmm(probs, v.transpose(0, 1))  # [Hkv, q_len * G, D]
            out[start:end] = o.view(num_kv_heads, q_len, group, -1).transpose(0, 1).reshape(q_len, num_q_heads, -1)
            continue
        if q.dtype != torch.float64:
            out[start:end] = F.scaled_dot_product_attention(
                q[start:end].transpose(0, 1), k.transpose(0, 1).to(q.dtype), v.transpose(0, 1).to(q.dtype),
                attn_mask=visible, scale=scale, enable_gqa=group > 1,
            ).transpose(0, 1)
            continue
        # The explicit computation (float64: the exactness tests want a float64 softmax).
        k = k.repeat_interleave(group, dim=1).transpose(0, 1).to(q.dtype)  # [Hq, S, D]
        v = v.repeat_interleave(group, dim=1).transpose(0, 1).to(q.dtype)
        qi = q[start:end].transpose(0, 1)  # [Hq, q_len, D]
        scores = torch.matmul(qi, k.transpose(1, 2)) * scale  # [Hq, q_len, S]
        scores = scores.masked_fill(~visible, float("-inf"))
        # float64 models stay float64 (the exactness tests); everything else softmaxes in fp32.
        probs = torch.softmax(scores.to(torch.float64 if q.dtype == torch.float64 else torch.float32), dim=-1)
        probs = probs.to(q.dtype)
        out[start:end] = torch.matmul(probs, v).transpose(0, 1)
    return out


# Query rows per sequence that the CPU's SDPA runs faster padded to more: its flash kernel
# costs more at three rows than at four (benchmarks/RESULTS.md). Rows are independent in
# attention, so the padded rows' results are dropped and the others are unchanged.
_CPU_SDPA_PADDED_ROWS = {3: 4}


def _uniform_batch_attention(q, k_cache, v_cache, meta: AttentionMetadata, scale: float,
                             seq_lens: list[int], q_len: int, seqs: list[int] | None = None,
                             out: torch.Tensor | None = None) -> torch.Tensor:
    """Every sequence has q_len query rows (a decode batch, or chains verified at one depth):
    one gather and one masked SDPA for the whole batch instead of a loop over sequences.
    Same visibility rule as above: key j of sequence b is visible to its row t iff
    j < ctx_b, or j - ctx_b = i in [0, q_len) with custom_mask[b*q_len + t, i] (causal: i <= t).
    seqs: only these sequences (each with q_len rows; the others are someone else's), their
    rows' results written into `out`."""
    dev = q.device
    key = "uniform_mask" if seqs is None else ("uniform_mask", q_len)
    group = None
    tables = meta.block_tables
    if seqs is not None:   # this group's query rows, block tables and lengths: once per forward
        group = meta.scratch.get(("uniform_rows", q_len))
        if group is None:
            cu = meta.cu_query_lens_list if meta.cu_query_lens_list is not None else meta.cu_query_lens.tolist()
            rows = torch.tensor([cu[i] + t for i in seqs for t in range(q_len)], dtype=torch.long, device=dev)
            picked = meta.block_tables.index_select(0, torch.tensor(seqs, dtype=torch.long, device=dev))
            group = meta.scratch[("uniform_rows", q_len)] = (rows, picked, [seq_lens[i] for i in seqs])
        rows, tables, seq_lens = group
    num_seqs, block_size = len(seq_lens), k_cache.shape[1]
    pad = _CPU_SDPA_PADDED_ROWS.get(q_len, q_len) - q_len if dev.type == "cpu" else 0
    max_len = max(seq_lens)
    num_blocks = (max_len + block_size - 1) // block_size
    mask = meta.scratch.get(key)  # [B, 1, q_len + pad, S], the same in every layer
    if mask is None:
        j = torch.arange(num_blocks * block_size, device=dev)[None, None, :]  # [1, 1, S]
        ctx = (torch.tensor(seq_lens, device=dev) - q_len)[:, None, None]  # [B, 1, 1]
        local = j - ctx  # [B, 1, S]: index among the sequence's own rows
        own = (local >= 0) & (local < q_len)
        if meta.custom_mask is None:
            t = torch.arange(q_len, device=dev)[None, :, None]  # [1, Q, 1]
            own_visible = own & (local <= t)
        else:
            custom = meta.custom_mask if group is None else meta.custom_mask.index_select(0, rows)
            own_masks = custom[:, :q_len].reshape(num_seqs, q_len, q_len)  # [B, Q, Q]
            picked = torch.gather(own_masks, 2, local.clamp(0, q_len - 1).expand(num_seqs, q_len, -1))
            own_visible = own & picked
        mask = ((local < 0) | own_visible)[:, None]  # [B, 1, Q, S]; padding keys (local >= q_len) hidden
        if pad:   # the padded query rows see what the last row sees (their results are dropped)
            mask = torch.cat([mask, mask[:, :, -1:].expand(-1, -1, pad, -1)], dim=2)
        meta.scratch[key] = mask
    blocks = tables[:, :num_blocks].long().flatten()
    shape = (num_seqs, num_blocks * block_size, *k_cache.shape[2:])
    k = k_cache.index_select(0, blocks).view(shape).transpose(1, 2).to(q.dtype)  # [B, Hkv, S, D]
    v = v_cache.index_select(0, blocks).view(shape).transpose(1, 2).to(q.dtype)
    qg = q if group is None else q.index_select(0, rows)
    qb = qg.view(num_seqs, q_len, *q.shape[1:]).transpose(1, 2)  # [B, Hq, Q, D]
    if pad:
        qb = torch.cat([qb, qb[:, :, -1:].expand(-1, -1, pad, -1)], dim=2)
    res = F.scaled_dot_product_attention(qb, k, v, attn_mask=mask, scale=scale,
                                         enable_gqa=q.shape[1] != k_cache.shape[2])
    if pad:
        res = res[:, :, :q_len]
    res = res.transpose(1, 2).reshape(qg.shape)
    if group is None:
        return res
    out.index_copy_(0, rows, res)
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


def greedy_walk(tokens: list[int], parents: list[int], argmax: list[int]) -> tuple[list[int], int]:
    """Greedy tree verification on host lists: from the root, accept the first child whose token
    is the target's argmax at its parent's row, and go on from it until no child is; the bonus
    is the argmax at the last accepted row. Row 0 is the root's, row 1 + k node k's; parents
    come before children (BFS order), so one scan in index order visits each node's children in
    order and an accepted node's children after it. Returns (accepted nodes, bonus)."""
    cur, row, path = -1, 0, []
    for c, (x, parent) in enumerate(zip(tokens, parents)):
        if parent == cur and x == argmax[row]:
            path.append(c)
            cur, row = c, c + 1
    return path, argmax[row]


def tree_accept_reference(
    target_probs: torch.Tensor,  # [B, N+1, V] float32, row 0 = root, row 1+n = after node n
    target_argmax: torch.Tensor,  # [B, N+1] int64
    draft_probs: torch.Tensor,  # [B, N, V] float32, read only for sampled nodes
    tokens: torch.Tensor,  # [B, N] int64
    parents: torch.Tensor,  # [B, N] int32, -1 = child of the root, BFS order
    is_sampled: torch.Tensor,  # [B, N] bool
    num_nodes: torch.Tensor,  # [B] int32
    is_greedy: torch.Tensor,  # [B] bool
    uniforms: torch.Tensor,  # [B, N+1] float32 in [0, 1)
    max_depth: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Tree verification, one sequence at a time; see kernels/tree_accept.py for the maths.

    Greedy sequences walk host lists (`greedy_walk`: the argmax is all they read). For sampled
    ones the residual p is kept unnormalised with its mass m = sum(p): the normalised test
    u < p(x) / (m q(x)) is evaluated as u * q(x) * m < p(x), and the bonus is the first
    token whose running sum of p exceeds u * m. The Triton kernel does exactly the same.
    """
    batch, max_nodes = tokens.shape
    max_depth = max_nodes if max_depth is None else max_depth
    toks, pars, sizes = tokens.tolist(), parents.tolist(), num_nodes.tolist()
    greedy_rows, argmax = is_greedy.tolist(), target_argmax.tolist()
    paths: list[list[int]] = []
    bonus = [0] * batch
    residuals: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}   # sampled rows: (p, mass) of the bonus
    for b in range(batch):
        if greedy_rows[b]:
            path, bonus[b] = greedy_walk(toks[b][:sizes[b]], pars[b][:sizes[b]], argmax[b])
            paths.append(path)
            continue
        cur, path = -1, []
        p = target_probs[b, 0].float()
        mass = p.sum()
        # Parents come before children, so one scan in index order visits the children of
        # the current node in order, and the children of an accepted node after it.
        for c in range(sizes[b]):
            if pars[b][c] != cur:
                continue
            x = toks[b][c]
            if bool(is_sampled[b, c]):
                q = draft_probs[b, c].float()
                ok = bool(uniforms[b, c] * q[x] * mass < p[x])
                if not ok:
                    residual = torch.clamp(p - q * mass, min=0.0)
                    residual_mass = residual.sum()
                    if residual_mass > 0:  # p == q up to rounding: rejection had probability 0
                        p, mass = residual, residual_mass
            else:
                ok = bool(uniforms[b, c] * mass < p[x])
                if not ok and mass - p[x] > 0:
                    mass = mass - p[x]
                    p = p.clone()
                    p[x] = 0.0
            if ok:
                path.append(c)
                cur = c
                p = target_probs[b, c + 1].float()
                mass = p.sum()
        residuals[b] = (p, mass)
        paths.append(path)
    if residuals:   # every sampled row's bonus in one inverse-CDF draw
        rows = list(residuals)
        p = torch.stack([residuals[b][0] for b in rows])
        threshold = uniforms[rows, max_nodes].to(p.dtype) * torch.stack([residuals[b][1] for b in rows])
        for b, tok in zip(rows, _inverse_cdf(p, threshold).tolist()):
            bonus[b] = tok
    accepted = torch.tensor([(path + [-1] * max_depth)[:max_depth] for path in paths],
                            dtype=torch.int32).view(batch, max_depth)
    num_accepted = torch.tensor([len(path) for path in paths], dtype=torch.int32)
    return accepted, num_accepted, torch.tensor(bonus, dtype=torch.int64)


def _inverse_cdf(p: torch.Tensor, threshold: torch.Tensor) -> torch.Tensor:
    """Per row of p [R, V]: the first index whose running sum exceeds threshold [R], or the last
    index with p > 0 where rounding leaves none (threshold = u * sum(p) with u just below 1)."""
    cdf = torch.cumsum(p, dim=-1)
    first = torch.searchsorted(cdf, threshold[:, None].contiguous(), right=True).squeeze(1)
    last = p.shape[1] - 1 - (p.flip(-1) > 0).int().argmax(dim=-1)
    return torch.where(first < p.shape[1], first, last)
