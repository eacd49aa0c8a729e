"""ModelRunner: one model, its KV tensors in the shared pool, and one flattened forward.

The engine and the drafters describe a forward as plain Python lists (`ForwardInput`);
the runner turns them into tensors once, runs the model and returns the logits of the
rows asked for. Target and draft each have a runner; both index the pool by the same
block ids.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from itertools import accumulate

import torch

from specserve.errors import ConfigError
from specserve.model.attention import AttentionMetadata


@dataclass
class ForwardInput:
    """Rows of one forward, sequence after sequence. Built by appending with `add`."""

    input_ids: list[int] = field(default_factory=list)
    positions: list[int] = field(default_factory=list)
    slot_mapping: list[int] = field(default_factory=list)
    block_tables: list[list[int]] = field(default_factory=list)
    query_lens: list[int] = field(default_factory=list)
    seq_lens: list[int] = field(default_factory=list)
    logit_rows: list[int] = field(default_factory=list)  # rows whose logits are returned, in order
    # Per sequence: its [q_len, q_len] visibility among its own rows, or None = causal.
    masks: list[list[list[bool]] | torch.Tensor | None] = field(default_factory=list)

    @property
    def num_rows(self) -> int:
        return len(self.input_ids)

    def add(
        self,
        token_ids: list[int],
        positions: list[int],
        slots: list[int],
        block_table: list[int],
        seq_len: int,
        logit_rows: list[int] = (),
        mask: list[list[bool]] | torch.Tensor | None = None,
    ) -> int:
        """Add one sequence's rows; `logit_rows` are local row indices. Returns its first row."""
        first = len(self.input_ids)
        self.input_ids.extend(token_ids)
        self.positions.extend(positions)
        self.slot_mapping.extend(slots)
        self.block_tables.append(block_table)
        self.query_lens.append(len(token_ids))
        self.seq_lens.append(seq_len)
        self.logit_rows.extend(first + r for r in logit_rows)
        self.masks.append(mask)
        return first


