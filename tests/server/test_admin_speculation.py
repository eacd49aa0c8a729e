"""/admin/speculation: switching a running server between the adaptive controller and static
depths. Exact whatever the setting and whenever it changes; refused with a reason where it
cannot be; off by default."""

from __future__ import annotations

import json
import threading
import urllib.error
import urllib.request

import pytest

from specserve.engine import LLMEngine

from tests.server.conftest import ServerThread, engine_config, wait_until


def _post(srv, body, raw: bytes | None = None, path: str = "/admin/speculation") -> tuple[int, dict]:
    data = raw if raw is not None else json.dumps(body).encode()
    req = urllib.request.Request(srv.base + path, data=data, method="POST",
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def _get(srv) -> tuple[int, dict]:
    try:
        with urllib.request.urlopen(srv.base + "/admin/speculation") as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def _gauge(srv, name: str) -> float:
    with urllib.request.urlopen(srv.base + "/metrics") as r:
        for line in r.read().decode().splitlines():
            if line.startswith(name + " "):
                return float(line.split()[1])
    raise AssertionError(f"{name} not on /metrics")


@pytest.fixture(scope="module")
def admin_server(server_target, server_draft):
    cfg = engine_config(server_target, server_draft, spec_mode="adaptive", max_depth=4, admin_api=True)
    srv = ServerThread(LLMEngine(cfg, progress=False), cfg)
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def reference(server_target):
    """Target-only greedy text of the prompts used here."""
    cfg = engine_config(server_target, None)
    srv = ServerThread(LLMEngine(cfg, progress=False), cfg)
    client = srv.client()
    model = client.models.list().data[0].id
    out = {p: client.completions.create(model=model, prompt=p, max_tokens=40, temperature=0).choices[0].text
           for p in ("The quick brown", "Once upon a time")}
    srv.stop()
    return out


def test_off_unless_the_operator_turns_it_on(server):
    assert _get(server)[0] == 404
    status, body = _post(server, {"mode": "static", "depth": 1})
    assert status == 404 and "/admin/speculation" in body["error"]["message"]
    assert server.engine.speculation() == {"mode": "static", "depth": 3}   # nothing changed


def test_switching_changes_the_plan_and_never_the_output(admin_server, reference):
    srv, ctrl = admin_server, admin_server.engine.spec.controller
    client = srv.client()
    model = client.models.list().data[0].id
    assert _get(srv) == (200, {"mode": "adaptive"})
    assert _gauge(srv, "specserve_spec_adaptive") == 1

    assert _post(srv, {"mode": "static", "depth": 2}) == (200, {"mode": "static", "depth": 2})
    assert _get(srv) == (200, {"mode": "static", "depth": 2})
    assert _gauge(srv, "specserve_spec_adaptive") == 0
    planned, drafts = sum(ctrl.depth_histogram.values()), srv.engine.spec.totals.num_drafts
    text = client.completions.create(model=model, prompt="The quick brown", max_tokens=40, temperature=0)
    assert text.choices[0].text == reference["The quick brown"]
    # Static depth 2 ran the steps, and the detached controller neither planned nor learned.
    assert srv.engine.spec.totals.num_drafts > drafts and srv.engine.spec.totals.last_depth == 2
    assert sum(ctrl.depth_histogram.values()) == planned

    assert _post(srv, {"mode": "static", "depth": 0}) == (200, {"mode": "static", "depth": 0})
    drafts = srv.engine.spec.totals.num_drafts
    text = client.completions.create(model=model, prompt="Once upon a time", max_tokens=40, temperature=0)
    assert text.choices[0].text == reference["Once upon a time"]
    assert srv.engine.spec.totals.num_drafts == drafts   # plain decoding: nothing drafted

    assert _post(srv, {"mode": "adaptive"}) == (200, {"mode": "adaptive"})
    text = client.completions.create(model=model, prompt="The quick brown", max_tokens=40, temperature=0)
    assert text.choices[0].text == reference["The quick brown"]
    assert srv.engine.spec.controller is ctrl   # the same controller, with what it had learned
    assert sum(ctrl.depth_histogram.values()) > planned   # the controller plans again
    assert _gauge(srv, "specserve_controller_goodput_estimate") == pytest.approx(ctrl.last_plan.goodput)


def test_a_switch_in_the_middle_of_a_stream_keeps_it_exact(admin_server, reference):
    srv = admin_server
    client = srv.client()
    model = client.models.list().data[0].id
    _post(srv, {"mode": "static", "depth": 4})
    pieces, switched = [], threading.Event()
    stream = client.completions.create(model=model, prompt="Once upon a time", max_tokens=40, temperature=0,
                                       stream=True)
    for chunk in stream:
        pieces.append(chunk.choices[0].text)
        if not switched.is_set():   # after the first chunk: the request is running
            assert _post(srv, {"mode": "static", "depth": 1})[0] == 200
            switched.set()
    assert "".join(pieces) == reference["Once upon a time"]
    assert srv.engine.spec.totals.last_depth == 1
    assert wait_until(lambda: srv.engine.pool.num_free_blocks == srv.engine.pool.num_blocks)   # every block back
    _post(srv, {"mode": "adaptive"})


@pytest.mark.parametrize("body, param, words", [
    ({"mode": "static"}, "depth", "integer 'depth' in 0..4"),
    ({"mode": "static", "depth": 9}, "depth", "got 9"),
    ({"mode": "static", "depth": "3"}, "depth", "got '3'"),
    ({"mode": "static", "depth": True}, "depth", "got True"),
    ({"mode": "fast"}, "mode", "unknown speculation mode 'fast'"),
    ({"mode": "adaptive", "depth": 3}, "depth", "only for mode 'static'"),
    ({"mode": "static", "depth": 2, "tree": "fixed"}, "tree", "unknown field(s) 'tree'"),
    ({"depth": 2}, "mode", "missing 'mode'"),
])
def test_a_bad_setting_is_refused_with_its_reason_and_nothing_changes(admin_server, body, param, words):
    srv = admin_server
    before = srv.engine.speculation()
    status, err = _post(srv, body)
    assert status == 400 and words in err["error"]["message"] and err["error"]["param"] == param
    assert srv.engine.speculation() == before
    client = srv.client()   # and the server serves on
    out = client.completions.create(model=client.models.list().data[0].id, prompt="x", max_tokens=3, temperature=0)
    assert out.usage.completion_tokens == 3


def test_a_body_that_is_not_a_json_object_is_refused(admin_server):
    status, err = _post(admin_server, None, raw=b"{mode: static")
    assert status == 400 and "not valid JSON" in err["error"]["message"]
    status, err = _post(admin_server, ["static", 2])
    assert status == 400 and "must be a JSON object" in err["error"]["message"]


def test_a_server_started_static_builds_its_controller_when_switched(server_target, server_draft, reference):
    cfg = engine_config(server_target, server_draft, spec_mode="static", spec_depth=3, admin_api=True)
    srv = ServerThread(LLMEngine(cfg, progress=False), cfg)
    try:
        assert srv.engine.spec.controller is None
        assert _post(srv, {"mode": "adaptive"}) == (200, {"mode": "adaptive"})
        client = srv.client()
        text = client.completions.create(model=client.models.list().data[0].id, prompt="The quick brown",
                                         max_tokens=40, temperature=0)
        assert text.choices[0].text == reference["The quick brown"]
        assert sum(srv.engine.spec.controller.depth_histogram.values()) > 0
    finally:
        srv.stop()


def test_nothing_to_switch_without_a_draft(server_target):
    cfg = engine_config(server_target, None, admin_api=True)
    srv = ServerThread(LLMEngine(cfg, progress=False), cfg)
    try:
        assert _get(srv) == (200, {"mode": "off"})
        status, err = _post(srv, {"mode": "static", "depth": 2})
        assert status == 400 and "no draft" in err["error"]["message"]
    finally:
        srv.stop()
