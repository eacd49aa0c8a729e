"""The adaptive controller on synthetic costs: the capacity curve, the acceptance estimates,
the plan (checked against brute force), early stop and learning (specserve/controller.py)."""

from __future__ import annotations

import itertools

import pytest

from specserve.controller import (AdaptiveController, Acceptance, CapacityCurve, ControllerConfig, EarlyStop, Plan,
                                  _monotone)

BUCKETS = [1, 2, 4, 8, 16, 32, 64]


def curve(base=0.010, per_row=0.0, per_seq=0.0, level=0.001, rest=0.0005, rows=9) -> CapacityCurve:
    """verify(B, r) = base + per_seq B + per_row B r; a draft level and the rest constant."""
    return CapacityCurve(BUCKETS, [[base + per_seq * b + per_row * b * r for r in range(1, rows + 1)] for b in BUCKETS],
                         [level] * len(BUCKETS), [rest] * len(BUCKETS))


def goodput(c: CapacityCurve, rates: list[list[float]], lengths: list[int]) -> float:
    """G of giving sequence i lengths[i] chain nodes, sequence i's conditional rates rates[i]."""
    tokens = 0.0
    for r, n in zip(rates, lengths):
        p = 1.0
        tokens += 1.0
        for a in r[:n]:
            p *= a
            tokens += p
    B = len(lengths)
    return tokens / (c.rest_s(B) + max(lengths) * c.level_s(B) + c.verify_s(B, B + sum(lengths)))


def controller(c: CapacityCurve, rates: dict | None = None, **cfg) -> AdaptiveController:
    ctl = AdaptiveController(c, config=ControllerConfig(**{"margin": 0.0, **cfg}))
    if rates:
        for rid, r in rates.items():   # a request's own estimate: pinned by many observations
            ctl.acceptance.requests[rid] = ([1e12 * a for a in r], [1e12] * len(r), [0])
    return ctl


# -- the capacity curve ---------------------------------------------------------------------

def test_the_curve_interpolates_batch_sizes_and_rows():
    c = curve(base=0.01, per_row=0.001)
    assert c.verify_s(8, 8 * 3) == pytest.approx(0.01 + 0.001 * 24)
    assert c.verify_s(12, 12 * 2) == pytest.approx(0.5 * (0.01 + 0.016) + 0.5 * (0.01 + 0.032))
    assert c.verify_s(4, 4 * 2.5) == pytest.approx(0.01 + 0.001 * 10)
    assert c.verify_s(1, 12) > c.verify_s(1, 9)   # past the table: along its last segment


def test_pooling_adjacent_violators_gives_the_nearest_non_decreasing_row():
    assert _monotone([1.0, 3.0, 2.0, 4.0]) == [1.0, 2.5, 2.5, 4.0]
    assert _monotone([5.0, 1.0, 1.0]) == [7 / 3] * 3
    xs = [3.0, 1.0, 2.0, 6.0, 5.0]
    out = _monotone(list(xs))
    assert out == sorted(out) and sum(out) == pytest.approx(sum(xs))


def test_a_slower_machine_lifts_every_row_and_the_shape_moves_where_measured():
    c = curve(base=0.01, per_row=0.001)
    cfg = ControllerConfig()
    before = c.verify_row(8)
    for _ in range(60):   # every pass of 8 x 3 rows now takes 1.5x
        c.observe(8, 24, 1.5 * before[2], 0, 0.0, None, cfg)
    after = c.verify_row(8)
    assert after[2] == pytest.approx(1.5 * before[2], rel=0.02)
    assert all(a > 1.2 * b for a, b in zip(after, before))    # unmeasured rows follow the level
    assert after == sorted(after)


def test_a_measured_dip_never_makes_more_rows_cheaper():
    c = curve(base=0.01, per_row=0.001)
    for _ in range(200):
        c.observe(8, 8 * 5, 0.5 * c.verify_s(8, 8 * 5), 0, 0.0, None, ControllerConfig())
    row = c.verify_row(8)
    assert row == sorted(row)


