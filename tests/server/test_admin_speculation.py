"""/admin/speculation: switching a running server between the adaptive controller and static
depths (what `benchmarks/sweep.py --one-process` compares settings with). Exact whatever the
setting and whenever it changes; refused with a reason where it cannot be; off by default."""

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
    srv, ctrl = admin_server, admin_server.engine.spec.adaptive
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
    assert sum(ctrl.depth_histogram.values()) > planned   # the controller plans again
    # Its series stay on /metrics while it is detached, and after.
    assert _gauge(srv, "specserve_controller_goodput_estimate") == pytest.approx(ctrl.goodput_estimate)


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


def test_no_adaptive_controller_to_switch_to_without_one_built_at_start_up(server_target, server_draft):
    cfg = engine_config(server_target, server_draft, spec_mode="static", spec_depth=3, admin_api=True)
    srv = ServerThread(LLMEngine(cfg, progress=False), cfg)
    try:
        status, err = _post(srv, {"mode": "adaptive"})
        assert status == 400 and "mode = 'static'" in err["error"]["message"] and err["error"]["param"] == "mode"
        assert _post(srv, {"mode": "static", "depth": 1}) == (200, {"mode": "static", "depth": 1})
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


def test_knob_controllers_take_turns_with_adaptive_in_one_server(admin_server, reference, monkeypatch):
    """benchmarks.serve_knobs: a knob setting is a copy of the start-up controller with some
    arguments changed, switched to by name like adaptive; it plans and learns only while it
    is attached, the output stays exact, and a bad knob is refused before the server starts."""
    from benchmarks import serve_knobs
    from specserve.spec import Speculator

    for name in ("set_setting", "setting", "forget_history"):   # install() patches the class: undone after
        monkeypatch.setattr(Speculator, name, getattr(Speculator, name))
    knobs = serve_knobs.parse_knobs(["calm:explore_interval=16,explore_margin=0.05",
                                     "nobias:bias_half_life=0,bias_limits=(0.5, 2.0)"])
    assert knobs == {"calm": {"explore_interval": 16, "explore_margin": 0.05},
                     "nobias": {"bias_half_life": 0, "bias_limits": (0.5, 2.0)}}
    serve_knobs.install(knobs)
    srv, start = admin_server, admin_server.engine.spec.adaptive
    client = srv.client()
    model = client.models.list().data[0].id
    client.completions.create(model=model, prompt="Once upon a time", max_tokens=20, temperature=0)
    learned = list(start.acceptance)

    assert _post(srv, {"mode": "calm"}) == (200, {"mode": "calm"})
    assert _get(srv) == (200, {"mode": "calm"})
    calm = srv.engine.spec.controller
    assert calm is not start and calm.explore_interval == 16 and calm.explore_margin == 0.05
    # Everything else as the start-up controller had it when first switched to: its
    # calibration and what it had learned, in a copy of its own.
    assert calm.acceptance == learned and calm.costs is not start.costs
    assert calm.switch_margin == start.switch_margin and calm.bias_decay == start.bias_decay
    assert start.explore_interval == 8
    before = sum(start.depth_histogram.values())
    text = client.completions.create(model=model, prompt="The quick brown", max_tokens=40, temperature=0)
    assert text.choices[0].text == reference["The quick brown"]
    assert sum(calm.depth_histogram.values()) > before and sum(start.depth_histogram.values()) == before
    assert calm._requests == {}   # the finished request was forgotten by the controller that served it

    assert _post(srv, {"mode": "nobias"}) == (200, {"mode": "nobias"})
    nobias = srv.engine.spec.controller
    assert nobias.bias_decay is None and nobias.bias_limits == (0.5, 2.0) and nobias.explore_interval == 8
    assert _post(srv, {"mode": "calm"}) == (200, {"mode": "calm"}) and srv.engine.spec.controller is calm
    assert _post(srv, {"mode": "calm", "depth": 3})[0] == 400
    assert _post(srv, {"mode": "static", "depth": 99})[0] == 400
    assert _get(srv) == (200, {"mode": "calm"}) and srv.engine.spec.controller is calm
    assert _post(srv, {"mode": "static", "depth": 2}) == (200, {"mode": "static", "depth": 2})
    assert _post(srv, {"mode": "adaptive"}) == (200, {"mode": "adaptive"})
    assert srv.engine.spec.controller is start

    for bad, words in (("calm", "expected NAME:key=value"), ("x:explore_intervall=3", "not an AdaptiveController"),
                       ("x:max_depth=4", "sizes the controller"), ("adaptive:explore_interval=3", "new word"),
                       ("x:explore_interval=fast", "not a Python literal")):
        with pytest.raises(SystemExit, match=words):
            serve_knobs.parse_knobs([bad])
    with pytest.raises(ValueError, match="bias_half_life"):
        serve_knobs.knob_controller(start, {"bias_half_life": -1})
    # A knob may set what the start-up controller's shape also carries (stop_scale: no early stop).
    assert serve_knobs.knob_controller(start, {"stop_scale": 0}).stop_scale == 0
    assert start.stop_scale == serve_knobs.knob_controller(start, {}).stop_scale


