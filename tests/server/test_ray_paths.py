"""The Ray Serve path (server/ray_serve.py) as a client and an operator see it, beside a plain
specserve server (create_app) of the same configuration: error responses (status, JSON body,
Retry-After, Allow, WWW-Authenticate) pass through unchanged; streamed SSE bytes are the same
for greedy chat and completion requests (n > 1, logprobs, usage, stop strings); X-Request-Id
and CORS behave as on the plain server; a client that goes away mid-stream frees its request
on the replica; /health, /v1/models and /metrics answer through the ingress; the router's
bookkeeping stays bounded and honest; serve.shutdown ends the streams in flight. One local Ray
(2 CPUs) and one deployment of two replicas for the whole module. Skipped only when Ray is
not installed."""

from __future__ import annotations

import http.client
import json
import re
import socket
import threading
import time

import pytest

pytest.importorskip("ray", reason="Ray is not installed (pip install -e '.[ray]'); CI installs it")

from specserve.engine import LLMEngine  # noqa: E402
from specserve.server import protocol  # noqa: E402
from tests.server.conftest import ServerThread, engine_config, ray_deployment, wait_until  # noqa: E402

KEY = "s3cret"
ORIGIN = "http://page.example"
AUTH = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def cfg(server_target, server_draft):
    return engine_config(server_target, server_draft, spec_mode="static", spec_depth=3, dtype="float64",
                         api_key=KEY, allowed_origins=[ORIGIN], max_waiting_requests=4,
                         max_model_len=512)


@pytest.fixture(scope="module")
def single(cfg):
    srv = ServerThread(LLMEngine(cfg, progress=False), cfg)
    yield srv.base
    srv.stop()


@pytest.fixture(scope="module")
def ray_app(cfg):
    """(base URL, the ingress handle) of one deployment of two replicas on a local Ray."""
    with ray_deployment(cfg, num_cpus=2, replicas=2, cpus_per_replica=0.5) as app:
        yield app


@pytest.fixture(scope="module")
def ray_base(ray_app):
    return ray_app[0]


def raw(base: str, method: str, path: str, body: bytes | dict | None = None, headers: dict | None = None,
        timeout: float = 120.0) -> tuple[int, dict, bytes]:
    """(status, headers with lower-case names, body) of one request on a connection of its own."""
    host, port = base.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=timeout)
    try:
        if isinstance(body, dict):
            body = json.dumps(body).encode()
        conn.request(method, path, body=body, headers={"Content-Type": "application/json", **(headers or {})})
        r = conn.getresponse()
        return r.status, {k.lower(): v for k, v in r.getheaders()}, r.read()
    finally:
        conn.close()


_IDS = re.compile(rb'"id":"[^"]*","created":\d+')


def same_bytes(data: bytes) -> bytes:
    """The body without what differs between two runs of one request (its id and time)."""
    return _IDS.sub(b'"id":ID,"created":T', data)


# -- error responses --------------------------------------------------------------------------

_ERROR_CASES = {
    "malformed json": ("POST", "/v1/completions", b'{"prompt": "x", ', AUTH),
    "not an object": ("POST", "/v1/chat/completions", b"[1, 2]", AUTH),
    "unknown model": ("POST", "/v1/completions", {"model": "nope", "prompt": "x", "max_tokens": 2}, AUTH),
    "unknown model GET": ("GET", "/v1/models/nope", None, AUTH),
    "max_tokens too big": ("POST", "/v1/completions", {"prompt": "x", "max_tokens": 10**9}, AUTH),
    "bad type": ("POST", "/v1/chat/completions",
                 {"messages": [{"role": "user", "content": "hi"}], "temperature": "hot"}, AUTH),
    "context too long": ("POST", "/v1/completions", {"prompt": "word " * 600, "max_tokens": 4}, AUTH),
    "queue full (429)": ("POST", "/v1/completions", {"prompt": "x", "max_tokens": 2, "n": 5}, AUTH),
    "wrong method (405)": ("GET", "/v1/completions", None, AUTH),
    "unknown route (404)": ("POST", "/v1/nowhere", {}, AUTH),
    "no key (401)": ("POST", "/v1/completions", {"prompt": "x", "max_tokens": 2}, {}),
    "wrong key (401)": ("POST", "/v1/completions", {"prompt": "x", "max_tokens": 2},
                        {"Authorization": "Bearer wrong"}),
    "body over the limit (413)": ("POST", "/v1/completions",
                                  b'{"prompt": "' + b"a" * protocol.MAX_BODY_BYTES + b'"}', AUTH),
    "body just under the limit": ("POST", "/v1/completions",
                                  b'{"padding": "' + b"a" * (protocol.MAX_BODY_BYTES - 64) + b'"}', AUTH),
}
_CLIENT_HEADERS = ("content-type", "retry-after", "allow", "www-authenticate")


