"""The engine-core process under supervision, at awkward moments (specserve/core.py, server/app.py).

One engine core (EngineCoreClient) is frozen (SIGSTOP) with a stream of n = 2 running, a
request of n = 3 waiting for admission and an /admin/speculation call waiting for its reply,
then killed, and its replacement killed again while it loads: every caller gets its error
(an error event and [DONE], or a 503), none hangs; /health answers 503 until a core serves
again; greedy output after the restarts is what it was; no descriptor, thread or process is
left behind; and what an operator set or counted before the restart is still so after it.

Two cores (EngineGroup): one killed while streams run on both; the other's streams finish,
new requests go to it and /health stays 200 meanwhile; an /admin/speculation call during the
restart is applied everywhere or nowhere; after shutdown no core process is left."""

from __future__ import annotations

import os
import re
import signal
import threading
import urllib.error
import urllib.request

import pytest

from specserve.core import EngineCoreClient, EngineGroup
from tests.server.conftest import ServerThread, SseStream, engine_config, http, wait_until

LONG = 480   # tokens a long stream asks for (the checkpoint's context is 512)


@pytest.fixture(scope="module")
def cfg(server_target):
    # The prompt-lookup drafter speculates without a second model to load: a core starts in a
    # few seconds, and each restart here costs one start.
    return engine_config(server_target, "ngram", spec_mode="static", spec_depth=2, max_model_len=512, threads=1,
                         admin_api=True, cpu__linear="torch", cpu__compile="off")


# -- helpers ----------------------------------------------------------------------------------


def health(base: str) -> int:
    return http(base, "/health", timeout=10)[0]


class Call(threading.Thread):
    """http() on a thread of its own; `result` once it ended."""

    def __init__(self, base: str, path: str, body: dict):
        super().__init__(daemon=True)
        self.args, self.result = (base, path, body), None
        self.start()

    def run(self):
        try:
            self.result = http(*self.args)
        except BaseException as e:
            self.result = e


def counters(base: str) -> dict[str, float]:
    """The engine counters on /metrics (name -> value), unlabelled ones."""
    with urllib.request.urlopen(base + "/metrics", timeout=10) as r:
        text = r.read().decode()
    return {m.group(1): float(m.group(2)) for m in re.finditer(r"^(specserve_\w+_total) (\S+)$", text, re.M)}


