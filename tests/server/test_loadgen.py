"""The load generator's statistics, arrival process and SSE client (against a scripted server)."""

import asyncio
import json
import math
import os
import random
import statistics

import pytest
from aiohttp import web

from benchmarks import loadgen
from benchmarks.loadgen import (RequestResult, acceptance_figures, arrival_delays, compute_metrics,
                                parse_goodput, parse_spec_metrics, summarize)


def test_summary_percentiles_are_ordered_and_right():
    values = list(range(1, 101))   # 1..100
    s = summarize(values)
    assert s["mean"] == pytest.approx(50.5)
    assert s["median"] == pytest.approx(50.5)
    assert s["p90"] == pytest.approx(90.1)
    assert s["p99"] == pytest.approx(99.01)
    rng = random.Random(0)
    s = summarize([rng.expovariate(1.0) for _ in range(1000)])
    assert s["median"] <= s["p90"] <= s["p99"]
    assert summarize([])["count"] == 0


def synthetic(ttft, gaps, n_out=None):
    """A result whose first chunk came at ttft and each next one after the given gaps."""
    r = RequestResult(ok=True, ttft=ttft, itl=list(gaps), num_chunks=len(gaps) + 1)
    r.e2e = ttft + sum(gaps)
    r.num_output_tokens = n_out if n_out is not None else len(gaps) + 1
    return r


def test_tpot_itl_and_goodput_from_synthetic_timestamps():
    a = synthetic(0.100, [0.020] * 9)           # 10 tokens: tpot = 0.18 / 9 = 0.02
    b = synthetic(0.400, [0.050, 0.010])        # 3 tokens: tpot = 0.06 / 2 = 0.03
    c = synthetic(0.050, [0.030] * 4, n_out=10)  # 5 chunks carrying 10 tokens: tpot = 0.12 / 9
    assert a.tpot == pytest.approx(0.02)
    assert b.tpot == pytest.approx(0.03)
    assert c.tpot == pytest.approx(0.12 / 9)
    assert synthetic(0.1, []).tpot is None      # one token: no TPOT
    failed = RequestResult(ok=False, error="HTTP 500")
    m = compute_metrics([a, b, c, failed], duration=2.0, targets=parse_goodput(["ttft:200", "tpot:25"]))
    assert m["num_completed"] == 3 and m["num_failed"] == 1
    assert m["total_output_tokens"] == 23
    assert m["output_throughput"] == pytest.approx(11.5)
    assert m["itl_s"]["count"] == 9 + 2 + 4
    assert m["itl_s"]["median"] == pytest.approx(0.020)
    assert m["ttft_s"]["mean"] == pytest.approx((0.1 + 0.4 + 0.05) / 3)
    assert m["tokens_per_chunk"] == pytest.approx(23 / 18)
    # a meets both; b misses ttft; c meets; the failure never counts.
    assert m["goodput_requests_per_s"] == pytest.approx(2 / 2.0)
    with pytest.raises(ValueError, match="ttfb"):
        parse_goodput(["ttfb:3"])


def test_poisson_arrivals_have_the_mean_rate():
    rng = random.Random(1)
    gaps = arrival_delays(20000, 4.0, 1.0, rng)
    assert statistics.fmean(gaps) == pytest.approx(0.25, rel=0.03)
    # Exponential gaps: coefficient of variation 1.
    assert statistics.pstdev(gaps) / statistics.fmean(gaps) == pytest.approx(1.0, rel=0.05)


@pytest.mark.parametrize("burstiness", [0.25, 4.0])
def test_burstiness_sets_the_variance_not_the_mean(burstiness):
    rng = random.Random(2)
    gaps = arrival_delays(40000, 10.0, burstiness, rng)
    mean = statistics.fmean(gaps)
    assert mean == pytest.approx(0.1, rel=0.04)
    # gamma(K, 1/(R K)): variance = 1 / (K R^2)
    assert statistics.pvariance(gaps) == pytest.approx(1 / (burstiness * 100), rel=0.1)


def test_infinite_rate_sends_everything_at_once():
    assert arrival_delays(5, math.inf, 1.0, random.Random(0)) == [0.0] * 5
    with pytest.raises(ValueError, match="-1"):
        arrival_delays(5, -1.0, 1.0, random.Random(0))