def slots_for(block_table: list[int], block_size: int, start: int, count: int) -> list[int]:
    """Pool slots of positions [start, start + count) of a sequence."""
    return [block_table[p // block_size] * block_size + p % block_size for p in range(start, start + count)]


class CpuThreads:
    """Intra-op threads per forward on the CPU: all of them for forwards of at least `min_rows`
    rows, one below that. A decode row or a draft level streams weights from memory and the
    BLAS does not split so few rows, so more threads only add their synchronisation; a verified
    chain has the rows to share (benchmarks/RESULTS.md)."""

    def __init__(self, max_threads: int, min_rows: int = 5):
        self.max_threads, self.min_rows = max_threads, min_rows

    def enter(self, num_rows: int) -> int:
        """Set the threads for a forward of `num_rows`; returns the count to restore after."""
        before = torch.get_num_threads()
        want = self.max_threads if num_rows >= self.min_rows else 1
        if want != before:
            torch.set_num_threads(want)
        return before


_COMPILED_MAX_MASK = 1 << 25   # elements of the compiled forward's visibility mask (model/compiled.py)


class ModelRunner:
    def __init__(self, model: torch.nn.Module, args, num_blocks: int, block_size: int, device: torch.device,
                 cpu_threads: CpuThreads | None = None):
        self.model = model
        self.args = args
        self.device = device
        self.block_size = block_size
        try:
            self.kv_caches = model.make_kv_caches(num_blocks, block_size, device=device)
        except (RuntimeError, MemoryError) as e:   # the allocator's own words, in one line
            gib = num_blocks * args.kv_bytes_per_block(block_size, model.dtype) / 2**30
            raise ConfigError(f"cache: {num_blocks} blocks of {block_size} tokens need {gib:.1f} GiB for "
                              f"one model's KV, which cannot be allocated ({str(e).splitlines()[0]}); lower "
                              "cache.num_blocks or cache.kv_cache_bytes") from None
        self.cpu_threads = cpu_threads if device.type == "cpu" and cpu_threads and cpu_threads.max_threads > 1 else None
        self.graphs = None   # ForwardGraphs once use_graphs() is called
        self.compiled = None   # the compiled CPU forward once use_compiled() is called
        self._causal: dict[tuple[int, int], torch.Tensor] = {}   # (B, q) -> [B, q, q] causal masks

    def use_graphs(self, max_batch: int, max_rows: int, max_blocks: int, capture: bool | None = None,
                   pool=None) -> None:
        """Serve uniform forwards (decode, chain verify, draft levels) from CUDA graphs, padded
        to captured batch sizes (specserve/graphs.py); on the CPU the same padded path runs
        eagerly."""
        from specserve.graphs import ForwardGraphs

        self.graphs = ForwardGraphs(self.model, self.kv_caches, self.device, max_batch, max_rows, max_blocks,
                                    capture=capture, pool=pool)

    def use_compiled(self, forward) -> None:
        """Run forwards through a compiled forward (model/compiled.py) where its layout fits. Its
        forwards use every thread at every row count: without the eager ops' per-call costs a
        one-row step is bound by the matmuls, which two threads share (benchmarks/RESULTS.md)."""
        from specserve.model.llama import kv_pool

        self.compiled = forward
        self.kv_pool = kv_pool(self.kv_caches)
        if self.cpu_threads is not None:
            self.cpu_threads = CpuThreads(self.cpu_threads.max_threads, min_rows=1)

    @property
    def cache_tensors(self) -> list[torch.Tensor]:
        return [t for pair in self.kv_caches for t in pair]

    def prepare(self, inp: ForwardInput) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, torch.Tensor]:
        """The tensors of one forward: (input_ids [T] int64, positions [T] int64, metadata,
        logit_rows [len(inp.logit_rows)] int64). A draft step is a row or a few, so each
        tensor creation (and each host->device copy) is a visible share of it: all int64
        inputs are views of one buffer, and all int32 metadata views of another."""
        num_rows, num_seqs = inp.num_rows, len(inp.seq_lens)
        longs = torch.tensor(
            inp.input_ids + inp.positions + inp.slot_mapping + inp.logit_rows, dtype=torch.int64, device=self.device
        )
        input_ids, positions, slot_mapping, logit_rows = longs.split_with_sizes(
            [num_rows, num_rows, num_rows, len(inp.logit_rows)])
        cu = list(accumulate(inp.query_lens, initial=0))
        max_blocks = max(len(bt) for bt in inp.block_tables)
        ints = cu + inp.seq_lens  # then each block table, zero-padded to max_blocks
        for bt in inp.block_tables:
            ints += bt
            if len(bt) < max_blocks:
                ints += [0] * (max_blocks - len(bt))
        ints = torch.tensor(ints, dtype=torch.int32, device=self.device)
        cu_query_lens, seq_lens, block_tables = ints.split_with_sizes([num_seqs + 1, num_seqs, num_seqs * max_blocks])
        max_q = max(inp.query_lens)
        custom_mask = None
        if any(m is not None for m in inp.masks):
            custom_mask = torch.zeros(num_rows, max_q, dtype=torch.bool)
            for i, m in enumerate(inp.masks):
                q = inp.query_lens[i]
                if m is None:
                    custom_mask[cu[i] : cu[i + 1], :q] = torch.ones(q, q, dtype=torch.bool).tril()
                else:
                    m = m if isinstance(m, torch.Tensor) else torch.tensor(m, dtype=torch.bool)
                    custom_mask[cu[i] : cu[i + 1], :q] = m
            custom_mask = custom_mask.to(self.device)
        meta = AttentionMetadata(
            slot_mapping=slot_mapping,
            block_tables=block_tables.view(num_seqs, max_blocks),
            cu_query_lens=cu_query_lens,
            seq_lens=seq_lens,
            max_query_len=max_q,
            max_seq_len=max(inp.seq_lens),
            custom_mask=custom_mask,
            has_skipped_slots=num_rows > 0 and min(inp.slot_mapping) < 0,
            cu_query_lens_list=cu,
            seq_lens_list=list(inp.seq_lens),
        )
        return input_ids, positions, meta, logit_rows

    @torch.inference_mode()
    def forward(self, inp: ForwardInput) -> torch.Tensor | None:
        """Run the rows of `inp`; returns logits of `inp.logit_rows`: [len(logit_rows), vocab]
        (None when no row asks for logits: a prefill chunk only writes KV)."""
        if self.cpu_threads is None:
            return self._forward(inp)
        restore = self.cpu_threads.enter(inp.num_rows)
        try:
            return self._forward(inp)
        finally:
            torch.set_num_threads(restore)

    def _forward(self, inp: ForwardInput) -> torch.Tensor | None:
        logit_rows = logits = None
        if self.graphs is not None and self.graphs.eligible(inp):
            hidden = self.graphs.forward(inp)
        elif self.compiled is not None and (out := self._compiled_forward(inp)) is not None:
            hidden, logits = out   # logits of every row where the program ran the LM head
        else:
            input_ids, positions, meta, logit_rows = self.prepare(inp)
            hidden = self.model(input_ids, positions, self.kv_caches, meta)
        rows = inp.logit_rows
        if not rows:
            return None
        rows_of = hidden if logits is None else logits
        if rows == list(range(rows[0], rows[0] + len(rows))):  # a run of rows (decode, verify, chain draft)
            rows_of = rows_of[rows[0] : rows[0] + len(rows)]
        else:
            if logit_rows is None:
                logit_rows = torch.tensor(rows, dtype=torch.int64).to(hidden.device, non_blocking=True)
            rows_of = rows_of.index_select(0, logit_rows)
        return self.model.compute_logits(rows_of) if logits is None else rows_of

    def _compiled_forward(self, inp: ForwardInput) -> tuple[torch.Tensor, torch.Tensor | None] | None:
        """The hidden rows of `inp`, in its order, from the compiled forward, and their logits where
        the program computed them (else None); None (run it eagerly)
        when padding every sequence to the most rows would more than double the rows (a prompt
        chunk beside decode rows), or when its [B, q * heads per KV head, keys] visibility mask
        would pass 32 MiB (long chunks at long contexts, which the eager path's attention takes
        block by block)."""
        q_lens, seq_lens = inp.query_lens, inp.seq_lens
        B, q, T = len(q_lens), max(q_lens), inp.num_rows
        bs = self.block_size
        ctx = [s - n for s, n in zip(seq_lens, q_lens)]
        W = max(1, -(-max(ctx) // bs))
        group = self.args.num_heads // self.args.num_kv_heads
        if B * q > 2 * T + 8 or B * q * group * (W * bs + q) > _COMPILED_MAX_MASK:
            return None
        uniform = B * q == T
        ids, pos, slots = inp.input_ids, inp.positions, inp.slot_mapping
        if not uniform:   # each sequence padded to q rows: token 0 at position 0, written nowhere
            ids, pos, slots, real, start = [], [], [], [], 0
            for n in q_lens:
                pad = q - n
                ids += inp.input_ids[start:start + n] + [0] * pad
                pos += inp.positions[start:start + n] + [0] * pad
                slots += inp.slot_mapping[start:start + n] + [-1] * pad
                real += range(len(ids) - q, len(ids) - pad)
                start += n
        tables = [x for bt in inp.block_tables for x in (bt + [0] * W)[:W]]   # its context's blocks, padded
        longs = torch.tensor(ids + pos + slots + ctx + tables, dtype=torch.int64)
        ids_t, pos_t, slots_t, ctx_t, tables_t = longs.split_with_sizes([B * q, B * q, B * q, B, B * W])
        if all(m is None for m in inp.masks) and uniform:
            mask = self._causal.get((B, q))
            if mask is None:
                mask = self._causal[(B, q)] = torch.ones(q, q, dtype=torch.bool).tril().expand(B, q, q).contiguous()
        else:
            mask = torch.eye(q, dtype=torch.bool).repeat(B, 1, 1)   # a padding row sees itself only
            for b, (m, n) in enumerate(zip(inp.masks, q_lens)):
                if m is None:
                    mask[b, :n, :n] = torch.ones(n, n, dtype=torch.bool).tril()
                else:
                    mask[b, :n, :n] = m if isinstance(m, torch.Tensor) else torch.tensor(m, dtype=torch.bool)
        k_pool, v_pool = self.kv_pool
        hidden, logits = self.compiled(ids_t.view(B, q), pos_t.view(B, q), k_pool, v_pool, tables_t.view(B, W),
                                       ctx_t, mask, slots_t)
        if not uniform:
            real = torch.tensor(real)
            hidden, logits = hidden[real], None if logits is None else logits[real]
        return hidden, logits