def test_levels_and_the_rest_of_a_step_are_learned():
    c = curve(level=0.001, rest=0.0)
    c.rest = [0.0] * len(BUCKETS)
    c.num_rest = [0] * len(BUCKETS)
    cfg = ControllerConfig()
    c.observe(4, 12, c.verify_s(4, 12), 2, 0.006, 0.002, cfg)
    assert c.rest_s(4) == pytest.approx(0.002)   # the first measurement, not an EMA from 0
    for _ in range(100):
        c.observe(4, 12, c.verify_s(4, 12), 2, 0.006, 0.002, cfg)
    assert c.level_s(4) == pytest.approx(0.003, rel=0.01)


# -- acceptance -----------------------------------------------------------------------------

def test_a_requests_rates_start_global_and_move_with_its_own_evidence():
    cfg = ControllerConfig(max_depth=4)
    acc = Acceptance(cfg)
    assert acc.rates("a", False, 0) == [cfg.initial_acceptance] * 4
    for step in range(1, 30):
        acc.observe("a", False, 4, 4, step)   # every node accepted
        acc.observe("b", False, 4, 0, step)   # none
    a, b = acc.rates("a", False, 30), acc.rates("b", False, 30)
    assert a[0] > 0.8 > 0.3 > b[0]
    assert acc.rates("b", False, 30)[1] == acc.glob[False][1]   # never observed past its first miss
    # Not verified for a while: back toward the global rates.
    later = acc.rates("b", False, 200)[0]
    assert later == pytest.approx(acc.glob[False][0], abs=0.01)
    acc.forget("a")
    assert "a" not in acc.requests
    assert acc.glob[True] == [cfg.initial_acceptance] * 4   # sampled requests apart


def test_each_request_teaches_the_global_rates_only_its_first_observations():
    cfg = ControllerConfig(max_depth=2, teach_global=3)
    acc = Acceptance(cfg)
    for step in range(100):   # one request accepted for ever: it must not dominate
        acc.observe("lucky", False, 1, 1, step)
    assert acc.seen[False][0] == 3
    for i in range(40):
        acc.observe(f"new{i}", False, 1, 0, 0)
    assert acc.glob[False][0] < 0.3


# -- the plan -------------------------------------------------------------------------------

@pytest.mark.parametrize("batch", [1, 2, 3])
@pytest.mark.parametrize("costs", [dict(per_row=0.0005), dict(per_row=0.003, level=0.004), dict(per_row=0.0001)])
def test_the_plan_is_the_best_set_of_chains(batch, costs):
    """Brute force over every combination of chain lengths: none has a higher goodput."""
    c = curve(**costs, rows=6)
    rates = [[0.9, 0.85, 0.8, 0.7, 0.6], [0.5, 0.4, 0.3, 0.3, 0.2], [0.95] * 5][:batch]
    ctl = controller(c, dict(enumerate(rates)), max_depth=5)
    plan = ctl.plan([(i, 5, False) for i in range(batch)])
    lengths = [plan.nodes.get(i, 0) for i in range(batch)]
    best = max(goodput(c, rates, list(ls)) for ls in itertools.product(range(6), repeat=batch))
    assert goodput(c, rates, lengths) == pytest.approx(best, rel=1e-9)
    assert plan.goodput == pytest.approx(best, rel=1e-9)
    assert plan.depth == max(lengths)


def test_sure_requests_run_deeper_than_unsure_ones():
    ctl = controller(curve(per_row=0.0004), {"sure": [0.95] * 8, "unsure": [0.45] * 8})
    plan = ctl.plan([("sure", 20, False), ("unsure", 20, False)])
    assert plan.nodes["sure"] > plan.nodes.get("unsure", 0)


def test_rows_that_are_dear_make_plain_decoding():
    ctl = controller(curve(base=0.002, per_row=0.002, level=0.002))
    plan = ctl.plan([(i, 20, False) for i in range(64)])
    assert plan.depth == 0 and not plan.nodes
    ctl = controller(curve(base=0.02, per_row=0.00001))   # rows nearly free: deep
    assert ctl.plan([(i, 20, False) for i in range(4)]).depth >= 4


