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


def test_sweep_against_running_servers_writes_table_and_plots(tmp_path):
    """sweep.py in 'already running server' mode (no server is started), then plots.py."""
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
        sweep.main(["--model", "m", "--base-url", f"none={base}", "--base-url", f"adaptive={base}",
                    "--concurrency", "1", "2", "--out-dir", str(tmp_path), "--",
                    "--num-prompts", "3", "--no-progress"])
        # Interleaved: settings take turns at each concurrency, in cell_order's order (two
        # settings alternate), one directory per round, each round its own prompt draw.
        sweep.main(["--model", "m", "--base-url", f"none={base}", "--base-url", f"adaptive={base}",
                    "--concurrency", "1", "2", "--interleave", "--rounds", "2", "--warmup-requests", "0",
                    "--out-dir", str(tmp_path / "inter"), "--", "--num-prompts", "3", "--no-progress"])
    finally:
        box["loop"].call_soon_threadsafe(box["loop"].stop)
        t.join(10)
    table = (tmp_path / "summary.md").read_text().splitlines()
    assert len(table) == 2 + 4
    assert table[2].startswith("| none | 1 |") and table[-1].startswith("| adaptive | 2 |")
    assert (tmp_path / "latency_throughput.png").stat().st_size > 1000
    assert (tmp_path / "depth_over_time.png").exists()
    res = json.loads((tmp_path / "adaptive_c2.json").read_text())
    assert res["metrics"]["num_completed"] == 3 and res["config"]["label"] == "adaptive"
    for r in (0, 1):
        rows = (tmp_path / "inter" / f"round{r}" / "summary.md").read_text().splitlines()[2:]
        order = [(row.split("|")[1].strip(), row.split("|")[2].strip()) for row in rows]
        first = ["none", "adaptive"] if r == 0 else ["adaptive", "none"]
        assert order == [(first[0], "1"), (first[1], "1"), (first[1], "2"), (first[0], "2")]
        cell = json.loads((tmp_path / "inter" / f"round{r}" / "none_c1.json").read_text())
        assert cell["config"]["seed"] == r


@pytest.mark.parametrize("n", [2, 3, 4, 5, 8])
def test_sweep_cell_order_puts_each_setting_everywhere_and_after_every_other_alike(n):
    """--interleave's order of cells: over n rounds (2n for odd n) every setting runs once (twice)
    in every position and right after every other setting once (twice); a rotation kept the
    same neighbours every round."""
    from collections import Counter

    from benchmarks.sweep import cell_order

    settings = [f"s{i}" for i in range(n)]
    rows = [cell_order(settings, i) for i in range(n if n % 2 == 0 else 2 * n)]
    times = 1 if n % 2 == 0 else 2
    assert all(sorted(r) == settings for r in rows)
    assert set(Counter((s, r.index(s)) for r in rows for s in r).values()) == {times}
    after = Counter((r[k], r[k + 1]) for r in rows for k in range(n - 1))
    assert len(after) == n * (n - 1) and set(after.values()) == {times}
    assert cell_order(settings, len(rows)) == rows[0]


def test_sweep_report_pools_rounds_and_checks_the_criteria():
    """Three rounds per cell: throughput is all tokens over all time (not the median round's),
    latencies come from the median round, and the issue-6 checks read the pooled figures."""
    from benchmarks import sweep_report

    def run(label, conc, tokens, seconds, ttft):
        return {"config": {"label": label, "max_concurrency": conc},
                "metrics": {"output_throughput": tokens / seconds, "total_output_tokens": tokens,
                            "duration_s": seconds, "ttft_s": {"median": ttft}},
                "depth_series": [[0.0, 4], [1.0, 6]] if label == "adaptive" else []}

    cells = {
        # none: 100 tok/s each round; static1: rounds of 300, 100, 100 tok/s (median 100; pooled
        # 600 tokens in 4 s = 150, the last round being 2 s long); adaptive 150 tok/s each round.
        ("none", 1): [run("none", 1, 100, 1.0, 0.1)] * 3,
        ("static1", 1): [run("static1", 1, 300, 1.0, 0.3), run("static1", 1, 100, 1.0, 0.2),
                         run("static1", 1, 200, 2.0, 0.1)],
        ("adaptive", 1): [run("adaptive", 1, 150, 1.0, 0.1)] * 3,
    }
    text, rows = sweep_report.report(cells)
    by = {r["config"]["label"]: r for r in rows}
    assert by["static1"]["metrics"]["output_throughput"] == pytest.approx(600 / 4.0)
    assert by["static1"]["metrics"]["output_throughput_median_round"] == pytest.approx(100.0)
    assert by["static1"]["metrics"]["ttft_s"]["median"] in (0.2, 0.1)   # a median-throughput round's own
    assert by["static1"]["metrics"]["pooled_rounds"] == 3
    # Per round adaptive / static1: 150/300, 150/100, 150/100.
    # Its standard error: the sd of log 0.5, log 1.5, log 1.5 (0.634) over sqrt(3).
    assert "| 1 | static1 (150) | 1.000 | 0.50-1.50 | +-0.366 | 1.000 (static1) | 1.500 | 5.0 |" in text
    assert "at every concurrency: **yes**" in text
    assert "picked on the other rounds: **yes**" in text
    assert "adaptive / no speculation = **1.500**" in text


def test_sweep_report_keeps_its_rounds_and_pools_them_with_later_ones(tmp_path):
    """rounds.json keeps what pooling reads of every run; given back among the inputs (the
    file, or the report folder holding it) it pools with new rounds as if they had been swept
    together: throughput over all rounds, the checks over all of them, latencies from the full
    rounds only."""
    import subprocess
    import sys
    from pathlib import Path

    from benchmarks import sweep_report

    def run(label, tokens, seconds, seed):
        return {"config": {"label": label, "max_concurrency": 2, "seed": seed}, "commit": "abc1234",
                "metrics": {"output_throughput": tokens / seconds, "total_output_tokens": tokens,
                            "duration_s": seconds, "ttft_s": {"median": 0.1, "p99": 0.2},
                            "itl_s": {"median": 0.01, "p99": 0.02}}}

    def write_round(d, results):
        d.mkdir(parents=True)
        (d / "all_results.json").write_text(json.dumps(results))
        return d

    # An old sweep of two rounds, and a new one of one round.
    old = [write_round(tmp_path / "old" / f"round{i}",
                       [run("none", 100, 1.0, i), run("static1", 200, 1.0 + i, i), run("adaptive", 210, 1.0 + i, i)])
           for i in range(2)]
    new = write_round(tmp_path / "new" / "round0",
                      [run("none", 100, 2.0, 2), run("static1", 200, 4.0, 2), run("adaptive", 180, 2.0, 2)])
    root = Path(__file__).resolve().parents[2]
    kept = tmp_path / "kept"
    out = subprocess.run([sys.executable, "-m", "benchmarks.sweep_report", *map(str, old), "--out-dir", str(kept)],
                         capture_output=True, text=True, cwd=root)
    assert out.returncode == 0, out.stderr
    records = json.loads((kept / "rounds.json").read_text())
    assert len(records) == 6 and {"setting", "concurrency", "round", "seed", "commit", "output_tokens",
                                  "seconds"} <= set(records[0])
    # Pooled from the kept rounds alone: the same figures as from the rounds themselves.
    again = sweep_report.report(sweep_report.load([kept / "rounds.json"]))[0]
    assert again.splitlines()[:5] == sweep_report.report(sweep_report.load(old))[0].splitlines()[:5]
    # Kept + new: static1 600 tokens in 1 + 2 + 4 s, adaptive 600 in 1 + 2 + 2 s.
    for first in (kept, kept / "rounds.json"):
        cells = sweep_report.load([first, new])
        assert [r.get("compact", False) for r in cells[("adaptive", 2)]] == [True, True, False]
        text, rows = sweep_report.report(cells)
        by = {r["config"]["label"]: r for r in rows}
        assert by["static1"]["metrics"]["output_throughput"] == pytest.approx(600 / 7)
        assert by["adaptive"]["metrics"]["output_throughput"] == pytest.approx(600 / 5)
        assert by["adaptive"]["metrics"]["pooled_rounds"] == 3
        assert "ttft_s" in by["adaptive"]["metrics"]   # the latencies of the one full round
        assert "| 2 | static1 (86) | 1.400 | 1.05-1.80 |" in text   # per round 1.05, 1.05, 90 / 50
    # The report (and its plots) from the pooled rounds.
    out = subprocess.run([sys.executable, "-m", "benchmarks.sweep_report", str(kept), str(new),
                          "--out-dir", str(tmp_path / "pooled")], capture_output=True, text=True, cwd=root)
    assert out.returncode == 0, out.stderr
    assert (tmp_path / "pooled" / "latency_throughput.png").is_file()
    assert len(json.loads((tmp_path / "pooled" / "rounds.json").read_text())) == 9
    # A file that is not kept rounds is named, with the record that is wrong.
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps([records[0], {"setting": "none"}]))
    with pytest.raises(SystemExit, match=r"bad.json: record 1 is not a kept round"):
        sweep_report.load([bad])
    bad.write_text("{not json")
    with pytest.raises(SystemExit, match="cannot read kept rounds"):
        sweep_report.load([bad])


