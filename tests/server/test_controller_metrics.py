"""The adaptive controller's decisions on /metrics (DESIGN.md §6: depth histogram, acceptance
per position, goodput estimate), read from a real server."""

from __future__ import annotations

import urllib.request

import pytest

from specserve.engine import LLMEngine

from tests.server.conftest import ServerThread, engine_config


def _scrape(srv) -> dict[str, float]:
    with urllib.request.urlopen(srv.base + "/metrics") as r:
        text = r.read().decode()
    return {name: float(value) for name, value in
            (line.rsplit(" ", 1) for line in text.splitlines() if line and not line.startswith("#"))}


@pytest.fixture(scope="module")
def adaptive_server(server_target, server_draft):
    cfg = engine_config(server_target, server_draft, spec_mode="adaptive", max_depth=4)
    srv = ServerThread(LLMEngine(cfg, progress=False), cfg)
    yield srv
    srv.stop()


def test_controller_decisions_are_exported(adaptive_server):
    srv = adaptive_server
    client = srv.client()
    model = client.models.list().data[0].id
    before = _scrape(srv)
    out = client.completions.create(model=model, prompt="The quick brown", max_tokens=24, temperature=0)
    assert out.usage.completion_tokens == 24
    after = _scrape(srv)
    ctrl = srv.engine.spec.controller

    # The depth histogram: one count per planned step, by depth, as the controller kept it.
    steps = {k: v for k, v in after.items() if k.startswith("specserve_controller_steps_total{")}
    assert steps and sum(steps.values()) == sum(ctrl.depth_histogram.values())
    assert sum(steps.values()) > sum(v for k, v in before.items() if k.startswith("specserve_controller_steps_total{"))
    for depth, count in ctrl.depth_histogram.items():
        assert steps[f'specserve_controller_steps_total{{depth="{depth}"}}'] == count

    # Acceptance estimate per position 1..max_depth, each a probability.
    acc = [after[f'specserve_controller_acceptance_estimate{{position="{k}"}}'] for k in range(1, 5)]
    assert acc == pytest.approx(ctrl.acceptance) and all(0.0 <= a <= 1.0 for a in acc)

    assert after["specserve_controller_goodput_estimate"] == pytest.approx(ctrl.goodput_estimate)
    assert after["specserve_controller_goodput_estimate"] > 0
    assert after["specserve_controller_expected_tokens_per_pass"] >= 1.0
    assert after["specserve_controller_plan_changes_total"] == ctrl.num_plan_changes
    assert after["specserve_controller_guard_trips_total"] == ctrl.num_guard_trips
    # The cost model it decided from: calibrated at start-up, so batch size 1 is there.
    assert after['specserve_controller_verify_seconds{batch_size="1",num_tokens="1"}'] > 0
    assert after['specserve_controller_draft_step_seconds{batch_size="1"}'] > 0
    assert after['specserve_controller_verify_level{batch_size="1"}'] > 0
    # Each depth's correction at batch size 1, as the controller would read it now.
    bias = [after[f'specserve_controller_bias_factor{{batch_size="1",depth="{d}"}}'] for d in range(5)]
    assert bias == pytest.approx(ctrl.bias_factors(1)) and all(0.6 <= f <= 1.5 for f in bias)
    # Greedy requests only: one kind, no per-kind estimates; once both kinds are kept, both.
    assert not any(k.startswith("specserve_controller_kind_acceptance_estimate") for k in after)
    ctrl._start_kinds(ctrl.global_acceptance())
    ctrl._kind_acc[True][0] = 0.25
    kinds = _scrape(srv)
    for kind, accs in (("greedy", ctrl._kind_acc[False]), ("sampled", ctrl._kind_acc[True])):
        got = [kinds[f'specserve_controller_kind_acceptance_estimate{{kind="{kind}",position="{k}"}}']
               for k in range(1, 5)]
        assert got == pytest.approx(accs)
    assert kinds['specserve_controller_kind_acceptance_estimate{kind="sampled",position="1"}'] == 0.25
    ctrl._kind_acc, ctrl._kind_num_seen = None, {}   # the server goes on as it was


def test_steps_carry_their_context_and_calibration_measured_its_cost(adaptive_server):
    srv = adaptive_server
    ctrl = srv.engine.spec.controller
    seen = []
    observe = ctrl.observe
    ctrl.observe = lambda stats: (seen.append(stats), observe(stats))[1]
    try:
        client = srv.client()
        model = client.models.list().data[0].id
        out = client.completions.create(model=model, prompt="one two three four five six",
                                        max_tokens=16, temperature=0)
    finally:
        del ctrl.observe
    timed = [s for s in seen if s.verify_s > 0]
    assert timed and all(s.batch_size == 1 for s in timed)
    # the tokens already cached when the pass ran: from the prompt on, growing, never past the end
    ctxs = [s.context_tokens for s in timed]
    prompt = out.usage.prompt_tokens
    assert ctxs == sorted(ctxs) and prompt <= ctxs[0] and ctxs[-1] < prompt + 16
    snap = ctrl.costs.snapshot()
    assert snap["reference_context"] == 32
    assert 1 in snap["verify_s_per_context_token"] and 1 in snap["draft_s_per_context_token"]
    # per rows per sequence (every one measured), none negative
    slopes = snap["verify_s_per_context_token"][1]
    assert {1, 2, 3, 5} <= set(slopes) and all(v >= 0 for v in slopes.values())
    # (per rows as measured: not necessarily rising with the rows, see set_context_curves)
    # measured at two longer contexts than the reference (the curve is read between them),
    # every rows there, never cheaper for a longer context
    contexts = {c for per in snap["verify_context_s"][1].values() for c in per}
    assert len(contexts) == 3 and min(contexts) == 32
    assert snap["verify_context_s"][1].keys() == slopes.keys()
    for per in snap["verify_context_s"][1].values():
        assert list(per.values()) == sorted(per.values()) and per[32] == 0.0
    assert len(snap["draft_context_s"][1]) == 3