def test_no_request_gets_more_nodes_than_it_can_use():
    ctl = controller(curve(per_row=0.0))
    plan = ctl.plan([("a", 2, False), ("b", 0, False), ("c", 20, False)])
    assert plan.nodes["a"] <= 2 and "b" not in plan.nodes and plan.nodes["c"] <= 8


def test_a_near_tie_is_plain_decoding():
    c = curve(per_row=0.0003)
    ctl = controller(c, {0: [0.5] * 8})
    assert ctl.plan([(0, 20, False)]).depth > 0
    plain = 1 / (c.rest_s(1) + c.verify_s(1, 1))
    gain = ctl.last_plan.goodput / plain - 1
    ctl = controller(c, {0: [0.5] * 8}, margin=gain + 0.01)
    assert ctl.plan([(0, 20, False)]).depth == 0


def test_trees_take_one_depth_for_the_batch():
    nodes = [0, 3, 6, 8, 9]   # e.g. branching [3, 2, ...]
    c = curve(per_row=0.0001, rows=10)
    ctl = AdaptiveController(c, nodes, ControllerConfig(max_depth=4, margin=0.0))
    plan = ctl.plan([("a", 20, False), ("b", 1, False)])
    d = plan.depth
    assert d > 0 and plan.nodes == {"a": nodes[d], "b": nodes[1]}


def test_a_calibrated_draft_stops_its_own_chains():
    c = curve(per_row=0.0005)
    ctl = AdaptiveController(c, None, ControllerConfig(margin=0.0), path_probs=True)
    seqs = [(i, 20, False) for i in range(4)]
    assert ctl.plan(seqs).early_stop is None   # nothing known of its calibration yet
    chains = [(i, False, 4, 3, [0.9, 0.8, 0.7, 0.4]) for i in range(4)]   # 3 accepted of 2.8 predicted
    for _ in range(100):
        ctl.observe(4, 20, 4, 0.004, c.verify_s(4, 20), 0.0005, chains)
    assert ctl.calibration == pytest.approx(3 / 2.8, rel=0.01)
    plan = ctl.plan(seqs)
    assert plan.early_stop is not None and plan.early_stop.ratio == ctl.calibration
    assert all(n == 8 for n in plan.nodes.values())   # up to the cap: the drafter cuts
    for _ in range(500):   # far from calibrated: the estimates decide alone
        ctl.observe(4, 20, 4, 0.004, c.verify_s(4, 20), 0.0005, [(i, False, 4, 0, [0.9, 0.8, 0.7, 0.6])
                                                                  for i in range(4)])
    assert ctl.plan(seqs).early_stop is None


def test_early_stop_keeps_nodes_that_pay_for_their_rows():
    # One sequence; the first row past plain decoding carries a fixed 20 ms, then 4 ms a row.
    stop = EarlyStop(goodput=100.0, ratio=1.0, rate=0.8, level_s=0.001,
                     verify_s=[0.01, 0.034, 0.038, 0.042, 0.046], batch_size=1, rows=1)
    assert not stop.keep(0.39)        # 100 tok/s x 4 ms a row = 0.4 tokens: the fixed part is not a row's
    assert stop.keep(0.41) and stop.rows == 2
    assert stop.next_level([0.9])     # 0.72 tokens against 0.5
    assert not stop.next_level([0.5])


def test_observe_learns_costs_only_from_decode_steps():
    c = curve(per_row=0.001)
    ctl = controller(c)
    before = c.verify_s(8, 16)
    ctl.observe(8, 16, 1, 0.002, 3 * before, 0.001, [("a", False, 1, 1, [])], timed=False)
    assert c.verify_s(8, 16) == before and "a" in ctl.acceptance.requests
    ctl.observe(8, 16, 1, 0.002, 3 * before, 0.001, [])
    assert c.verify_s(8, 16) > before
    snap = ctl.snapshot()
    assert snap["curve"]["buckets"] == BUCKETS and snap["calibration"] is None
    assert isinstance(ctl.plan([]), Plan)
