"""Long, varied loads that must leave nothing behind.

Hundreds of requests of every kind (streaming and not, n > 1, several prompts, stop strings,
stop token ids, logprobs, prompt logprobs and echo, seeds, penalties, refusals with 400 and
429, aborts at random points, prefix-sharing prompts, switches between static and adaptive
speculation) go through the in-process engine (LLMEngine, LLM), the HTTP server on an
AsyncEngine thread, and the HTTP server on engine-core processes (one EngineCoreClient, and
an EngineGroup of two). When the load has drained, every per-request structure is empty:
the scheduler's queues, the engine's request map and abort list, the speculator's lists,
the adaptive controller's per-request acceptance state (of the live controller and of one
kept aside while a static depth plans), the backends' stream and call maps, the group's
routing maps, the pool (no block referenced; every block free once the prefix cache is
reset), the server loop's asyncio tasks, the threads, the open file descriptors, the ZMQ
ipc files, the /metrics series; and a later batch of the same load grows the heap no more
than noise.
"""

from __future__ import annotations

import asyncio
import gc
import glob
import json
import os
import random
import tempfile
import threading
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from specserve.engine import LLMEngine
from specserve.errors import InvalidRequestError
from specserve.llm import LLM
from specserve.sampling import SamplingParams
from tests.checkpoints import CORPUS
from tests.server.conftest import SseStream, ServerThread, engine_config, http, wait_until

SHARED = "Once upon a time there was a little cat who liked"   # a prefix many prompts share
STOPS = [" the", "e", ".", "o", "\n", "at"]


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Tiny forwards on a shared machine: one intra-op thread, restored after the module."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _text(rng: random.Random) -> str:
    s = rng.choice(CORPUS[:9])
    start = rng.randrange(0, max(1, len(s) - 12))
    piece = s[start:start + rng.randint(6, 50)].strip() or "Hello there"
    return SHARED + " " + piece if rng.random() < 0.4 else piece


def _params(rng: random.Random, vocab: int) -> SamplingParams:
    kw: dict = {"max_tokens": rng.randint(1, 20), "temperature": rng.choice([0.0, 0.0, 0.7, 1.0])}
    if rng.random() < 0.3:
        kw["stop"] = rng.sample(STOPS, rng.randint(1, 2))
    if rng.random() < 0.1:
        kw["stop_token_ids"] = [rng.randrange(vocab)]
        kw["min_tokens"] = rng.randint(0, 3)
    if rng.random() < 0.25:
        kw["logprobs"] = rng.choice([0, 2])
    if rng.random() < 0.1:
        kw["prompt_logprobs"] = 1
        if rng.random() < 0.3:
            kw["max_tokens"] = 0
    if rng.random() < 0.2:
        kw["seed"] = rng.randrange(10_000)
    if rng.random() < 0.1:
        kw["presence_penalty"], kw["frequency_penalty"] = 0.5, 0.2
    if rng.random() < 0.1:
        kw["top_k"], kw["top_p"] = 5, 0.9
    return SamplingParams(**kw)


# -- what "empty" means -------------------------------------------------------------------------


def _controllers(engine: LLMEngine) -> list:
    return [c for c in (engine.spec.controller, engine.spec._detached) if c is not None]


def assert_engine_empty(engine: LLMEngine) -> None:
    """Every per-request structure of an idle engine is empty, and the pool holds nothing."""
    sched, pool, spec = engine.scheduler, engine.pool, engine.spec
    assert not sched.waiting and not sched.running, (list(sched.waiting), sched.running)
    assert engine.requests == {}, list(engine.requests)[:5]
    assert engine._aborted == [], engine._aborted[:5]
    assert spec.failed == {}, spec.failed
    assert spec._finished == [], spec._finished[:5]
    for c in _controllers(engine):
        assert c.acceptance.requests == {}, list(c.acceptance.requests)[:5]
        assert c.acceptance.taught == {}, list(c.acceptance.taught)[:5]
    pool.check_all_free()
    pool.check_consistency()
    assert pool.num_free_blocks == pool.num_blocks
    pool.reset_prefix_cache()
    assert len(pool._free_block_ids) == pool.num_blocks and pool.num_cached_blocks == 0
    pool.check_consistency()