@pytest.mark.parametrize("case", list(_ERROR_CASES))
def test_error_responses_pass_through_unchanged(ray_base, single, case):
    method, path, body, headers = _ERROR_CASES[case]
    got = raw(ray_base, method, path, body, headers)
    want = raw(single, method, path, body, headers)
    assert want[0] >= 400, want   # the case is an error on the plain server
    assert (got[0], {k: got[1].get(k) for k in _CLIENT_HEADERS}, got[2]) == \
        (want[0], {k: want[1].get(k) for k in _CLIENT_HEADERS}, want[2])
    error = json.loads(got[2])["error"]
    assert set(error) == {"message", "type", "param", "code"}


# -- streams ----------------------------------------------------------------------------------

_STREAMS = {
    "completion, n=2, logprobs, usage": ("/v1/completions", {
        "prompt": "Once upon a time", "max_tokens": 12, "n": 2, "logprobs": 2,
        "stream_options": {"include_usage": True}}),
    "completion, echo, stop string": ("/v1/completions", {
        "prompt": "The river city", "max_tokens": 24, "echo": True, "stop": ["e", "a"]}),
    "chat, n=2, logprobs, usage, stop": ("/v1/chat/completions", {
        "messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Tell a story"}],
        "max_tokens": 16, "n": 2, "logprobs": True, "top_logprobs": 2, "stop": ["o"],
        "stream_options": {"include_usage": True}}),
}


@pytest.mark.parametrize("case", list(_STREAMS))
def test_stream_bytes_match_the_plain_server(ray_base, single, case):
    path, body = _STREAMS[case]
    body = {**body, "temperature": 0, "stream": True}
    got, want = raw(ray_base, "POST", path, body, AUTH), raw(single, "POST", path, body, AUTH)
    assert got[0] == want[0] == 200
    assert {k: got[1].get(k) for k in ("content-type", "cache-control")} == \
        {k: want[1].get(k) for k in ("content-type", "cache-control")}
    assert same_bytes(got[2]) == same_bytes(want[2])
    assert got[2].endswith(b"data: [DONE]\n\n") and b'"finish_reason":"' in got[2]


@pytest.mark.parametrize("stream", [False, True])
def test_x_request_id_names_the_response_as_on_the_plain_server(ray_base, single, stream):
    body = {"prompt": "Once upon a time", "max_tokens": 3, "temperature": 0, "stream": stream}
    headers = {**AUTH, "X-Request-Id": "client-req-42"}
    for base in (single, ray_base):
        status, _, data = raw(base, "POST", "/v1/completions", body, headers)
        assert status == 200
        first = data.split(b"\n\n")[0].removeprefix(b"data: ") if stream else data
        assert json.loads(first)["id"] == "cmpl-client-req-42", base