def test_sweep_report_picks_the_best_static_out_of_sample():
    """The best static depth picked on the other rounds and measured on the held-out one: the
    pick is not the luckiest setting's own rounds, so it can read below the in-sample best."""
    from benchmarks import sweep_report

    def run(label, tokens):
        return {"config": {"label": label, "max_concurrency": 4},
                "metrics": {"output_throughput": float(tokens), "total_output_tokens": tokens,
                            "duration_s": 1.0, "ttft_s": {"median": 0.1}}}

    cells = {("none", 4): [run("none", 100)] * 3,
             ("static1", 4): [run("static1", t) for t in (300, 100, 110)],
             ("static2", 4): [run("static2", t) for t in (200, 210, 200)],
             ("adaptive", 4): [run("adaptive", 180)] * 3}
    # Round 0 held out: static2 leads the others (205 vs 105) and ran 200 there; round 1:
    # static1 (205 vs 200) ran 100; round 2: static2 (205 vs 200) ran 200.
    throughput, picks = sweep_report.held_out_best(cells, ["static1", "static2"], 4)
    assert picks == ["static2", "static1", "static2"]
    assert throughput == pytest.approx(500 / 3)
    text, _ = sweep_report.report(cells)
    # In sample the best is static2 (610 / 3 s): 180 / 203.3 = 0.885; held out 180 / 166.7.
    assert "| 4 | static2 (203) | 0.885 |" in text
    assert "| 1.080 (static1, static2) |" in text
    assert "at every concurrency: **no**" in text and "picked on the other rounds: **yes**" in text
    # A sweep of some settings only (--settings adaptive static1 static2): no plain decoding.
    text, _ = sweep_report.report({k: v for k, v in cells.items() if k[0] != "none"})
    assert "| 1.080 (static1, static2) | n/a |" in text and "no speculation = **n/a**" in text
    # Static settings only (a sweep of two servers' variants of one depth): no checks, no crash.
    text, _ = sweep_report.report({k: v for k, v in cells.items() if k[0].startswith("static")})
    assert "every concurrency: **n/a (no adaptive)**" in text and "other rounds: **n/a (no adaptive)**" in text
    # One round: nothing to pick out of sample.
    one = {k: v[:1] for k, v in cells.items()}
    assert sweep_report.held_out_best(one, ["static1", "static2"], 4) is None
    assert "picked on the other rounds: **n/a (one round)**" in sweep_report.report(one)[0]


def test_sweep_report_reads_an_ab_sweep_against_the_named_baseline(tmp_path):
    """An A/B of two revisions (sweep --variant new REV --variant pre REV --settings new pre)
    has no adaptive: --baseline new reads pre against new, per concurrency pooled and as the
    geometric mean of the rounds' ratios with its standard error."""
    from benchmarks import sweep_report

    def run(label, tokens, r):
        return {"config": {"label": label, "max_concurrency": 1, "round": r},
                "metrics": {"output_throughput": float(tokens), "total_output_tokens": tokens,
                            "duration_s": 1.0, "ttft_s": {"median": 0.1}}}

    rounds = [[run("new", 100, 0), run("pre", 110, 0)], [run("new", 100, 1), run("pre", 90, 1)]]
    dirs = []
    for r, results in enumerate(rounds):
        d = tmp_path / f"round{r}"
        d.mkdir()
        (d / "all_results.json").write_text(json.dumps(results))
        dirs.append(d)
    text, _ = sweep_report.report(sweep_report.load(dirs), baseline="new")
    # Pooled 200 / 200; per round 1.1 and 0.9: geometric mean 0.995, log sd 0.142 over 2.
    assert "| variant / new | c=1 | all |" in text
    assert "| pre | 1.000 (0.995 +-0.100; 0.90-1.10) | 1.000 (0.995) |" in text
    assert "| concurrency | best static |" not in text   # no checks table without statics
    # Without a baseline among the settings: no variant table, no crash.
    assert "variant /" not in sweep_report.report(sweep_report.load(dirs))[0]
    import subprocess
    import sys
    from pathlib import Path
    out = subprocess.run([sys.executable, "-m", "benchmarks.sweep_report", *map(str, dirs),
                          "--out-dir", str(tmp_path / "rep"), "--baseline", "old"],
                         capture_output=True, text=True, cwd=Path(__file__).resolve().parents[2])
    assert out.returncode != 0
    assert "--baseline 'old' is not a setting of these rounds (they ran new, pre)" in out.stderr


def test_cpu_lists_and_pinning_the_server_and_the_client(tmp_path):
    """--server-cpus / --client-cpus (and loadgen --cpus): taskset's CPU lists, a clear error
    for a bad one, and a started server runs every thread on the CPUs it was given."""
    import subprocess
    import sys

    from benchmarks import sweep

    assert loadgen.parse_cpus("0") == {0}
    assert loadgen.parse_cpus("0-2,5") == {0, 1, 2, 5}
    for bad in ("", "a", "1-x"):
        with pytest.raises(ValueError, match="CPU list"):
            loadgen.parse_cpus(bad)
    cpu = max(os.sched_getaffinity(0))   # one CPU this test may use, not necessarily 0
    # The server: a stand-in that reports the CPUs of its main thread and of a thread it starts.
    script = tmp_path / "fake_server.py"
    script.write_text("import os, sys, threading\n"
                      "seen = [sorted(os.sched_getaffinity(0))]\n"
                      "t = threading.Thread(target=lambda: seen.append(sorted(os.sched_getaffinity(0))))\n"
                      "t.start(); t.join()\n"
                      "print(sys.argv[1], seen)\n")
    proc = sweep.start_server(f"{sys.executable} {script} {{port}} {{overrides}}", "", 1234, "", tmp_path / "log",
                              cpus=str(cpu))
    assert proc.wait(30) == 0
    assert (tmp_path / "log").read_text().strip() == f"1234 [[{cpu}], [{cpu}]]"
    # The client pins itself (pid 0); here a child stands in for it so this test's process
    # keeps every CPU.
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        loadgen.pin_to_cpus(str(cpu), pid=child.pid)
        assert os.sched_getaffinity(child.pid) == {cpu}
        loadgen.pin_to_cpus(None, pid=child.pid)   # no list: left alone
        assert os.sched_getaffinity(child.pid) == {cpu}
    finally:
        child.kill()
        child.wait()


def test_sweep_restarts_its_servers_every_round_when_asked(tmp_path):
    """--interleave --rounds N --restart-per-round: every round gets fresh server processes
    (a process keeps its own pace for life, so a setting's rounds must not share one);
    without it, one process per setting serves every round."""
    import sys
    from pathlib import Path

    from benchmarks import sweep

    root = Path(__file__).resolve().parents[2]
    pids = tmp_path / "pids"
    script = tmp_path / "fake_server.py"
    script.write_text(
        "import os, sys\n"
        f"sys.path.insert(0, {str(root)!r})\n"
        "from aiohttp import web\n"
        "from tests.server.test_loadgen import metrics_route, scripted_completions\n"
        "async def health(request):\n"
        "    return web.Response(text='ok')\n"
        f"with open({str(pids)!r}, 'a') as f:\n"
        "    f.write(f\"{os.getpid()} {' '.join(sys.argv[2:])}\\n\")\n"
        "app = web.Application()\n"
        "app.router.add_post('/v1/completions', scripted_completions)\n"
        "app.router.add_get('/metrics', metrics_route)\n"
        "app.router.add_get('/health', health)\n"
        "web.run_app(app, host='127.0.0.1', port=int(sys.argv[1]), print=None)\n")

    def run(out: str, *flags: str) -> list[str]:
        pids.write_text("")
        sweep.main(["--model", "m", "--server-cmd", f"{sys.executable} {script} {{port}} {{overrides}}",
                    "--settings", "none", "static1", "--port", str(_free_ports(2)), "--concurrency", "1",
                    "--interleave", "--rounds", "2", "--warmup-requests", "0", *flags,
                    "--out-dir", str(tmp_path / out), "--", "--num-prompts", "2", "--no-progress"])
        return pids.read_text().splitlines()

    fresh = run("fresh", "--restart-per-round", "--step-logs")
    assert len(fresh) == 4 and len({line.split()[0] for line in fresh}) == 4
    assert sum("--draft-kind none" in line for line in fresh) == 2
    assert (tmp_path / "fresh" / "server_none_round1.log").exists()
    # --step-logs: each server gets a log of its own (benchmarks.step_report finds it by name).
    for setting in ("none", "static1"):
        for r in (0, 1):
            log = tmp_path / "fresh" / f"steps_{setting}_round{r}.jsonl"
            assert sum(f"--step-log {log}" in line for line in fresh) == 1
    for r in (0, 1):
        cell = json.loads((tmp_path / "fresh" / f"round{r}" / "static1_c1.json").read_text())
        assert cell["metrics"]["num_completed"] == 2
        assert 0 < cell["finished_at"] - cell["started_at"] == pytest.approx(cell["metrics"]["duration_s"])
    kept = run("kept")
    assert len(kept) == 2 and len({line.split()[0] for line in kept}) == 2
    assert not any("--step-log" in line for line in kept)


