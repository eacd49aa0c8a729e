"""benchmarks/paired.py: settings in turn inside one engine, the controller fed only by its own runs."""

import json

import pytest

from benchmarks.paired import main, paired_ratio, parse_setting, plot, report, run, step_kind, summarise
from specserve import LLM


def test_settings_and_ratios():
    assert parse_setting("adaptive") is None and parse_setting("static5") == 5
    assert parse_setting("static8@0.3") == (8, 0.3)
    assert parse_setting("calm", {"calm": {"stop_scale": 0}}) == "calm"
    for bad in ("static", "staticx", "none", "Adaptive", "static8@", "static8@0", "static8@1.5", "static8@x", "calm"):
        with pytest.raises(ValueError, match="unknown setting"):
            parse_setting(bad)
    mean, se = paired_ratio([2.0, 4.0, 3.0], [1.0, 2.0, 2.0])
    assert mean == pytest.approx(11 / 6) and se == pytest.approx(((1 / 12) / 3) ** 0.5)
    assert paired_ratio([3.0], [2.0]) == (1.5, None)
    assert step_kind({"prefill_seqs": 1, "decode": 8}, 8) == "mixed"
    assert step_kind({"prefill_seqs": 0, "decode": 6}, 8) == "full"
    assert step_kind({"prefill_seqs": 0, "decode": 5}, 8) == "tail"


def test_an_unknown_setting_is_refused_before_anything_loads():
    with pytest.raises(ValueError, match="unknown setting 'static'"):
        main(["--settings", "adaptive", "static", "--no-progress"])


def test_runs_count_every_token_and_static_runs_leave_the_controller_alone(tmp_path):
    log = tmp_path / "steps.jsonl"
    log.touch()
    llm = LLM(progress=False, max_num_seqs=2, cpu_threads=1, step_log=str(log))
    prompts = [llm.tokenizer.encode(t)[:12] for t in ("The cat sat on", "A quick brown fox", "Once upon a", "In the")]
    controller = llm.engine.spec.controller
    before, depth0 = controller.num_steps, llm.engine.spec.config.spec.depth
    res = run(llm, ["static2", "static3"], 2, prompts, 8, 2, log, progress=False, warmup=False)
    assert controller.num_steps == before   # detached: the static runs fed it nothing
    for name, depth in (("static2", 2), ("static3", 3)):
        e = res["settings"][name]
        assert len(e["tokens_per_s"]) == 2 and all(x > 0 for x in e["tokens_per_s"])
        steps = e["steps"]
        assert sum(steps[k]["tokens"] for k in ("full", "tail", "mixed")) == 2 * 4 * 8   # every token, once
        assert set(steps["depths"]) == {depth}
    # With the adaptive setting: its own figures and the paired ratios.
    res3 = run(llm, ["adaptive", "static2"], 2, prompts, 8, 2, log, progress=False)
    assert controller.num_steps > before and llm.engine.spec.config.spec.depth == depth0   # restored
    ratio = res3["settings"]["static2"]["adaptive_over_this"]
    a, s = res3["settings"]["adaptive"]["tokens_per_s"], res3["settings"]["static2"]["tokens_per_s"]
    assert ratio["mean"] == pytest.approx((a[0] / s[0] + a[1] / s[1]) / 2) and ratio["se"] is not None
    text = report(res3)
    assert "| adaptive |" in text and "| static2 |" in text
    assert plot(res3, tmp_path / "p.png").stat().st_size > 0
    json.dumps(res3)


def test_knob_and_hand_set_early_stop_settings_run_in_the_same_engine(tmp_path):
    # A knob setting plans with its own copy of the start-up controller (which it leaves as it
    # was); staticD@P drafts chains of at most D, each stopping below P, and puts the
    # configured early stop back.
    log = tmp_path / "steps.jsonl"
    log.touch()
    llm = LLM(progress=False, max_num_seqs=2, cpu_threads=1, step_log=str(log))
    prompts = [llm.tokenizer.encode(t)[:12] for t in ("The cat sat on", "A quick brown fox", "Once upon a", "In the")]
    spec = llm.engine.spec
    start, before, stop0 = spec.controller, spec.controller.num_steps, spec.config.spec.early_stop
    seen = []
    real = spec.drafter.propose

    def propose(seqs, shape, prefills):
        trees = real(seqs, shape, prefills)
        seen.extend((shape.stop_below, t) for t in trees if t.num_nodes)
        return trees

    spec.drafter.propose = propose
    res = run(llm, ["calm", "static3@0.9"], 2, prompts, 8, 2, log, progress=False, warmup=False,
              knobs={"calm": {"stop_scale": 0, "explore_interval": 16}})
    assert start.num_steps == before and spec.controller is start and spec.config.spec.early_stop == stop0
    assert res["knobs"] == {"calm": {"stop_scale": 0, "explore_interval": 16}}
    for name in ("calm", "static3@0.9"):
        steps = res["settings"][name]["steps"]
        assert sum(steps[k]["tokens"] for k in ("full", "tail", "mixed")) == 2 * 4 * 8
    assert set(res["settings"]["static3@0.9"]["steps"]["depths"]) == {3}
    hand = [t for stop, t in seen if stop == 0.9]
    assert hand and all(t.num_nodes <= 3 for t in hand)
    assert any(t.num_nodes < min(3, t.room) for t in hand), "no chain stopped below 0.9"
    assert all(stop == 0.0 for stop, t in seen if stop != 0.9)   # calm: no early stop of its own


def test_summarise_splits_steps_by_kind():
    recs = [
        {"prefill_seqs": 0, "decode": 4, "step_s": 0.1, "emitted": 12, "draft_s": 0.02, "verify_s": 0.06, "depth": 3},
        {"prefill_seqs": 0, "decode": 1, "step_s": 0.05, "emitted": 4, "draft_s": 0.01, "verify_s": 0.03, "depth": 3},
        {"prefill_seqs": 2, "decode": 2, "step_s": 0.2, "emitted": 6, "draft_s": 0.04, "verify_s": 0.1, "depth": 2},
    ]
    s = summarise(recs, 4)
    assert s["full"]["steps"] == 1 and s["full"]["tokens_per_s"] == pytest.approx(120)
    assert s["full"]["verify_ms_per_seq"] == pytest.approx(15) and s["tail"]["tokens"] == 4
    assert s["mixed"]["draft_ms_per_seq"] == pytest.approx(20) and s["depths"] == {2: 1, 3: 2}
