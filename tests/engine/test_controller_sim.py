"""benchmarks/controller_sim.py: a sweep's fixed-depth costs replayed against the controller."""

import json
import math

import pytest

from benchmarks.controller_sim import Pace, _static_depth, compare, environment_from_costs, main, run

# Per depth, what a sweep's fixed settings measured at 32 requests (ms and tokens a sequence;
# rounded from s22b): depth 3 best, 5 close behind, plain decoding 0.8 of the best.
COSTS = {
    0: dict(draft_ms=0.0, verify_ms=28.3, rest_ms=1.9, tok_per_seq=1.00),
    1: dict(draft_ms=7.2, verify_ms=54.0, rest_ms=2.1, tok_per_seq=1.86),
    2: dict(draft_ms=10.9, verify_ms=51.5, rest_ms=2.3, tok_per_seq=2.59),
    3: dict(draft_ms=14.6, verify_ms=57.4, rest_ms=2.4, tok_per_seq=3.21),
    4: dict(draft_ms=18.9, verify_ms=68.2, rest_ms=2.6, tok_per_seq=3.65),
    5: dict(draft_ms=21.5, verify_ms=74.0, rest_ms=2.6, tok_per_seq=4.10),
    6: dict(draft_ms=27.0, verify_ms=86.7, rest_ms=2.9, tok_per_seq=4.51),
}


def test_the_environment_reproduces_what_the_fixed_settings_measured():
    env = environment_from_costs(32, COSTS)
    assert env.max_depth == 8 and env.measured_depth == 6
    for d, c in COSTS.items():
        # Exact but where the measured gain of a depth exceeds the one above it (5 over 4 here:
        # an acceptance above 1, noise), which is clipped to 0.99.
        assert env.mean_tokens(d) == pytest.approx(c["tok_per_seq"], rel=1e-6 if d < 5 else 0.01)
        assert env.verify[d] == pytest.approx(c["verify_ms"] / 1e3)
    # Past the measured depths each part goes on rising by its last step; nothing gets cheaper.
    assert env.draft[7] - env.draft[6] == pytest.approx(env.draft[6] - env.draft[5])
    assert env.verify[8] > env.verify[7] > env.verify[6]
    assert max(range(7), key=env.goodput) == 3
    with pytest.raises(SystemExit, match="without gaps"):
        environment_from_costs(32, {d: COSTS[d] for d in (0, 1, 3)})
    assert _static_depth("none") == 0 and _static_depth("static5") == 5
    with pytest.raises(ValueError, match="unknown setting"):
        _static_depth("static")


def test_the_pace_has_the_spread_and_memory_it_is_given():
    pace = Pace(__import__("random").Random(0), sd=0.11, phi=0.85, ar_share=0.65)
    xs = [math.log(pace.next()) for _ in range(40000)]
    m = sum(xs) / len(xs)
    var = sum((x - m) ** 2 for x in xs) / len(xs)
    lag1 = sum((a - m) * (b - m) for a, b in zip(xs, xs[1:])) / len(xs) / var
    assert math.sqrt(var) == pytest.approx(0.11, rel=0.05)
    assert lag1 == pytest.approx(0.85 * 0.65, abs=0.03)
    steady = Pace(__import__("random").Random(0), sd=0.0)
    assert {steady.next() for _ in range(10)} == {1.0}


def test_static_runs_yield_what_the_environment_says_and_share_their_requests():
    env = environment_from_costs(32, COSTS)
    for d in (0, 3, 6):
        r = run(env, "none" if d == 0 else f"static{d}", {}, seed=1, steps=300, pace_sd=0.0, part_sd=0.0)
        assert set(r["depths"]) == {d}
        # Requests differ in ease and end at max_tokens (their last steps draft less), so the
        # run reads a little below the population's goodput, never far from it.
        assert r["tokens"] / r["seconds"] == pytest.approx(env.goodput(d), rel=0.06)
    # The same seed: the same requests, pace and timing noise for every setting.
    a = run(env, "static3", {}, seed=4, steps=100)
    assert run(env, "static3", {}, seed=4, steps=100) == a
    assert run(env, "static3", {}, seed=5, steps=100) != a


def test_calibration_error_reaches_the_adaptive_controller_only():
    env = environment_from_costs(32, COSTS)
    # A fixed depth never reads the calibration; the controller plans from it.
    assert (run(env, "static3", {}, seed=2, steps=100, calibration_sd=0.3)
            == run(env, "static3", {}, seed=2, steps=100, calibration_sd=0.0))
    assert (run(env, "adaptive", {}, seed=2, steps=100, calibration_sd=0.3)
            != run(env, "adaptive", {}, seed=2, steps=100, calibration_sd=0.0))