def _fake_sweep_server(tmp_path):
    """A server script for sweep.main's --server-cmd that notes '<pid> start <args>', '<pid>
    serve <setting>' per completion and '<pid> reset' per prefix-cache reset in a log file;
    the admin routes only with --admin-api. Returns (script, log, a port free with the three
    after it)."""
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    log = tmp_path / "log"
    script = tmp_path / "fake_server.py"
    script.write_text(
        "import json, os, sys\n"
        f"sys.path.insert(0, {str(root)!r})\n"
        "from aiohttp import web\n"
        "from tests.server.test_loadgen import metrics_route, scripted_completions\n"
        "state = {'setting': 'start'}\n"
        f"def note(line):\n    open({str(log)!r}, 'a').write(f'{{os.getpid()}} {{line}}\\n')\n"
        "note('start ' + ' '.join(sys.argv[2:]))\n"
        "async def health(request):\n"
        "    return web.Response(text='ok')\n"
        "async def switch(request):\n"
        "    body = await request.json()\n"
        "    state['setting'] = body['mode'] + str(body.get('depth', ''))\n"
        "    return web.json_response(body)\n"
        "async def complete(request):\n"
        "    note('serve ' + state['setting'])\n"
        "    return await scripted_completions(request)\n"
        "app = web.Application()\n"
        "app.router.add_post('/v1/completions', complete)\n"
        "app.router.add_get('/metrics', metrics_route)\n"
        "app.router.add_get('/health', health)\n"
        "async def reset(request):\n"
        "    note('reset')\n"
        "    return web.json_response({'dropped_blocks': 0})\n"
        "if '--admin-api' in sys.argv:\n"
        "    app.router.add_post('/admin/speculation', switch)\n"
        "    app.router.add_post('/admin/reset_prefix_cache', reset)\n"
        "web.run_app(app, host='127.0.0.1', port=int(sys.argv[1]), print=None)\n")
    # sweep --interleave starts its servers at once on --port, --port + 1, ...: each of them
    # must be free, not only the first.
    return script, log, _free_ports(4)


def _free_ports(n: int) -> int:
    """A port free with the n - 1 after it (one taken by another process failed a sweep test
    now and then: a server that could not bind)."""
    import socket

    for _ in range(100):
        with socket.socket() as a:
            a.bind(("127.0.0.1", 0))
            port = a.getsockname()[1]
        socks = []
        try:
            for p in range(port, port + n):
                sock = socket.socket()
                socks.append(sock)
                sock.bind(("127.0.0.1", p))
            return port
        except OSError:
            continue
        finally:
            for sock in socks:
                sock.close()
    raise RuntimeError(f"no {n} free consecutive ports")


def test_sweep_one_process_switches_one_server_between_settings(tmp_path):
    """--one-process: adaptive and the static depths are one server per round, switched by
    POST /admin/speculation before each of their cells; none keeps a server of its own."""
    import sys

    from benchmarks import sweep

    script, log, port = _fake_sweep_server(tmp_path)
    sweep.main(["--model", "m", "--server-cmd", f"{sys.executable} {script} {{port}} {{overrides}}",
                "--settings", "none", "static1", "adaptive", "static3", "--port", str(port), "--concurrency", "1", "2",
                "--interleave", "--rounds", "2", "--restart-per-round", "--one-process", "--warmup-requests", "1",
                "--out-dir", str(tmp_path / "out"), "--", "--num-prompts", "2", "--no-progress"])
    lines = [line.split(maxsplit=1) for line in log.read_text().splitlines()]
    starts = [(pid, rest) for pid, rest in lines if rest.startswith("start")]
    assert len(starts) == 4   # two servers a round: none, and the shared one
    shared = {pid for pid, rest in starts if "--admin-api" in rest}
    assert len(shared) == 2 and all("--spec-mode adaptive" in rest for pid, rest in starts if pid in shared)
    assert all("--draft-kind none" in rest for pid, rest in starts if pid not in shared)
    served = [(pid, rest.split()[1]) for pid, rest in lines if rest.startswith("serve")]
    # Each server's warm-up (2 requests at the largest concurrency, 2) and cells of 2 requests,
    # the shared server switched to each setting for its cells: warmed up in adaptive mode.
    on_shared = [what for pid, what in served if pid in shared]
    assert on_shared.count("adaptive") == 2 * 2 + 2 * 2 * 2
    assert on_shared.count("static1") == on_shared.count("static3") == 2 * 2 * 2
    assert all(what == "start" for pid, what in served if pid not in shared)
    for r in (0, 1):
        for setting in ("none", "static1", "adaptive", "static3"):
            cell = json.loads((tmp_path / "out" / f"round{r}" / f"{setting}_c2.json").read_text())
            assert cell["metrics"]["num_completed"] == 2 and cell["config"]["label"] == setting
    with pytest.raises(SystemExit):
        sweep.main(["--model", "m", "--one-process", "--settings", "adaptive", "--out-dir", str(tmp_path / "x")])


def test_sweep_cold_prompts_empties_the_prefix_cache_before_every_cell(tmp_path):
    """--cold-prompts: each server (started with --admin-api, the one of none too) gets POST
    /admin/reset_prefix_cache before every cell it serves, so no cell finds an earlier one's
    prompts cached."""
    import sys

    from benchmarks import sweep

    script, log, port = _fake_sweep_server(tmp_path)
    sweep.main(["--model", "m", "--server-cmd", f"{sys.executable} {script} {{port}} {{overrides}}",
                "--settings", "none", "adaptive", "static2", "--port", str(port), "--concurrency", "1", "2",
                "--interleave", "--rounds", "1", "--one-process", "--warmup-requests", "1", "--cold-prompts",
                "--out-dir", str(tmp_path / "out"), "--", "--num-prompts", "2", "--no-progress"])
    lines = [line.split(maxsplit=1) for line in log.read_text().splitlines()]
    starts = {pid: rest for pid, rest in lines if rest.startswith("start")}
    assert len(starts) == 2 and all("--admin-api" in rest for rest in starts.values())
    for pid in starts:
        events = [rest.split()[0] for p, rest in lines if p == pid and rest.split()[0] in ("reset", "serve")]
        # The warm-up's requests, then per cell a reset followed by its requests (2 each).
        cells = 2 if "--draft-kind none" in starts[pid] else 4
        assert events.count("reset") == cells
        first_reset = events.index("reset")
        assert events[first_reset:] == ["reset", "serve", "serve"] * cells


def test_sweep_warms_servers_up_at_its_largest_concurrency():
    """A fresh process's first pass at a size touches that memory first: the warm-up runs at the
    largest concurrency of the sweep, with at least one request per unit of it."""
    from benchmarks import sweep

    args = loadgen.make_parser().parse_args(
        sweep.warmup_args("http://h:1", "m", 8, [1, 2, 64, 4], ["--max-tokens", "16"]))
    assert args.max_concurrency == 64 and args.num_prompts == 64 and args.max_tokens == 16
    args = loadgen.make_parser().parse_args(sweep.warmup_args("http://h:1", "m", 8, [1, 2], []))
    assert args.max_concurrency == 2 and args.num_prompts == 8