METRICS_BEFORE = """\
# TYPE specserve_spec_num_drafts_total counter
specserve_spec_num_drafts_total 10
# TYPE specserve_spec_num_draft_tokens_total counter
specserve_spec_num_draft_tokens_total 40
# TYPE specserve_spec_num_accepted_tokens_total counter
specserve_spec_num_accepted_tokens_total 20
# TYPE specserve_spec_accepted_per_position_total counter
specserve_spec_accepted_per_position_total{position="1"} 9
specserve_spec_accepted_per_position_total{position="2"} 6
# TYPE specserve_spec_depth gauge
specserve_spec_depth 4
"""
METRICS_AFTER = METRICS_BEFORE.replace(" 10\n", " 110\n").replace(" 40\n", " 440\n") \
    .replace("total 20\n", "total 320\n").replace('"1"} 9', '"1"} 89').replace('"2"} 6', '"2"} 56')


def test_acceptance_figures_from_prometheus_text():
    before, after = parse_spec_metrics(METRICS_BEFORE), parse_spec_metrics(METRICS_AFTER)
    assert before["depth"] == 4 and before["accepted_per_position"] == {1: 9, 2: 6}
    acc = acceptance_figures(before, after)
    assert acc["num_drafts"] == 100 and acc["num_accepted_tokens"] == 300
    assert acc["acceptance_rate"] == pytest.approx(300 / 400)
    assert acc["mean_acceptance_length"] == pytest.approx(4.0)
    assert acc["acceptance_per_position"] == {"1": pytest.approx(0.8), "2": pytest.approx(0.5)}
    # Another engine exports none of them.
    other = parse_spec_metrics("# TYPE vllm_x counter\nvllm_x_total 3\n")
    assert other == {} and acceptance_figures(other, other) == {}


# ------------------------------------------------------------------ scripted SSE server
CHUNK_GAP = 0.03
PIECES = ["Hello", ", ", "world", "!"]


async def scripted_completions(request):
    body = await request.json()
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await resp.prepare(request)
    chat = "messages" in body

    async def send(obj):
        await resp.write(b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n")

    await asyncio.sleep(0.05)   # "prefill"
    for i, piece in enumerate(PIECES):
        if i:
            await asyncio.sleep(CHUNK_GAP)
        last = i == len(PIECES) - 1
        if chat:
            delta = {"role": "assistant", "content": piece} if i == 0 else {"content": piece}
            choice = {"index": 0, "delta": delta, "finish_reason": "length" if last else None}
        else:
            choice = {"index": 0, "text": piece, "finish_reason": "length" if last else None}
        # Split one event across two writes, as a proxy might: the client must reassemble lines.
        data = b"data: " + json.dumps({"id": "x", "choices": [choice]}).encode() + b"\n\n"
        await resp.write(data[:7])
        await resp.write(data[7:])
    if body.get("stream_options", {}).get("include_usage"):
        # 6 tokens in 4 chunks: a speculative server sends several tokens per chunk.
        await send({"id": "x", "choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 6,
                                                        "total_tokens": 9}})
    await resp.write(b"data: [DONE]\n\n")
    await resp.write_eof()
    return resp


async def metrics_route(request):
    return web.Response(text=METRICS_BEFORE, content_type="text/plain")


async def with_server(coro_fn):
    app = web.Application()
    app.router.add_post("/v1/completions", scripted_completions)
    app.router.add_post("/v1/chat/completions", scripted_completions)
    app.router.add_get("/metrics", metrics_route)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]
    try:
        return await coro_fn(f"http://127.0.0.1:{port}")
    finally:
        await runner.cleanup()


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_client_parses_scripted_sse_stream(endpoint):
    import aiohttp

    async def go(base):
        async with aiohttp.ClientSession() as session:
            path = "/v1/chat/completions" if endpoint == "chat" else "/v1/completions"
            payload = loadgen.build_payload(endpoint, "m", "hi", 8, 0.0, False)
            return await loadgen.stream_request(session, base + path, payload, 0.0)

    r = asyncio.run(with_server(go))
    assert r.ok, r.error
    assert r.text == "Hello, world!"
    assert r.num_chunks == 4 and r.num_output_tokens == 6 and r.usage_reported
    assert len(r.itl) == 3
    assert all(CHUNK_GAP * 0.8 <= x <= CHUNK_GAP + 0.1 for x in r.itl), r.itl
    assert 0.04 <= r.ttft <= r.e2e
    assert r.tpot == pytest.approx((r.e2e - r.ttft) / 5)