def _drain(engine: LLMEngine, limit: int = 20_000) -> None:
    for _ in range(limit):
        if not engine.has_unfinished_requests() and not engine._aborted:
            return
        engine.step()
    raise AssertionError("the engine did not drain")


def _objects() -> int:
    gc.collect()
    return len(gc.get_objects())


# -- (a) the in-process engine ----------------------------------------------------------------


def _engine_batch(engine: LLMEngine, rng: random.Random, num: int, counts: dict) -> None:
    """`num` requests arriving over the steps, a tenth aborted at a random point, some refused,
    the speculation setting switched now and then; stepped until drained."""
    vocab = engine.target_args.vocab_size
    live: list[str] = []
    added = 0
    while added < num or engine.has_unfinished_requests() or engine._aborted:
        for _ in range(rng.randint(0, 4) if added < num else 0):
            added += 1
            r = rng.random()
            try:
                if r < 0.04:   # longer than the context: refused
                    engine.add_request(None, [5] * (engine.max_model_len + 1), SamplingParams(max_tokens=1))
                elif r < 0.06:   # a bad id: refused
                    engine.add_request(None, [vocab + 3], SamplingParams(max_tokens=1))
                else:
                    prompt = _text(rng) if rng.random() < 0.8 else engine.tokenizer.encode(_text(rng))
                    live.append(engine.add_request(None, prompt, _params(rng, vocab)).request_id)
            except InvalidRequestError:
                counts["refused"] += 1
        if live and rng.random() < 0.12:
            engine.abort_request(live.pop(rng.randrange(len(live))))
            counts["aborted"] += 1
        if rng.random() < 0.03 and engine.draft is not None:
            if rng.random() < 0.5:
                engine.set_speculation("adaptive")
            else:
                engine.set_speculation("static", rng.randint(0, 3))
            counts["switches"] += 1
        for out in engine.step():
            if out.finished:
                counts[out.finish_reason] = counts.get(out.finish_reason, 0) + 1
                if out.request_id in live:
                    live.remove(out.request_id)


@pytest.fixture(scope="module")
def small_engine(server_target, server_draft):
    """The noisy draft at static depth 3, a pool of 40 blocks of 8 (preemptions), a short queue."""
    cfg = engine_config(server_target, server_draft, spec_mode="static", spec_depth=3, num_blocks=40,
                        max_waiting_requests=24, threads=1)
    return LLMEngine(cfg, progress=False)


def test_engine_returns_to_empty_after_a_varied_load(small_engine):
    """~660 mixed requests with aborts, refusals, preemptions and speculation switches: after
    each batch every per-request structure is empty and the pool is whole; the third batch
    leaves no more live objects than the second (a warm-up precedes both)."""
    engine, rng = small_engine, random.Random(7)
    counts = {"refused": 0, "aborted": 0, "switches": 0}
    sizes = []
    for _ in range(3):
        _engine_batch(engine, rng, 220, counts)
        _drain(engine)
        assert_engine_empty(engine)
        sizes.append(_objects())
    assert counts["refused"] and counts["aborted"] >= 10 and counts["switches"] >= 3, counts
    assert counts.get("stop") and counts.get("length"), counts
    assert engine.scheduler.num_preemptions > 0
    assert sizes[2] - sizes[1] < 2000, sizes


def test_an_abort_between_steps_is_forgotten_by_the_controller(small_engine):
    """A request the adaptive controller learned from, then aborted while the engine is idle
    between steps: once the engine is drained nothing of it is left in the controller."""
    engine = small_engine
    engine.set_speculation("adaptive")
    try:
        ids = [engine.add_request(None, SHARED + f" {i}", SamplingParams(max_tokens=40, temperature=0.0)).request_id
               for i in range(4)]
        for _ in range(6):
            engine.step()
        for request_id in ids:
            engine.abort_request(request_id)
        _drain(engine)
        assert_engine_empty(engine)
    finally:
        engine.set_speculation("static", 3)


