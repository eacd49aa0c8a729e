"""What an operator reads on /metrics, /stats and /admin/speculation, checked against the load
that produced it: token totals equal the responses' usage, one TTFT and one e2e observation per
completion, queue and KV gauges back to 0 when idle, the speculative counters equal to the
engine's own and consistent among themselves, a valid Prometheus exposition, and counters that
never go backwards when the engine loop or the engine-core process is restarted."""

from __future__ import annotations

import time
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from specserve.engine import LLMEngine
from tests.server.conftest import ServerThread, SseStream, engine_config, http, wait_until

COUNTERS = ("specserve_prompt_tokens_total", "specserve_generation_tokens_total",
            "specserve_prefix_cache_queries_total", "specserve_prefix_cache_hits_total",
            "specserve_num_preemptions_total", "specserve_spec_num_drafts_total",
            "specserve_spec_num_draft_tokens_total", "specserve_spec_num_accepted_tokens_total",
            "specserve_requests_failed_total", "specserve_engine_restarts_total")


def scrape_text(base: str) -> str:
    with urllib.request.urlopen(base + "/metrics", timeout=10) as r:
        return r.read().decode()


def scrape(base: str) -> dict[tuple[str, tuple], float]:
    """(sample name, sorted labels) -> value, from the parsed exposition."""
    out = {}
    for fam in text_string_to_metric_families(scrape_text(base)):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def v(m: dict, name: str, **labels) -> float:
    return m.get((name, tuple(sorted((k, str(x)) for k, x in labels.items()))), 0.0)


def per_position(m: dict) -> list[float]:
    pos = {int(dict(lbl)["position"]): val for (n, lbl), val in m.items()
           if n == "specserve_spec_accepted_per_position_total"}
    return [pos[p] for p in sorted(pos)]


def post(base: str, path: str, body: dict) -> dict:
    status, out = http(base, path, body)
    assert status == 200, out
    return out


@pytest.fixture(scope="module")
def srv(server_target, server_draft):
    cfg = engine_config(server_target, server_draft, spec_mode="static", spec_depth=3, admin_api=True)
    s = ServerThread(LLMEngine(cfg, progress=False), cfg)
    s.model = server_target.name
    yield s
    s.stop()


def idle(srv) -> bool:
    e = srv.engine
    return not e.has_unfinished_requests() and e.pool.num_free_blocks == e.pool.num_blocks


# -- the exposition itself ----------------------------------------------------------------------


def test_exposition_is_valid_prometheus(srv):
    """Every family parses; no series appears twice; counters end in _total; each histogram has
    ascending cumulative buckets with le="+Inf" equal to _count."""
    post(srv.base, "/v1/completions", {"model": srv.model, "prompt": "Hello there", "max_tokens": 6,
                                       "temperature": 0})
    text = scrape_text(srv.base)
    seen = set()
    for line in text.splitlines():
        if line and not line.startswith("#"):
            key = line.rsplit(" ", 1)[0]
            assert key not in seen, f"duplicate series {key}"
            seen.add(key)
    types = {}
    for fam in text_string_to_metric_families(text):
        types[fam.name] = fam.type
        if fam.type == "counter":
            assert all(s.name.endswith(("_total", "_created")) for s in fam.samples), fam
        if fam.type == "histogram":
            buckets = [(s.labels["le"], s.value) for s in fam.samples if s.name.endswith("_bucket")]
            count = next(s.value for s in fam.samples if s.name.endswith("_count"))
            assert buckets[-1] == ("+Inf", count), (fam.name, buckets[-1], count)
            values = [b for _, b in buckets]
            assert values == sorted(values), fam.name
            assert [float(le) for le, _ in buckets] == sorted(float(le) for le, _ in buckets)
    for name in ("specserve_time_to_first_token_seconds", "specserve_inter_token_latency_seconds",
                 "specserve_e2e_request_latency_seconds"):
        assert types[name] == "histogram", (name, types.get(name))
    for name in ("specserve_num_requests_running", "specserve_num_requests_waiting",
                 "specserve_kv_cache_usage_perc", "specserve_spec_mean_tokens_per_pass"):
        assert types[name] == "gauge", (name, types.get(name))
    for name in COUNTERS:
        assert types[name[:-len("_total")]] == "counter", name


# -- a counted load ---------------------------------------------------------------------------