def test_benchmark_run_end_to_end_against_scripted_server(tmp_path):
    out = tmp_path / "res.json"

    async def go(base):
        args = loadgen.make_parser().parse_args([
            "--base-url", base, "--model", "m", "--num-prompts", "6", "--max-concurrency", "2",
            "--request-rate", "50", "--max-tokens", "8", "--goodput", "ttft:1000", "--no-progress",
            "--scrape-interval", "0.05", "--out", str(out)])
        return await loadgen.run_benchmark(args, loadgen.select_prompts(args))

    res = asyncio.run(with_server(go))
    m = res["metrics"]
    assert m["num_completed"] == 6 and m["total_output_tokens"] == 36
    assert m["itl_s"]["count"] == 18
    # Concurrency 2, each request ~0.14 s: six take at least three rounds.
    assert m["duration_s"] >= 3 * (0.05 + 3 * CHUNK_GAP)
    assert m["goodput_requests_per_s"] == pytest.approx(m["request_throughput"])
    assert res["depth_series"] and res["depth_series"][0][1] == 4
    assert res["acceptance"]["num_drafts"] == 0   # the scripted counters do not move
    json.dumps(res)   # serialisable as written by main()


def test_sweep_against_running_servers_writes_report_and_plots(tmp_path):
    """sweep.py against already-running servers (nothing is started): interleaved rounds, the
    settings' order rotated, each round its own prompt draw; the report pools the rounds."""
    import threading

    from benchmarks import sweep

    ready = threading.Event()
    box = {}

    def serve():
        loop = asyncio.new_event_loop()
        asyncio.set_event_loop(loop)

        async def health(request):
            return web.Response(text="ok")

        async def start():
            app = web.Application()
            app.router.add_post("/v1/completions", scripted_completions)
            app.router.add_get("/metrics", metrics_route)
            app.router.add_get("/health", health)
            runner = web.AppRunner(app)
            await runner.setup()
            site = web.TCPSite(runner, "127.0.0.1", 0)
            await site.start()
            box["port"] = site._server.sockets[0].getsockname()[1]
            box["runner"] = runner
        loop.run_until_complete(start())
        box["loop"] = loop
        ready.set()
        loop.run_forever()
        loop.run_until_complete(box["runner"].cleanup())

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    assert ready.wait(10)
    base = f"http://127.0.0.1:{box['port']}"
    try:
        sweep.main(["--model", "m", "--base-url", f"none={base}", "--base-url", f"static2={base}",
                    "--base-url", f"adaptive={base}", "--concurrency", "1", "2", "--rounds", "2",
                    "--min-prompts", "3", "--prompts-per-concurrency", "1", "--out-dir", str(tmp_path), "--",
                    "--no-progress"])
    finally:
        box["loop"].call_soon_threadsafe(box["loop"].stop)
        t.join(10)
    for r in (0, 1):
        cell = json.loads((tmp_path / f"round{r}" / "none_c1.json").read_text())
        assert cell["config"]["seed"] == r and cell["metrics"]["num_completed"] == 3
    report = (tmp_path / "report.md").read_text()
    assert "| adaptive |" in report and "| 1 | static2" in report and "2 round(s)" in report
    assert (tmp_path / "latency_throughput.png").stat().st_size > 1000
    assert sweep.main(["--report", str(tmp_path)]) == 0


def test_sweep_report_pools_tokens_over_seconds_and_sets_adaptive_beside_the_best():
    from benchmarks.sweep import pooled, report

    def cell(label, conc, tokens, seconds):
        return {"config": {"label": label, "max_concurrency": conc},
                "metrics": {"total_output_tokens": tokens, "duration_s": seconds, "output_throughput": tokens / seconds,
                            "ttft_s": {"median": 0.01}, "itl_s": {"median": 0.002}}}

    cells = [cell("none", 4, 100, 1.0), cell("none", 4, 100, 3.0),
             cell("static2", 4, 300, 1.0), cell("static3", 4, 250, 1.0), cell("adaptive", 4, 290, 1.0)]
    pool = pooled(cells)
    assert pool["none"][4]["tokens_per_s"] == pytest.approx(50.0) and pool["none"][4]["rounds"] == 2
    text = report(cells)
    assert "| 4 | static2 (300) | 0.967 | 5.800 |" in text


def test_sweep_report_pairs_rounds_and_sets_each_setting_beside_in_process():
    from benchmarks.sweep import report

    def cell(label, seed, tps):
        return {"config": {"label": label, "max_concurrency": 8, "seed": seed},
                "metrics": {"total_output_tokens": tps, "duration_s": 1.0, "output_throughput": tps,
                            "ttft_s": {"median": 0.01, "p99": 0.03}, "itl_s": {"median": 0.002, "p99": 0.004}}}

    # adaptive / static1 per round: 1.0, 0.9, 1.1 -> mean 1.0, standard error 0.1 / sqrt(3).
    cells = [cell("static1", r, 100.0) for r in range(3)] + [cell("adaptive", r, t) for r, t in
                                                             enumerate([100.0, 90.0, 110.0])]
    cells += [cell("in_process", r, 200.0) for r in range(3)]
    text = report(cells)
    assert "| 8 | static1 (100) | 1.000 +- 0.058 | n/a |" in text
    assert "| 8 | adaptive | 100 | 0.500 +- 0.029 | 10 / 30 | 2.0 / 4.0 |" in text
    assert "| 8 | in_process | 200 | 1 | 10 / 30 |" in text