def test_a_refused_llm_batch_leaves_nothing_queued(server_target, server_draft):
    """LLM.generate with a batch whose last prompt is refused raises, and afterwards the engine
    holds neither the batch's requests nor anything of theirs; a later batch is served."""
    llm = LLM(engine_config(server_target, server_draft, spec_mode="static", spec_depth=2, num_blocks=64,
                            threads=1), progress=False)
    engine = llm.engine
    too_long = [7] * (engine.max_model_len + 5)
    for _ in range(3):
        with pytest.raises(InvalidRequestError):
            llm.generate(["one", "two", too_long], SamplingParams(max_tokens=4))
    assert engine._aborted == [] and engine.spec._finished == [], (engine._aborted, engine.spec._finished)
    assert_engine_empty(engine)
    outs = llm.generate(["three", SHARED], SamplingParams(max_tokens=4, temperature=0.0))
    assert [o.finish_reason for o in outs] == ["length", "length"]
    assert_engine_empty(engine)


# -- (b) the HTTP server, engine on a thread ---------------------------------------------------


def _body(rng: random.Random, tok, vocab: int) -> tuple[str, dict]:
    """(path, JSON body) of one random request."""
    chat = rng.random() < 0.35
    body: dict = {"max_tokens": rng.randint(1, 16), "temperature": rng.choice([0, 0, 0.8])}
    if rng.random() < 0.25:
        body["n"] = rng.randint(2, 3)
    if rng.random() < 0.3:
        body["stop"] = rng.sample(STOPS, rng.randint(1, 2))
    if rng.random() < 0.15:
        body["seed"] = rng.randrange(1000)
    if rng.random() < 0.1:
        body["stop_token_ids"] = [rng.randrange(vocab)]
    if rng.random() < 0.5:
        body["stream"] = True
        if rng.random() < 0.3:
            body["stream_options"] = {"include_usage": True}
    if chat:
        body["messages"] = [{"role": "user", "content": _text(rng)}]
        if rng.random() < 0.2:
            body["logprobs"], body["top_logprobs"] = True, 2
        return "/v1/chat/completions", body
    prompts = [_text(rng) for _ in range(rng.choice([1, 1, 1, 2]))]
    body["prompt"] = prompts if len(prompts) > 1 else prompts[0]
    if rng.random() < 0.2:
        body["prompt"] = [tok.encode(p) for p in prompts] if len(prompts) > 1 else tok.encode(prompts[0])
    if rng.random() < 0.2:
        body["logprobs"] = rng.choice([0, 1])
    if rng.random() < 0.1:
        body["echo"] = True
    r = rng.random()
    if r < 0.04:
        body["max_tokens"] = 10_000            # over the context: 400
    elif r < 0.06:
        body["temperature"] = -1               # a bad field: 400
    return "/v1/completions", body