def test_a_counted_load_reads_back_exactly(srv):
    """Completions and chats, streaming and not, n = 1 and 2, a stop string, EOS allowed: the
    token counters move by the responses' usage (the prompt once per prompt, as usage counts
    it), one TTFT and one e2e observation per completion that produced a token, ITL
    observations for every token after each completion's first output, gauges back to 0, and
    the speculative counters equal the engine's totals."""
    base, model = srv.base, srv.model
    assert wait_until(lambda: idle(srv), timeout=10)
    before = scrape(base)
    usage_prompt = usage_completion = choices = 0
    first_chunk_tokens = 0
    bodies = [
        {"prompt": "The quick brown", "max_tokens": 17, "temperature": 0, "ignore_eos": True},
        {"prompt": "Once upon a time", "max_tokens": 9, "temperature": 0.9, "seed": 3, "n": 2},
        {"prompt": "Stop me when", "max_tokens": 30, "temperature": 0, "stop": [" the", "e"]},
        {"prompt": [5, 6, 7, 8, 9, 10], "max_tokens": 12, "temperature": 1.0, "seed": 1},
    ]
    for body in bodies:
        out = post(base, "/v1/completions", {"model": model, **body})
        usage_prompt += out["usage"]["prompt_tokens"]
        usage_completion += out["usage"]["completion_tokens"]
        choices += len(out["choices"])
    chat = post(base, "/v1/chat/completions", {"model": model, "max_tokens": 11, "temperature": 0, "n": 2,
                                               "messages": [{"role": "user", "content": "Say hi"}]})
    usage_prompt += chat["usage"]["prompt_tokens"]
    usage_completion += chat["usage"]["completion_tokens"]
    choices += 2
    # streaming, with usage
    s = SseStream(base, {"model": model, "prompt": "Streaming along", "max_tokens": 15, "temperature": 0,
                         "ignore_eos": True, "stream_options": {"include_usage": True}, "logprobs": 1})
    s.join(60)
    chunks = s.chunks()
    usage = chunks[-1]["usage"]
    usage_prompt += usage["prompt_tokens"]
    usage_completion += usage["completion_tokens"]
    choices += 1
    first_chunk_tokens += len(chunks[0]["choices"][0]["logprobs"]["tokens"])
    assert wait_until(lambda: idle(srv), timeout=10)
    time.sleep(0.05)
    after = scrape(base)
    d = {name: v(after, name) - v(before, name) for name in
         ("specserve_prompt_tokens_total", "specserve_generation_tokens_total",
          "specserve_time_to_first_token_seconds_count", "specserve_e2e_request_latency_seconds_count",
          "specserve_inter_token_latency_seconds_count", "specserve_requests_failed_total")}
    assert d["specserve_prompt_tokens_total"] == usage_prompt, (d, usage_prompt)
    assert d["specserve_generation_tokens_total"] == usage_completion, (d, usage_completion)
    assert d["specserve_time_to_first_token_seconds_count"] == choices, (d, choices)
    assert d["specserve_e2e_request_latency_seconds_count"] == choices, (d, choices)
    assert d["specserve_requests_failed_total"] == 0
    # after each completion's first output (1 token + at most depth 3 accepted): every token once
    itl = d["specserve_inter_token_latency_seconds_count"]
    assert usage_completion - 4 * choices <= itl <= usage_completion - choices, (itl, usage_completion, choices)
    # each completion's e2e latency covers its TTFT
    d_e2e = v(after, "specserve_e2e_request_latency_seconds_sum") - v(before, "specserve_e2e_request_latency_seconds_sum")
    d_ttft = v(after, "specserve_time_to_first_token_seconds_sum") - v(before, "specserve_time_to_first_token_seconds_sum")
    assert d_e2e >= d_ttft - 1e-9, (d_e2e, d_ttft)
    # gauges at rest
    assert v(after, "specserve_num_requests_running") == 0
    assert v(after, "specserve_num_requests_waiting") == 0
    assert v(after, "specserve_kv_cache_usage_perc") == 0
    # the speculative counters: the engine's, and consistent with one another
    t = srv.engine.spec.totals
    assert v(after, "specserve_spec_num_drafts_total") == t.num_drafts
    assert v(after, "specserve_spec_num_draft_tokens_total") == t.num_draft_tokens
    assert v(after, "specserve_spec_num_accepted_tokens_total") == t.num_accepted_tokens
    pp = per_position(after)
    assert pp == list(t.accepted_per_position)
    assert sum(pp) == t.num_accepted_tokens
    assert all(a >= b for a, b in zip(pp, pp[1:])), pp
    assert len(pp) <= 3 and t.num_accepted_tokens <= t.num_draft_tokens <= 3 * t.num_drafts
    tpp = v(after, "specserve_spec_mean_tokens_per_pass")
    assert tpp == pytest.approx((t.num_drafts + t.num_accepted_tokens) / t.num_drafts)
    # /stats says the same as /metrics
    status, stats = http(base, "/stats")
    assert status == 200
    assert stats["running"] == 0 and stats["waiting"] == 0 and stats["requests_failed"] == v(
        after, "specserve_requests_failed_total")
    assert stats["tokens_per_pass"] == pytest.approx(tpp)
    assert stats["acceptance"] == pytest.approx([a / t.num_drafts for a in pp])
    assert stats["mode"] == "static" and stats["depth"] == v(after, "specserve_spec_depth") == 3
    assert http(base, "/admin/speculation")[1] == {"mode": "static", "depth": 3}
    assert v(after, "specserve_spec_adaptive") == 0


