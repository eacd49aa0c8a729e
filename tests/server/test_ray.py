"""specserve on Ray Serve (server/ray_serve.py), on a local Ray cluster on this CPU: two replicas
of one pair answer 32 concurrent streams correctly and both serve; the SSE bytes are those of
a plain specserve server; a replica killed mid-run ends its streams with an error event and
[DONE] while the service keeps answering; replicas scale up on requests in flight; SIGTERM
drains the streams in flight before exiting. Skipped only when Ray is not installed
(`pip install -e ".[ray]"`; CI installs it)."""

from __future__ import annotations

import json
import re
import socket
import threading
import time
import urllib.error
import urllib.request

import msgspec
import pytest

pytest.importorskip("ray", reason="Ray is not installed (pip install -e '.[ray]'); CI installs it")

from specserve.engine import LLMEngine  # noqa: E402
from specserve.llm import LLM  # noqa: E402
from specserve.sampling import SamplingParams  # noqa: E402
from tests.server.conftest import ServerThread, concurrently, engine_config, ray_deployment, wait_until  # noqa: E402

PROMPTS = [f"Story {i}: once upon a time" for i in range(32)]


@pytest.fixture(scope="module")
def cfg(server_target, server_draft):
    return engine_config(server_target, server_draft, spec_mode="static", spec_depth=3, dtype="float64")


@pytest.fixture(scope="module")
def ray_base(cfg):
    with ray_deployment(cfg, num_cpus=4, replicas=2) as (base, _):
        yield base


def stream(base: str, prompt: str, max_tokens: int = 16, **extra) -> tuple[str, list[str]]:
    """(the replica that served, the data lines of the SSE stream)."""
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True, **extra}
    req = urllib.request.Request(base + "/v1/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        return r.headers.get("x-specserve-replica"), [
            line[6:] for line in r.read().decode().splitlines() if line.startswith("data: ")]


