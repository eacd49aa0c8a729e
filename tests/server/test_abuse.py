"""Clients that abuse the server, against the in-process engine, one engine-core process
(EngineCoreClient) and two cores (EngineGroup): raw-socket disconnects at random moments
(before the first byte, after the headers or a chunk, mid-stream) with n = 1..3 and two
prompts, streaming and not; aborts racing natural finishes (max_tokens 1-2, stop strings
that end at once, cut in the API server on the core path, include_stop_str_in_output);
bodies that never complete; pipelined requests whose client leaves. Afterwards nothing runs
or waits in any core, no KV block is held, no stream or in-flight count is left, /metrics
shows idle, every completed response was well formed (no traceback, streams end with
[DONE]), and a new request is served."""

from __future__ import annotations

import json
import random
import socket
import threading
import time
import urllib.request

import pytest

from specserve.core import EngineCoreClient, EngineGroup
from specserve.engine import LLMEngine
from tests.server.conftest import ServerThread, engine_config, wait_until


@pytest.fixture(scope="module", params=["inproc", "core", "group"])
def srv(request, server_target):
    cfg = engine_config(server_target, "ngram", spec_mode="static", spec_depth=2, num_blocks=64, threads=1)
    backend = {"inproc": lambda: LLMEngine(cfg, progress=False), "core": lambda: EngineCoreClient(cfg),
               "group": lambda: EngineGroup(cfg, 2)}[request.param]()
    s = ServerThread(backend, cfg)
    yield s
    s.stop()


def state(s):
    from specserve.server.app import STATE
    return s.app[STATE]


def raw(s, body: dict, cut: int | None, timeout=60.0) -> bytes:
    """POST body on a raw socket; close after `cut` bytes of the answer (None: read it all)."""
    data = json.dumps(body).encode()
    sock = socket.create_connection(("127.0.0.1", s.port), timeout=timeout)
    try:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Connection: close\r\nContent-Length: " + str(len(data)).encode() + b"\r\n\r\n" + data)
        got = b""
        while cut is None or len(got) < cut:
            chunk = sock.recv(65536)
            if not chunk:
                break
            got += chunk
        return got
    finally:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
        sock.close()


def idle_report(s) -> dict:
    st = state(s)
    be = st.async_engine
    snap = be.snapshot()
    rep = {"running": snap["running"], "waiting": snap["waiting"], "blocks_held": snap["blocks_held"],
           "num_inflight": st.num_inflight}
    if isinstance(be, EngineGroup):
        rep["group_inflight"] = list(be.inflight)
        rep["core_of"] = len(be._core_of)
        rep["streams"] = sum(len(c._streams) for c in be.cores)
    elif isinstance(be, EngineCoreClient):
        rep["streams"] = len(be._streams)
    else:
        rep["streams"] = len(be._streams)
        rep["requests"] = len(be.engine.requests)
    return rep


def is_idle(rep: dict) -> bool:
    return all((v == [0, 0] if isinstance(v, list) else v == 0) for v in rep.values())


def check_full(got: bytes, stream: bool) -> None:
    assert b"Traceback" not in got, got[-2000:]
    head, _, body = got.partition(b"\r\n\r\n")
    assert b" 200 " in head.split(b"\r\n")[0], got[:1000]
    if stream:
        assert b"data: [DONE]\n\n" in body and b'"error"' not in body, body[-300:]
    else:
        assert b'"choices"' in body, body[-300:]


def test_abuse_then_idle(srv):
    rng = random.Random(7)
    errors = []

    def one(k):
        r = random.Random(k)
        stream = r.random() < 0.6
        body = {"prompt": ["Once upon a time", "The cat sat"] if r.random() < 0.5 else "Hello there",
                "n": r.randint(1, 3), "max_tokens": r.choice([1, 2, 8, 40]), "temperature": r.choice([0, 0.9]),
                "stream": stream}
        if r.random() < 0.4:
            body["stop"] = [r.choice(["e", " ", "a", "o", "\n"])]
            body["include_stop_str_in_output"] = r.random() < 0.5
        if r.random() < 0.2:
            body["ignore_eos"] = True
            body["max_tokens"] = 100
        cut = r.choice([None, None, 0, 1, 50, 200, 400, 1000])
        try:
            got = raw(srv, body, cut)
            if cut is None:
                check_full(got, stream)
        except Exception as e:
            errors.append(f"{body} cut={cut}: {e!r}")

    threads = [threading.Thread(target=one, args=(k,)) for k in range(60)]
    for t in threads:
        t.start()
        time.sleep(rng.random() * 0.02)
    for t in threads:
        t.join(120)
    assert not errors, "\n".join(errors[:10])
    assert wait_until(lambda: is_idle(idle_report(srv)), timeout=20), idle_report(srv)
    m = urllib.request.urlopen(srv.base + "/metrics", timeout=10).read().decode()
    assert "specserve_num_requests_running 0.0" in m and "specserve_num_requests_waiting 0.0" in m, m
    if isinstance(state(srv).async_engine, EngineGroup):
        assert 'specserve_engine_num_requests_running{engine="0"} 0.0' in m, m
        assert 'specserve_engine_num_requests_running{engine="1"} 0.0' in m, m
    got = raw(srv, {"prompt": "Hi", "max_tokens": 4, "stream": True}, None)
    check_full(got, True)


def test_partial_bodies_and_pipelined_requests_then_idle(srv):
    body = json.dumps({"prompt": ["Once upon a time", "The cat"], "n": 2, "max_tokens": 60, "ignore_eos": True,
                       "stream": True}).encode()
    req = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: "
           + str(len(body)).encode() + b"\r\n\r\n" + body)
    for k in range(12):
        s = socket.create_connection(("127.0.0.1", srv.port), timeout=30)
        if k % 3 == 0:
            s.sendall(req[:len(req) - 5])     # the body never completes
        elif k % 3 == 1:
            s.sendall(req + req + req)        # pipelined: the first runs, then the client leaves
            s.recv(100)
        else:
            s.sendall(req)
        time.sleep(0.01 * k)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
        s.close()
    assert wait_until(lambda: is_idle(idle_report(srv)), timeout=20), idle_report(srv)
    check_full(raw(srv, {"prompt": "Hi", "max_tokens": 4, "stream": True}, None), True)