def test_refused_requests_count_no_tokens(srv):
    """A request refused with a 400 (context too long, bad field) moves no token counter, no
    latency histogram and no failure counter."""
    base, model = srv.base, srv.model
    before = scrape(base)
    status, _ = http(base, "/v1/completions", {"model": model, "prompt": [5] * 300, "max_tokens": 4})
    assert status == 400
    status, _ = http(base, "/v1/completions", {"model": model, "prompt": "x", "max_tokens": 4,
                                               "temperature": -1})
    assert status == 400
    after = scrape(base)
    for name in ("specserve_prompt_tokens_total", "specserve_generation_tokens_total",
                 "specserve_time_to_first_token_seconds_count", "specserve_e2e_request_latency_seconds_count",
                 "specserve_requests_failed_total"):
        assert v(after, name) == v(before, name), name


def test_an_aborted_stream_returns_the_gauges_to_zero(srv):
    """A client that leaves mid-stream: its tokens until then are counted once (one TTFT, no
    e2e), and running, waiting and KV usage go back to 0."""
    base, model = srv.base, srv.model
    assert wait_until(lambda: idle(srv), timeout=10)
    before = scrape(base)
    s = SseStream(base, {"model": model, "prompt": "Leave early", "max_tokens": 200, "ignore_eos": True,
                         "temperature": 0}, close_after=3)
    s.join(60)
    assert wait_until(lambda: idle(srv), timeout=10)
    assert wait_until(lambda: v(scrape(base), "specserve_num_requests_running") == 0, timeout=5)
    after = scrape(base)
    assert v(after, "specserve_kv_cache_usage_perc") == 0
    assert v(after, "specserve_num_requests_waiting") == 0
    assert v(after, "specserve_time_to_first_token_seconds_count") - v(
        before, "specserve_time_to_first_token_seconds_count") == 1
    assert v(after, "specserve_generation_tokens_total") - v(before, "specserve_generation_tokens_total") < 200
    assert v(after, "specserve_requests_failed_total") == v(before, "specserve_requests_failed_total")


def test_prefix_cache_counters_equal_the_pools(srv):
    """The same long prompt twice: the second finds its whole blocks in the cache; the exported
    query and hit tokens are the pool's and move by the prompt's length and its cached blocks."""
    base, model = srv.base, srv.model
    prompt = list(range(30, 70))   # 40 tokens: 5 blocks of 8
    before = scrape(base)
    post(base, "/v1/completions", {"model": model, "prompt": prompt, "max_tokens": 2, "temperature": 0})
    post(base, "/v1/completions", {"model": model, "prompt": prompt, "max_tokens": 2, "temperature": 0})
    after = scrape(base)
    pool = srv.engine.pool
    assert v(after, "specserve_prefix_cache_queries_total") == pool.prefix_cache_query_tokens
    assert v(after, "specserve_prefix_cache_hits_total") == pool.prefix_cache_hit_tokens
    dq = v(after, "specserve_prefix_cache_queries_total") - v(before, "specserve_prefix_cache_queries_total")
    dh = v(after, "specserve_prefix_cache_hits_total") - v(before, "specserve_prefix_cache_hits_total")
    assert dq == 2 * len(prompt), dq
    assert 32 <= dh <= 40, dh


def test_switching_speculation_is_read_back_everywhere(srv):
    """POST /admin/speculation: GET, /stats and /metrics (spec_adaptive, spec_depth after a step)
    agree with it."""
    base, model = srv.base, srv.model
    try:
        assert post(base, "/admin/speculation", {"mode": "static", "depth": 1}) == {"mode": "static", "depth": 1}
        post(base, "/v1/completions", {"model": model, "prompt": "Depth one", "max_tokens": 6, "temperature": 0,
                                       "ignore_eos": True})
        m = scrape(base)
        assert v(m, "specserve_spec_depth") == 1 and v(m, "specserve_spec_adaptive") == 0
        assert http(base, "/stats")[1]["depth"] == 1
        assert post(base, "/admin/speculation", {"mode": "adaptive"})["mode"] == "adaptive"
        post(base, "/v1/completions", {"model": model, "prompt": "Adaptive now", "max_tokens": 6,
                                       "temperature": 0, "ignore_eos": True})
        m = scrape(base)
        assert v(m, "specserve_spec_adaptive") == 1
        assert http(base, "/admin/speculation")[1]["mode"] == "adaptive"
        assert http(base, "/stats")[1]["mode"] == "adaptive"
        steps = sum(val for (n, _), val in m.items() if n == "specserve_controller_steps_total")
        assert steps > 0
    finally:
        post(base, "/admin/speculation", {"mode": "static", "depth": 3})


