"""Continuous batching over the shared KV pool: who computes what in the next step.

Requests join and leave between steps. Every step has a token budget
(`max_num_batched_tokens`): running requests go first (oldest first), each taking its
pending token plus, when speculating, the tree nodes the plan gives it; prompts are
prefilled in chunks with what is left. When the pool runs out of blocks the scheduler first
drops speculation (the request's own, then that of those scheduled before it), then
preempts the youngest running request by recompute (its blocks are freed; it re-enters the
front of the queue and is prefilled again, prefix cache first).
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field

from specserve.config import SchedulerConfig
from specserve.kv_pool import KVPool, blocks_needed
from specserve.request import Request, RequestStatus


@dataclass
class ScheduledSeq:
    request: Request
    num_new_tokens: int  # target positions computed this step (a prefill chunk, or 1: the pending token)
    num_spec_nodes: int = 0  # tree nodes verified after the pending token (slots reserved)

    @property
    def is_decode(self) -> bool:
        """True when this step reaches the end of the sequence, so a new token is produced."""
        req = self.request
        return req.num_computed_tokens + self.num_new_tokens == req.num_tokens

    @property
    def is_prefill(self) -> bool:
        """A prompt chunk (or a preempted request's recompute), not one pending token."""
        return self.num_new_tokens > 1 or not self.is_decode


@dataclass
class SchedulerOutput:
    seqs: list[ScheduledSeq] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)

    @property
    def num_batched_tokens(self) -> int:
        return sum(s.num_new_tokens + s.num_spec_nodes for s in self.seqs)

    @property
    def is_empty(self) -> bool:
        return not self.seqs