def _post(base: str, path: str, body: dict) -> int:
    req = urllib.request.Request(base + path, data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            r.read()
            return r.status
    except urllib.error.HTTPError as e:
        e.read()
        return e.code


def _stream(base: str, path: str, body: dict, close_after: int | None) -> int:
    """A streaming request read line by line; the client goes away after `close_after` events."""
    req = urllib.request.Request(base + path, data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            events = 0
            for line in r:
                if line.startswith(b"data: "):
                    events += 1
                    if close_after is not None and events >= close_after:
                        return -1
            return r.status
    except urllib.error.HTTPError as e:
        e.read()
        return e.code


def _http_load(base: str, tok, vocab: int, num: int, seed: int, admin: bool = True, workers: int = 6) -> dict:
    """`num` random requests from `workers` clients at once; ~15% of streams dropped mid-way;
    speculation switched now and then. Returns status -> count (-1: dropped by the client)."""
    rng = random.Random(seed)
    jobs = []
    for _ in range(num):
        path, body = _body(rng, tok, vocab)
        drop = rng.randint(1, 6) if body.get("stream") and rng.random() < 0.15 else None
        switch = None
        if admin and rng.random() < 0.04:
            switch = {"mode": "adaptive"} if rng.random() < 0.5 else {"mode": "static", "depth": rng.randint(0, 3)}
        jobs.append((path, body, drop, switch))

    def run(job) -> int:
        path, body, drop, switch = job
        if switch is not None:
            assert http(base, "/admin/speculation", switch)[0] == 200
        if body.get("stream"):
            return _stream(base, path, body, drop)
        return _post(base, path, body)

    counts: dict = {}
    with ThreadPoolExecutor(workers) as pool:
        for status in pool.map(run, jobs):
            counts[status] = counts.get(status, 0) + 1
    return counts


def _fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def _metric_series(base: str) -> set[str]:
    with urllib.request.urlopen(base + "/metrics", timeout=30) as r:
        text = r.read().decode()
    return {line.rsplit(" ", 1)[0] for line in text.splitlines() if line and not line.startswith("#")}


async def _tasks() -> list[str]:
    me = asyncio.current_task()
    return sorted(repr(t.get_coro()) for t in asyncio.all_tasks() if t is not me)


@pytest.fixture(scope="module")
def thread_server(server_target, server_draft):
    cfg = engine_config(server_target, server_draft, spec_mode="static", spec_depth=3, num_blocks=48,
                        max_waiting_requests=6, threads=1, admin_api=True)
    srv = ServerThread(LLMEngine(cfg, progress=False), cfg)
    yield srv
    srv.stop()


def test_http_server_on_a_thread_returns_to_empty(thread_server):
    """Three rounds of ~140 random HTTP requests (6 clients at once, a queue of 6: some 429s;
    400s; drops): afterwards the AsyncEngine's stream map, the engine, the pool, the loop's
    tasks, the threads, the fds and the /metrics series are as after the warm-up round; the
    heap does not grow between the second and third rounds."""
    srv = thread_server
    from specserve.server.app import STATE

    state = srv.app[STATE]
    backend, engine = state.async_engine, srv.engine
    tok, vocab = engine.tokenizer, engine.target_args.vocab_size

    def settled() -> bool:
        return (state.num_inflight == 0 and not backend._streams and not engine.has_unfinished_requests()
                and not engine._aborted and backend._commands.empty())

    totals: dict = {}
    baseline = None
    sizes = []
    for round in range(3):
        counts = _http_load(srv.base, tok, vocab, 140, seed=100 + round)
        for k, v in counts.items():
            totals[k] = totals.get(k, 0) + v
        assert wait_until(settled, 20), (state.num_inflight, list(backend._streams)[:5], engine.requests)
        # Between two steps of the engine thread (it is idle now): the engine's own structures.
        assert wait_until(lambda: engine.spec._finished == [], 5)
        assert_engine_empty(engine)
        # One setting for every scrape: the adaptive controller's series exist only while it plans.
        assert http(srv.base, "/admin/speculation", {"mode": "static", "depth": 3})[0] == 200
        snapshot = (srv.call(_tasks()), threading.active_count(), _fds(), _metric_series(srv.base))
        sizes.append(_objects())
        if baseline is None:
            baseline = snapshot
            continue
        tasks, threads, fds, series = snapshot
        assert tasks == baseline[0], (tasks, baseline[0])
        assert threads <= baseline[1], (threads, baseline[1])
        assert fds <= baseline[2] + 2, (fds, baseline[2])
        assert series == baseline[3], sorted(series ^ baseline[3])[:10]
    assert totals.get(200, 0) > 200 and totals.get(400) and totals.get(-1), totals
    assert sizes[2] - sizes[1] < 3000, sizes
    assert http(srv.base, "/health")[0] == 200


def test_disconnects_while_queued_and_refused_choices_leave_nothing(thread_server):
    """Streams of n = 3 dropped at their first event while others queue, and n = 3 requests
    whose later choices are refused by a full queue: nothing stays in the AsyncEngine, the
    engine or the pool."""
    from specserve.server.app import STATE

    srv = thread_server
    state = srv.app[STATE]
    backend, engine = state.async_engine, srv.engine
    body = {"prompt": SHARED, "max_tokens": 30, "n": 3, "temperature": 0.8}
    streams = [SseStream(srv.base, body, close_after=1) for _ in range(8)]
    statuses = [_post(srv.base, "/v1/completions", {**body, "n": 4}) for _ in range(4)]
    for s in streams:
        s.join(60)
    assert set(statuses) <= {200, 429}, statuses
    assert wait_until(lambda: state.num_inflight == 0 and not backend._streams
                      and not engine.has_unfinished_requests() and not engine._aborted, 20)
    assert wait_until(lambda: engine.spec._finished == [], 5)
    assert_engine_empty(engine)


# -- (c) the engine-core process backend and a group of two -----------------------------------


def _ipc_files() -> set[str]:
    return set(glob.glob(os.path.join(tempfile.gettempdir(), f"specserve-{os.getpid()}-*")))


def _core_load(server_target, server_draft, group: int | None) -> None:
    from specserve.core import EngineCoreClient, EngineGroup
    from specserve.server.app import STATE

    cfg = engine_config(server_target, server_draft, spec_mode="static", spec_depth=3, num_blocks=48,
                        max_waiting_requests=8, threads=1, admin_api=True)
    fds, threads, ipc = _fds(), threading.active_count(), _ipc_files()
    backend = EngineGroup(cfg, group) if group else EngineCoreClient(cfg)
    srv = ServerThread(backend, cfg)
    try:
        state = srv.app[STATE]
        cores = backend.cores if group else [backend]
        tok = backend.tokenizer
        vocab = len(tok)
        counts = _http_load(srv.base, tok, vocab, 40 if group else 100, seed=7 + (group or 0))
        assert counts.get(200, 0) > 20 and counts.get(400), counts

        def settled() -> bool:
            snap = backend.snapshot()
            return (state.num_inflight == 0 and all(not c._streams and not c._calls for c in cores)
                    and snap["running"] == 0 and snap["waiting"] == 0)

        assert wait_until(settled, 20), backend.snapshot()
        # The cores' pools: every block back (the prefix cache's evictable blocks count as free).
        assert wait_until(lambda: backend.snapshot()["blocks_held"] == 0, 5), backend.snapshot()
        if group:
            assert backend._core_of == {} and backend.inflight == [0] * group, (backend._core_of, backend.inflight)
            assert all(backend.routed), backend.routed
        assert srv.call(_tasks()) and len(srv.call(_tasks())) <= 1 + len(cores), srv.call(_tasks())
        assert http(srv.base, "/health")[0] == 200
    finally:
        srv.stop()
        # The harness's loop (not the server's code) keeps its default executor's threads.
        srv.loop.run_until_complete(srv.loop.shutdown_default_executor())
        srv.loop.close()
    assert wait_until(lambda: threading.active_count() <= threads, 5), threading.enumerate()
    assert _ipc_files() == ipc, _ipc_files() - ipc
    assert wait_until(lambda: _fds() <= fds + 2, 5), (_fds(), fds)


def test_engine_core_process_returns_to_empty(server_target, server_draft):
    """~100 random HTTP requests on one engine-core process: afterwards no stream, call or
    block is held, the loop runs only its watcher; after shutdown no fd, thread or ipc file
    of it is left."""
    _core_load(server_target, server_draft, None)


def test_engine_group_of_two_returns_to_empty(server_target, server_draft):
    """~40 random HTTP requests on two engine cores behind one server: the same, and the group's
    routing maps are empty too."""
    _core_load(server_target, server_draft, 2)
