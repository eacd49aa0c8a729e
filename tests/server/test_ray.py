"""specserve on Ray Serve (server/ray_serve.py), on a local Ray cluster on this CPU: two replicas
of one pair answer 32 concurrent streams correctly and both serve; the SSE bytes are those of
a plain specserve server; a replica killed mid-run ends its streams with an error event and
[DONE] while the service keeps answering. Skipped only when Ray is not installed
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
from tests.server.conftest import ServerThread, concurrently, engine_config, wait_until  # noqa: E402

PROMPTS = [f"Story {i}: once upon a time" for i in range(32)]


@pytest.fixture(scope="module")
def cfg(server_target, server_draft):
    return engine_config(server_target, server_draft, spec_mode="static", spec_depth=3, dtype="float64")


@pytest.fixture(scope="module")
def ray_base(cfg):
    import ray
    from ray import serve

    from specserve.server.ray_serve import build_app

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False, ignore_reinit_error=True)
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    serve.run(build_app(msgspec.to_builtins(cfg), replicas=2), name="specserve", route_prefix="/")
    base = f"http://127.0.0.1:{port}"
    yield base
    serve.shutdown()
    ray.shutdown()


def stream(base: str, prompt: str, max_tokens: int = 16, **extra) -> tuple[str, list[str]]:
    """(the replica that served, the data lines of the SSE stream)."""
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True, **extra}
    req = urllib.request.Request(base + "/v1/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        return r.headers.get("x-specserve-replica"), [
            line[6:] for line in r.read().decode().splitlines() if line.startswith("data: ")]


def text_of(events: list[str]) -> str:
    return "".join(json.loads(e)["choices"][0]["text"] for e in events if e != "[DONE]" and "choices" in e)


def test_two_replicas_serve_32_concurrent_streams_correctly(ray_base, cfg):
    offline = LLM(cfg, progress=False).generate(PROMPTS, SamplingParams(max_tokens=16, temperature=0.0))
    results = concurrently(lambda i: stream(ray_base, PROMPTS[i]), len(PROMPTS))
    assert [text_of(events) for _, events in results] == [o.text for o in offline]
    assert all(events[-1] == "[DONE]" for _, events in results)
    assert len({replica for replica, _ in results}) == 2, "both replicas should have served"


def test_the_sse_bytes_are_specservers_own(ray_base, cfg):
    srv = ServerThread(LLMEngine(cfg, progress=False), cfg)
    try:
        body = json.dumps({"prompt": PROMPTS[3], "max_tokens": 12, "temperature": 0, "stream": True,
                           "stream_options": {"include_usage": True}}).encode()

        def raw(base: str) -> bytes:
            req = urllib.request.Request(base + "/v1/completions", data=body,
                                         headers={"Content-Type": "application/json"})
            with urllib.request.urlopen(req, timeout=120) as r:
                return re.sub(rb'"id":"[^"]*","created":\d+,"model":"[^"]*"', b"ID", r.read())

        assert raw(ray_base) == raw(srv.base)
    finally:
        srv.stop()


def test_the_router_prefers_the_prefix_owner_unless_it_is_much_busier():
    """PrefixAffinityRouter's own rule, on stand-in replicas: no owner -> every replica; the
    replica that served a prompt's prefix first, then every replica; none once that replica
    has more than `slack` requests beyond the least loaded."""
    import asyncio
    from types import SimpleNamespace

    from specserve.server.ray_serve import _make_router_class

    cls = _make_router_class()
    router = cls.__new__(cls)
    router.initialize_state(slack=2)
    a, b = SimpleNamespace(replica_id="a"), SimpleNamespace(replica_id="b")

    def request(prompt: str):
        return SimpleNamespace(args=("/v1/completions", json.dumps({"prompt": prompt}).encode()))

    def choose(prompt: str):
        return asyncio.run(router.choose_replicas([a, b], request(prompt)))

    shared = "The archive of the river city kept its letters in stone boxes. " * 4
    assert choose(shared + "one") == [[a, b]]
    router.on_request_routed(request(shared + "one"), "b", None)
    assert choose(shared + "two") == [[b], [a, b]]
    assert choose("an unrelated prompt " * 10) == [[a, b]]
    for _ in range(2):
        router.on_request_routed(request("other " * 20), "b", None)
    assert choose(shared + "three") == [[a, b]], "b has 3 in flight, a none: more than slack 2"
    router.on_request_completed("b", "x")
    assert choose(shared + "four") == [[b], [a, b]]


def test_a_killed_replica_ends_its_streams_and_the_service_answers(ray_base):
    import ray

    results: dict[int, tuple[str, list[str]]] = {}
    threads = [threading.Thread(target=lambda i=i: results.__setitem__(
        i, stream(ray_base, PROMPTS[i], max_tokens=200, ignore_eos=True, temperature=0.7))) for i in range(6)]
    for t in threads:
        t.start()
    time.sleep(0.5)   # every stream running
    replicas = [a for a in ray.util.list_named_actors(all_namespaces=True) if "specserve-engine" in a["name"]]
    assert len(replicas) == 2
    ray.kill(ray.get_actor(replicas[0]["name"], namespace=replicas[0]["namespace"]), no_restart=False)
    for t in threads:
        t.join(120)
    ended = [events for _, events in results.values()]
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