def test_sweep_warm_up_sends_every_prompt_of_a_prompts_file(tmp_path):
    """Cells draw their prompts from the file, the same for every setting of a round: sent once
    before, each is a prefix-cache hit for every setting, not for all but the first."""
    from benchmarks import sweep

    small, large = tmp_path / "small.jsonl", tmp_path / "large.jsonl"
    small.write_text("".join(json.dumps(f"prompt {i}") + "\n" for i in range(100)))
    large.write_text("".join(json.dumps(f"prompt {i}") + "\n" for i in range(2000)))
    argv = sweep.warmup_args("http://h:1", "m", 8, [16, 32], ["--prompts-file", str(small), "--max-tokens", "4"])
    args = loadgen.make_parser().parse_args(argv)
    assert args.num_prompts == 100 and args.max_concurrency == 32 and args.prompts_file == str(small)
    assert len(loadgen.select_prompts(args)) == 100 == len(set(loadgen.select_prompts(args)))
    argv = sweep.warmup_args("http://h:1", "m", 8, [16, 32], ["--prompts-file", str(large)])
    assert loadgen.make_parser().parse_args(argv).num_prompts == sweep.WARMUP_MAX_PROMPTS

def test_sweep_report_names_a_round_that_has_not_finished(tmp_path):
    from benchmarks import sweep_report

    (tmp_path / "round0").mkdir()   # the sweep writes all_results.json when the round is done
    with pytest.raises(SystemExit, match="round0.*finished sweep round"):
        sweep_report.load([tmp_path / "round0"])


def test_sweep_report_cell_noise_is_what_setting_and_round_levels_leave():
    """Two settings x two rounds: levels per setting and per round (any size) cancel, and a
    +-d residual pattern reads as sd 2d on one degree of freedom."""
    import math

    from benchmarks import sweep_report

    d = 0.05
    level = {"static1": math.log(300), "adaptive": math.log(200)}
    pace = [0.0, math.log(1.7)]                     # the second round ran on a faster stretch
    sign = {"static1": [1, -1], "adaptive": [-1, 1]}

    def run(label, r):
        tput = math.exp(level[label] + pace[r] + sign[label][r] * d)
        return {"config": {"label": label, "max_concurrency": 1},
                "metrics": {"output_throughput": tput, "total_output_tokens": tput, "duration_s": 1.0}}

    cells = {(s, 1): [run(s, 0), run(s, 1)] for s in level}
    sd, dof = sweep_report.cell_noise(cells)
    assert dof == 1 and sd == pytest.approx(2 * d)
    assert sweep_report.cell_noise({k: v[:1] for k, v in cells.items()}) is None


def test_step_report_takes_each_cell_apart_from_the_step_logs(tmp_path):
    """benchmarks.step_report: a cell's steps are the log lines inside its started/finished
    window, pooled over rounds; its figures are what those lines add up to."""
    from benchmarks import step_report

    def step(t, depth, decode, emitted, step_s, prefill=0, draft_s=0.0, verify_s=0.0):
        return {"t": t, "depth": depth, "nodes": depth, "decode": decode, "prefill_seqs": 1 if prefill else 0,
                "prefill_tokens": prefill, "emitted": emitted, "draft_s": draft_s, "verify_s": verify_s,
                "step_s": step_s}

    for r, tput in ((0, 100.0), (1, 300.0)):
        rd = tmp_path / f"round{r}"
        rd.mkdir()
        t0 = 1000.0 * (r + 1)
        (rd / "static2_c4.json").write_text(json.dumps(
            {"started_at": t0, "finished_at": t0 + 10, "metrics": {"output_throughput": tput}}))
        lines = [
            step(t0 - 1, 2, 4, 12, 9.0),                                     # before the cell: not counted
            step(t0 + 1, 2, 2, 6, 0.3, prefill=50, draft_s=0.05, verify_s=0.2),  # mixed
            step(t0 + 2, 2, 4, 12, 0.1, draft_s=0.02, verify_s=0.06),        # decode-only, 3 tok/seq
            step(t0 + 3, 0, 4, 4, 0.1, verify_s=0.08),                       # a plain step, 1 tok/seq
        ]
        text = "\n".join(json.dumps(s) for s in lines) + "\n"
        if r == 1:
            text += '{"t": 2004, "dep'   # a line cut short by a killed server
        (tmp_path / f"steps_static2_round{r}.jsonl").write_text(text)
    # A result file without a step log (or from before the logs) is left out, not an error.
    (tmp_path / "round0" / "static3_c4.json").write_text(json.dumps({"metrics": {"output_throughput": 1.0}}))

    rows = step_report.summarise(step_report.cells_of(tmp_path))
    assert set(rows) == {("static2", 4)}
    r = rows[("static2", 4)]
    assert r["cells"] == 2 and r["tput"] == pytest.approx(200.0)
    assert r["steps"] == 3 and r["mixed_steps"] == 1
    assert r["mixed_share"] == pytest.approx(0.3 / 0.5)
    assert r["dec_ms"] == pytest.approx(100.0) and r["mix_ms"] == pytest.approx(300.0)
    assert r["tok_per_seq"] == pytest.approx(16 / 8) and r["batch"] == pytest.approx(4.0)
    # Beyond draft + verify: 0.05, 0.02 and 0.02 s of the three steps.
    assert r["rest_ms"] == pytest.approx(1e3 * 0.09 / 3)
    assert r["depth_share"] == pytest.approx({2: 0.8, 0: 0.2})
    table = step_report.markdown(rows)
    assert "| 4 | static2 | 2 | 200 | 3 | 1 | 60 |" in table
    assert step_report.main([str(tmp_path / "round0" / "nothing")]) == 1


def test_step_report_counts_the_empty_slot_steps_a_request(tmp_path, capsys):
    """step_report.churn: concurrency x steps less the sequences decoded, over the requests
    served, pooled over a setting's cells, and those after a cell's last prompt step (the drain);
    a cell whose result has no num_completed is left out."""
    from benchmarks import step_report

    def step(t, decode, prefill=0):
        return {"t": t, "depth": 3, "nodes": 3, "decode": decode, "prefill_seqs": 1 if prefill else 0,
                "prefill_tokens": prefill, "emitted": 3 * decode, "draft_s": 0.01, "verify_s": 0.02,
                "step_s": 0.04}

    rd = tmp_path / "round0"
    rd.mkdir()
    # Two cells of static3 at 4 requests: 4 steps decoding 4, 3, 2 and 4 sequences (3 slot-steps
    # empty) for 2 requests, then 2 steps decoding 4 and 1 (3 empty) for 1 request: 2 a request.
    # The drain: none after the first cell's prompt step; the second cell ran no prompt, so all of
    # it (3 empty): 1 a request.
    (rd / "static3_c4.json").write_text(json.dumps(
        {"started_at": 10.0, "finished_at": 20.0, "metrics": {"output_throughput": 1.0, "num_completed": 2}}))
    (rd / "static3_c8.json").write_text(json.dumps(
        {"started_at": 30.0, "finished_at": 40.0, "metrics": {"output_throughput": 1.0}}))   # no count
    steps = [step(11, 4), step(12, 3), step(13, 2, prefill=40), step(14, 4), step(31, 8), step(32, 8)]
    (tmp_path / "steps_shared_round0.jsonl").write_text("\n".join(json.dumps(s) for s in steps) + "\n")
    rd1 = tmp_path / "round1"
    rd1.mkdir()
    (rd1 / "static3_c4.json").write_text(json.dumps(
        {"started_at": 50.0, "finished_at": 60.0, "metrics": {"output_throughput": 1.0, "num_completed": 1}}))
    (tmp_path / "steps_shared_round1.jsonl").write_text(
        "\n".join(json.dumps(s) for s in (step(51, 4), step(52, 1))) + "\n")

    ch = step_report.churn(step_report.cells_of(tmp_path))
    assert set(ch) == {("static3", 4)}
    c = ch[("static3", 4)]
    assert c["steps"] == 6 and c["requests"] == 3
    assert c["batch"] == pytest.approx(18 / 6)
    assert c["empty_per_request"] == pytest.approx((4 * 6 - 18) / 3)
    assert c["drain_per_request"] == pytest.approx(3 / 3)
    assert step_report.main([str(tmp_path), "--churn"]) == 0
    assert "| 4 | static3 | 6 | 3 | 3.00 | 2.00 | 1.00 |" in capsys.readouterr().out


def test_step_report_prices_a_controllers_depths_at_the_fixed_depths_rates():
    """step_report.mix: the controller's time share at each depth times the fixed setting's
    throughput there, over the best static depth; depths no fixed setting ran are left out
    and their share reported."""
    from benchmarks import step_report

    def row(tput, share):
        return {"tput": tput, "depth_share": share}

    rows = {
        ("none", 8): row(50.0, {0: 1.0}),
        ("static2", 8): row(80.0, {2: 1.0}),
        ("static3", 8): row(100.0, {3: 1.0}),
        ("adaptive", 8): row(85.0, {0: 0.1, 2: 0.3, 3: 0.4, 8: 0.2}),
        ("static3", 16): row(10.0, {3: 1.0}),   # another concurrency: not in the mix at 8
        ("adaptive", 16): row(12.0, {5: 1.0}),  # no fixed setting at its depth
    }
    mx = step_report.mix(rows)
    m = mx[("adaptive", 8)]
    assert m["own"] == pytest.approx(0.85)
    assert m["mix"] == pytest.approx((0.1 * 50 + 0.3 * 80 + 0.4 * 100) / 0.8 / 100)
    assert m["unpriced_share"] == pytest.approx(0.2)
    assert mx[("adaptive", 16)]["mix"] is None and mx[("adaptive", 16)]["own"] == pytest.approx(1.2)
    assert set(mx) == {("adaptive", 8), ("adaptive", 16)}
    assert "| 8 | adaptive | 0.850 | 0.863 | 20% |" in step_report.mix_markdown(mx)


