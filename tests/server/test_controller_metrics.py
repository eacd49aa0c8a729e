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
    assert acc == pytest.approx(ctrl.acceptance.glob[False]) and all(0.0 <= a <= 1.0 for a in acc)
    assert after["specserve_controller_goodput_estimate"] == pytest.approx(ctrl.last_plan.goodput)
    # The capacity curve it decides from: probed at start-up, learned since.
    curve = ctrl.curve.to_dict()
    for b, row in zip(curve["buckets"], curve["verify_s"]):
        for r, seconds in enumerate(row, 1):
            assert after[f'specserve_controller_verify_seconds{{batch_size="{b}",rows="{r}"}}'] == \
                pytest.approx(seconds)
    assert after['specserve_controller_draft_level_seconds{batch_size="1"}'] > 0
    assert 'specserve_controller_step_rest_seconds{batch_size="1"}' in after