def test_a_shadow_knob_plans_as_usual_and_runs_one_depth():
    """serve_knobs' shadow_depth=D: the copy plans and learns every step as adaptive would (its
    own work stays in the step) while each step runs depth D without early stop, so beside
    staticD in one server the difference is the controller's cost alone."""
    from benchmarks import serve_knobs
    from specserve.controller import AdaptiveController, Plan, StepStats

    assert serve_knobs.parse_knobs(["sh:shadow_depth=5,explore_interval=16"]) == {
        "sh": {"shadow_depth": 5, "explore_interval": 16}}
    with pytest.raises(SystemExit, match="integer depth"):
        serve_knobs.parse_knobs(["sh:shadow_depth=deep"])
    start = AdaptiveController(max_depth=8, stop_scale=1.0)
    start.calibrate(lambda b, n: 0.01 + 0.001 * n, lambda b: 0.002, batch_sizes=(1,), nodes_per_seq=range(9))
    with pytest.raises(ValueError, match="shadow_depth must be in 0..8"):
        serve_knobs.knob_controller(start, {"shadow_depth": 9})
    shadow = serve_knobs.knob_controller(start, {"shadow_depth": 5, "explore_interval": 16})
    assert shadow.explore_interval == 16
    for step in range(40):
        plan = shadow.plan(1, ["r"], 100, [8])
        assert plan == Plan(5, 5) and shadow.stop_below == 0.0
        shadow.observe(StepStats(batch_size=1, depth=5, num_nodes=5, draft_s=0.01, verify_s=0.015,
                                 num_accepted=[5 if step % 2 else 2], request_ids=["r"]))
    # It planned every step on its own estimates and learned from the depth-5 steps it ran.
    assert sum(shadow.depth_histogram.values()) == 40 and shadow.goodput_estimate > 0
    assert shadow.num_steps == 40
    assert shadow.acceptance[:5] != start.acceptance[:5]
    assert start.num_steps == 0


def _post_reset(srv) -> tuple[int, dict]:
    return _post(srv, {}, path="/admin/reset_prefix_cache")


def test_reset_prefix_cache_makes_the_next_prompt_prefill_whole(admin_server, server):
    """POST /admin/reset_prefix_cache (what `sweep --cold-prompts` sends before each cell):
    the finished requests' cached blocks go, the next identical prompt is prefilled whole and
    its output is the same. Off without --admin-api."""
    assert _post_reset(server)[0] == 404
    srv = admin_server
    pool = srv.engine.pool
    client = srv.client()
    model = client.models.list().data[0].id
    prompt = "Once upon a time " * 12   # several full KV blocks
    first = client.completions.create(model=model, prompt=prompt, max_tokens=8, temperature=0).choices[0].text
    assert wait_until(lambda: pool.num_free_blocks == pool.num_blocks)
    cached = pool.num_evictable_blocks
    assert cached > 0
    hits = pool.prefix_cache_hit_tokens
    assert _post_reset(srv) == (200, {"dropped_blocks": cached})
    assert pool.num_cached_blocks == 0 and pool.num_free_blocks == pool.num_blocks
    again = client.completions.create(model=model, prompt=prompt, max_tokens=8, temperature=0).choices[0].text
    assert again == first
    assert pool.prefix_cache_hit_tokens == hits   # nothing of it was found cached
    # Without a reset the same prompt is a hit.
    assert wait_until(lambda: pool.num_free_blocks == pool.num_blocks)
    client.completions.create(model=model, prompt=prompt, max_tokens=8, temperature=0)
    assert pool.prefix_cache_hit_tokens > hits
    pool.check_consistency()