def test_step_report_reads_the_shared_servers_log_of_a_one_process_sweep(tmp_path):
    """sweep --one-process: adaptive and the static settings share one server and one step
    log, steps_shared_roundI.jsonl; each cell's steps are those inside its own window."""
    from benchmarks import step_report

    rd = tmp_path / "round0"
    rd.mkdir()
    lines = []
    for i, (setting, depth) in enumerate((("static3", 3), ("adaptive", 5))):
        t0 = 100.0 * (i + 1)
        (rd / f"{setting}_c2.json").write_text(json.dumps(
            {"started_at": t0, "finished_at": t0 + 10, "metrics": {"output_throughput": 50.0}}))
        lines += [{"t": t0 + k, "depth": depth, "nodes": depth, "decode": 2, "prefill_seqs": 0, "prefill_tokens": 0,
                   "emitted": 2 * (depth + 1), "draft_s": 0.01, "verify_s": 0.02, "step_s": 0.04} for k in (1, 2)]
    (tmp_path / "steps_shared_round0.jsonl").write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    rows = step_report.summarise(step_report.cells_of(tmp_path))
    assert set(rows) == {("static3", 2), ("adaptive", 2)}
    assert rows[("static3", 2)]["depth_share"] == {3: 1.0} and rows[("adaptive", 2)]["depth_share"] == {5: 1.0}
    assert rows[("static3", 2)]["steps"] == rows[("adaptive", 2)]["steps"] == 2


def test_step_report_depth_costs_compare_one_depth_across_settings(tmp_path):
    """--depth-costs: per concurrency, setting and depth, the decode-only steps near the full
    batch that follow a step at the same depth (a switch's first step and prefills left out)."""
    from benchmarks import step_report

    rd = tmp_path / "round0"
    rd.mkdir()
    lines = []
    for i, (setting, depths, step_s) in enumerate((("static3", [3, 3, 3], 0.020), ("adaptive", [5, 3, 3, 3], 0.030))):
        t0 = 100.0 * (i + 1)
        (rd / f"{setting}_c4.json").write_text(json.dumps(
            {"started_at": t0, "finished_at": t0 + 10, "metrics": {"output_throughput": 50.0}}))
        lines += [{"t": t0 + k, "depth": d, "nodes": d, "decode": 4, "prefill_seqs": 0, "prefill_tokens": 0,
                   "emitted": 4 * (d + 1), "draft_s": 0.005, "verify_s": 0.012, "step_s": step_s}
                  for k, d in enumerate(depths, start=1)]
        # a step that also prefills, and a small batch: neither counts
        lines += [{"t": t0 + 8, "depth": 3, "nodes": 3, "decode": 4, "prefill_seqs": 1, "prefill_tokens": 30,
                   "emitted": 16, "draft_s": 0.1, "verify_s": 0.1, "step_s": 0.5},
                  {"t": t0 + 9, "depth": 3, "nodes": 3, "decode": 1, "prefill_seqs": 0, "prefill_tokens": 0,
                   "emitted": 4, "draft_s": 0.1, "verify_s": 0.1, "step_s": 0.5}]
    (tmp_path / "steps_shared_round0.jsonl").write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    dc = step_report.depth_costs(step_report.cells_of(tmp_path))
    assert set(dc[4]) == {("static3", 3), ("adaptive", 3)}   # depth 5 ran once, after nothing alike
    assert dc[4][("static3", 3)]["steps"] == 2 and dc[4][("adaptive", 3)]["steps"] == 2
    assert dc[4][("adaptive", 3)]["step_ms"] == pytest.approx(30.0) and dc[4][("static3", 3)]["step_ms"] == pytest.approx(20.0)
    assert dc[4][("adaptive", 3)]["rest_ms"] == pytest.approx(13.0) and dc[4][("static3", 3)]["tok_per_seq"] == 4.0
    table = step_report.depth_costs_markdown(dc)
    assert "| 3 | adaptive | 2 | 4.0 | 30.0 | 5.0 | 12.0 | 13.0 | 4.00 |" in table
    assert "| 3 | static3 | 2 | 4.0 | 20.0 |" in table


def test_step_report_paired_costs_pair_a_controllers_depth_with_the_fixed_depth_round_by_round(tmp_path):
    """--paired-costs: per concurrency, a controller's draft + verify at a depth over the fixed
    depth's in the same round, geometric mean over rounds with its standard error; decode-only
    and mixed steps apart, small batches and thin cells left out."""
    from benchmarks import step_report

    lines = []
    for r, (slow, host) in enumerate(((1.10, 1.0), (1.05, 2.0))):   # round 1's host twice as slow
        rd = tmp_path / f"round{r}"
        rd.mkdir()
        for i, (setting, factor) in enumerate((("static3", 1.0), ("adaptive", slow))):
            t0 = 1000.0 * r + 100.0 * (i + 1)
            (rd / f"{setting}_c4.json").write_text(json.dumps(
                {"started_at": t0, "finished_at": t0 + 50, "metrics": {"output_throughput": 50.0},
                 "config": {"out": f"out/round{r}/{setting}_c4.json"}}))
            v = 0.010 * factor * host
            lines += [{"t": t0 + k, "depth": 3, "nodes": 3, "decode": 4, "prefill_seqs": 0, "prefill_tokens": 0,
                       "emitted": 12, "draft_s": v / 2, "verify_s": v, "step_s": 2 * v} for k in range(1, 7)]
            # mixed steps, dearer by the prompt chunk: paired among themselves
            lines += [{"t": t0 + 10 + k, "depth": 3, "nodes": 3, "decode": 4, "prefill_seqs": 1,
                       "prefill_tokens": 30, "emitted": 12, "draft_s": v, "verify_s": 2 * v, "step_s": 4 * v}
                      for k in range(5)]
            # a small batch, and a depth with too few steps: neither counts
            lines += [{"t": t0 + 20, "depth": 3, "nodes": 3, "decode": 1, "prefill_seqs": 0, "prefill_tokens": 0,
                       "emitted": 4, "draft_s": 1.0, "verify_s": 1.0, "step_s": 3.0}]
            lines += [{"t": t0 + 21 + k, "depth": 4, "nodes": 4, "decode": 4, "prefill_seqs": 0,
                       "prefill_tokens": 0, "emitted": 12, "draft_s": v, "verify_s": v, "step_s": 3 * v}
                      for k in range(4)]
    (tmp_path / "steps_shared.jsonl").write_text("\n".join(json.dumps(x) for x in sorted(lines, key=lambda x: x["t"])) + "\n")
    pc = step_report.paired_costs(step_report.cells_of(tmp_path))
    assert set(pc[4]) == {("adaptive", 3, "decode"), ("adaptive", 3, "mixed")}
    for kind in ("decode", "mixed"):
        r = pc[4][("adaptive", 3, kind)]
        assert r["rounds"] == 2
        assert r["ratio"] == pytest.approx(math.sqrt(1.10 * 1.05))   # the host's pace cancels in each round
        assert r["se"] == pytest.approx(r["ratio"] * abs(math.log(1.10 / 1.05)) / 2)
    table = step_report.paired_costs_markdown(pc)
    assert f"| 3 | adaptive | decode | 2 | {math.sqrt(1.10 * 1.05):.3f} |" in table


