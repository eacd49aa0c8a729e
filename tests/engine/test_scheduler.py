"""The scheduler with a real KVPool and plain Requests, no model: budgets, chunked prefill,
speculation dropped before preemption, preemption by recompute, max_num_seqs, queue order."""

from __future__ import annotations

from specserve.config import SchedulerConfig
from specserve.kv_pool import KVPool
from specserve.request import Request, RequestStatus
from specserve.sampling import SamplingParams
from specserve.scheduler import Scheduler


def make(num_blocks=64, block_size=4, budget=2048, max_num_seqs=64, chunked=True, prefix=False):
    pool = KVPool(num_blocks, block_size, enable_prefix_caching=prefix)
    cfg = SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=max_num_seqs, enable_chunked_prefill=chunked)
    return Scheduler(cfg, pool, max_model_len=512, has_draft_kv=False), pool


def every(sched, n):
    """A plan giving every running request n nodes."""
    return {r.request_id: n for r in sched.running}


def req(rid, n_prompt, max_tokens=8, base=10):
    return Request(rid, [base + i for i in range(n_prompt)], SamplingParams(max_tokens=max_tokens), [])


def advance(sched, out, accepted=0):
    """What the engine does after a step: rows computed; a decoding row yields 1 + accepted tokens."""
    for s in out.seqs:
        r = s.request
        if s.is_decode:
            a = min(accepted, s.num_spec_nodes)
            r.num_computed_tokens += s.num_new_tokens + a
            r.token_ids.extend([7] * (a + 1))
            if r.num_output_tokens >= r.params.max_tokens:
                sched.finish(r, "length")
                continue
        else:
            r.num_computed_tokens += s.num_new_tokens
        sched.postprocess(r)


def run_all(sched, max_steps=500, num_spec_nodes=0, budget=None):
    steps = []
    for _ in range(max_steps):
        if not sched.has_unfinished():
            return steps
        out = sched.schedule(every(sched, num_spec_nodes))
        if budget is not None:
            assert out.num_batched_tokens <= budget
        steps.append(out)
        advance(sched, out)
    raise AssertionError(f"not finished after {max_steps} steps: running {sched.running}, waiting {list(sched.waiting)}")


def test_token_budget_and_chunked_prefill():
    sched, pool = make(budget=8)
    reqs = [req(f"r{i}", 10, max_tokens=3) for i in range(3)]
    for r in reqs:
        sched.add(r)
    first = sched.schedule()
    assert [(s.request.request_id, s.num_new_tokens, s.is_decode) for s in first.seqs] == [("r0", 8, False)]
    advance(sched, first)
    second = sched.schedule()
    # r0's last 2 prompt tokens (which produce its first token), then a 6-token chunk of r1.
    assert [(s.request.request_id, s.num_new_tokens, s.is_decode) for s in second.seqs] == [
        ("r0", 2, True), ("r1", 6, False)]
    advance(sched, second)
    steps = run_all(sched, budget=8)
    assert all(r.num_output_tokens == 3 and r.finish_reason == "length" for r in reqs)
    assert all(0 < s.num_batched_tokens <= 8 for s in steps)
    pool.check_all_free()


def test_no_chunking_admits_whole_prompts_only():
    sched, pool = make(budget=12, chunked=False)
    a, b = req("a", 10, max_tokens=2), req("b", 10, max_tokens=2)
    sched.add(a)
    sched.add(b)
    out = sched.schedule()
    assert [(s.request.request_id, s.num_new_tokens) for s in out.seqs] == [("a", 10)]
    assert list(sched.waiting) == [b]
    run_all(sched)
    pool.check_all_free()


def test_no_chunking_prompt_longer_than_budget_still_runs():
    """A prompt (or a preempted request's prompt + output) longer than the whole budget
    would otherwise wait forever with chunked prefill off."""
    sched, pool = make(budget=8, chunked=False)
    r = req("long", 12, max_tokens=2)
    sched.add(r)
    run_all(sched, max_steps=20, budget=8)
    assert r.finish_reason == "length"
    pool.check_all_free()


def test_max_num_seqs():
    sched, pool = make(max_num_seqs=2)
    reqs = [req(f"r{i}", 3, max_tokens=4) for i in range(5)]
    for r in reqs:
        sched.add(r)
    out = sched.schedule()
    assert len(out.seqs) == 2 and len(sched.running) == 2 and len(sched.waiting) == 3
    advance(sched, out)
    for out in run_all(sched):
        assert len(sched.running) <= 2 and len(out.seqs) <= 2
    pool.check_all_free()