def stream_announcing(base: str, prompt: str, started: threading.Semaphore, **extra) -> list[str]:
    """`stream`'s data lines, read as they come; `started` is released at the first one."""
    body = {"prompt": prompt, "max_tokens": 200, "temperature": 0, "stream": True, "ignore_eos": True, **extra}
    req = urllib.request.Request(base + "/v1/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    events = []
    with urllib.request.urlopen(req, timeout=120) as r:
        for line in r:
            if line.startswith(b"data: "):
                events.append(line[6:].decode().strip())
                if len(events) == 1:
                    started.release()
    return events


def text_of(events: list[str]) -> str:
    return "".join(json.loads(e)["choices"][0]["text"] for e in events if e != "[DONE]" and "choices" in e)


def test_two_replicas_serve_32_concurrent_streams_correctly(ray_base, cfg):
    offline = LLM(cfg, progress=False).generate(PROMPTS, SamplingParams(max_tokens=16, temperature=0.0))
    results = concurrently(lambda i: stream(ray_base, PROMPTS[i]), len(PROMPTS))
    assert [text_of(events) for _, events in results] == [o.text for o in offline]
    assert all(events[-1] == "[DONE]" for _, events in results)
    assert len({replica for replica, _ in results}) == 2, "both replicas should have served"


def test_the_sse_bytes_are_specservers_own(ray_base, cfg):
    """The stream's bytes and the headers a client reads (content type, no caching)."""
    srv = ServerThread(LLMEngine(cfg, progress=False), cfg)
    try:
        body = json.dumps({"prompt": PROMPTS[3], "max_tokens": 12, "temperature": 0, "stream": True,
                           "stream_options": {"include_usage": True}}).encode()

        def raw(base: str) -> bytes:
            req = urllib.request.Request(base + "/v1/completions", data=body,
                                         headers={"Content-Type": "application/json"})
            with urllib.request.urlopen(req, timeout=120) as r:
                headers = {k: r.headers[k] for k in ("Content-Type", "Cache-Control")}
                return headers, re.sub(rb'"id":"[^"]*","created":\d+,"model":"[^"]*"', b"ID", r.read())

        assert raw(ray_base) == raw(srv.base)
    finally:
        srv.stop()


def test_the_router_prefers_the_prefix_owner_unless_it_is_much_busier():
    """PrefixAffinityRouter's own rule, on stand-in replicas: no owner -> the least loaded,
    ties in turn, then every replica; a choice counts as load until Ray routes it or it
    completes, so a burst chosen before any is routed alternates; the replica that served a
    prompt's prefix first, unless it has more than `slack` requests beyond the least loaded."""
    import asyncio
    import itertools
    from types import SimpleNamespace

    from specserve.server.ray_serve import _make_router_class

    cls = _make_router_class()
    router = cls.__new__(cls)
    router.initialize_state(slack=2)
    a, b = SimpleNamespace(replica_id="a"), SimpleNamespace(replica_id="b")
    ids = itertools.count()

    def request(prompt: str):
        return SimpleNamespace(args=("/v1/completions", json.dumps({"prompt": prompt}).encode()),
                               metadata=SimpleNamespace(internal_request_id=f"r{next(ids)}"))

    def choose(req):
        return asyncio.run(router.choose_replicas([a, b], req))

    burst = [request(f"short {i}") for i in range(6)]
    chosen = [choose(r)[0] for r in burst]
    assert chosen == [[a], [b]] * 3, "a burst chosen before routing alternates"
    assert choose(burst[0])[0] == [a], "a retry drops its own earlier choice: a and b tie at 2 again"
    for r, (replica,) in zip(burst, chosen):
        router.on_request_routed(r, replica.replica_id, None)
        router.on_request_completed(replica.replica_id, r.metadata.internal_request_id)
    assert router.inflight == {"a": 0, "b": 0} and not router.choosing

    shared = "The archive of the river city kept its letters in stone boxes. " * 4
    one = request(shared + "one")
    assert choose(one) == [[b], [a, b]], "the burst's retry took a last: b's turn"
    router.on_request_routed(one, "b", None)
    assert choose(request(shared + "two")) == [[b], [a, b]], "b served the prefix"
    unrelated = request("an unrelated prompt " * 10)
    assert choose(unrelated) == [[a], [a, b]]   # b has one in flight and one chosen
    router.on_request_completed("a", unrelated.metadata.internal_request_id)
    router.choosing.clear()
    for _ in range(2):
        other = request("other " * 20)
        router.on_request_routed(other, "b", None)
    assert choose(request(shared + "three")) == [[a], [a, b]], "b has 3 in flight, a none: more than slack 2"
    router.choosing.clear()
    router.on_request_completed("b", other.metadata.internal_request_id)
    assert choose(request(shared + "four")) == [[b], [a, b]]


def test_the_ingress_asks_for_the_api_key_before_a_replica_sees_the_request():
    """Ingress on a stand-in replica: with [server] api_key set, /v1/ needs the key (a 401 that
    never reaches a replica), /health does not; the replicas' own servers check no key."""
    import asyncio

    from starlette.requests import Request

    from specserve.server.ray_serve import Ingress

    reached = []

    class Replica:
        def options(self, stream):
            return self

        def remote(self, path, body, method, headers=None):
            reached.append(path)

            async def answer():
                yield 200, {"Content-Type": "application/json"}, "r0"
                yield b"{}"
            return answer()

    def call(path: str, key: str | None) -> int:
        headers = [(b"authorization", f"Bearer {key}".encode())] if key else []

        async def receive():
            return {"type": "http.request", "body": b"{}", "more_body": False}

        scope = {"type": "http", "method": "POST", "path": path, "headers": headers, "query_string": b"",
                 "root_path": ""}
        return asyncio.run(Ingress(Replica(), api_key="s3cret")(Request(scope, receive))).status_code

    assert [call("/v1/completions", None), call("/v1/completions", "wrong"), call("/v1/completions", "s3cret"),
            call("/health", None)] == [401, 401, 200, 200]
    assert reached == ["/v1/completions", "/health"]


def test_a_killed_replica_ends_its_streams_and_the_service_answers(ray_base):
    import ray

    results: dict[int, list[str]] = {}
    started = threading.Semaphore(0)
    threads = [threading.Thread(target=lambda i=i: results.__setitem__(
        i, stream_announcing(ray_base, PROMPTS[i], started, temperature=0.7))) for i in range(6)]
    for t in threads:
        t.start()
    for _ in threads:
        assert started.acquire(timeout=60)
    replicas = [a for a in ray.util.list_named_actors(all_namespaces=True) if "specserve-engine" in a["name"]]
    assert len(replicas) == 2
    ray.kill(ray.get_actor(replicas[0]["name"], namespace=replicas[0]["namespace"]), no_restart=False)
    for t in threads:
        t.join(120)
    ended = list(results.values())
    assert len(ended) == 6 and all(events[-1] == "[DONE]" for events in ended)
    cut = [events for events in ended if "error" in events[-2]]
    assert cut, "the killed replica's streams should end with an error event"
    for events in cut:
        assert json.loads(events[-2])["error"]["code"] == "replica_unavailable"

    def answers() -> bool:
        try:
            return stream(ray_base, PROMPTS[0], max_tokens=4)[1][-1] == "[DONE]"
        except (urllib.error.URLError, OSError):
            return False

    assert wait_until(answers, timeout=60, interval=0.5)


def replica_count(app: str) -> int:
    from ray import serve

    status = serve.status().applications[app].deployments["specserve-engine"]
    return status.replica_states.get("RUNNING", 0)


def test_replicas_scale_up_with_requests_in_flight(ray_base, cfg):
    """An application of one replica that may grow to two, at two requests in flight per
    replica: six clients streaming back to back make Ray Serve start the second, which then
    serves."""
    from ray import serve

    from specserve.server.ray_serve import build_app

    serve.run(build_app(msgspec.to_builtins(cfg), replicas=1, max_replicas=2,
                        autoscaling={"target_ongoing_requests": 2, "upscale_delay_s": 0.5, "downscale_delay_s": 600,
                                     "metrics_interval_s": 0.5, "look_back_period_s": 2.0}),
              name="scaled", route_prefix="/scaled")
    base = ray_base + "/scaled"
    stop = threading.Event()

    def client(i: int) -> None:
        while not stop.is_set():
            stream(base, PROMPTS[i], max_tokens=100, ignore_eos=True)

    clients = [threading.Thread(target=client, args=(i,)) for i in range(6)]
    try:
        assert replica_count("scaled") == 1
        for t in clients:
            t.start()
        assert wait_until(lambda: replica_count("scaled") == 2, timeout=90, interval=0.5), serve.status()
        stop.set()
        for t in clients:
            t.join(120)
        served: set[str] = set()

        def both_serve() -> bool:   # a burst at a time, until the handle routes to the new one too
            served.update(replica for replica, _ in concurrently(lambda i: stream(base, PROMPTS[i], max_tokens=8), 8))
            return len(served) == 2

        assert wait_until(both_serve, timeout=60, interval=0.5), "the added replica should serve"
    finally:
        stop.set()
        serve.delete("scaled")


def test_a_drain_that_runs_out_of_time_ends_the_streams_with_an_error(ray_base, cfg):
    """Ingress.drain with too little time: the streams still running end with a shutting_down
    error event and [DONE], and it says how many it cut."""
    from ray import serve

    from specserve.server.ray_serve import build_app

    ingress = serve.run(build_app(msgspec.to_builtins(cfg), replicas=1), name="drained", route_prefix="/drained")
    base = ray_base + "/drained"
    results: dict[int, list[str]] = {}
    started = threading.Semaphore(0)

    def client(i: int) -> None:
        results[i] = stream_announcing(base, PROMPTS[i], started, temperature=0.7)

    threads = [threading.Thread(target=client, args=(i,)) for i in range(2)]
    try:
        for t in threads:
            t.start()
        for _ in threads:
            assert started.acquire(timeout=60)
        assert ingress.drain.remote(0.0).result(timeout_s=60) == 2
        for t in threads:
            t.join(60)
        for events in results.values():
            assert events[-1] == "[DONE]" and json.loads(events[-2])["error"]["code"] == "shutting_down"
    finally:
        serve.delete("drained")


def test_sigterm_drains_the_streams_in_flight_and_exits(tmp_path, server_target):
    """`specserve serve --ray` under SIGTERM: new requests get 503 while the running streams
    finish whole, then the process exits 0. Its own local Ray (RAY_ADDRESS=local)."""
    import os
    import signal
    import subprocess
    import sys

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-c", "import sys; from specserve.cli import main; sys.exit(main(sys.argv[1:]))",
           "serve", "--ray", "--replicas", "1", "--target", str(server_target), "--device", "cpu",
           "--dtype", "float32", "--num-blocks", "64", "--port", str(port), "--shutdown-timeout", "60"]
    env = dict(os.environ, RAY_ADDRESS="local")
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True, env=env, cwd=tmp_path)
    log: list[str] = []
    threading.Thread(target=lambda: log.extend(proc.stderr), daemon=True).start()
    base = f"http://127.0.0.1:{port}"
    try:
        assert wait_until(lambda: any("serving on Ray" in line for line in log), timeout=120), "".join(log)
        results: dict[int, tuple[float, list[str]]] = {}
        started = threading.Semaphore(0)

        def client(i: int) -> None:
            events = stream_announcing(base, PROMPTS[i], started, max_tokens=300)
            results[i] = (time.monotonic(), events)

        threads = [threading.Thread(target=client, args=(i,)) for i in range(3)]
        for t in threads:
            t.start()
        for _ in threads:
            assert started.acquire(timeout=60)
        signalled = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        refusals: list[tuple[int, str]] = []

        def refused() -> bool:
            try:
                stream(base, "x", max_tokens=2)
                return False
            except urllib.error.HTTPError as e:
                refusals.append((e.code, json.loads(e.read())["error"]["code"]))
                return True

        assert wait_until(refused, timeout=20, interval=0.1), "".join(log)
        assert refusals[-1] == (503, "shutting_down")
        for t in threads:
            t.join(120)
        assert sorted(results) == [0, 1, 2]
        assert any(ended > signalled for ended, _ in results.values()), "no stream was in flight at SIGTERM"
        for _, events in results.values():
            assert events[-1] == "[DONE]" and "error" not in events[-2]
            assert json.loads(events[-2])["choices"][0]["finish_reason"] == "length"
        assert proc.wait(60) == 0, "".join(log)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