def test_step_report_pricing_sets_a_controllers_price_beside_the_fixed_depths_steps(tmp_path):
    """--pricing: per concurrency and controller, each depth's priced draft + verify over what
    that static depth measured, in bins of context per sequence, the bins weighted by the
    controller's steps; steps that prefill or miss part of the batch are left out."""
    from benchmarks import step_report

    rd = tmp_path / "round0"
    rd.mkdir()
    lines = []

    def step(t, depth, ctx, draft_s, verify_s, decode=4, prefill=0, **kw):
        return {"t": t, "depth": depth, "nodes": depth, "decode": decode, "prefill_seqs": 1 if prefill else 0,
                "prefill_tokens": prefill, "context": ctx * decode, "emitted": decode * (depth + 1),
                "draft_s": draft_s, "verify_s": verify_s, "step_s": draft_s + verify_s + 0.001, **kw}
    # static3 measured 10 + 20 ms at 100 tokens a sequence and 12 + 24 ms at 150.
    (rd / "static3_c4.json").write_text(json.dumps(
        {"started_at": 100, "finished_at": 200, "metrics": {"output_throughput": 50.0}}))
    for k in range(3):
        lines += [step(101 + k, 3, 100, 0.010, 0.020), step(111 + k, 3, 150, 0.012, 0.024)]
    lines += [step(120, 3, 100, 1.0, 1.0, prefill=30), step(121, 3, 100, 1.0, 1.0, decode=3)]   # left out
    # The controller priced depth 3 at 1.1x at 100 tokens (3 steps) and exactly at 150 (1 step:
    # too few), and ran depth 4.
    (rd / "adaptive_c4.json").write_text(json.dumps(
        {"started_at": 300, "finished_at": 400, "metrics": {"output_throughput": 50.0}}))
    pred = lambda d, v: {"draft_pred": [None, None, None, d, 14.0], "verify_pred": [None, None, None, v, 30.0]}  # noqa: E731
    lines += [step(301 + k, 4, 100, 0.014, 0.030, **pred(11.0, 22.0)) for k in range(3)]
    lines += [step(310, 4, 150, 0.014, 0.030, **pred(12.0, 24.0))]
    (tmp_path / "steps_shared_round0.jsonl").write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    pr = step_report.pricing(step_report.cells_of(tmp_path))
    r = pr[4]["adaptive"]
    assert r["draft_verify"] == {3: pytest.approx(1.1)} and r["verify"] == {3: pytest.approx(1.1)}
    assert r["steps"] == {3: 3} and r["held"] == {4: 4}
    assert step_report.pricing(step_report.cells_of(tmp_path), min_steps=1)[4]["adaptive"]["draft_verify"] == {
        3: pytest.approx((3 * 1.1 + 1.0) / 4)}
    assert "| adaptive | 1.100; 1.100 | 4: 4 |" in step_report.pricing_markdown(pr)


def test_step_report_change_costs_split_a_depth_by_the_step_before(tmp_path):
    """--change-costs: per concurrency, setting and depth, the decode-only steps near the full
    batch by the depth of the decode-only step before (medians), and "*" pooling the settings
    that ran more than one depth."""
    from benchmarks import step_report

    rd = tmp_path / "round0"
    rd.mkdir()
    lines = []
    runs = (("static3", [3, 3, 3, 3], {}), ("adaptive", [5, 3, 3, 3, 2, 3, 3], {1: 0.020, 5: 0.030}))
    for i, (setting, depths, verify_at) in enumerate(runs):
        t0 = 100.0 * (i + 1)
        (rd / f"{setting}_c4.json").write_text(json.dumps(
            {"started_at": t0, "finished_at": t0 + 20, "metrics": {"output_throughput": 50.0}}))
        lines += [{"t": t0 + k, "depth": d, "nodes": d, "decode": 4, "prefill_seqs": 0, "prefill_tokens": 0,
                   "emitted": 4 * (d + 1), "draft_s": 0.004, "verify_s": verify_at.get(k - 1, 0.012),
                   "step_s": 0.004 + verify_at.get(k - 1, 0.012) + 0.009} for k, d in enumerate(depths, start=1)]
        # a step that also prefills (not counted, and the step after it has no step before)
        lines += [{"t": t0 + 10, "depth": 3, "nodes": 3, "decode": 4, "prefill_seqs": 1, "prefill_tokens": 30,
                   "emitted": 16, "draft_s": 0.1, "verify_s": 0.1, "step_s": 0.5},
                  {"t": t0 + 11, "depth": 3, "nodes": 3, "decode": 4, "prefill_seqs": 0, "prefill_tokens": 0,
                   "emitted": 16, "draft_s": 0.1, "verify_s": 0.1, "step_s": 0.5}]
    (tmp_path / "steps_shared_round0.jsonl").write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    cc = step_report.change_costs(step_report.cells_of(tmp_path))[4]
    # adaptive's depth 3: after 5 (verify 20 ms), in a run (12, 12, 12 ms), after 2 (30 ms)
    assert cc[("adaptive", 3, "deeper")]["steps"] == 1
    assert cc[("adaptive", 3, "deeper")]["verify_ms_seq"] == pytest.approx(5.0)
    assert cc[("adaptive", 3, "shallower")]["verify_ms_seq"] == pytest.approx(7.5)
    assert cc[("adaptive", 3, "same")]["steps"] == 3 and cc[("adaptive", 3, "same")]["verify_ms_seq"] == pytest.approx(3.0)
    assert cc[("adaptive", 2, "deeper")]["draft_ms_seq"] == pytest.approx(1.0)
    assert cc[("adaptive", 3, "same")]["rest_ms"] == pytest.approx(9.0)
    assert cc[("static3", 3, "same")]["steps"] == 3
    assert ("*", 3, "same") in cc and cc[("*", 3, "same")]["steps"] == 3   # static3 ran one depth: not pooled
    table = step_report.change_costs_markdown({4: cc})
    assert "| 3 | adaptive | shallower | 1 | 7.500 | 1.000 | 9.00 |" in table
    assert step_report.main([str(tmp_path), "--change-costs"]) == 0

def test_step_report_regimes_price_every_depth_by_the_depth_chosen(tmp_path):
    """--regimes: per concurrency and controller, the verify ms it priced each depth at, by the
    depth it chose, beside each depth's measured mean; prefill steps and small batches left out."""
    from benchmarks import step_report

    rd = tmp_path / "round0"
    rd.mkdir()
    (rd / "adaptive_c4.json").write_text(json.dumps(
        {"started_at": 100.0, "finished_at": 120.0, "metrics": {"output_throughput": 50.0}}))

    def step(t, depth, pred, verify, decode=4, prefill=0):
        return {"t": t, "depth": depth, "nodes": depth, "decode": decode, "prefill_seqs": prefill,
                "prefill_tokens": 8 * prefill, "emitted": decode * 2, "draft_s": 0.004, "verify_s": verify,
                "step_s": 0.004 + verify + 0.002, "verify_pred": pred}

    lines = [step(101, 3, [10.0, 20.0, 22.0, 25.0, 30.0], 0.024),
             step(102, 3, [10.0, 20.0, 22.0, 26.0, 30.0], 0.026),
             step(103, 4, [10.0, 20.0, 23.0, 28.0, 31.0], 0.029),
             step(104, 4, [10.0, 20.0, 23.0, 30.0, 31.0], 0.031, prefill=1),   # prefill: left out
             step(105, 4, [10.0, 20.0, 23.0, 40.0, 31.0], 0.031, decode=1)]    # 1 of 4: left out
    (tmp_path / "steps_shared_round0.jsonl").write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    r = step_report.regimes(step_report.cells_of(tmp_path))[4]["adaptive"]
    assert r["by_choice"][3]["steps"] == 2 and r["by_choice"][4]["steps"] == 1
    assert r["by_choice"][3]["pred"][4] == pytest.approx(30.0)
    assert r["by_choice"][3]["pred"][3] == pytest.approx(25.5)
    assert r["by_choice"][4]["pred"][3] == pytest.approx(28.0)
    assert r["measured"] == {3: pytest.approx(25.0), 4: pytest.approx(29.0)}
    table = step_report.regimes_markdown({4: {"adaptive": r}}, min_steps=1)
    assert "| 3 | 2 | **25.50** | 30.00 |" in table and "| measured | | 25.00 | 29.00 |" in table
    assert step_report.main([str(tmp_path), "--regimes"]) == 0


