"""One speculative step: propose -> verify (ONE target forward) -> accept -> compact.

Verify rows of a speculating sequence: its pending token, then its tree's nodes in BFS
order. The pending token sits at position T - 1 (T = tokens so far), node k at RoPE
position T - 1 + depth(k) and scratch slot of position T + k; each node sees the whole
committed prefix, the pending token, its ancestors and itself. Prefill chunks and
sequences that do not speculate ride in the same forward with their causal rows.

Acceptance is the tree-verification kernel (kernels/tree_accept.py), exactly DESIGN.md §5:
greedy follows the target's argmax; sampled requests use multi-round speculative sampling
(Leviathan et al. 2023; Miao et al. 2023, SpecInfer), so the output follows the target's
distribution. Accepted nodes off the chain are compacted to positions T..T+a-1 (target KV;
the draft re-reads accepted branch tokens in its next catch-up, see drafts/model.py).
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from specserve.config import EngineConfig
from specserve.errors import InvalidRequestError
from specserve.drafts.base import TreeShape
from specserve.kernels import ops
from specserve.request import Request
from specserve.runner import ForwardInput, slots_for
from specserve.sampling import SamplingTensors, target_probs
from specserve.scheduler import Scheduler, SchedulerOutput, ScheduledSeq
from specserve.tree import DraftTree, fixed_tree_size

logger = logging.getLogger("specserve")


@dataclass
class Plan:
    depth: int = 0  # tree levels; 0 = plain decode
    num_nodes: int = 0  # tree nodes per sequence (root excluded)
    stop_below: float = 0.0  # chains: a sequence stops drafting below this path probability
    level_below: float = 0.0  # chains: the batch stops drafting when a level would not pay (TreeShape)


@dataclass
class SpecTotals:
    """Engine-wide speculative counters (exported as metrics)."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)
    num_verify_passes: int = 0  # target passes that verified at least one tree
    num_emitted_tokens: int = 0  # tokens produced by those passes (accepted + bonus)
    last_depth: int = 0

    def add_position(self, pos: int) -> None:
        while len(self.accepted_per_position) <= pos:
            self.accepted_per_position.append(0)
        self.accepted_per_position[pos] += 1

    @property
    def mean_tokens_per_pass(self) -> float:
        return self.num_emitted_tokens / self.num_verify_passes if self.num_verify_passes else 1.0


class NoSpeculation:
    """[draft] kind = "none": every step is a plain decode step."""

    drafter = None
    controller = None
    adaptive = None

    def __init__(self):
        self.totals = SpecTotals()
        self.last_timing = (0.0, 0.0)

    def setting(self) -> dict:
        return {"mode": "off"}

    def set_setting(self, mode: str, depth: int | None = None) -> dict:
        raise InvalidRequestError("this server has no draft ([draft] kind = 'none'): there is no speculation "
                                  "to switch", param="mode")

    def plan(self, scheduler: Scheduler) -> Plan:
        return Plan()

    def prefill_draft(self, batch: SchedulerOutput) -> None:
        pass

    def forget(self, request: Request) -> None:
        pass

    def observe(self, batch: SchedulerOutput, plan: Plan, draft_s: float, verify_s: float, *args, **kwargs) -> None:
        self.last_timing = (draft_s, verify_s)

    def end_step(self, step_s: float) -> None:
        pass

    def calibrate(self, *args, **kwargs) -> None:
        pass


def _is_prefill(s: ScheduledSeq) -> bool:
    return s.num_new_tokens > 1 or not s.is_decode


def _chunk_tree_mask(m: int, tree_mask: list[list[bool]]) -> list[list[bool]] | torch.Tensor:
    """Visibility among m chunk rows followed by a tree's nodes: the chunk is causal, its last
    row is the tree's root, and each node sees the chunk before the root and, from the root on,
    what the tree's verify mask says (m == 1: that mask itself). A tensor (a prompt's chunk can
    be thousands of rows: as nested lists the mask would cost more than the pass)."""
    if m == 1:
        return tree_mask
    n = len(tree_mask) - 1
    mask = torch.ones(m + n, m + n, dtype=torch.bool).tril_()
    mask[m - 1:, m - 1:] = torch.tensor(tree_mask, dtype=torch.bool)
    return mask