def test_speculation_is_dropped_before_anyone_is_preempted():
    # Two sequences at 7 tokens (2 blocks of 4, 4 blocks in the pool): decoding 1 token fits
    # their blocks, speculating 3 more nodes would need a third block each: none is left.
    sched, pool = make(num_blocks=4, block_size=4)
    a, b = req("a", 7, max_tokens=10), req("b", 7, max_tokens=10, base=50)
    sched.add(a)
    sched.add(b)
    advance(sched, sched.schedule())
    assert pool.num_free_blocks == 0 and a.num_computed_tokens == 7 and a.num_tokens == 8
    out = sched.schedule(every(sched, 3))
    assert [(s.request.request_id, s.num_new_tokens, s.num_spec_nodes) for s in out.seqs] == [("a", 1, 0), ("b", 1, 0)]
    assert sched.num_preemptions == 0 and not out.preempted


def test_an_older_requests_speculation_is_dropped_before_a_younger_one_is_preempted():
    # a at 8 tokens fits its 2 blocks, and its 3 nodes would take the pool's last block; b at
    # 9 tokens needs that block for its pending token. a speculates less; nobody is preempted.
    sched, pool = make(num_blocks=5, block_size=4)
    a, b = req("a", 7, max_tokens=10), req("b", 8, max_tokens=10, base=50)
    sched.add(a)
    sched.add(b)
    advance(sched, sched.schedule())
    assert pool.num_free_blocks == 1 and (a.num_tokens, b.num_tokens) == (8, 9)
    out = sched.schedule(every(sched, 3))
    assert [(s.request.request_id, s.num_new_tokens, s.num_spec_nodes) for s in out.seqs] == [("a", 1, 0), ("b", 1, 0)]
    assert sched.num_preemptions == 0 and not out.preempted
    assert (len(a.block_table), len(b.block_table), pool.num_free_blocks) == (2, 3, 0)


def test_speculation_reserves_scratch_and_is_capped_by_budget():
    sched, pool = make(num_blocks=16, block_size=4, budget=6)
    a, b = req("a", 3), req("b", 2, base=50)
    sched.add(a)
    sched.add(b)
    advance(sched, sched.schedule())
    out = sched.schedule({"a": 4, "b": 4})
    # a: pending token + 4 nodes = 5 of the 6-token budget; b: 1 token left, no room for nodes.
    assert [(s.num_new_tokens, s.num_spec_nodes) for s in out.seqs] == [(1, 4), (1, 0)]
    assert out.num_batched_tokens == 6
    # Slots for positions up to num_tokens + 4 - 1 = 7 are reserved: 2 blocks.
    assert len(a.block_table) == 2
    # After the step, blocks wholly past the sequence's end go back (rejected scratch).
    advance(sched, out, accepted=0)
    assert len(a.block_table) == 2 and a.num_tokens == 5
    sched.postprocess(a)
    assert len(a.block_table) == 2
    a.token_ids = a.token_ids[:4]
    a.num_computed_tokens = 3
    sched.postprocess(a)
    assert len(a.block_table) == 1


def test_preemption_by_recompute_frees_blocks_and_requeues_first():
    sched, pool = make(num_blocks=4, block_size=4)
    # 8 + 6 tokens fit the 4-block pool alone (the engine refuses requests that never fit).
    a, b, c = req("a", 8, max_tokens=6), req("b", 8, max_tokens=6, base=50), req("c", 2, max_tokens=2, base=90)
    sched.add(a)
    sched.add(b)
    out = sched.schedule()
    assert len(out.seqs) == 2 and pool.num_free_blocks == 0
    sched.add(c)  # arrives later, waits
    advance(sched, out)
    # Both now hold 9 tokens: a's pending token needs a 3rd block. b (the youngest) is preempted.
    out = sched.schedule()
    assert out.preempted == [b] and sched.num_preemptions == 1 and b.stats.num_preemptions == 1
    assert [s.request for s in out.seqs] == [a]
    assert b.status is RequestStatus.WAITING and b.block_table == [] and b.num_computed_tokens == 0
    assert list(sched.waiting) == [b, c], "the preempted request goes to the front of the queue"
    assert len(a.block_table) == 3 and pool.num_free_blocks == 1
    assert b.num_tokens == 9  # its generated token is kept and recomputed later
    advance(sched, out)
    # Run everything to the end: all finish, every block comes back.
    run_all(sched)
    assert [r.finish_reason for r in (a, b, c)] == ["length"] * 3
    assert b.num_output_tokens == 6
    pool.check_all_free()
    pool.check_consistency()