def test_replay_costs_reads_the_rows_against_their_run_medians(tmp_path):
    """benchmarks.replay_costs: a setting's decode-only steps fed in order to a cost model,
    the rows read after each cell over the run medians of the sweep's steps."""
    from benchmarks import replay_costs, step_report
    from specserve.controller import CostModel

    rd = tmp_path / "round0"
    rd.mkdir()
    cost = lambda b, rows: 0.002 + 0.001 * b * rows  # noqa: E731
    lines = []
    for i, (setting, depths) in enumerate((("static3", [3] * 12), ("adaptive", [5] * 6 + [3] * 40))):
        t0 = 100.0 * (i + 1)
        (rd / f"{setting}_c4.json").write_text(json.dumps(
            {"started_at": t0, "finished_at": t0 + 60, "metrics": {"output_throughput": 50.0}}))
        lines += [{"t": t0 + k, "depth": d, "nodes": d, "decode": 4, "prefill_seqs": 0, "prefill_tokens": 0,
                   "emitted": 8, "draft_s": 0.001, "verify_s": cost(4, d + 1), "step_s": 0.02}
                  for k, d in enumerate(depths, start=1)]
        # a step that also prefills: neither fed nor a run step; one whose trees were cut near
        # the requests' ends (8 of 12 nodes): fed at the 3 rows it verified, not a run step
        lines.append({"t": t0 + 55, "depth": 3, "nodes": 3, "decode": 4, "prefill_seqs": 1, "prefill_tokens": 30,
                      "emitted": 4, "draft_s": 0.1, "verify_s": 0.5, "step_s": 0.6})
        lines.append({"t": t0 + 0.5, "depth": 3, "nodes": 3, "decode": 4, "prefill_seqs": 0, "prefill_tokens": 0,
                      "emitted": 8, "drafted": 8, "draft_s": 0.001, "verify_s": cost(4, 3), "step_s": 0.02})
    lines.sort(key=lambda x: x["t"])   # a log is in time order
    (tmp_path / "steps_shared_round0.jsonl").write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    cells = step_report.cells_of(tmp_path)
    truth = replay_costs.run_medians(cells, 4)
    assert truth == {4: pytest.approx(cost(4, 4) / 4)}   # 6 rows ran 5 times in a run: too few
    cm = CostModel()
    for rows in (1, 2, 4, 6, 9):   # a calibration that reads every row 1.5x dear
        cm.observe_verify(4, 4 * rows, 1.5 * cost(4, rows), track_level=False)
    fed = []
    observe = cm.observe_verify
    cm.observe_verify = lambda b, tokens, *a, **k: (fed.append(tokens), observe(b, tokens, *a, **k))
    rows = replay_costs.replay(cells, "adaptive", cm, 4, truth)
    assert [r["steps"] for r in rows] == [47] and rows[0]["concurrency"] == 4
    assert fed == [12] + [24] * 6 + [16] * 40   # the cut step at the rows it verified
    assert rows[0]["read"][4] == pytest.approx(1.0, abs=0.03)   # the level has followed the steps
    table = replay_costs.markdown(rows, None)
    assert "| 0 | 4 | 47 | 1.0" in table and "4 rows" in table
    assert replay_costs.main([str(tmp_path), "--setting", "nosuch"]) == 1

def test_step_report_step_kinds_set_a_runs_steps_apart_from_isolated_ones(tmp_path):
    """--step-kinds: the controller's decode-only steps by depth and by where they stood (in a
    run, starting one, isolated between other depths), measured over predicted."""
    from benchmarks import step_report

    rd = tmp_path / "round0"
    rd.mkdir()
    (rd / "adaptive_c4.json").write_text(json.dumps(
        {"started_at": 100.0, "finished_at": 200.0, "metrics": {"output_throughput": 50.0}}))
    tokens = [1.0, 1.8, 2.5, 3.0, 3.5]   # the fresh evaluation's tokens a sequence per depth
    lines = []
    # Depths 3 3 3 1 3 3 2 2 3: 3 runs, 1 isolated, 2 switched into; the first and last steps
    # have no neighbour on one side and are left out. Depth 3 steps emit as predicted (4 x 3
    # tokens) in the predicted time; depth 1 takes twice its predicted time.
    for k, d in enumerate([3, 3, 3, 1, 3, 3, 2, 2, 3]):
        predicted = 4 * tokens[d] / 0.1   # tokens/s: a step predicted at 0.1 s
        step_s = 0.2 if d == 1 else 0.1
        lines.append({"t": 101.0 + k, "depth": d, "nodes": d, "decode": 4, "prefill_seqs": 0, "prefill_tokens": 0,
                      "emitted": round(4 * tokens[d]) if d != 1 else 7, "draft_s": 0.01, "verify_s": 0.02,
                      "step_s": step_s, "predicted": predicted, **({"tokens": tokens} if k == 0 else {})})
    (tmp_path / "steps_shared_round0.jsonl").write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    sk = step_report.step_kinds(step_report.cells_of(tmp_path))[4]
    assert {k: v["steps"] for k, v in sk.items()} == {
        ("adaptive", 3, "run"): 3, ("adaptive", 3, "switch-in"): 1, ("adaptive", 1, "isolated"): 1,
        ("adaptive", 2, "switch-in"): 1, ("adaptive", 2, "run"): 1}
    assert sk[("adaptive", 3, "run")]["time"] == pytest.approx(1.0)
    assert sk[("adaptive", 3, "run")]["tokens"] == pytest.approx(1.0)
    iso = sk[("adaptive", 1, "isolated")]
    assert iso["time"] == pytest.approx(2.0) and iso["tokens"] == pytest.approx(7 / 7.2)
    assert iso["goodput"] == pytest.approx(7 / 0.2 / (4 * 1.8 / 0.1))
    table = step_report.step_kinds_markdown({4: sk})
    assert "| 1 | adaptive | isolated | 1 | 0.972 | 2.000 | 0.486 |" in table
    assert step_report.main([str(tmp_path), "--step-kinds"]) == 0