# -- restarts ------------------------------------------------------------------------------------


def test_counters_survive_a_restart_of_the_engine_loop(srv):
    """The in-process engine loop dies and the engine is reset: every counter on /metrics
    (prefix-cache queries and hits, preemptions, speculative counters) is at least what it was."""
    base, model, engine = srv.base, srv.model, srv.engine
    post(base, "/v1/completions", {"model": model, "prompt": list(range(30, 70)), "max_tokens": 4,
                                   "temperature": 0})
    assert wait_until(lambda: idle(srv), timeout=10)
    before = scrape(base)
    assert v(before, "specserve_prefix_cache_queries_total") > 0
    step, calls = engine.step, [0]

    def dies_once():
        calls[0] += 1
        if calls[0] == 2:
            raise RuntimeError("simulated device failure")
        return step()

    engine.step = dies_once
    restarts = engine.num_restarts
    try:
        status, _ = http(base, "/v1/completions", {"model": model, "prompt": "Doomed", "max_tokens": 20,
                                                   "temperature": 0, "ignore_eos": True})
        assert wait_until(lambda: engine.num_restarts == restarts + 1, timeout=10)
    finally:
        engine.step = step
    assert wait_until(lambda: idle(srv), timeout=10)
    after = scrape(base)
    dropped = {n: (v(before, n), v(after, n)) for n in COUNTERS if v(after, n) < v(before, n)}
    assert not dropped, dropped



class _Proc:
    exitcode, pid = -9, 4242

    def is_alive(self):
        return False


class _Socket:
    def close(self):
        pass


def test_core_counters_never_go_backwards_while_a_core_restarts(server_target):
    """EngineCoreClient._restart after its core died, the new core slow to start: what
    /metrics reads meanwhile (the client's snapshot) has every counter between its value before
    the death and its value once the new core is ready, and no running or waiting requests."""
    import asyncio

    from specserve.core import EngineCoreClient
    from specserve.metrics import ServerMetrics

    cfg = engine_config(server_target, "ngram", spec_mode="static", spec_depth=2)
    client = EngineCoreClient(cfg)
    dead = {"running": 2, "waiting": 1, "kv_usage": 0.25, "blocks_held": 64, "prefix_cache_queries": 78,
            "prefix_cache_hits": 16, "restarts": 0, "failed": 1, "preemptions": 2, "num_drafts": 40,
            "num_draft_tokens": 80, "num_accepted_tokens": 30, "accepted_per_position": [20, 10],
            "tokens_per_pass": 1.75, "depth": 2, "speculation": {"mode": "static", "depth": 2},
            "controller": None}
    fresh = {**dead, "running": 0, "waiting": 0, "kv_usage": 0.0, "blocks_held": 0, "prefix_cache_queries": 0,
             "prefix_cache_hits": 0, "failed": 0, "preemptions": 0, "num_drafts": 0, "num_draft_tokens": 0,
             "num_accepted_tokens": 0, "accepted_per_position": [], "tokens_per_pass": 1.0}
    client._snapshot = dict(dead)
    client._proc, client._push, client._pull = _Proc(), _Socket(), _Socket()
    metrics = ServerMetrics(client.snapshot)
    during: list[dict] = []

    async def slow_spawn():   # the new core loads: /metrics is scraped meanwhile, then it is ready
        during.append(scrape_metrics(metrics))
        client._snapshot = dict(fresh)

    client._spawn = slow_spawn
    before = scrape_metrics(metrics)
    asyncio.run(client._restart())
    after = scrape_metrics(metrics)
    names = [n for n in COUNTERS if n not in ("specserve_prompt_tokens_total", "specserve_generation_tokens_total")]
    for n in names:
        seq = [v(before, n), v(during[0], n), v(after, n)]
        assert seq[0] <= seq[1] <= seq[2], (n, seq)
    pp = [per_position(m) for m in (before, during[0], after)]
    width = max(map(len, pp))
    pp = [p + [0.0] * (width - len(p)) for p in pp]
    assert all(a <= b <= c for a, b, c in zip(*pp)), pp
    assert v(during[0], "specserve_num_requests_running") == 0
    assert v(during[0], "specserve_num_requests_waiting") == 0
    assert v(after, "specserve_engine_restarts_total") == 1


