"""CUDA graphs for the uniform forwards: decode steps, chain verify passes, draft levels.

At small batches a step is bound by the host launching hundreds of kernels, not by the GPU's
work (benchmarks/RESULTS.md, "On a GPU"); a captured graph replays them all in one launch.

A forward qualifies when every sequence has the same number of rows q, no tree mask, and
some row's logits are wanted (a decode step: q = 1; a chain verify pass: q = depth + 1; a
draft level; a draft catch-up of two rows a sequence, the last one's logits). It is padded to the next captured batch size Bp (`SIZES`, up to max_num_seqs):
padding rows read token 0 at position 0, write no KV (slot -1) and see q keys of block 0;
being rows of their own in every per-row op, they change nothing in the real rows. Each
(Bp, q) has static input buffers and, on CUDA, a graph captured at its first use (after two
eager warm-up runs, so that Triton compiles outside the capture) into one memory pool that
all the runner's graphs share; the hidden rows come back as a view of the graph's output
and the LM head runs eagerly on the rows whose logits are wanted (a [Bp*q, vocab] output per
graph would cost gigabytes across graphs).

On the CPU there is nothing to capture: `capture=False` runs the same padded forward on the
same buffers eagerly, which is what the tests check (and what makes `cuda_graphs = true`
harmless there, if slower).
"""

from __future__ import annotations

import torch

from specserve.model.attention import AttentionMetadata

# Batch sizes captured (each forward is padded to the next one): dense where small batches
# are common and padding is dear relative to the batch.
SIZES = (1, 2, 4, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512)


class _Entry:
    """Static buffers (and, on CUDA, the graph) of one padded shape: Bp sequences of q rows."""

    def __init__(self, batch: int, rows: int, max_blocks: int, device: torch.device):
        self.batch, self.rows, self.max_blocks = batch, rows, max_blocks
        T = batch * rows
        self.longs = torch.zeros(3 * T, dtype=torch.int64, device=device)          # ids, positions, slots
        self.ints = torch.zeros(2 * batch + 1 + batch * max_blocks, dtype=torch.int32, device=device)
        self.input_ids, self.positions, slots = self.longs.split_with_sizes([T, T, T])
        cu, seq_lens, tables = self.ints.split_with_sizes([batch + 1, batch, batch * max_blocks])
        self.cu = [i * rows for i in range(batch + 1)]
        self.meta = AttentionMetadata(
            slot_mapping=slots, block_tables=tables.view(batch, max_blocks), cu_query_lens=cu, seq_lens=seq_lens,
            max_query_len=rows, max_seq_len=rows, custom_mask=None,
            cu_query_lens_list=self.cu, seq_lens_list=[rows] * batch, has_skipped_slots=True,
        )
        self.graph: torch.cuda.CUDAGraph | None = None
        self.hidden: torch.Tensor | None = None   # the captured forward's output

    def fill(self, inp) -> None:
        """Copy a forward's rows into the buffers, padded."""
        B, q, Bp = len(inp.seq_lens), self.rows, self.batch
        pad_rows = (Bp - B) * q
        longs = (inp.input_ids + [0] * pad_rows + inp.positions + [0] * pad_rows
                 + inp.slot_mapping + [-1] * pad_rows)
        seq_lens = list(inp.seq_lens) + [q] * (Bp - B)
        # Only the columns this forward's longest table has: the kernels never read a row
        # past ceil(seq_len / block_size), and a padding row reads column 0 only. (The whole
        # [Bp, max_blocks] table, sized by max_model_len, cost more to build than a graph saves
        # at long contexts.)
        wb = max(len(bt) for bt in inp.block_tables)
        tables = [bt + [0] * (wb - len(bt)) for bt in inp.block_tables] + [[0] * wb] * (Bp - B)
        self._copy(self.longs, longs, torch.int64)
        self._copy(self.ints[: 2 * Bp + 1], self.cu + seq_lens, torch.int32)
        self._copy(self.meta.block_tables[:, :wb], tables, torch.int32)
        # The CPU (reference) path reads host copies; a captured graph never looks at them.
        self.meta.seq_lens_list = seq_lens
        self.meta.max_seq_len = max(seq_lens)
        self.meta.scratch = {}

    def fill_padding(self) -> None:
        """Every row a padding row (what the capture runs on)."""
        Bp, q, W = self.batch, self.rows, self.max_blocks
        T = Bp * q
        self._copy(self.longs, [0] * (2 * T) + [-1] * T, torch.int64)
        self._copy(self.ints, self.cu + [q] * Bp + [0] * (Bp * W), torch.int32)
        self.meta.seq_lens_list = [q] * Bp
        self.meta.max_seq_len = q
        self.meta.scratch = {}

    @staticmethod
    def _copy(dst: torch.Tensor, values: list, dtype: torch.dtype) -> None:
        if dst.is_cuda:
            src = torch.tensor(values, dtype=dtype, pin_memory=True)
            dst.copy_(src, non_blocking=True)   # the host allocator keeps src until the copy ran
        else:
            dst.copy_(torch.tensor(values, dtype=dtype))


