"""KVPool and Scheduler together under a hypothesis state machine, no model.

Rules add requests (random prompts, many sharing a prefix with an earlier request's tokens,
some asking for prompt logprobs), run engine steps, abort requests and probe the prefix
cache, in tiny pools where preemption is common. A step is what LLMEngine.step does with
the scheduler and the pool: Speculator.plan's node caps, Scheduler.schedule, the drafter's
catch-up (drafts/model.py, drafts/ngram.py), the verify pass's slot writes and the commit's
compaction (spec.py), then LLMEngine._postprocess / _append (tokens, stop and length, a stop
string's cut) into Scheduler.postprocess or Scheduler.finish.

Each model's KV is shadowed per pool slot by the token whose KV it holds, so the checks are
about content, not only counts: a request's computed positions hold its tokens in both
models, and every cached block holds the tokens its key names.
"""

from __future__ import annotations

import random

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from specserve.config import SchedulerConfig
from specserve.kv_pool import KVPool, blocks_needed
from specserve.request import Request, RequestStatus
from specserve.runner import slots_for
from specserve.sampling import SamplingParams
from specserve.scheduler import Scheduler

EOS = 7             # tokens are 0..3; the sampler emits EOS now and then
TREE_SCRATCH = -1   # what a draft tree's rows leave in the draft's KV (not a token of the sequence)


class Drawn:
    """A step's random outcomes (plan, trees, acceptance, tokens, stops, failures), from one seed
    hypothesis draws per step: a step takes dozens of them, one draw each would be slow."""

    def __init__(self, seed: int):
        self.rng = random.Random(seed)

    def int(self, lo: int, hi: int) -> int:
        return self.rng.randint(lo, hi) if hi > lo else lo

    def bool(self) -> bool:
        return self.rng.random() < 0.5

    def token(self) -> int:
        t = self.rng.randrange(16)
        return EOS if t == 15 else t % 4


class Plain:
    """Outcomes of plain decoding: no speculation, no stops or failures, every token 1."""

    def int(self, lo: int, hi: int) -> int:
        return lo

    def bool(self) -> bool:
        return False

    def token(self) -> int:
        return 1


def owes_prompt_logprobs(req: Request) -> bool:
    return req.prompt_logprobs is not None and len(req.prompt_logprobs) < req.num_prompt_tokens


def block_keys(token_ids: list[int], block_size: int, num_blocks: int) -> list[tuple]:
    """The prefix-cache keys of a sequence's first num_blocks full blocks (KVPool's chain)."""
    keys, parent = [], None
    for i in range(num_blocks):
        key = (parent, tuple(token_ids[i * block_size:(i + 1) * block_size]))
        keys.append(key)
        parent = hash(key)
    return keys