def test_a_request_that_cannot_fit_alongside_preempts_itself():
    sched, pool = make(num_blocks=3, block_size=4)
    a = req("a", 11, max_tokens=3)
    sched.add(a)
    out = sched.schedule()
    assert len(a.block_table) == 3
    advance(sched, out)
    # 12 tokens now, pending token fits; after the next one a 4th block is needed: a alone
    # cannot continue and preempts itself (the engine refuses requests that never fit).
    out = sched.schedule()
    assert [s.request for s in out.seqs] == [a]
    advance(sched, out)
    out = sched.schedule()
    assert out.preempted == [a] and out.seqs == [] and pool.num_free_blocks == 3


def test_finish_and_abort_anywhere_free_blocks():
    sched, pool = make(num_blocks=8, block_size=4, prefix=True)
    a, b = req("a", 9), req("b", 5, base=50)
    sched.add(a)
    sched.add(b)
    advance(sched, sched.schedule())
    w = req("w", 3, base=90)
    sched.add(w)
    sched.finish(w, "abort")  # waiting
    sched.finish(a, "abort")  # running
    sched.finish(a, "abort")  # twice: harmless
    assert a.finish_reason == "abort" and w.status is RequestStatus.FINISHED
    sched.finish(b, "stop")
    assert not sched.has_unfinished()
    pool.check_all_free()


def test_prefix_cache_hit_on_admission():
    """A request that finishes in its first step (max_tokens=1) still leaves its prompt's
    full blocks in the prefix cache."""
    sched, pool = make(num_blocks=16, block_size=4, prefix=True)
    a = req("a", 10, max_tokens=1)
    sched.add(a)
    run_all(sched)
    b = req("b", 10, max_tokens=1)  # same tokens
    sched.add(b)
    out = sched.schedule()
    # 2 full blocks (8 tokens) cached; the last block is never fully matched.
    assert b.stats.num_cached_tokens == 8 and out.seqs[0].num_new_tokens == 2
    advance(sched, out)
    pool.check_all_free()


def test_each_request_gets_the_nodes_the_plan_gives_it():
    sched, _ = make(num_blocks=32, block_size=4)
    for rid in "abc":
        sched.add(req(rid, 3, max_tokens=20, base=10 + ord(rid)))
    advance(sched, sched.schedule())
    out = sched.schedule({"a": 3, "c": 1})
    assert [(s.request.request_id, s.num_spec_nodes) for s in out.seqs] == [("a", 3), ("b", 0), ("c", 1)]
    assert all(not s.is_prefill for s in out.seqs)


def test_a_waiting_request_holds_no_prefix_hits_that_the_queue_front_needs():
    """Without chunked prefill, a request with prefix-cache hits that waits for a step with room
    for its whole prompt gives the hits back: otherwise a request preempted to the queue's front,
    needing every block, waited on them for ever (and so did the one holding them)."""
    pool = KVPool(6, 2, enable_prefix_caching=True)
    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=6, enable_chunked_prefill=False), pool, 64,
                      has_draft_kv=False)
    first = Request("first", [1] * 5, SamplingParams(max_tokens=1), [])   # leaves [1, 1, 1, 1] cached
    sched.add(first)
    advance(sched, sched.schedule())
    assert first.is_finished
    whole = Request("whole", [2] * 5, SamplingParams(max_tokens=7), [])   # 12 tokens: the whole pool
    sched.add(whole)
    advance(sched, sched.schedule())
    hits = Request("hits", [1] * 4 + [9] * 6, SamplingParams(max_tokens=1), [])   # 4 cached, 6 new
    sched.add(hits)
    for _ in range(40):
        out = sched.schedule()
        assert all(not r.block_table for r in sched.waiting), "a waiting request holds blocks"
        advance(sched, out)
        if not sched.has_unfinished():
            break
    assert whole.is_finished and hits.is_finished
    pool.check_all_free()