class Scheduler:
    def __init__(self, config: SchedulerConfig, pool: KVPool, max_model_len: int, has_draft_kv: bool):
        self.config = config
        self.pool = pool
        self.max_model_len = max_model_len
        self.has_draft_kv = has_draft_kv
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0

    # -- queue ---------------------------------------------------------------------------

    def add(self, request: Request) -> None:
        self.waiting.append(request)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def finish(self, request: Request, reason: str) -> None:
        """Finish or abort a request wherever it is; its blocks go back to the pool at once."""
        if request.status is RequestStatus.RUNNING:
            self.running.remove(request)
        elif request.status is RequestStatus.WAITING:
            self.waiting.remove(request)
        else:
            return
        request.status = RequestStatus.FINISHED
        request.finish_reason = reason
        self._cache_blocks(request)  # a request finishing in its first step still fills the cache
        self._free_blocks(request)

    # -- one step ------------------------------------------------------------------------

    def schedule(self, spec_nodes: Mapping[str, int] | None = None) -> SchedulerOutput:
        """Plan one step. `spec_nodes`: request id -> tree nodes to reserve after that request's
        pending token (the plan's; absent = plain decode)."""
        spec_nodes = spec_nodes or {}
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens

        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            num_new = min(req.num_tokens - req.num_computed_tokens, budget)
            decoding = req.num_computed_tokens + num_new == req.num_tokens
            # No speculation in a step that preempted: what a preemption frees is for decoding.
            spec = self._spec_nodes(req, spec_nodes.get(req.request_id, 0), budget - num_new) \
                if decoding and num_new == 1 and not out.preempted else 0
            while not self._reserve(req, req.num_computed_tokens + num_new + spec):
                if spec:
                    spec = 0  # speculation goes before anybody is preempted: this request's,
                    continue
                dropped = self._drop_speculation(out)   # then that of those scheduled before it
                if dropped:
                    budget += dropped
                    continue
                victim = self.running[-1]
                self._preempt(victim, out)
                if victim is req:
                    break
            else:
                out.seqs.append(ScheduledSeq(req, num_new, spec))
                budget -= num_new + spec
                i += 1
                continue
            break  # req itself was preempted: it was the last running request

        # Admit waiting requests only when nobody had to be preempted this step.
        while self.waiting and not out.preempted and budget > 0 and len(self.running) < self.config.max_num_seqs:
            req = self.waiting[0]
            # A request still owed prompt logprobs computes its whole prompt: no cache hits.
            owed = req.prompt_logprobs is not None and len(req.prompt_logprobs) < req.num_prompt_tokens
            if not req.block_table and self.pool.enable_prefix_caching and not owed:
                blocks, num_cached = self.pool.match_prefix(req.token_ids)
                req.block_table = list(blocks)
                req.num_computed_tokens = num_cached
                # The draft computes what the cache holds only of the target's KV.
                req.num_draft_computed_tokens = self.pool.draft_cached_tokens(blocks) if self.has_draft_kv \
                    else num_cached
                req.num_draft_marked_blocks = req.num_draft_computed_tokens // self.pool.block_size
                req.stats.num_cached_tokens = max(req.stats.num_cached_tokens, num_cached)
            num_new = req.num_tokens - req.num_computed_tokens
            if num_new > budget:
                # Without chunking a prompt waits for a step with room for all of it; one longer
                # than the whole budget (or a preempted request's prompt + output) never gets
                # one, so it is chunked anyway rather than left waiting forever. A request that
                # waits holds no blocks: its prefix-cache hits go back (they are found again),
                # else a request preempted to the queue's front could wait on them for ever.
                if not self.config.enable_chunked_prefill and num_new <= self.config.max_num_batched_tokens:
                    self._free_blocks(req)
                    break
                num_new = budget
            if not self._reserve(req, req.num_computed_tokens + num_new):
                self._free_blocks(req)  # give back the prefix-cache hits; try again next step
                break
            self.waiting.popleft()
            req.status = RequestStatus.RUNNING
            if req.stats.first_scheduled_time is None:
                req.stats.first_scheduled_time = time.monotonic()
            self.running.append(req)
            out.seqs.append(ScheduledSeq(req, num_new))
            budget -= num_new
        return out

    def postprocess(self, request: Request) -> None:
        """After a step: register newly full blocks for the prefix cache, and give back blocks
        wholly past the sequence's end (rejected speculation's scratch)."""
        keep = blocks_needed(request.num_tokens, self.pool.block_size)
        if len(request.block_table) > keep:
            self.pool.free(request.block_table[keep:])
            del request.block_table[keep:]
        self._cache_blocks(request)

    def _cache_blocks(self, request: Request) -> None:
        if self.pool.enable_prefix_caching and request.block_table:
            # Capped by num_tokens: a step cut short by a stop drops tokens it had computed.
            num_valid = min(request.num_computed_tokens, request.num_tokens)
            self.pool.cache_blocks(request.block_hashes, request.block_table, request.token_ids, num_valid)
            if self.has_draft_kv:
                done = min(num_valid, request.num_draft_computed_tokens) // self.pool.block_size
                if done > request.num_draft_marked_blocks:
                    self.pool.mark_draft(request.block_table[request.num_draft_marked_blocks:done])
                    request.num_draft_marked_blocks = done

    # -- helpers -------------------------------------------------------------------------

    def _spec_nodes(self, req: Request, wanted: int, budget_left: int) -> int:
        """Cap the tree so its positions stay inside the context and the step's budget."""
        room = self.max_model_len - req.num_tokens  # node at depth d sits at position num_tokens - 1 + d
        return max(0, min(wanted, room, budget_left))

    def _drop_speculation(self, out: SchedulerOutput) -> int:
        """Take back the latest speculating sequence's nodes and their scratch blocks (all
        allocated this step: after `postprocess` no block lies past a sequence's end); the
        number of nodes taken back, 0 when no sequence speculates."""
        for seq in reversed(out.seqs):
            if seq.num_spec_nodes:
                req, nodes = seq.request, seq.num_spec_nodes
                seq.num_spec_nodes = 0
                keep = blocks_needed(req.num_computed_tokens + seq.num_new_tokens, self.pool.block_size)
                self.pool.free(req.block_table[keep:])
                del req.block_table[keep:]
                return nodes
        return 0

    def _reserve(self, req: Request, num_tokens: int) -> bool:
        missing = blocks_needed(num_tokens, self.pool.block_size) - len(req.block_table)
        if missing <= 0:
            return True
        blocks = self.pool.allocate(missing)
        if blocks is None:
            return False
        req.block_table.extend(blocks)
        return True

    def _preempt(self, req: Request, out: SchedulerOutput) -> None:
        """Preempt by recompute: drop every block; the request starts over from the queue's front."""
        self.running.remove(req)
        self._free_blocks(req)
        req.status = RequestStatus.WAITING
        req.stats.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(req)
        out.preempted.append(req)
        out.seqs = [s for s in out.seqs if s.request is not req]

    def _free_blocks(self, req: Request) -> None:
        if req.block_table:
            self.pool.free(req.block_table)
        req.block_table = []
        req.block_hashes = []
        req.num_computed_tokens = 0
        req.num_draft_computed_tokens = req.num_draft_marked_blocks = 0