def test_sweep_in_process_runs_every_setting_in_one_engine(tiny_llama, tmp_path, monkeypatch):
    """--in-process: one engine serves every cell, switched between them; its cells have loadgen's
    shape (so the report and plots read them), and every block comes back."""
    from benchmarks import sweep

    config = tmp_path / "tiny.toml"
    config.write_text(f'device = "cpu"\n[target]\npath = "{tiny_llama}"\ndtype = "float64"\n'
                      f'[draft]\npath = "{tiny_llama}"\ndtype = "float64"\n'
                      '[cache]\nnum_blocks = 128\nblock_size = 4\n[cpu]\ncompile = "off"\n')
    made = []
    init = sweep.InProcess.__init__
    monkeypatch.setattr(sweep.InProcess, "__init__", lambda self, *a: (init(self, *a), made.append(self))[0])
    out = tmp_path / "out"
    assert sweep.main(["--config", str(config), "--in-process", "--settings", "adaptive", "static0", "static2",
                       "--concurrency", "1", "3", "--rounds", "2", "--min-prompts", "3",
                       "--prompts-per-concurrency", "1", "--out-dir", str(out), "--",
                       "--max-tokens", "5", "--ignore-eos", "--min-words", "2", "--max-words", "6"]) == 0
    assert len(made) == 1
    engine = made[0].engine
    for r in (0, 1):
        for label in ("adaptive", "static0", "static2"):
            cell = json.loads((out / f"round{r}" / f"{label}_c3.json").read_text())
            m = cell["metrics"]
            assert cell["config"]["seed"] == r and m["num_completed"] == 3 and m["total_output_tokens"] == 15
            assert m["ttft_s"]["count"] == 3 and m["itl_s"]["count"] >= 1
    report = (out / "report.md").read_text()
    assert "| 3 | static" in report and " +- " in report and "2 round(s)" in report
    assert engine.scheduler.config.max_num_seqs >= 3 and not engine.has_unfinished_requests()
    engine.pool.check_all_free()
    with pytest.raises(SystemExit):
        sweep.main(["--in-process", "--settings", "none", "--out-dir", str(out)])


@pytest.mark.parametrize("n", [2, 3, 5])
def test_sweep_cell_order_puts_each_setting_everywhere(n):
    from benchmarks.sweep import cell_order

    settings = [f"s{i}" for i in range(n)]
    rows = [cell_order(settings, i) for i in range(n)]
    assert all(sorted(r) == settings for r in rows)
    assert all(sorted(r.index(s) for r in rows) == list(range(n)) for s in settings)


def test_cpu_lists_and_pinning_the_client(tmp_path):
    import subprocess
    import sys

    assert loadgen.parse_cpus("0") == {0}
    assert loadgen.parse_cpus("0-2,5") == {0, 1, 2, 5}
    for bad in ("", "a", "1-x"):
        with pytest.raises(ValueError, match="CPU list"):
            loadgen.parse_cpus(bad)
    cpu = max(os.sched_getaffinity(0))
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        loadgen.pin_to_cpus(str(cpu), pid=child.pid)
        assert os.sched_getaffinity(child.pid) == {cpu}
    finally:
        child.kill()
        child.wait()


def test_sweep_starts_a_server_per_setting(tmp_path, monkeypatch):
    """Without --base-url: a `specserve serve` per setting, with that setting's flags, healthy
    before the load starts, stopped after."""
    from benchmarks import sweep

    started = []

    def fake_start(setting, config, port, log_path, cpus):
        started.append((setting, port))
        return None

    monkeypatch.setattr(sweep, "start_server", fake_start)
    built = []   # the compiled forwards are built (or found cached) before any server starts
    monkeypatch.setattr("specserve.model.compiled.build_for", lambda cfg: built.append(cfg) or [])
    monkeypatch.setattr(sweep, "wait_healthy", lambda *a: (_ for _ in ()).throw(RuntimeError("not healthy")))
    with pytest.raises(RuntimeError, match="not healthy"):
        sweep.main(["--settings", "none", "adaptive", "--port", "9100", "--out-dir", str(tmp_path)])
    assert started == [("none", 9100), ("adaptive", 9101)] and len(built) == 1
    assert "--spec-mode static --spec-depth 3" == sweep.SETTINGS["static3"]