def test_cors_as_on_the_plain_server(ray_base, single):
    """An allowed origin's POST gets Access-Control-Allow-Origin; its preflight (no key, as
    browsers send none) gets 204 with the allowed methods."""
    body = {"prompt": "hi", "max_tokens": 2, "temperature": 0}
    preflight = {"Origin": ORIGIN, "Access-Control-Request-Method": "POST",
                 "Access-Control-Request-Headers": "authorization, content-type"}
    for base in (single, ray_base):
        status, headers, _ = raw(base, "POST", "/v1/completions", body, {**AUTH, "Origin": ORIGIN})
        assert (status, headers.get("access-control-allow-origin")) == (200, ORIGIN), base
        status, headers, _ = raw(base, "OPTIONS", "/v1/completions", None, preflight)
        assert (status, headers.get("access-control-allow-origin")) == (204, ORIGIN), base
        assert "POST" in headers.get("access-control-allow-methods", ""), base


# -- operator routes --------------------------------------------------------------------------

def test_health_models_and_metrics_through_the_ingress(ray_base, single):
    status, headers, body = raw(ray_base, "GET", "/health")
    assert (status, json.loads(body)) == (200, {"status": "ok"})
    got, want = raw(ray_base, "GET", "/v1/models", None, AUTH), raw(single, "GET", "/v1/models", None, AUTH)
    assert got[0] == 200 and same_bytes(got[2]) == same_bytes(want[2])
    assert raw(ray_base, "GET", "/v1/models", None, {})[0] == 401
    status, headers, body = raw(ray_base, "GET", "/metrics")
    assert status == 200 and headers["content-type"].startswith("text/plain")
    assert b"specserve_num_requests_running" in body and b"specserve_kv_cache_usage_perc" in body


_GAUGES = ("specserve_num_requests_running", "specserve_kv_cache_usage_perc", "specserve_generation_tokens_total")


def _replica_metrics(base: str, replica: str, timeout: float = 30.0) -> dict[str, float]:
    """Requests running, KV usage and tokens generated by one replica, from its /metrics read
    through the ingress (which spreads requests without a prompt over the replicas: ask until
    that one answers)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        status, headers, body = raw(base, "GET", "/metrics")
        if status == 200 and headers.get("x-specserve-replica") == replica:
            text = body.decode()
            return {name: float(re.search(rf"^{name}(?:{{[^}}]*}})? (\S+)$", text, re.M).group(1))
                    for name in _GAUGES}
    raise AssertionError(f"replica {replica} never answered /metrics")


def test_a_client_gone_mid_stream_frees_its_request_on_the_replica(ray_base):
    """A stream of 2 x 470 tokens whose client goes away after its first events: the replica
    stops generating (far fewer than 940 tokens), and its running requests and KV usage go
    back to 0."""
    generated: dict[str, float] = {}   # replica -> its tokens so far

    def both_seen() -> bool:
        status, headers, body = raw(ray_base, "GET", "/metrics")
        m = re.search(rb"^specserve_generation_tokens_total (\S+)$", body, re.M)
        generated[headers["x-specserve-replica"]] = float(m.group(1))
        return len(generated) == 2
    assert wait_until(both_seen, timeout=30)
    host, port = ray_base.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=60)
    body = {"prompt": "A long tale: " * 4, "max_tokens": 470, "n": 2, "temperature": 0.7, "ignore_eos": True,
            "stream": True}
    conn.request("POST", "/v1/completions", body=json.dumps(body), headers={"Content-Type": "application/json",
                                                                           **AUTH})
    r = conn.getresponse()
    replica = r.getheader("x-specserve-replica")
    assert r.status == 200 and replica
    for _ in range(3):
        assert r.readline().startswith(b"data: ")
        r.readline()
    conn.sock.shutdown(socket.SHUT_RDWR)
    conn.close()
    after: dict[str, float] = {}

    def idle() -> bool:
        after.update(_replica_metrics(ray_base, replica))
        return after["specserve_num_requests_running"] == 0 and after["specserve_kv_cache_usage_perc"] == 0
    assert wait_until(idle, timeout=30, interval=0.3), after
    assert after["specserve_generation_tokens_total"] - generated[replica] < 940 - 150, \
        "the replica kept generating for a client that went away"


def test_concurrent_streams_each_get_their_own_bytes(ray_base, single):
    """Eight concurrent greedy streams with different prompts, through the ingress: each the
    same bytes as the plain server gives that prompt alone."""
    bodies = [{"prompt": f"Story {i}: once", "max_tokens": 10, "temperature": 0, "stream": True} for i in range(8)]
    results: dict[int, tuple] = {}
    threads = [threading.Thread(target=lambda i=i: results.__setitem__(
        i, raw(ray_base, "POST", "/v1/completions", bodies[i], AUTH))) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    for i, body in enumerate(bodies):
        want = raw(single, "POST", "/v1/completions", body, AUTH)
        assert results[i][0] == 200 and same_bytes(results[i][2]) == same_bytes(want[2])


# -- the router's bookkeeping -----------------------------------------------------------------

def _router():
    from types import SimpleNamespace

    from specserve.server.ray_serve import _make_router_class

    cls = _make_router_class()
    router = cls.__new__(cls)
    router.initialize_state(slack=2)
    router._replicas, router._replica_id_set = {}, set()   # what the base class's hooks touch
    router._replicas_list, router._queue_len_gauge_last_update = [], {}

    def request(prompt: str, rid: str):
        return SimpleNamespace(args=("/v1/completions", json.dumps({"prompt": prompt}).encode()),
                               metadata=SimpleNamespace(internal_request_id=rid))
    return router, request


def test_a_request_a_replica_refused_does_not_count_as_one_finished():
    """Ray calls on_request_completed for a request a replica rejected (queue full) without
    on_request_routed: the load of that replica's requests really in flight stays counted."""
    router, request = _router()
    for rid in ("r1", "r2"):
        router.on_request_routed(request(f"prompt {rid}", rid), "a", None)
    router.on_request_completed("a", "r3")   # r3 was refused by a, then routed elsewhere
    assert router._load(time.monotonic()).get("a", 0) == 2
    router.on_request_completed("a", "r1")
    router.on_request_completed("a", "r2")
    assert router._load(time.monotonic()).get("a", 0) == 0