def children(pid: int | None = None) -> dict[int, str]:
    """Child processes of `pid` (this process): pid -> state letter; multiprocessing's resource
    tracker (one per process, for its whole life) left out."""
    pid = pid or os.getpid()
    found = {}
    for p in os.listdir("/proc"):
        if not p.isdigit():
            continue
        try:
            with open(f"/proc/{p}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            with open(f"/proc/{p}/cmdline", "rb") as f:
                cmdline = f.read()
        except OSError:
            continue
        if int(fields[1]) == pid and b"resource_tracker" not in cmdline:
            found[int(p)] = fields[0]
    return found


def gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


def num_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def backend(srv):
    from specserve.server.app import STATE

    return srv.app[STATE].async_engine


def stop(srv) -> None:
    """Stop a ServerThread and close its event loop (its own descriptors), so that what is left
    open afterwards is the backend's."""
    srv.stop()
    srv.loop.close()


# -- one core, killed at awkward moments ------------------------------------------------------


@pytest.fixture(scope="module")
def core_server(cfg):
    srv = ServerThread(EngineCoreClient(cfg), cfg)
    yield srv
    srv.stop()


def test_get_speculation_right_after_a_post_shows_the_new_setting(core_server):
    """An idle core applies /admin/speculation at once and says so in its reply; GET (and
    /stats, /metrics) read the core's snapshot, which an idle core does not send again."""
    status, body = http(core_server.base, "/admin/speculation", {"mode": "static", "depth": 1})
    assert (status, body) == (200, {"mode": "static", "depth": 1})
    assert wait_until(lambda: http(core_server.base, "/admin/speculation")[1] == body, timeout=1), \
        http(core_server.base, "/admin/speculation")


@pytest.fixture(scope="module")
def killed(core_server):
    """The scenario of the module docstring's first paragraph, once; what it observed."""
    base, core = core_server.base, backend(core_server)
    seen: dict = {}
    assert http(base, "/admin/speculation", {"mode": "static", "depth": 1})[0] == 200
    greedy = {"prompt": "Once upon a time", "max_tokens": 24, "temperature": 0, "ignore_eos": True}
    status, body = http(base, "/v1/completions", greedy)
    assert status == 200, body
    seen["text_before"] = body["choices"][0]["text"]
    seen["fds_before"], seen["threads_before"] = num_fds(), threading.active_count()   # no request open
    long = {"prompt": "The cat sat", "n": 2, "max_tokens": LONG, "ignore_eos": True, "temperature": 0.8}
    s = SseStream(base, long)
    assert s.first.wait(30) and s.error is None, s.error
    # the counters as of a step of that stream: more than one greedy request's
    assert wait_until(lambda: core.snapshot()["running"] == 2, timeout=10), core.snapshot()
    seen["counters_before"] = counters(base)
    seen["restarts_before"] = seen["counters_before"]["specserve_engine_restarts_total"]
    old = core.pid
    seen["children_before"] = set(children()) - {old}
    os.kill(old, signal.SIGSTOP)   # frozen: what is sent now waits in the socket
    try:
        admit = Call(base, "/v1/completions", {"prompt": "A dog", "n": 3, "max_tokens": 8})
        admin = Call(base, "/admin/speculation", {"mode": "static", "depth": 3})
        assert wait_until(lambda: len(core._streams) == 5 and len(core._calls) == 1, timeout=20), \
            (len(core._streams), len(core._calls))
    finally:
        os.kill(old, signal.SIGKILL)
    for t in (s, admit, admin):
        t.join(30)
    seen["stream"], seen["admit"], seen["admin"] = s, admit.result, admin.result
    seen["hung"] = [name for name, t in (("stream", s), ("admission", admit), ("admin", admin)) if t.is_alive()]
    # Twice in a row: the replacement dies while it loads.
    assert wait_until(lambda: core.pid not in (None, old), timeout=20)
    second = core.pid
    seen["restarting_at_second_kill"] = core.restarting
    seen["health_during"] = health(base)
    os.kill(second, signal.SIGKILL)
    seen["recovered"] = wait_until(lambda: health(base) == 200, timeout=90, interval=0.1)
    seen["restarted_pid"] = core.pid
    status, body = http(base, "/v1/completions", greedy)
    assert status == 200, body
    seen["text_after"] = body["choices"][0]["text"]
    assert wait_until(lambda: core.snapshot()["running"] == 0 and core.snapshot()["prefix_cache_queries"] > 0,
                      timeout=10), core.snapshot()
    seen["snapshot_after"] = core.snapshot()
    seen["counters_after"] = counters(base)
    seen["speculation_after"] = http(base, "/admin/speculation")[1]
    seen["fds_ok"] = wait_until(lambda: num_fds() <= seen["fds_before"], timeout=5)
    seen["fds_after"] = num_fds()
    seen["threads_ok"] = wait_until(lambda: threading.active_count() <= seen["threads_before"], timeout=10)
    seen["children_after"] = children()
    return seen


def test_every_caller_of_a_killed_core_gets_its_error_and_none_hangs(killed):
    assert not killed["hung"], f"still waiting after the kill: {killed['hung']}"
    # the stream in flight (n = 2): one error event, then [DONE]
    outcome = killed["stream"].outcome()
    assert outcome.startswith("error: ") and "restarting" in outcome, outcome
    # the request of n = 3 being admitted, and the speculation call: a 503 each
    status, body = killed["admit"]
    assert status == 503 and body["error"]["code"] == "engine_unavailable", (status, body)
    status, body = killed["admin"]
    assert status == 503 and body["error"]["type"] == "service_unavailable", (status, body)


def test_health_is_503_while_restarting_twice_then_200(killed):
    assert killed["restarting_at_second_kill"]
    assert killed["health_during"] == 503
    assert killed["recovered"], "the core did not come back after being killed twice"
    assert killed["counters_after"]["specserve_engine_restarts_total"] >= killed["restarts_before"] + 1


def test_after_the_restarts_output_is_unchanged_and_nothing_leaks(killed):
    assert killed["text_after"] == killed["text_before"]
    snap = killed["snapshot_after"]
    assert snap["running"] == snap["waiting"] == snap["blocks_held"] == 0, snap
    assert killed["fds_ok"], (killed["fds_before"], killed["fds_after"])
    assert killed["threads_ok"], [t.name for t in threading.enumerate()]
    # the cores killed are reaped (no zombie): the new one is the only child added
    after = killed["children_after"]
    assert set(after) == killed["children_before"] | {killed["restarted_pid"]}, after
    assert all(state != "Z" for state in after.values()), after


def test_the_speculation_setting_survives_a_restart(killed):
    """An operator set static depth 1 (the config says 2); the core died and was replaced. The
    server still says, and runs, what the operator set."""
    assert killed["speculation_after"] == {"mode": "static", "depth": 1}


def test_engine_counters_never_go_backwards_across_a_restart(killed):
    """Prometheus counters of one server process: a core's restart must not reset them (with
    --engines N a drop of one core's share reads as a reset of the total, and rate() spikes)."""
    before, after = killed["counters_before"], killed["counters_after"]
    dropped = {k: (before[k], after.get(k)) for k in before if after.get(k, 0.0) < before[k]}
    assert not dropped, dropped


# -- two cores, one killed --------------------------------------------------------------------


@pytest.fixture(scope="module")
def group_killed(cfg):
    seen: dict = {}
    before_children, before_fds = children(), num_fds()
    srv = ServerThread(EngineGroup(cfg, 2), cfg)
    g = backend(srv)
    pids = [c.pid for c in g.cores]
    try:
        streams = []
        # Prompts under a block (no prefix to follow): least load decides, 0, 1, 0, 1.
        for prompt in ("Hi", "Yo", "Go", "So"):
            streams.append(SseStream(srv.base, {"prompt": prompt, "max_tokens": LONG, "ignore_eos": True,
                                             "temperature": 0.8}))
            assert streams[-1].first.wait(30) and streams[-1].error is None, streams[-1].error
        on = [g._core_of.get(f"{s.id}-0") for s in streams]
        assert on == [0, 1, 0, 1], on
        os.kill(pids[0], signal.SIGKILL)
        assert wait_until(lambda: g.cores[0].restarting, timeout=10)
        seen["health_during"] = health(srv.base)
        seen["admin_during"] = http(srv.base, "/admin/speculation", {"mode": "static", "depth": 1})
        seen["served_during"] = []   # (status, routed to the dead core?) of requests sent while it restarts
        for i in range(3):
            if not g.cores[0].restarting:
                break
            routed_0 = g.routed[0]
            status = http(srv.base, "/v1/completions", {"prompt": f"Req {i}", "max_tokens": 4})[0]
            seen["served_during"].append((status, g.routed[0] - routed_0))
        for s in streams:
            s.join(60)
        seen["outcomes"] = [(i, s.outcome()) for i, s in zip(on, streams)]
        seen["recovered"] = wait_until(lambda: g.cores[0].is_alive, timeout=90, interval=0.1)
        pids.append(g.cores[0].pid)
        # one request on each core: both snapshots come from a step after everything above
        assert wait_until(lambda: g.inflight == [0, 0], timeout=10)
        both = [SseStream(srv.base, {"prompt": p, "max_tokens": 40, "ignore_eos": True}) for p in ("Hm", "Ok")]
        for s in both:
            s.join(60)
        assert wait_until(lambda: all(c.snapshot()["running"] == 0 for c in g.cores), timeout=10)
        seen["speculation_per_core"] = [c.snapshot()["speculation"] for c in g.cores]
    finally:
        stop(srv)
    seen["cores_gone"] = wait_until(lambda: all(gone(p) for p in pids), timeout=20)
    seen["pids"] = pids
    seen["children_after"] = children()
    seen["children_before"] = before_children
    seen["fds_ok"] = wait_until(lambda: num_fds() <= before_fds, timeout=3)
    seen["fds"] = (before_fds, num_fds())
    return seen


def test_a_dead_core_in_a_group_of_two_the_other_keeps_serving(group_killed):
    seen = group_killed
    assert seen["health_during"] == 200
    assert seen["served_during"] and all(s == (200, 0) for s in seen["served_during"]), seen["served_during"]
    for core, outcome in seen["outcomes"]:
        if core == 0:
            assert outcome.startswith("error: ") and "restarting" in outcome, outcome
        else:
            assert outcome == "length", outcome
    assert seen["recovered"]


def test_a_group_shuts_down_without_leaving_a_process_or_descriptor(group_killed):
    seen = group_killed
    assert seen["cores_gone"], [(p, gone(p)) for p in seen["pids"]]
    assert set(seen["children_after"]) <= set(seen["children_before"]), seen["children_after"]
    assert seen["fds_ok"], seen["fds"]


def test_speculation_set_while_a_core_restarts_is_applied_everywhere_or_nowhere(group_killed):
    """POST /admin/speculation while one of two cores restarts: either it applies to both (the
    restarted one too) or it is refused and changes nothing; never half of the group."""
    status, body = group_killed["admin_during"]
    per_core = group_killed["speculation_per_core"]
    if status == 200:
        assert per_core == [body, body], per_core
    else:
        assert per_core == [{"mode": "static", "depth": 2}] * 2, (status, body, per_core)
