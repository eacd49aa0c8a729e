"""benchmarks/workload_shift.py: every setting runs every phase in order on an engine of its
own, the figures add up (each request decodes max_tokens), and bad phases are refused."""

from __future__ import annotations

import pytest
import torch

from benchmarks import workload_shift
from benchmarks.workload_shift import Phase
from specserve import LLM
from tests.checkpoints import make_checkpoint, make_noisy_copy


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("shift")
    target = make_checkpoint(root / "target", "llama", dtype=torch.float64)
    return target, make_noisy_copy(target, root / "draft", seed=4)   # accepts some, rejects some


@pytest.mark.parametrize("lockstep", [True, False])
def test_every_setting_runs_every_phase_and_the_figures_add_up(pair, tmp_path, lockstep):
    made = []

    def make_llm():
        llm = LLM(target=str(pair[0]), draft=str(pair[1]), dtype="float64", device="cpu", progress=False,
                  num_blocks=256, block_size=4, max_num_seqs=4, spec_mode="adaptive", spec__max_depth=4)
        made.append(llm)
        return llm

    phases = [Phase.parse(p) for p in ("4:6:3", "2:3:9:1.0", "3:4:7")]
    res = workload_shift.measure(make_llm, phases, ["adaptive", "static0", "static2"], repeat=2, progress=False,
                                 lockstep=lockstep)
    assert len(made) == 6   # an engine per setting per repetition
    assert res["phases"] == ["4:6:3", "2:3:9:1", "3:4:7"]
    for setting, rows in res["results"].items():
        assert len(rows) == 3
        for phase, row in zip(phases, rows):
            assert len(row["runs"]) == 2
            for run in row["runs"]:
                assert run["tokens"] == phase.num_requests * phase.max_tokens
                assert run["steps"] == sum(run["depths"].values()) > 0
                assert run["tokens_per_s"] == pytest.approx(run["tokens"] / run["seconds"])
            assert min(r["tokens_per_s"] for r in row["runs"]) <= row["tokens_per_s"] <= max(
                r["tokens_per_s"] for r in row["runs"])
    assert all(set(run["depths"]) == {"0"} for row in res["results"]["static0"] for run in row["runs"])
    assert all(set(run["depths"]) <= {"0", "2"} for row in res["results"]["static2"] for run in row["runs"])
    # A plain step of static0 yields one token a sequence: never fewer steps than tokens / B.
    for phase, row in zip(phases, res["results"]["static0"]):
        assert row["runs"][0]["steps"] >= phase.num_requests * phase.max_tokens / phase.batch
    for i, r in enumerate(res["adaptive_over_best_static"]):
        best = res["results"][r["best"]][i]["tokens_per_s"]
        assert best == max(res["results"][s][i]["tokens_per_s"] for s in ("static0", "static2"))
        assert r["ratio"] == pytest.approx(res["results"]["adaptive"][i]["tokens_per_s"] / best)
    table = workload_shift.format_table(res)
    assert table.count("\n") == 4 and "adaptive / best static" in table
    assert workload_shift.plot(res, tmp_path / "shift.png").stat().st_size > 0


@pytest.mark.parametrize("text, message", [
    ("4:8", "expected B:N:max_tokens"),
    ("4:x:8", "integers"),
    ("0:8:8", "at least 1"),
    ("4:8:8:-1", "temperature >= 0"),
    ("4:8:8:1.0:1.5", "top_p in"),
])
def test_bad_phases_are_refused_naming_them(text, message):
    with pytest.raises(ValueError, match=message):
        Phase.parse(text)


def test_the_command_line_refuses_bad_settings_and_phases(capsys):
    with pytest.raises(SystemExit):
        workload_shift.main(["--settings", "adaptive", "deep9"])
    assert "deep9" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        workload_shift.main(["--phases", "4:8"])
    assert "4:8" in capsys.readouterr().err


def test_lockstep_takes_turns_phase_by_phase_each_engine_in_order(monkeypatch):
    """Lockstep: every engine runs phase i before any runs phase i + 1, the settings' order
    rotates from phase to phase, and each engine still meets its phases in order."""
    from types import SimpleNamespace

    order = []

    def fake_run_phase(llm, phase, prompts, seed):
        order.append((llm.setting, phase.max_tokens))
        return {"tokens": 1, "seconds": 1.0, "tokens_per_s": 1.0, "steps": 1, "depths": {"0": 1}}

    def make_llm():
        engine = SimpleNamespace(pool=SimpleNamespace(check_all_free=lambda: None))
        llm = SimpleNamespace(engine=engine, setting=None)
        engine.set_speculation = lambda mode, depth: setattr(llm, "setting", mode + ("" if depth is None else str(depth)))
        return llm

    monkeypatch.setattr(workload_shift, "run_phase", fake_run_phase)
    phases = [Phase.parse(f"1:1:{n}") for n in (1, 2, 3)]
    workload_shift.measure(make_llm, phases, ["adaptive", "static0", "static2"], progress=False)
    assert [n for _, n in order] == [1, 1, 1, 2, 2, 2, 3, 3, 3]
    assert [s for s, _ in order[:3]] == ["adaptive", "static0", "static2"]
    assert [s for s, _ in order[3:6]] == ["static0", "static2", "adaptive"]
    order.clear()
    workload_shift.measure(make_llm, phases, ["adaptive", "static0"], progress=False, lockstep=False)
    assert order == [("adaptive", 1), ("adaptive", 2), ("adaptive", 3), ("static0", 1), ("static0", 2), ("static0", 3)]