def test_a_dead_replica_leaves_no_entries_behind():
    """After a replica dies (and the completions of its requests come in), the router keeps
    nothing about it: no prefix owners, no load, no turn."""
    router, request = _router()
    shared = "The archive of the river city kept its letters in stone boxes. " * 4
    for i, replica in enumerate(["a", "b", "a"]):
        router.on_request_routed(request(shared + str(i), f"r{i}"), replica, None)
    router.last_chosen.update({"a": 1, "b": 2})
    router.on_replica_actor_died("a")
    router.on_request_completed("a", "r0")
    router.on_request_completed("a", "r2")
    assert "a" not in router.owner.values()
    assert "a" not in router.inflight and "a" not in router.last_chosen


def test_a_prefix_owner_no_longer_a_candidate_does_not_hide_a_shorter_one():
    """A replica gone from the candidates (scaled down, replaced) that served the longest
    prefix: the live replica that served a shorter prefix of the prompt is preferred."""
    import asyncio
    from types import SimpleNamespace

    router, request = _router()
    shared = "The archive of the river city kept its letters in stone boxes. " * 2
    longer = shared + "and more of the same words " * 4
    router.on_request_routed(request(longer, "r0"), "gone", None)
    router.on_request_routed(request(shared, "r1"), "b", None)
    router.on_request_completed("gone", "r0")
    router.on_request_completed("b", "r1")
    router.last_chosen.update({"a": 1, "b": 2})   # a tie in load would go to a
    a, b = SimpleNamespace(replica_id="a"), SimpleNamespace(replica_id="b")
    chosen = asyncio.run(router.choose_replicas([a, b], request(longer + "!", "r2")))
    assert chosen[0] == [b], "b served the longest prefix a candidate served"