def test_step_report_curves_put_measured_depths_beside_the_prediction(tmp_path):
    """step_report --curves: per concurrency, the fixed settings' tokens/s over full-batch
    decode-only steps by depth, the adaptive controller's predicted curve relative to its
    best (mean over its steps, each read by the evaluation its plan came from), and where it
    ran."""
    from benchmarks import step_report

    def step(t, depth, decode, emitted, step_s, prefill=0, curve=None, bias=None, predicted=None, tokens=None):
        s = {"t": t, "depth": depth, "nodes": depth, "decode": decode, "prefill_seqs": 1 if prefill else 0,
             "prefill_tokens": prefill, "emitted": emitted, "draft_s": 0.0, "verify_s": 0.5 * step_s,
             "step_s": step_s}
        if curve is not None:
            s.update(predicted=curve[depth], curve=curve)
        if tokens is not None:
            s["tokens"] = tokens
        if bias is not None:
            s["bias"] = bias
        if predicted is not None:
            s["predicted"] = predicted
        return s

    logs = {
        "none": [step(1, 0, 4, 4, 0.01), step(2, 0, 4, 4, 0.01)],                      # 400 tok/s
        "static2": [step(1, 2, 4, 12, 0.02), step(2, 2, 2, 6, 0.001),                  # 600; B=2 < 3: left out
                    step(3, 2, 4, 12, 0.5, prefill=100)],                              # a mixed step: left out
        "adaptive": [dict(step(1, 2, 4, 12, 0.03, curve=[100.0, 200.0, 400.0], tokens=[1.0, 2.0, 3.0]),  # 400 tok/s as predicted
                          draft_pred=[0.0, 4.0, 6.0], verify_pred=[38.0, 34.0, 22.0], rest_pred=2.0),
                     step(2, 1, 4, 8, 0.01, curve=[100.0, 400.0, 200.0], bias=[1.0, 0.5, 1.0]),
                     step(3, 1, 4, 8, 0.01, predicted=1000.0)],                        # 800 of 1000 promised
    }
    (tmp_path / "round0").mkdir()
    for setting, steps in logs.items():
        (tmp_path / "round0" / f"{setting}_c4.json").write_text(json.dumps(
            {"started_at": 0.5, "finished_at": 10, "metrics": {"output_throughput": 1.0}}))
        (tmp_path / f"steps_{setting}_round0.jsonl").write_text("\n".join(json.dumps(s) for s in steps))
    c = step_report.curves(step_report.cells_of(tmp_path))[4]
    assert c["measured"] == pytest.approx({0: 400.0, 2: 600.0})
    # Every adaptive step weighs once, read by the evaluation its plan came from: the third
    # step (no curve of its own) reads the second's.
    assert c["predicted"] == pytest.approx({0: 0.25, 1: 2.5 / 3, 2: 2 / 3})
    assert c["share"] == pytest.approx({1: 0.4, 2: 0.6})
    assert c["evaluations"] == 3
    # The decision's curve where it logged its factors: 100, 200, 200 -> / 200.
    assert c["corrected"] == pytest.approx({0: 0.5, 1: 1.0, 2: 1.0})
    # Depth 1: 16 tokens emitted where 400 x 0.01 + 1000 x 0.01 = 14 were promised.
    assert c["own"] == pytest.approx({1: 16 / 14, 2: 1.0})
    # The fixed settings' step time and tokens a sequence, beside the prediction (from the one
    # evaluation that logged its tokens: 4 sequences x 2 tokens / 200 tok/s = 40 ms at depth 1).
    assert c["step_ms"] == pytest.approx({0: 10.0, 2: 20.0}) and c["tokens"] == pytest.approx({0: 1.0, 2: 3.0})
    assert c["pred_ms"] == pytest.approx({0: 40.0, 1: 40.0, 2: 30.0})
    assert c["pred_tokens"] == pytest.approx({0: 1.0, 1: 2.0, 2: 3.0})
    # The parts of a step, measured by the fixed settings and as the evaluation priced them.
    assert c["verify_ms"] == pytest.approx({0: 5.0, 2: 10.0}) and c["draft_ms"] == pytest.approx({0: 0.0, 2: 0.0})
    assert c["rest_ms"] == pytest.approx({0: 5.0, 2: 10.0})
    assert c["pred_draft_ms"] == pytest.approx({0: 0.0, 1: 4.0, 2: 6.0})
    assert c["pred_verify_ms"] == pytest.approx({0: 38.0, 1: 34.0, 2: 22.0}) and c["pred_rest_ms"][1] == 2.0
    table = step_report.curves_markdown({4: c})
    assert "| adaptive priced, verify ms | 38.0 | 34.0 | 22.0 |" in table
    assert "| fixed setting, verify ms | 5.0 |  | 10.0 |" in table
    assert "| fixed setting, tok/s | 400 |  | 600 |" in table
    assert "| adaptive time share |  | 40% | 60% |" in table
    assert "| adaptive corrected, / its best | 0.50 | 1.00 | 1.00 |" in table
    assert "| adaptive steps, measured / predicted |  | 1.14 | 1.00 |" in table
    assert "| fixed setting, ms a step | 10.0 |  | 20.0 |" in table
    assert "| adaptive predicted, ms a step | 40.0 | 40.0 | 30.0 |" in table
    png = step_report.plot_curves({4: c}, tmp_path / "curves.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 5000


def test_serve_tree_imports_specserve_from_the_tree_it_is_given(tmp_path):
    """benchmarks.serve_tree TREE ARGS: every specserve.* import resolves inside TREE (its own
    pyproject.toml maps the packages), and ARGS go to that tree's command line."""
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    tree = tmp_path / "tree"
    (tree / "specserve").mkdir(parents=True)
    (tree / "kernels").mkdir()
    (tree / "pyproject.toml").write_text('[tool.setuptools.package-dir]\n"specserve.kernels" = "kernels"\n')
    (tree / "specserve" / "__init__.py").write_text("")
    (tree / "kernels" / "__init__.py").write_text("WHERE = 'tree kernels'\n")
    (tree / "specserve" / "cli.py").write_text(
        "import specserve, specserve.kernels\n"
        "def main(argv):\n"
        "    print(specserve.__file__, specserve.kernels.WHERE, argv)\n"
        "    return 3\n")
    proc = subprocess.run([sys.executable, "-m", "benchmarks.serve_tree", str(tree), "serve", "--port", "1"],
                          cwd=root, capture_output=True, text=True)
    assert proc.returncode == 3, proc.stderr
    assert proc.stdout.split()[:3] == [str(tree.resolve() / "specserve" / "__init__.py"), "tree", "kernels"]
    assert "['serve', '--port', '1']" in proc.stdout
    (tree / "kernels" / "__init__.py").unlink()
    proc = subprocess.run([sys.executable, "-m", "benchmarks.serve_tree", str(tree), "serve"],
                          cwd=root, capture_output=True, text=True)
    assert proc.returncode != 0 and "lacks the package(s) specserve.kernels" in proc.stderr


def test_sweep_variant_runs_another_revision_beside_adaptive(tmp_path, monkeypatch):
    """--variant NAME REV: REV's files exported to OUT/trees/NAME, a setting NAME started from
    that tree with adaptive's flags, and sweep_report sets it beside adaptive."""
    import sys
    from pathlib import Path

    from benchmarks import sweep, sweep_report

    root = Path(__file__).resolve().parents[2]
    with pytest.raises(SystemExit, match="not-a-rev.*is not a commit"):
        sweep.export_revision("not-a-rev", tmp_path / "x")
    assert sweep.variant_command("specserve serve --port 1", tmp_path).endswith(
        f"-m benchmarks.serve_tree {tmp_path} serve --port 1")
    with pytest.raises(SystemExit, match="starts with 'specserve'"):
        sweep.variant_command("python fake.py 1", tmp_path)

    script = tmp_path / "fake_server.py"
    script.write_text(
        "import sys\n"
        f"sys.path.insert(0, {str(root)!r})\n"
        "from aiohttp import web\n"
        "from tests.server.test_loadgen import metrics_route, scripted_completions\n"
        "async def health(request):\n"
        "    return web.Response(text='ok')\n"
        "app = web.Application()\n"
        "app.router.add_post('/v1/completions', scripted_completions)\n"
        "app.router.add_get('/metrics', metrics_route)\n"
        "app.router.add_get('/health', health)\n"
        "web.run_app(app, host='127.0.0.1', port=int(sys.argv[1]), print=None)\n")
    started = []
    real_start = sweep.start_server

    def start(template, config, port, overrides, log_path, cpus=None, tree=None, knobs=None):
        assert not knobs   # no --knobs given
        started.append((overrides, tree))
        return real_start(f"{sys.executable} {script} {{port}} {{overrides}}", config, port, overrides, log_path)
    monkeypatch.setattr(sweep, "start_server", start)
    out = tmp_path / "out"
    sweep.main(["--model", "m", "--settings", "adaptive", "old", "--variant", "old", "HEAD",
                "--port", "18931", "--concurrency", "1", "--interleave", "--rounds", "2", "--warmup-requests", "0",
                "--out-dir", str(out), "--", "--num-prompts", "2", "--no-progress"])
    tree = out / "trees" / "old"
    assert (tree / "specserve" / "controller.py").is_file() and (tree / "REVISION").read_text().strip()
    assert started[:2] == [("--spec-mode adaptive", None), ("--spec-mode adaptive", tree)]
    text, _ = sweep_report.report(sweep_report.load([out / "round0", out / "round1"]))
    assert "| variant / adaptive | c=1 | all |" in text
    assert any(line.startswith("| old | ") for line in text.splitlines())
    with pytest.raises(SystemExit):
        sweep.main(["--model", "m", "--variant", "static7", "HEAD", "--out-dir", str(out)])


def test_sweep_knobs_are_settings_of_the_shared_process(tmp_path, monkeypatch):
    """--knobs NAME:k=v (with --one-process): the shared server runs through
    benchmarks.serve_knobs with every knob setting, each switched to by its name."""
    import sys

    from benchmarks import sweep

    assert sweep.knobs_command("specserve serve --port 1", ["calm:explore_interval=16", "b:bias_limits=(0.5, 2.0)"]) \
        == (f"{sys.executable} -m benchmarks.serve_knobs --knobs calm:explore_interval=16 "
            "--knobs 'b:bias_limits=(0.5, 2.0)' serve --port 1")
    with pytest.raises(SystemExit, match="starts with 'specserve'"):
        sweep.knobs_command("python fake.py 1", ["calm:explore_interval=16"])
    for flags, words in ((["--knobs", "calm:explore_interval=16"], "needs --one-process"),
                         (["--one-process", "--interleave", "--knobs", "static9:explore_interval=16"], "word of its own"),
                         (["--one-process", "--interleave", "--knobs", "a:explore_interval=16",
                           "--knobs", "a:explore_margin=0"], "must be different")):
        with pytest.raises(SystemExit):
            sweep.main(["--model", "m", *flags, "--out-dir", str(tmp_path / "x")])

    started, switched = [], []
    monkeypatch.setattr(sweep, "start_server", lambda *a, **k: started.append((a, k)) or _FakeProc())
    monkeypatch.setattr(sweep, "wait_healthy", lambda *a, **k: None)
    monkeypatch.setattr(sweep, "stop_server", lambda proc: None)
    monkeypatch.setattr(sweep, "switch_setting", lambda base, setting: switched.append(setting))
    monkeypatch.setattr(sweep, "markdown_table", lambda results: "")
    monkeypatch.setattr(sweep.loadgen, "main", lambda argv: {"label": argv[argv.index("--label") + 1]})
    monkeypatch.setattr(sweep.plots, "make_all", lambda results, dest: [])
    sweep.main(["--model", "m", "--one-process", "--interleave", "--knobs", "calm:explore_interval=16",
                "--settings", "adaptive", "calm", "static2", "--concurrency", "1", "--warmup-requests", "0",
                "--out-dir", str(tmp_path / "out")])
    assert len(started) == 1   # one process serves all three
    args, kwargs = started[0]
    assert "--admin-api" in args[3] and kwargs["knobs"] == ["calm:explore_interval=16"]
    assert sorted(switched[1:]) == ["adaptive", "calm", "static2"]


class _FakeProc:
    def poll(self):
        return None