class ForwardGraphs:
    """The graphs (or, on the CPU, the padded buffers) of one model runner."""

    def __init__(self, model: torch.nn.Module, kv_caches, device: torch.device, max_batch: int,
                 max_rows: int, max_blocks: int, capture: bool | None = None, pool=None):
        """pool: a graph memory pool to capture into (torch.cuda.graph_pool_handle()), shared
        with the other runner's graphs: one stream runs them one at a time and each output is
        read before the next replay, so their scratch memory can be the same."""
        self.model, self.kv_caches, self.device = model, kv_caches, device
        self.sizes = [s for s in SIZES if s < max_batch] + [max_batch]
        self.max_rows, self.max_blocks = max_rows, max_blocks
        self.capture = device.type == "cuda" if capture is None else capture
        self.entries: dict[tuple[int, int], _Entry] = {}
        self.pool = pool   # the memory pool the graphs share (None: the first capture's)
        self.rows: set[int] | None = None   # after capture_all: the row counts captured, the only ones served
        self.replays = 0   # forwards served from the buffers (the tests count them)

    def eligible(self, inp) -> bool:
        B = len(inp.seq_lens)
        if B == 0 or B > self.sizes[-1]:
            return False
        q = inp.query_lens[0]
        if not 1 <= q <= self.max_rows or any(n != q for n in inp.query_lens) or any(m is not None for m in inp.masks):
            return False
        if not inp.logit_rows:   # a prompt chunk that only writes KV: nothing to read back
            return False
        if self.rows is not None and q not in self.rows:   # never capture inside a served step
            return False
        return max(len(bt) for bt in inp.block_tables) <= self.max_blocks

    @torch.inference_mode()
    def capture_all(self, rows: list[int]) -> int:
        """Capture every (batch size, rows) now, largest first (the pool then fits the smaller
        ones into the largest's memory), instead of at first use inside a timed step: a capture
        there costs the step two warm-up forwards and the capture, and the controller would
        book that as the pass's cost. Returns the number of shapes captured."""
        count = 0
        self.rows = (self.rows or set()) | set(rows)
        for q in sorted(rows, reverse=True):
            for Bp in reversed(self.sizes):
                if (Bp, q) not in self.entries:
                    self._entry(Bp, q)
                    count += 1
        return count

    def _entry(self, Bp: int, q: int) -> _Entry:
        entry = _Entry(Bp, q, self.max_blocks, self.device)
        if self.capture:
            self._capture(entry)   # registered only once captured: a failed capture raises
        self.entries[(Bp, q)] = entry
        return entry

    def forward(self, inp) -> torch.Tensor:
        """The hidden rows [T, H] of an eligible forward (a view: read it before the next one)."""
        B, q = len(inp.seq_lens), inp.query_lens[0]
        Bp = next(s for s in self.sizes if s >= B)
        entry = self.entries.get((Bp, q)) or self._entry(Bp, q)
        entry.fill(inp)
        self.replays += 1
        if entry.graph is not None:
            entry.graph.replay()
            hidden = entry.hidden
        else:
            hidden = self.model(entry.input_ids, entry.positions, self.kv_caches, entry.meta)
        return hidden[: B * q]

    def _capture(self, entry: _Entry) -> None:
        entry.fill_padding()
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):   # warm-up: Triton compiles and cuBLAS picks its kernels here
            for _ in range(2):
                self.model(entry.input_ids, entry.positions, self.kv_caches, entry.meta)
        torch.cuda.current_stream(self.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            entry.hidden = self.model(entry.input_ids, entry.positions, self.kv_caches, entry.meta)
        if self.pool is None:
            self.pool = graph.pool()
        entry.graph = graph