def test_a_calibration_step_reaches_the_controller_at_the_rows_it_names():
    env = environment_from_costs(32, COSTS)
    # Read past depth 8 (no pass has that many rows): nothing changes; at 4 nodes a sequence
    # (the step from four rows to five read 10% flat) the controller plans on other costs.
    base = run(env, "adaptive", {}, seed=2, steps=150, calibration_sd=0.0)
    assert run(env, "adaptive", {}, seed=2, steps=150, calibration_sd=0.0, calibration_step=(9, 0.5)) == base
    assert run(env, "adaptive", {}, seed=2, steps=150, calibration_sd=0.0, calibration_step=(4, 0.9)) != base
    assert (run(env, "static4", {}, seed=2, steps=100, calibration_step=(4, 0.9))
            == run(env, "static4", {}, seed=2, steps=100))


def test_on_a_steady_host_the_controller_finds_the_best_depth():
    env = environment_from_costs(32, COSTS)
    res = compare(env, {"adaptive": {}, "restless": {"explore_interval": 2, "explore_batch": None}},
                  seeds=2, steps=300, pace_sd=0.0)
    assert res["best"] == "static3"
    ratio, se = res["ratios"]["adaptive"]
    assert ratio >= 0.97
    depths = res["depths"]["adaptive"]
    assert depths.get(3, 0) > 0.6 * sum(depths.values())
    # A knob setting runs through the same requests: exploring every other step costs.
    assert res["ratios"]["restless"][0] < ratio - 0.01


def test_prompt_steps_cost_their_pass_and_teach_the_controller_no_costs():
    env = environment_from_costs(32, COSTS)
    plain = run(env, "static3", {}, seed=2, steps=300, pace_sd=0.0, part_sd=0.0)
    prompts = run(env, "static3", {}, seed=2, steps=300, pace_sd=0.0, part_sd=0.0, prefill_share=0.35)
    # A request ends every ~20 steps per slot, so most steps carry a prompt: slower overall.
    assert prompts["tokens"] / prompts["seconds"] < 0.97 * plain["tokens"] / plain["seconds"]
    # The controller learns costs only from the steps without a prompt.
    from specserve.controller import AdaptiveController
    seen = []
    original = AdaptiveController.observe
    try:
        AdaptiveController.observe = lambda self, stats: (seen.append(stats.verify_s > 0), original(self, stats))[1]
        r = run(env, "adaptive", {}, seed=2, steps=200, pace_sd=0.0, prefill_share=0.35, warmup_steps=0)
    finally:
        AdaptiveController.observe = original
    assert 0.2 * len(seen) < seen.count(False) < 0.9 * len(seen)
    assert r["tokens"] > 0


def _fake_sweep(root, costs, conc=8, steps=40):
    """A one-process sweep's files: each fixed setting's result file and its decode-only steps."""
    lines, t = [], 1000.0
    for depth, c in costs.items():
        setting = "none" if depth == 0 else f"static{depth}"
        start = t
        for _ in range(steps):
            step_s = (c["draft_ms"] + c["verify_ms"] + c["rest_ms"]) / 1e3
            t += step_s
            lines.append(json.dumps({"t": t, "depth": depth, "nodes": depth, "decode": conc, "prefill_seqs": 0,
                                     "emitted": round(c["tok_per_seq"] * conc), "draft_s": c["draft_ms"] / 1e3,
                                     "verify_s": c["verify_ms"] / 1e3, "step_s": step_s}))
        (root / "round0").mkdir(exist_ok=True)
        (root / "round0" / f"{setting}_c{conc}.json").write_text(
            json.dumps({"started_at": start, "finished_at": t + 1e-3}))
        t += 1.0
    (root / "steps_shared.jsonl").write_text("\n".join(lines) + "\n")


def test_main_replays_a_sweeps_step_logs(tmp_path, capsys):
    _fake_sweep(tmp_path, {d: COSTS[d] for d in range(5)})
    out = tmp_path / "sim.json"
    assert main([str(tmp_path), "--concurrency", "8", "--seeds", "2", "--steps", "120",
                 "--knobs", "nbr:explore_margin=0", "--calibration-sd", "0.1", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "8 requests" in text and "adaptive / static" in text and "nbr / static" in text
    res = json.loads(out.read_text())["8"]
    assert set(res["static"]) == {"none", "static1", "static2", "static3", "static4"}
    assert len(res["adaptive"]["adaptive"]) == 2
    with pytest.raises(SystemExit, match="no result file"):
        main([str(tmp_path / "empty"), "--concurrency", "8"])
    assert main([str(tmp_path), "--concurrency", "8", "--seeds", "1", "--steps", "60",
                 "--calibration-step", "4:0.94"]) == 0
    with pytest.raises(SystemExit):
        main([str(tmp_path), "--concurrency", "8", "--calibration-step", "four"])
    assert "--calibration-step: NODES:FACTOR" in capsys.readouterr().err