def scrape_metrics(metrics) -> dict:
    body, _ = metrics.render()
    out = {}
    for fam in text_string_to_metric_families(body.decode()):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


class _Core:
    def __init__(self, snap):
        self.snap = snap

    def snapshot(self):
        return dict(self.snap)


def test_an_engine_group_sums_its_cores_on_metrics():
    """--engines 2 (EngineGroup): each counter on /metrics is the sum of the cores' (accepted per
    position summed position by position, whatever each core's depth reached), the queue gauges
    too, and each core's share is labelled by its engine index."""
    from specserve.core import EngineGroup
    from specserve.metrics import ServerMetrics

    def snap(i, per_pos):
        return {"running": i + 1, "waiting": i, "kv_usage": 0.1 * (i + 1), "blocks_held": 4 * (i + 1),
                "prefix_cache_queries": 100 * (i + 1), "prefix_cache_hits": 10 * (i + 1), "restarts": i,
                "failed": i, "preemptions": 3 * i, "num_drafts": 50 + i, "num_draft_tokens": 150 + i,
                "num_accepted_tokens": sum(per_pos), "accepted_per_position": per_pos,
                "tokens_per_pass": 1.0 + sum(per_pos) / (50 + i), "depth": 3,
                "speculation": {"mode": "static", "depth": 3}, "controller": None}

    snaps = [snap(0, [30, 20, 5]), snap(1, [25, 7])]
    g = object.__new__(EngineGroup)
    g.cores, g.routed = [_Core(s) for s in snaps], [7, 5]
    m = scrape_metrics(ServerMetrics(g.snapshot))
    for key, name in (("prefix_cache_queries", "specserve_prefix_cache_queries_total"),
                      ("prefix_cache_hits", "specserve_prefix_cache_hits_total"),
                      ("failed", "specserve_requests_failed_total"), ("preemptions", "specserve_num_preemptions_total"),
                      ("num_drafts", "specserve_spec_num_drafts_total"),
                      ("num_draft_tokens", "specserve_spec_num_draft_tokens_total"),
                      ("num_accepted_tokens", "specserve_spec_num_accepted_tokens_total"),
                      ("restarts", "specserve_engine_restarts_total"),
                      ("running", "specserve_num_requests_running"), ("waiting", "specserve_num_requests_waiting")):
        assert v(m, name) == sum(s[key] for s in snaps), name
    assert per_position(m) == [55, 27, 5]
    assert v(m, "specserve_spec_mean_tokens_per_pass") == pytest.approx((101 + 87) / 101)
    for i, s in enumerate(snaps):
        assert v(m, "specserve_engine_num_requests_running", engine=i) == s["running"]
        assert v(m, "specserve_engine_prefix_cache_hits", engine=i) == s["prefix_cache_hits"]
        assert v(m, "specserve_engine_requests_routed", engine=i) == g.routed[i]


def test_preemptions_in_a_small_pool_are_counted_once(server_target):
    """Three concurrent requests in a 12-block pool: some are preempted and recomputed; the
    generation counter still equals the tokens the clients received (recomputed tokens are not
    counted again), the preemption counter is the scheduler's and > 0, and the gauges return to 0."""
    from tests.server.conftest import concurrently

    cfg = engine_config(server_target, "ngram", spec_mode="static", spec_depth=2, num_blocks=12)
    s = ServerThread(LLMEngine(cfg, progress=False), cfg)
    try:
        model = server_target.name
        before = scrape(s.base)

        def one(i):
            return post(s.base, "/v1/completions", {"model": model, "prompt": [10 + i] * 24, "max_tokens": 40,
                                                    "temperature": 0, "ignore_eos": True})

        outs = concurrently(one, 3)
        assert wait_until(lambda: idle(s), timeout=10)
        after = scrape(s.base)
        completion = sum(o["usage"]["completion_tokens"] for o in outs)
        assert completion == 120
        assert v(after, "specserve_generation_tokens_total") - v(before, "specserve_generation_tokens_total") == 120
        assert v(after, "specserve_num_preemptions_total") == s.engine.scheduler.num_preemptions > 0
        assert v(after, "specserve_time_to_first_token_seconds_count") == 3
        assert v(after, "specserve_kv_cache_usage_perc") == 0 and v(after, "specserve_num_requests_running") == 0
    finally:
        s.stop()