class Speculator:
    def __init__(self, config: EngineConfig, engine, drafter, controller):
        self.config = config
        self.engine = engine
        self.drafter = drafter
        self.controller = controller   # None while the setting is static (set_setting)
        self.adaptive = controller     # the controller built at start-up, kept while detached
        self.totals = SpecTotals()
        spec = config.spec
        self.tree_kind = spec.tree if drafter.has_kv else "chain"
        self._step_stats = None  # this step's StepStats, completed by end_step()
        # Finished in this step, (id, tokens decoded): forgotten once the step is reported.
        self._forget_after_step: list[tuple[str, int]] = []
        self._step_measured_s = 0.0  # its draft + verify time
        self.last_timing = (0.0, 0.0)  # the last step's draft and verify seconds, prefill or not (the step log)
        self.last_drafted = 0  # tree nodes the last step verified, all sequences together (the step log)

    # -- the setting ---------------------------------------------------------------------

    def setting(self) -> dict:
        """What plans the steps now: {"mode": "adaptive"} or {"mode": "static", "depth": d}."""
        if self.controller is not None:
            return {"mode": "adaptive"}
        return {"mode": "static", "depth": self.config.spec.depth}

    def set_setting(self, mode: str, depth: int | None = None) -> dict:
        """Switch between the adaptive controller and a static depth while serving (the
        engine calls this between steps). Any depth is exact (verification keeps only what
        the target agrees with), so requests in flight carry on under the new setting. A
        static setting detaches the controller: it neither plans nor learns until switched
        back, then goes on from its state (a long-running server's), like a sweep that
        compares settings inside one process (benchmarks/sweep.py --one-process). Adaptive
        needs the controller built at start-up (mode = "adaptive" in the config: its start-up
        calibration is what it plans from)."""
        if mode == "adaptive":
            if depth is not None:
                raise InvalidRequestError("'depth' is only for mode 'static' (the adaptive controller picks "
                                          "its own)", param="depth")
            if self.adaptive is None:
                raise InvalidRequestError("this server was started with [spec] mode = 'static': it has no "
                                          "adaptive controller (no start-up calibration) to switch to; start "
                                          "it with mode = 'adaptive' to switch between both", param="mode")
            self.controller = self.adaptive
        elif mode == "static":
            limit = max(self.config.spec.max_depth, 1)
            if not isinstance(depth, int) or isinstance(depth, bool) or not 0 <= depth <= limit:
                raise InvalidRequestError(f"mode 'static' needs an integer 'depth' in 0..{limit} ([spec] "
                                          f"max_depth), got {depth!r}", param="depth")
            self.controller = None
            self.config.spec.depth = depth
        else:
            raise InvalidRequestError(f"unknown speculation mode {mode!r}: 'adaptive' or 'static'", param="mode")
        return self.setting()

    # -- the plan ------------------------------------------------------------------------

    def shape(self, depth: int, stop_below: float = 0.0, level_below: float = 0.0) -> TreeShape:
        spec = self.config.spec
        return TreeShape(kind=self.tree_kind, depth=depth, branching=tuple(spec.branching), topk=spec.topk,
                         stop_below=stop_below, level_below=level_below)

    def num_nodes(self, depth: int) -> int:
        spec = self.config.spec
        if depth == 0:
            return 0
        if self.tree_kind == "fixed":
            return fixed_tree_size(spec.branching, depth)
        if self.tree_kind == "dynamic":
            return spec.num_nodes
        return depth

    def plan(self, scheduler: Scheduler) -> Plan:
        num_nodes = None
        if self.controller is not None:
            running = scheduler.running
            # How deep each request can still be drafted: the drafters stop one short of
            # max_tokens, the scheduler at the context's end.
            room = self.engine.max_model_len
            caps = [max(0, min(r.num_tokens_left - 1, room - r.num_tokens)) for r in running]
            chosen = self.controller.plan(max(1, len(running)), [r.request_id for r in running],
                                          sum(r.num_computed_tokens for r in running), caps,
                                          sum(max(0, r.num_output_tokens - 1) for r in running),
                                          [not r.params.is_greedy for r in running])
            depth = chosen.depth
            if self.tree_kind == "dynamic" and depth:
                num_nodes = max(depth, chosen.num_nodes)
        else:
            depth = self.config.spec.depth
        if self.tree_kind == "fixed":
            depth = min(depth, len(self.config.spec.branching))
        self.totals.last_depth = depth
        return Plan(depth, self.num_nodes(depth) if num_nodes is None else num_nodes, *self._stop_below(depth))

    def _stop_below(self, depth: int) -> tuple[float, float]:
        """[spec] early_stop for this step's chains, (per chain, per level): the controller's
        thresholds ("auto", adaptive mode), the configured number for each chain, or 0 (off,
        trees, plain steps)."""
        setting = self.config.spec.early_stop
        if depth == 0 or self.tree_kind != "chain" or setting == "off":
            return 0.0, 0.0
        if setting == "auto":
            c = self.controller
            return (c.stop_below, c.level_below) if c is not None else (0.0, 0.0)
        return float(setting), 0.0

    def calibrate(self, max_batch_size: int, context: int = 32,
                  longer_contexts: Sequence[int] = (128, 256)) -> None:
        """_calibrate, with the target's verify passes timed as they will run: tree passes carry
        a mask and never run from CUDA graphs (cuda_graphs), so for trees the calibration's
        maskless passes must not either."""
        self._warm_kernels()
        target = self.engine.target
        graphs = target.graphs
        if graphs is not None and self.tree_kind != "chain":
            target.graphs = None
        try:
            self._calibrate(max_batch_size, context, longer_contexts)
        finally:
            target.graphs = graphs

    def _warm_kernels(self) -> None:
        """On the Triton path: compile tree_accept (greedy and sampled, one node and two) and
        copy_slots (one slot and two) now. The forwards below compile the attention and the
        fused kernels; these two would otherwise compile at their first use in a served step
        (about a second each on the H100), which the controller would book as that step's cost."""
        engine = self.engine
        dev = engine.device
        if not ops.on_triton(torch.empty(0, device=dev)):
            return
        for V in (1, engine.target_args.vocab_size):
            for N in (1, 2):
                probs = torch.full((1, N + 1, V), 1.0 / V, device=dev)
                ops.tree_accept(
                    probs, torch.zeros(1, N + 1, dtype=torch.long, device=dev), probs[:, :N].contiguous(),
                    torch.zeros(1, N, dtype=torch.long, device=dev),
                    torch.arange(-1, N - 1, dtype=torch.int32, device=dev).view(1, N),
                    torch.full((1, N), V > 1, dtype=torch.bool, device=dev),
                    torch.full((1,), N, dtype=torch.int32, device=dev),
                    torch.full((1,), V == 1, dtype=torch.bool, device=dev),
                    torch.rand(1, N + 1, device=dev),
                )
        caches = engine.target.cache_tensors
        for m in (1, 2):   # slot 0 onto itself: the pool is empty at start-up
            slots = torch.zeros(m, dtype=torch.long, device=dev)
            ops.copy_slots(caches, slots, slots)

    def _calibrate(self, max_batch_size: int, context: int = 32,
                   longer_contexts: Sequence[int] = (128, 256)) -> None:
        """Warm-start the controller's cost tables with dummy forwards (DESIGN.md §6): one
        verify pass per (batch size, nodes per sequence), one draft step per batch size, and
        the draft levels of a whole step at a few depths, all at `context` tokens per sequence;
        and what the context adds to a verify pass and to a draft level, from the same passes
        at each of `longer_contexts` tokens per sequence.
        The pool is empty at start-up: the dummy sequences take their blocks from a fixed shuffle
        of it (see `batch`)."""
        if self.controller is None:
            return
        engine = self.engine
        block_size = engine.pool.block_size
        max_nodes = self.controller.max_num_nodes
        room = min(engine.pool.num_blocks * block_size, engine.max_model_len) - max_nodes - 1
        context = min(context, room)
        if context < 1:
            return
        longer = sorted({min(c, room) for c in longer_contexts} - {context})
        longer = [c for c in longer if c > context]

        num_blocks = engine.pool.num_blocks
        # The dummy sequences' blocks are strewn over the whole pool, as a served batch's are:
        # the pool hands out freed blocks first in, first out, and prompts reuse cached blocks
        # wherever they were, so once a server has run a while a sequence's blocks lie anywhere
        # (the forty-third session, on the dev CPU: 64 served sequences' blocks spanned 2613 of
        # the pool's 2978, 305 blocks apart on average). Gathering them costs more than reading
        # neighbouring blocks, and not by one factor: a step of depth 3 over 64 sequences at 136
        # tokens took 1.06-1.08x the time on strewn blocks (in one run one of depth 1 1.20x).
        # Calibrated on neighbouring blocks, the controller priced every depth off its own at 64
        # requests (step logs of 32 sweep rounds: plain decoding at 0.89 and depth 1 at 0.83 of
        # what they cost, depths 4-6 at 1.04-1.07, beside 1.02 for depth 3).
        strewn = list(range(num_blocks))
        random.Random(0).shuffle(strewn)

        def batch(batch_size: int, rows_per_seq: int, ctx: int = context, last_only: bool = False) -> ForwardInput:
            # Each dummy sequence on blocks of its own (wrapping round the pool only when it is
            # too small), as real sequences are: attention gathering 64 sequences' context from
            # the same few blocks reads them from the caches and costs less per token than the
            # engine's passes ever do.
            per_seq = -(-(ctx + rows_per_seq) // block_size)
            inp = ForwardInput()
            for i in range(batch_size):
                blocks = [strewn[(i * per_seq + j) % num_blocks] for j in range(per_seq)]
                inp.add([0] * rows_per_seq, list(range(ctx, ctx + rows_per_seq)),
                        slots_for(blocks, block_size, ctx, rows_per_seq), blocks,
                        ctx + rows_per_seq, logit_rows=[rows_per_seq - 1] if last_only else list(range(rows_per_seq)))
            return inp

        def draft_levels(batch_size: int, depths: Sequence[int], rounds: int = 3) -> dict[int, float]:
            """A step's draft levels as the engine runs them, for each of `depths`: after a
            target pass (which evicts the draft's weights from the caches), a first level of two
            rows per sequence (the catch-up) and depth - 1 levels of one, each read back (the
            tree grows on the host). Timed in interleaved rounds (the order reversed every other
            round, a warm-up first), each depth read as its fastest, as run_grid times the verify
            passes: timed depth after depth, best of two, a depth that caught a slow spell stood
            out for good (three start-ups offline, 4 sequences: depth 3's step over depth 5's
            read 0.74-0.81, and one depth in a row 30% above its neighbours), which is the size
            of the margins between depths at 4-8 requests."""
            # the catch-up wants the last row's logits only, as drafts/model.py asks
            verify, first, later = batch(batch_size, 1), batch(batch_size, 2, last_only=True), batch(batch_size, 1)

            def once(depth: int) -> float:
                engine.target.forward(verify)[-1, 0].item()
                start = time.perf_counter()
                engine.draft.forward(first).argmax(dim=-1).tolist()
                for _ in range(depth - 1):
                    engine.draft.forward(later).argmax(dim=-1).tolist()
                return time.perf_counter() - start

            order = sorted(set(depths))
            once(order[-1])   # warm-up
            best = dict.fromkeys(order, float("inf"))
            for i in range(rounds):
                for d in (order if i % 2 == 0 else order[::-1]):
                    best[d] = min(best[d], once(d))
            return best

        measured: dict[tuple, float] = {}   # the context slopes reuse the short passes

        def pass_time(runner, inp: ForwardInput) -> float:
            start = time.perf_counter()
            runner.forward(inp)[-1, 0].item()  # wait for the device
            return time.perf_counter() - start

        def run(runner, batch_size: int, rows_per_seq: int, ctx: int = context) -> float:
            key = (id(runner), batch_size, rows_per_seq, ctx)
            if key not in measured:   # the first run warms up; keep the fastest
                inp = batch(batch_size, rows_per_seq, ctx)
                measured[key] = min(pass_time(runner, inp) for _ in range(3))
            return measured[key]

        def run_grid(runner, batch_size: int, rows: list[int], contexts: list[int],
                     rounds: int = 3) -> dict[tuple[int, int], float]:
            """Every (rows, context) pass of one batch size, measured in rounds (each round runs
            every pass once, the order reversed every other round) and read as each one's
            fastest; run() then answers from those at `context`. Timed back to back, a pass's
            repeats all fell in whatever spell the machine was in: calibrating twice on the dev
            CPU, 64 sequences, the step from 3 to 4 rows and from 4 to 5 read 12.5 and 10.1 ms,
            then 1.1 and 23.4 (the true steps: 15-20 ms each), and such a kink is a dip in the
            predicted goodput that the plan does not cross. The contexts share the rounds, so
            a spell lifts a round's passes together and each pass's fastest escapes it: the
            sixth session's slope, from two minima timed one after the other, came out 3x too
            steep under one spell."""
            keys = [(r, c) for c in contexts for r in rows]
            inputs = {k: batch(batch_size, *k) for k in keys}
            for k in keys:   # warm-up
                pass_time(runner, inputs[k])
            best = dict.fromkeys(keys, float("inf"))
            for i in range(rounds):
                for k in (keys if i % 2 == 0 else keys[::-1]):
                    best[k] = min(best[k], pass_time(runner, inputs[k]))
            for r in rows:
                measured[(id(runner), batch_size, r, context)] = best[(r, context)]
            return best

        budget = self.config.scheduler.max_num_batched_tokens  # no step is ever larger
        # Every power-of-two batch bucket gets a row of its own: a bucket first seen online would
        # otherwise extrapolate its verify cost from its own two or three noisy points.
        sizes = [1 << i for i in range(9) if (1 << i) <= min(max_batch_size, budget)]
        nodes = sorted({0, 1, min(3, max_nodes), max_nodes})
        # Every chain length is measured, at every batch size: the cost of a few more rows is
        # not linear (cache effects, kernel choice by shape), the goodput curve over depth is
        # flat near its top, and an interpolated point a few percent off moves the plan. On
        # the dev CPU at 64 sequences of 200 tokens, 3 rows cost what 4 do, 1.2x what the 2
        # and 4 around them said; read cheap, depth 2 was run where 3-4 were best. Small
        # batches also get every draft depth (larger ones run their draft levels at a near
        # constant cost per level).
        fine_batch = 8
        fine_nodes = sorted(set(nodes) | set(range(min(self.controller.max_depth, max_nodes) + 1)))
        max_depth = self.controller.max_depth
        measure_draft = (lambda b: run(engine.draft, b, 1)) if self.drafter.has_kv else (lambda b: 1e-5)

        def context_curves(b: int, verify: dict[tuple[int, int], float]
                           ) -> tuple[dict[int, dict[int, float]], dict[int, float]]:
            """What the context adds to a verify pass, per rows per sequence, and to one draft
            level, at each longer context: attention reads every cached token for every row,
            so at many sequences with long contexts it is a large share of a pass. Without
            this term the whole rise would scale every row count alike (the rows' level), and
            speculation would look dearer than it is exactly at high load. Per rows, since the
            rise is not one figure (on the dev CPU at 64 sequences, 168 more tokens of context
            each added 16 ms to a one-row pass, 19 ms to two rows and 26-38 ms to 3-9 rows);
            and at more than one context, since it is not linear in the context either (at 16
            sequences, a pass at 136 tokens read off the line through 32 and 256 tokens was 3%
            over at 3-4 rows and 5-6% under at 6-9: deep plans priced cheap at the contexts
            served)."""
            rows = sorted({r for r, _ in verify})
            curves = {r: {c: verify[(r, c)] - verify[(r, context)] for c in longer} for r in rows}
            draft: dict[int, float] = {}
            if self.drafter.has_kv:
                levels = run_grid(engine.draft, b, [1], [context] + longer, rounds=5)
                draft = {c: levels[(1, c)] - levels[(1, context)] for c in longer}
            return curves, draft

        started = time.perf_counter()
        logger.info("controller: measuring step costs at batch sizes %s (start-up calibration)",
                    ", ".join(map(str, sizes)))
        for b in sizes:  # one size at a time, so each keeps only the node counts that fit the budget
            fine = b <= fine_batch
            verify_nodes = [n for n in fine_nodes if b * (n + 1) <= budget]
            grid = run_grid(engine.target, b, [n + 1 for n in verify_nodes], [context] + longer)
            depths = sorted({min(d, max_depth) for d in (range(1, max_depth + 1) if fine else (1, 3, max_depth)) if d > 0})
            levels = draft_levels(b, depths) if self.drafter.has_kv and depths and 2 * b <= budget else None
            self.controller.calibrate(
                lambda b, num_tokens: run(engine.target, b, num_tokens // b), measure_draft,
                batch_sizes=[b], nodes_per_seq=verify_nodes,
                measure_draft_total=(lambda b, d, levels=levels: levels[d]) if levels else None,
                draft_depths=depths,
                measure_context_curves=(lambda b, grid=grid: context_curves(b, grid)) if longer else None,
                reference_context=context,
            )
            logger.info("controller: batch size %d calibrated (%.1f s so far)", b, time.perf_counter() - started)

    def observe(self, batch: SchedulerOutput, plan: Plan, draft_s: float, verify_s: float,
                num_accepted: list[int], request_ids: list[str], draft_is_typical: bool = True,
                trees: list | None = None, context_tokens: int | None = None) -> None:
        """This step's timings and acceptance, for the controller once end_step() adds the
        rest of the step's time. Steps that also prefill would skew the decode cost model, so
        their timings are left out (their acceptance still counts), as is a draft time that
        is more than plain draft steps (draft_is_typical=False, see run())."""
        self.last_timing = (draft_s, verify_s)
        if self.controller is None:
            return
        from specserve.controller import StepStats

        decoding = [s for s in batch.seqs if not _is_prefill(s)]
        has_prefill = len(decoding) != len(batch.seqs)
        # Trees smaller than the plan (cut near max_tokens or the context's end, or by the
        # step's token budget) mean fewer verify rows and, when every tree was cut, fewer draft
        # levels than the plan's: the costs are booked under what ran, and each request's
        # acceptance counts only the depths its own tree had.
        trees = trees or []
        # A chain that stopped early on the draft's doubt (early_stop) still counts the depths
        # it was allowed: the positions it did not propose count as not accepted, so acceptance
        # is what this policy gets from each depth, and the plan's tokens are not overrated.
        # (Against the sequences that verified: the decoding ones and, with speculate_prompts,
        # prompts whose last chunk was given nodes.)
        cut = plan.num_nodes > 0 and (
            len(trees) < len(decoding) + sum(1 for s in batch.seqs if _is_prefill(s) and s.num_spec_nodes > 0)
            or any(t.num_nodes < plan.num_nodes for t in trees))
        seq_depths = [t.max_depth if t.room is None else min(t.room, plan.depth) for t in trees] if cut else None
        self._step_stats = StepStats(
            # A step of prompts alone still teaches acceptance (its timings are not read).
            batch_size=len(decoding) or len(request_ids),
            depth=plan.depth,
            num_nodes=plan.num_nodes,
            draft_s=0.0 if has_prefill or not draft_is_typical else draft_s,
            verify_s=0.0 if has_prefill else verify_s,
            num_accepted=num_accepted,
            request_ids=request_ids,
            seq_depths=seq_depths,
            num_tokens=len(decoding) + sum(t.num_nodes for t in trees) if cut else None,
            draft_depth=max((t.max_depth for t in trees), default=0) if cut else None,
            drafted_depths=[t.max_depth for t in trees] if cut else None,
            context_tokens=context_tokens,
        )
        if trees and plan.num_nodes > plan.depth and all(t.path_probs for t in trees):
            self._step_stats.path_probs = [t.path_probs for t in trees]
            self._step_stats.node_depths = [t.depths for t in trees]
        self._step_measured_s = draft_s + verify_s

    def end_step(self, step_s: float) -> None:
        """The engine step is over (outputs built): hand the controller what it measured.
        step_s: what the step cost, from the end of the step before (see LLMEngine.step)."""
        stats, self._step_stats = self._step_stats, None
        if stats is not None:
            if stats.verify_s > 0:
                stats.overhead_s = max(0.0, step_s - self._step_measured_s)
            self.controller.observe(stats)
        if self._forget_after_step:   # requests this step finished: reported, now forgotten
            for request_id, decoded in self._forget_after_step:
                self.forget_history(request_id, decoded)
            self._forget_after_step.clear()

    def prefill_draft(self, batch: SchedulerOutput) -> None:
        if self.drafter.has_kv:
            self.drafter.prefill([s for s in batch.seqs if _is_prefill(s)])

    def forget(self, request: Request) -> None:
        """The request finished or was aborted: its draft state goes now, its acceptance
        history once the step that finished it has been reported (end_step), since that
        report counts it and would otherwise start its history afresh."""
        self.drafter.forget(request)
        # What it decoded after its prompt's step (whose token the churn counts apart): its
        # slot's cycle, plain steps included, which report no requests to the controller.
        decoded = max(0, request.num_output_tokens - 1)
        stats = self._step_stats
        if stats is not None and request.request_id in stats.request_ids:
            self._forget_after_step.append((request.request_id, decoded))
        else:
            self.forget_history(request.request_id, decoded)

    def forget_history(self, request_id: str, num_tokens: int | None = None) -> None:
        """Drop a finished request's acceptance history from the controllers; num_tokens:
        what it decoded (the mean request length, see "Churn" in controller.py)."""
        if self.adaptive is not None:   # detached or not: its per-request history goes either way
            self.adaptive.forget(request_id, num_tokens)

    # -- one step ------------------------------------------------------------------------

    def run(self, batch: SchedulerOutput, plan: Plan) -> dict[str, list[int]]:
        if batch.is_empty:
            return {}
        engine = self.engine
        block_size = engine.pool.block_size
        t0 = time.perf_counter()
        spec_seqs = [s for s in batch.seqs if s.num_spec_nodes > 0]
        # A chunk that completes its prompt and speculates after it (Scheduler's
        # speculate_prompts) is drafted like a decoding sequence: the draft's catch-up takes
        # the chunk and its last row starts the tree.
        prefills = [s for s in batch.seqs if _is_prefill(s) and s.num_spec_nodes == 0]
        # The draft's first forward also catches it up on what it has not seen: normally the
        # pending token and the accepted run (at most depth + 1 tokens); after a spell at
        # depth 0, a whole backlog. Such a step's draft time says nothing about a draft step.
        backlog = max((s.request.num_tokens - s.request.num_draft_computed_tokens for s in spec_seqs), default=0)
        trees = self.drafter.propose(spec_seqs, self.shape(plan.depth, plan.stop_below, plan.level_below), prefills)
        tree_of = {s.request.request_id: t for s, t in zip(spec_seqs, trees) if t.num_nodes > 0}
        self.last_drafted = sum(t.num_nodes for t in tree_of.values())
        t1 = time.perf_counter()

        inp = ForwardInput()
        plain, verified = [], []  # requests sampled normally; (seq, tree, first logit row)
        context = sum(s.request.num_computed_tokens for s in batch.seqs if not _is_prefill(s))
        for s in batch.seqs:
            req, start = s.request, s.request.num_computed_tokens
            tree = tree_of.get(req.request_id)
            if tree is None:
                n = s.num_new_tokens
                inp.add(
                    req.token_ids[start : start + n],
                    list(range(start, start + n)),
                    slots_for(req.block_table, block_size, start, n),
                    req.block_table,
                    start + n,
                    logit_rows=[n - 1] if s.is_decode else [],
                )
                if s.is_decode:
                    plain.append(req)
                continue
            n = tree.num_nodes
            # The pending token, or a prompt's last chunk whose last token plays its part: the
            # tree hangs after row m - 1, and node k's scratch slot is position start + m + k.
            m = s.num_new_tokens
            verified.append((s, tree, len(inp.logit_rows)))
            inp.add(
                req.token_ids[start : start + m] + tree.tokens,
                list(range(start, start + m)) + [start + m - 1 + d for d in tree.depths],
                slots_for(req.block_table, block_size, start, m + n),
                req.block_table,
                start + m + n,
                logit_rows=list(range(m - 1, m + n)),
                mask=None if tree.is_chain else _chunk_tree_mask(m, tree.verify_mask()),
            )
        logits = engine.target.forward(inp)
        new_tokens: dict[str, list[int]] = {}
        if plain:
            tokens = engine.sample(logits[self._plain_rows(inp, verified)], plain)
            new_tokens.update({r.request_id: [t] for r, t in zip(plain, tokens)})
        if verified:
            new_tokens.update(self._accept(logits, verified))
        t2 = time.perf_counter()
        self.observe(
            batch, plan, t1 - t0, t2 - t1,
            [len(new_tokens[s.request.request_id]) - 1 for s, _, _ in verified],
            [s.request.request_id for s, _, _ in verified],
            draft_is_typical=backlog <= plan.depth + 1,
            trees=[tree for _, tree, _ in verified],
            context_tokens=context,
        )
        return new_tokens

    @staticmethod
    def _plain_rows(inp: ForwardInput, verified) -> torch.Tensor:
        """Logit rows (indices into the returned logits) of the plainly sampled requests."""
        taken = set()
        for _, tree, first in verified:
            taken.update(range(first, first + tree.num_nodes + 1))
        return torch.tensor([i for i in range(len(inp.logit_rows)) if i not in taken], dtype=torch.long)

    def _accept(self, logits: torch.Tensor, verified) -> dict[str, list[int]]:
        engine = self.engine
        num_seqs = len(verified)
        max_nodes = max(tree.num_nodes for _, tree, _ in verified)
        vocab = logits.shape[1]
        dev = logits.device
        requests = [s.request for s, _, _ in verified]
        # Gather every verified row once: [B, N + 1, V], padding rows repeat the root row.
        row_index = torch.zeros(num_seqs, max_nodes + 1, dtype=torch.long)
        for i, (_, tree, first) in enumerate(verified):
            row_index[i, : tree.num_nodes + 1] = torch.arange(first, first + tree.num_nodes + 1)
            row_index[i, tree.num_nodes + 1 :] = first
        rows = logits[row_index.to(dev).flatten()]  # [B * (N + 1), V]
        # min_tokens: row j of sequence i comes depth(j) tokens after its last one.
        engine.mask_min_tokens(rows, [
            (i * (max_nodes + 1) + j, s.request, depth)
            for i, (s, tree, _) in enumerate(verified) if s.request.params.min_tokens
            for j, depth in enumerate([0] + tree.depths + [0] * (max_nodes - tree.num_nodes))
        ])
        target_argmax = rows.argmax(dim=-1).view(num_seqs, max_nodes + 1)
        tensors = SamplingTensors.from_params([r.params for r in requests], dev)
        if tensors.all_greedy:
            # Greedy acceptance reads only the argmax: the kernel gets 1-wide placeholders.
            vocab = 1
            probs = torch.zeros(num_seqs, max_nodes + 1, 1, dtype=torch.float32, device=dev)
        else:
            per_row = lambda t: t.repeat_interleave(max_nodes + 1)  # noqa: E731
            probs = target_probs(rows, per_row(tensors.temperature), per_row(tensors.top_k), per_row(tensors.top_p),
                                 tensors.any_restricted)
            probs = probs.float().view(num_seqs, max_nodes + 1, vocab)

        tokens = torch.zeros(num_seqs, max_nodes, dtype=torch.long)
        parents = torch.full((num_seqs, max_nodes), -1, dtype=torch.int32)
        is_sampled = torch.zeros(num_seqs, max_nodes, dtype=torch.bool)
        draft_probs = torch.zeros(num_seqs, max_nodes, vocab, dtype=torch.float32, device=dev)
        num_nodes = torch.tensor([t.num_nodes for _, t, _ in verified], dtype=torch.int32)
        is_greedy = torch.tensor([r.params.is_greedy for r in requests], dtype=torch.bool)
        uniforms = torch.empty(num_seqs, max_nodes + 1, dtype=torch.float32)
        for i, (s, tree, _) in enumerate(verified):
            n = tree.num_nodes
            tokens[i, :n] = torch.tensor(tree.tokens)
            parents[i, :n] = torch.tensor(tree.parents, dtype=torch.int32)
            is_sampled[i, :n] = torch.tensor(tree.is_sampled)
            if tree.draft_probs is not None and vocab > 1:
                width = min(vocab, tree.draft_probs.shape[1])  # the draft's vocabulary may be padded differently
                draft_probs[i, :n, :width] = tree.draft_probs[:, :width].float()
            # Exactly n + 1 draws per request (one per node, then the bonus, which tree_accept
            # reads at column max_nodes): a seeded request's stream must not depend on how
            # wide the other trees in the batch are.
            gen = s.request.generator
            if gen is not None:
                u = torch.rand(n + 1, generator=gen, device=gen.device).cpu()
            else:
                u = torch.rand(n + 1)
            uniforms[i, :n] = u[:n]
            uniforms[i, n:] = u[n]
        if not ops.on_triton(logits):   # the torch reference (CPU): nothing to copy or wait for
            accepted, num_accepted, bonus = ops.tree_accept(
                probs, target_argmax, draft_probs, tokens, parents, is_sampled, num_nodes, is_greedy, uniforms)
            accepted, num_accepted, bonus = accepted.tolist(), num_accepted.tolist(), bonus.tolist()
        else:
            # On a GPU every host-to-device copy from pageable memory and every read back waits
            # for the device: the five integer inputs travel as one int64 buffer (cast there),
            # and the three outputs come back as one. (tests/kernels/test_engine_on_kernels.py
            # runs this branch on the CPU.)
            N = max_nodes
            packed = torch.cat([tokens.flatten(), parents.flatten().long(), is_sampled.flatten().long(),
                                num_nodes.long(), is_greedy.long()]).to(dev)
            t_d, p_d, s_d, n_d, g_d = packed.split_with_sizes([num_seqs * N] * 3 + [num_seqs] * 2)
            accepted, num_accepted, bonus = ops.tree_accept(
                probs, target_argmax, draft_probs, t_d.view(num_seqs, N), p_d.view(num_seqs, N).int(),
                s_d.view(num_seqs, N).bool(), n_d.int(), g_d.bool(), uniforms.to(dev),
            )
            width = accepted.shape[1]
            back = torch.cat([accepted.flatten().long(), num_accepted.long(), bonus.long()]).tolist()
            accepted = [back[i * width:(i + 1) * width] for i in range(num_seqs)]
            num_accepted = back[num_seqs * width: num_seqs * width + num_seqs]
            bonus = back[num_seqs * width + num_seqs:]

        out: dict[str, list[int]] = {}
        src, dst = [], []
        block_size = engine.pool.block_size
        for i, (s, tree, _) in enumerate(verified):
            req = s.request
            base = req.num_tokens  # scratch slot of node k: position base + k
            a = num_accepted[i]
            path = accepted[i][:a]
            for depth, node in enumerate(path):
                if node != depth:  # off the chain: move its KV to position base + depth
                    src += slots_for(req.block_table, block_size, base + node, 1)
                    dst += slots_for(req.block_table, block_size, base + depth, 1)
            # The engine advances num_computed_tokens past the pending token and these a nodes.
            out[req.request_id] = [tree.tokens[k] for k in path] + [bonus[i]]
            if self.drafter.has_kv:
                # Only the chain drafter leaves node KV at final positions (a pruned dynamic tree can
                # look like a chain but was fed in another slot order).
                fed = tree.num_nodes - 1 if self.tree_kind == "chain" else 0
                req.num_draft_computed_tokens = base + min(a, fed)
            self._count(req, tree.num_nodes, a)
        if src:
            ops.copy_slots(
                engine.target.cache_tensors,
                torch.tensor(src, dtype=torch.long, device=dev),
                torch.tensor(dst, dtype=torch.long, device=dev),
            )
        return out

    def _count(self, req: Request, num_nodes: int, num_accepted: int) -> None:
        stats, totals = req.stats, self.totals
        stats.num_drafts += 1
        stats.num_draft_tokens += num_nodes
        stats.num_accepted_tokens += num_accepted
        while len(stats.accepted_per_position) < num_accepted:
            stats.accepted_per_position.append(0)
        for pos in range(num_accepted):
            stats.accepted_per_position[pos] += 1
            totals.add_position(pos)
        totals.num_drafts += 1
        totals.num_draft_tokens += num_nodes
        totals.num_accepted_tokens += num_accepted
        totals.num_verify_passes += 1
        totals.num_emitted_tokens += num_accepted + 1


def make_speculator(config: EngineConfig, engine):
    kind = config.draft.kind
    if kind == "none":
        return NoSpeculation()
    if kind == "ngram":
        from specserve.drafts.ngram import NgramDrafter

        drafter = NgramDrafter(config.draft.ngram_min, config.draft.ngram_max)
    else:
        from specserve.drafts.model import ModelDrafter

        drafter = ModelDrafter(engine.draft, target_vocab_size=engine.target_args.vocab_size)
    controller = None
    if config.spec.mode == "adaptive":
        controller = make_controller(config, tree_kind="chain" if kind == "ngram" else config.spec.tree)
    return Speculator(config, engine, drafter, controller)


def make_controller(config: EngineConfig, tree_kind: str):
    """The adaptive controller over depth 0..max_depth and the node budget of the tree shape."""
    from specserve.controller import AdaptiveController

    spec = config.spec
    max_depth = spec.max_depth
    if tree_kind == "fixed":
        max_depth = min(max_depth, len(spec.branching))
        max_nodes = fixed_tree_size(spec.branching, max_depth)
    elif tree_kind == "dynamic":
        max_nodes = max(spec.num_nodes, max_depth)
    else:
        max_nodes = max_depth
    # The early-stop threshold is worked out per step only where it is used.
    return AdaptiveController(mode="adaptive", max_depth=max_depth, max_num_nodes=max_nodes,
                              stop_scale=1.0 if spec.early_stop == "auto" and tree_kind == "chain" else 0.0)