class PoolAndScheduler(RuleBasedStateMachine):
    @initialize(
        block_size=st.integers(1, 4),
        num_blocks=st.integers(2, 16),
        budget=st.integers(1, 24),
        max_num_seqs=st.integers(1, 6),
        chunked=st.booleans(),
        prefix_caching=st.sampled_from([True, True, False]),
        drafter=st.sampled_from(["chain", "tree", "ngram", "none"]),
        max_model_len=st.integers(6, 40),
        data=st.data(),
    )
    def setup(self, block_size, num_blocks, budget, max_num_seqs, chunked, prefix_caching, drafter, max_model_len,
              data):
        self.configure(block_size, num_blocks, budget, max_num_seqs, chunked, prefix_caching, drafter, max_model_len)
        self.busy = True                            # until a rule or check returns: teardown checks nothing
        for _ in range(data.draw(st.integers(2, 6))):
            self.add(data)
        self.busy = False

    def configure(self, block_size, num_blocks, budget, max_num_seqs, chunked, prefix_caching, drafter,
                  max_model_len) -> None:
        self.pool = KVPool(num_blocks, block_size, enable_prefix_caching=prefix_caching)
        cfg = SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=max_num_seqs,
                              enable_chunked_prefill=chunked)
        self.drafter = drafter                      # "none" | "ngram" (no KV) | "chain" | "tree" (a draft model)
        self.has_draft_kv = drafter in ("chain", "tree")
        self.max_model_len = max_model_len
        self.sched = Scheduler(cfg, self.pool, max_model_len, has_draft_kv=self.has_draft_kv)
        self.requests: list[Request] = []
        self.target_kv: dict[int, int] = {}        # pool slot -> the token whose target KV it holds
        self.draft_kv: dict[int, int] = {}
        self.busy = False

    # -- rules -----------------------------------------------------------------------------

    @precondition(lambda self: len(self.sched.waiting) < 6)
    @rule(data=st.data())
    def add_requests(self, data):
        self.busy = True
        for _ in range(data.draw(st.integers(1, 3))):
            self.add(data)
        self.busy = False

    def add(self, data) -> None:
        bs = self.pool.block_size
        shared, earlier, head_len, tail, logprobs, max_tokens = data.draw(st.tuples(
            st.booleans(), st.integers(0, 63), st.integers(0, 63), st.lists(st.integers(0, 3), max_size=3 * bs + 2),
            st.integers(0, 3), st.integers(0, 20)))
        head: list[int] = []
        if shared and self.requests:   # a prefix of an earlier request's tokens (prompt and output)
            head = self.requests[earlier % len(self.requests)].token_ids
            head = head[:head_len % (len(head) + 1)]
        # LLMEngine.add_request refuses a request longer than the context or than the whole pool.
        cap = min(self.max_model_len, self.pool.num_blocks * bs)
        prompt = (head + tail)[:cap - 1] or [0]
        prompt_logprobs = 1 if logprobs == 3 else None   # then max_tokens may be 0 (echo)
        if max_tokens > 16:   # as large as add_request allows: the request alone may fill the pool
            max_tokens = cap - len(prompt)
        max_tokens = min(max_tokens if prompt_logprobs is not None else max(max_tokens, 1), cap - len(prompt))
        self.add_prompt(prompt, SamplingParams(max_tokens=max_tokens, temperature=0.0, prompt_logprobs=prompt_logprobs))

    def add_prompt(self, prompt: list[int], params: SamplingParams) -> Request:
        total = len(prompt) + params.max_tokens
        assert total <= self.max_model_len and blocks_needed(total, self.pool.block_size) <= self.pool.num_blocks
        req = Request(f"r{len(self.requests)}", prompt, params, [EOS])
        self.requests.append(req)
        self.sched.add(req)
        return req

    @precondition(lambda self: self.sched.has_unfinished())
    @rule(data=st.data())
    def decode_steps(self, data):
        """Steps without speculation (the plan gives no nodes)."""
        self.run_steps(data, data.draw(st.integers(1, 4)), speculate=False)

    @precondition(lambda self: self.sched.has_unfinished())
    @rule(data=st.data())
    def speculative_steps(self, data):
        """Steps whose plan gives decoding requests tree nodes (where there is a drafter)."""
        self.run_steps(data, data.draw(st.integers(1, 8)), speculate=True)

    def run_steps(self, data, num_steps: int, speculate: bool) -> None:
        self.busy = True
        for _ in range(num_steps):
            arrival, seed = data.draw(st.tuples(st.integers(0, 3), st.integers(0, 2**32 - 1)))
            if arrival == 3 and len(self.sched.waiting) < 6:   # a request arrives between two steps
                self.add(data)
            if not self.sched.has_unfinished():
                break
            self.engine_step(Drawn(seed), speculate)
            self.check_state()
        self.busy = False

    @precondition(lambda self: self.sched.has_unfinished())
    @rule(data=st.data())
    def drain(self, data):
        """Liveness: with no new arrivals, every request finishes, since each fits the pool alone
        (as LLMEngine.add_request makes sure): the oldest running one always goes on."""
        self.busy = True
        speculate, seed = data.draw(st.tuples(st.booleans(), st.integers(0, 2**32 - 1)))
        self.run_to_completion(Drawn(seed), speculate)
        self.busy = False

    def run_to_completion(self, drawn, speculate: bool) -> None:
        sched = self.sched
        live = list(sched.running) + list(sched.waiting)
        limit = 10 + sum(3 * (r.num_tokens + r.params.max_tokens) for r in live)
        for _ in range(limit):
            if not sched.has_unfinished():
                return
            self.engine_step(drawn, speculate)
            self.check_state()
        raise AssertionError(f"not finished after {limit} steps: running {sched.running}, waiting {list(sched.waiting)}")

    @precondition(lambda self: self.sched.has_unfinished())
    @rule(data=st.data())
    def abort(self, data):
        """LLMEngine.abort_request (or _fail): Scheduler.finish wherever the request is."""
        self.busy = True
        req = data.draw(st.sampled_from(list(self.sched.running) + list(self.sched.waiting)))
        self.finish(req, "abort")
        self.sched.finish(req, "abort")   # twice: harmless
        assert req.finish_reason == "abort"
        self.busy = False

    @precondition(lambda self: self.requests and self.pool.enable_prefix_caching)
    @rule(data=st.data())
    def probe_prefix_cache(self, data):
        """match_prefix returns only blocks whose key is the chain of the tokens asked for."""
        self.busy = True
        which, length, tail, reset = data.draw(st.tuples(
            st.integers(0, 63), st.integers(0, 63), st.lists(st.integers(0, 3), max_size=2), st.integers(0, 3)))
        tokens = self.requests[which % len(self.requests)].token_ids
        tokens = tokens[:1 + length % len(tokens)] + tail
        before = list(self.pool.ref_counts)
        block_ids, num_cached = self.pool.match_prefix(tokens)
        bs = self.pool.block_size
        assert num_cached == len(block_ids) * bs and num_cached < len(tokens)
        for block_id, key in zip(block_ids, block_keys(tokens, bs, len(block_ids))):
            assert self.pool._block_keys[block_id] == key
            assert [self.target_kv.get(s) for s in range(block_id * bs, (block_id + 1) * bs)] == list(key[1])
        assert len(set(block_ids)) == len(block_ids)
        self.pool.free(block_ids)
        assert self.pool.ref_counts == before
        if reset == 3:   # KVPool.reset_prefix_cache: in-use blocks keep their entries
            evictable = self.pool.num_evictable_blocks
            assert self.pool.reset_prefix_cache() == evictable and self.pool.num_evictable_blocks == 0
        self.busy = False

    # -- one engine step ---------------------------------------------------------------------

    def engine_step(self, drawn, speculate: bool) -> None:
        sched = self.sched
        running_before, waiting_before = list(sched.running), list(sched.waiting)
        owed_before = {r.request_id for r in waiting_before if owes_prompt_logprobs(r)}

        # Speculator.plan: nodes only for decoding requests, never past max_tokens - 1 or the context
        # (now and then uncapped: Scheduler.schedule keeps the tree inside the context by itself).
        nodes: dict[str, int] = {}
        depth = drawn.int(1, 4) if speculate and self.drafter != "none" else 0
        capped = drawn.int(0, 3) != 3
        for r in sched.running:
            if depth and r.num_computed_tokens >= r.num_tokens - 1:
                d = drawn.int(1, depth) if drawn.int(0, 3) else 0
                if capped:
                    d = min(d, r.num_tokens_left - 1, self.max_model_len - r.num_tokens)
                if d > 0:
                    nodes[r.request_id] = 2 * d if self.drafter == "tree" else d
        out = sched.schedule(nodes)
        self.check_schedule(out, nodes, running_before, waiting_before, owed_before)

        seqs = [(s, s.request.num_computed_tokens, s.num_new_tokens, s.is_decode, s.is_prefill) for s in out.seqs]
        # The drafter (Speculator.step -> propose): it catches up on prompt chunks and on what it
        # has not seen of each sequence it drafts for; a draft model's rows write its KV.
        trees: dict[str, tuple[list[int], list[int]]] = {}   # request id -> (tokens, parents)
        fed: dict[str, int] = {}
        spec_seqs = [s for s, *_ in seqs if s.num_spec_nodes]
        prefills = [s for s, _, _, _, is_prefill in seqs if is_prefill]
        if self.drafter in ("chain", "tree") and (spec_seqs or prefills):
            for s in prefills:
                self.draft_catch_up(s.request, s.request.num_computed_tokens + s.num_new_tokens)
            for s in spec_seqs:
                req = s.request
                max_depth = min(depth, s.num_spec_nodes, req.num_tokens_left - 1)
                if max_depth <= 0:
                    continue
                self.draft_catch_up(req, req.num_tokens)
                base = req.num_tokens
                if self.drafter == "chain":
                    # Node k's KV lands at base + k; the last node is never fed, unless early stop
                    # dropped the node after it.
                    n = max_depth if drawn.bool() else drawn.int(0, max_depth)
                    tree = ([drawn.token() for _ in range(n)], list(range(-1, n - 1)))
                    num_fed = n if n < max_depth and drawn.bool() else max(0, n - 1)
                    written = [(base + k, tree[0][k]) for k in range(num_fed)]
                else:                         # the rows fed so far, rewritten each level
                    tree = self.random_tree(drawn, s.num_spec_nodes, max_depth)
                    written = [(base + k, TREE_SCRATCH) for k in range(drawn.int(0, s.num_spec_nodes))]
                for pos, tok in written:
                    (slot,) = self.slots(req, pos, 1, "draft row")
                    self.draft_kv[slot] = tok
                fed[req.request_id] = len(tree[0]) - 1 if self.drafter == "chain" else 0
                trees[req.request_id] = tree
        elif self.drafter == "ngram":
            for s in spec_seqs:
                want = max(0, min(depth, s.num_spec_nodes, s.request.num_tokens_left - 1))
                n = want if drawn.bool() else drawn.int(0, want)   # the lookup may find less
                trees[s.request.request_id] = ([drawn.token() for _ in range(n)], list(range(-1, n - 1)))

        # The verify pass: each sequence's new tokens, then its tree's nodes in scratch slots.
        for s, start, m, is_decode, _ in seqs:
            req = s.request
            tokens, _ = trees.get(req.request_id, ([], []))
            assert len(tokens) <= s.num_spec_nodes
            rows = req.token_ids[start:start + m] + tokens
            for slot, tok in zip(self.slots(req, start, len(rows), "verify row"), rows):
                self.target_kv[slot] = tok
            if req.prompt_logprobs is not None:   # Speculator.step's scored rows
                first = len(req.prompt_logprobs) - 1
                num_scored = max(0, min(start + m, req.num_prompt_tokens - 1) - first) if first >= start else 0
                req.prompt_logprobs += ["logprob"] * num_scored

        # A request whose part of the step raised fails alone (Speculator.failed -> LLMEngine._fail).
        failed = [s.request for s, *_ in seqs if drawn.int(0, 31) == 31]

        # Acceptance and Speculator._commit: accepted nodes' target KV moves to base + depth.
        new_tokens: dict[str, list[int]] = {}
        for s, start, m, is_decode, _ in seqs:
            req = s.request
            if not is_decode or any(req is f for f in failed):
                continue
            tokens, parents = trees.get(req.request_id, ([], []))
            # The deepest accepted node (-1: none); a whole chain is accepted often.
            last = len(tokens) - 1 if drawn.bool() else drawn.int(-1, len(tokens) - 1)
            path = []
            while last >= 0:
                path.append(last)
                last = parents[last]
            path.reverse()
            base = req.num_tokens
            moves = [(self.slots(req, base + node, 1, "compaction")[0], self.slots(req, base + d, 1, "compaction")[0])
                     for d, node in enumerate(path) if node != d]
            values = [self.target_kv.get(src) for src, _ in moves]   # every read before any write
            for (_, dst), value in zip(moves, values):
                self.target_kv[dst] = value
            new_tokens[req.request_id] = [tokens[k] for k in path] + [drawn.token()]
            if tokens and self.has_draft_kv:
                req.num_draft_computed_tokens = base + min(len(path), fed[req.request_id])

        for req in failed:
            self.finish(req, "error")

        # LLMEngine._postprocess.
        for s, start, m, is_decode, _ in seqs:
            req = s.request
            if req.is_finished:
                continue
            toks = new_tokens.get(req.request_id)
            if toks is None:
                req.num_computed_tokens += m
                sched.postprocess(req)
                continue
            req.num_computed_tokens += m + len(toks) - 1
            reason = self.append(req, toks, drawn)
            if reason is None:
                sched.postprocess(req)
            else:
                self.finish(req, reason)

    def finish(self, req: Request, reason: str) -> None:
        """Scheduler.finish: the blocks go back, and the full blocks whose KV is computed stay
        in the prefix cache (a request finishing in its first step included)."""
        bs = self.pool.block_size
        valid = min(req.num_computed_tokens, req.num_tokens)
        keys = block_keys(req.token_ids, bs, min(valid // bs, len(req.block_table)))
        # Blocks hashed before stay private if another block held their key then (cache_blocks).
        keys = [key for i, key in enumerate(keys)
                if i >= len(req.block_hashes) or self.pool._block_keys[req.block_table[i]] is not None]
        self.sched.finish(req, reason)
        assert req.status is RequestStatus.FINISHED and req.finish_reason == reason and req.block_table == []
        if self.pool.enable_prefix_caching:
            assert all(key in self.pool._cached for key in keys), f"{req!r}: its computed full blocks are not cached"

    def append(self, req: Request, toks: list[int], drawn) -> str | None:
        """LLMEngine._append; a stop string completed by the step's k-th token cuts the rest."""
        params, reason = req.params, None
        if params.max_tokens == 0:
            return "length"
        kept = 0
        for tok in toks:
            req.token_ids.append(tok)
            kept += 1
            if tok in req.eos_token_ids:
                reason = "stop"
            elif req.num_output_tokens >= params.max_tokens or req.num_tokens >= self.max_model_len:
                reason = "length"
            if reason:
                break
        # The detokenizer found a stop string ending at toks[stop_index] (often in a speculative step,
        # whose tokens past it were computed: Scheduler._cache_blocks caps by num_tokens).
        if drawn.int(0, 11) == 11 or kept > 1 and drawn.int(0, 2) == 2:
            stop_index = drawn.int(0, kept - 1)
            drop = kept - 1 - stop_index
            if drop:
                del req.token_ids[-drop:]
            reason = "stop"
        return reason

    def draft_catch_up(self, req: Request, end: int) -> None:
        """ModelDrafter._catch_up: the draft's KV of positions [num_draft_computed_tokens, end)."""
        start = req.num_draft_computed_tokens
        if end <= start:
            return
        for slot, tok in zip(self.slots(req, start, end - start, "draft catch-up"), req.token_ids[start:end]):
            self.draft_kv[slot] = tok
        req.num_draft_computed_tokens = end

    def random_tree(self, drawn, num_nodes: int, max_depth: int) -> tuple[list[int], list[int]]:
        """A tree in BFS order (depths never decrease), at most num_nodes nodes and max_depth deep."""
        tokens, parents, depths = [], [], []
        for k in range(num_nodes if drawn.bool() else drawn.int(0, num_nodes)):
            candidates = [p for p in range(-1, k)
                          if (1 if p < 0 else depths[p] + 1) <= max_depth
                          and (1 if p < 0 else depths[p] + 1) >= (depths[-1] if depths else 1)]
            if not candidates:
                break
            p = candidates[drawn.int(0, len(candidates) - 1)]
            tokens.append(drawn.token())
            parents.append(p)
            depths.append(1 if p < 0 else depths[p] + 1)
        return tokens, parents

    def slots(self, req: Request, start: int, count: int, what: str) -> list[int]:
        reserved = len(req.block_table) * self.pool.block_size
        assert start + count <= reserved, (
            f"{what} of {req!r} writes positions [{start}, {start + count}) but its blocks hold {reserved}")
        return slots_for(req.block_table, self.pool.block_size, start, count)

    # -- checks --------------------------------------------------------------------------

    def check_schedule(self, out, nodes, running_before, waiting_before, owed_before) -> None:
        sched, bs = self.sched, self.pool.block_size
        cfg = sched.config
        # Progress: a step that schedules and preempts nobody leaves nothing running and the queue's
        # head unadmitted, and the next step is the same one: the engine would spin forever.
        assert out.seqs or out.preempted, (
            f"a step with nothing to do: running {sched.running}, waiting {list(sched.waiting)}, "
            f"{self.pool.num_free_blocks} of {self.pool.num_blocks} blocks allocatable")
        assert out.num_batched_tokens <= cfg.max_num_batched_tokens
        assert len(sched.running) <= cfg.max_num_seqs
        scheduled = [s.request for s in out.seqs]
        assert len(set(map(id, scheduled))) == len(scheduled)
        for s in out.seqs:
            req = s.request
            assert req.status is RequestStatus.RUNNING and req in sched.running
            assert s.num_new_tokens >= 1 and req.num_computed_tokens + s.num_new_tokens <= req.num_tokens
            # Slots are reserved for every position the step writes: new tokens, then tree nodes.
            need = blocks_needed(req.num_computed_tokens + s.num_new_tokens + s.num_spec_nodes, bs)
            assert len(req.block_table) >= need, f"{req!r}: {s} needs {need} blocks"
            if s.num_spec_nodes:
                assert s.is_decode and s.num_new_tokens == 1
                assert s.num_spec_nodes <= nodes.get(req.request_id, 0)
                assert req.num_tokens - 1 + s.num_spec_nodes <= self.max_model_len - 1
        # Running requests first, oldest first, then the admitted ones in queue order.
        assert scheduled == [r for r in sched.running if any(r is q for q in scheduled)]
        # Preemption by recompute takes the youngest first; they keep their order at the queue's front.
        k = len(out.preempted)
        if k:
            assert out.preempted == running_before[::-1][:k]
            assert list(sched.waiting)[:k] == running_before[-k:]
        for req in out.preempted:
            assert req.status is RequestStatus.WAITING and req.block_table == [] and req.num_computed_tokens == 0
            assert all(s.request is not req for s in out.seqs)
        admitted = [r for r in scheduled if any(r is w for w in waiting_before)]
        assert admitted == waiting_before[:len(admitted)], "admission out of queue order"
        if out.preempted:
            assert not admitted, "a request was admitted in a step that preempted"
            assert not any(s.num_spec_nodes for s in out.seqs), "speculation kept in a step that preempted"
        for req in admitted:
            if req.request_id in owed_before:   # prompt logprobs owed: the whole prompt is computed
                assert req.num_computed_tokens == 0, f"{req!r} owes prompt logprobs but hit the prefix cache"
        self.check_content()

    @invariant()
    def check_state(self):
        if not hasattr(self, "pool"):
            return
        was_busy, self.busy = self.busy, True
        pool, sched, bs = self.pool, self.sched, self.pool.block_size
        pool.check_consistency()
        held = sum(1 for rc in pool.ref_counts if rc > 0)
        assert len(pool._free_block_ids) + held + pool.num_evictable_blocks == pool.num_blocks
        assert pool.num_free_blocks == pool.num_blocks - held
        assert pool.num_evictable_blocks <= pool.num_cached_blocks

        running, waiting = list(sched.running), list(sched.waiting)
        assert len(set(map(id, running))) == len(running) and len(set(map(id, waiting))) == len(waiting)
        assert not set(map(id, running)) & set(map(id, waiting)), "a request both running and waiting"
        assert all(r.status is RequestStatus.RUNNING for r in running)
        assert all(r.status is RequestStatus.WAITING for r in waiting)
        live = running + waiting
        for r in self.requests:
            if not any(r is q for q in live):
                assert r.status is RequestStatus.FINISHED and r.block_table == [] and r.block_hashes == []

        # Refcounts: exactly the tables that hold each block; a block in two tables is a cached one.
        holders: dict[int, list[tuple[Request, int]]] = {}
        for r in live:
            assert len(set(r.block_table)) == len(r.block_table), f"{r!r} holds a block twice: {r.block_table}"
            for i, b in enumerate(r.block_table):
                holders.setdefault(b, []).append((r, i))
        for b in range(pool.num_blocks):
            assert pool.ref_counts[b] == len(holders.get(b, [])), (
                f"block {b}: refcount {pool.ref_counts[b]}, held by {[(r.request_id, i) for r, i in holders.get(b, [])]}")
        for b, hs in holders.items():
            if len(hs) > 1:
                assert pool._block_keys[b] is not None, f"block {b} shared by {hs} but not a cached block"

        for r in live:
            assert 0 <= r.num_computed_tokens < r.num_tokens, f"{r!r}"
            assert 0 <= r.num_draft_computed_tokens <= r.num_tokens, f"{r!r}"
            assert blocks_needed(r.num_computed_tokens, bs) <= len(r.block_table) <= blocks_needed(r.num_tokens, bs)
            # The sequence's block hashes are its own tokens' chain, over blocks whose KV is computed.
            assert len(r.block_hashes) * bs <= r.num_computed_tokens and len(r.block_hashes) <= len(r.block_table)
            keys = block_keys(r.token_ids, bs, min(len(r.block_table), r.num_tokens // bs))
            assert r.block_hashes == [hash(k) for k in keys[:len(r.block_hashes)]], f"{r!r}: stale block hashes"
            for i, b in enumerate(r.block_table):   # a cached block holds what the sequence holds there
                key = pool._block_keys[b]
                if key is not None:
                    assert i < len(keys) and key == keys[i], f"{r!r}: block {b} at index {i} is cached as {key}"
            if r.status is RequestStatus.WAITING:
                # Only a prefix-cache hit held while waiting (admission without chunking).
                assert len(r.block_table) * bs == r.num_computed_tokens >= r.num_draft_computed_tokens
                assert not r.block_table or not owes_prompt_logprobs(r)
        self.check_content()
        self.busy = was_busy

    def check_content(self) -> None:
        """Both models' KV (the shadow) holds each live sequence's tokens at its computed
        positions, and every cached block the tokens its key names (the draft's too where the
        block is marked draft-complete)."""
        bs = self.pool.block_size
        for r in list(self.sched.running) + list(self.sched.waiting):
            n = min(r.num_computed_tokens, r.num_tokens)
            got = [self.target_kv.get(s) for s in slots_for(r.block_table, bs, 0, n)]
            assert got == r.token_ids[:n], f"{r!r}: target KV {got} != tokens {r.token_ids[:n]}"
            if self.has_draft_kv:
                n = min(r.num_draft_computed_tokens, r.num_tokens)
                got = [self.draft_kv.get(s) for s in slots_for(r.block_table, bs, 0, n)]
                assert got == r.token_ids[:n], f"{r!r}: draft KV {got} != tokens {r.token_ids[:n]}"
        for key, b in self.pool._cached.items():
            slots = range(b * bs, (b + 1) * bs)
            assert tuple(self.target_kv.get(s) for s in slots) == key[1], f"cached block {b}: target KV is not {key}"
            if self.has_draft_kv and self.pool._draft_ok[b]:
                assert tuple(self.draft_kv.get(s) for s in slots) == key[1], f"cached block {b}: draft KV is not {key}"

    def teardown(self):
        """Aborting everything left, running or waiting, frees every block (DESIGN.md §4)."""
        if not hasattr(self, "pool") or self.busy:
            return
        for r in list(self.sched.running) + list(self.sched.waiting):
            self.finish(r, "abort")
        assert not self.sched.has_unfinished()
        self.check_state()
        self.pool.check_all_free()
        assert self.pool.num_free_blocks == self.pool.num_blocks


PoolAndScheduler.TestCase.settings = settings(
    max_examples=120, stateful_step_count=40, deadline=None, derandomize=True, database=None,
    suppress_health_check=list(HealthCheck))
test_pool_and_scheduler = PoolAndScheduler.TestCase
