"""benchmarks.controller_replay: a record of the controller's decisions that a change must match."""

import functools

from benchmarks import controller_replay
from benchmarks.controller_replay import first_difference, replay


def test_a_replay_is_the_same_every_time_and_a_changed_controller_is_caught():
    records, spent = replay(8, 150, seed=3)
    assert spent > 0 and len(records) == 150
    assert len({r[0] for r in records}) > 1   # the plan moves: explorations, batch changes
    assert first_difference(records, replay(8, 150, seed=3)[0]) is None
    changed = replay(8, 150, seed=3, band_margin=0.0)[0]
    assert first_difference(records, changed) is not None
    assert first_difference(records, records[:100]) == 100


def test_record_then_check_passes_and_fails_on_a_change(tmp_path, monkeypatch, capsys):
    path = tmp_path / "replay.json"
    assert controller_replay.main(["record", str(path), "--batch-sizes", "2", "16", "--steps", "80"]) == 0
    assert controller_replay.main(["check", str(path)]) == 0
    assert capsys.readouterr().out.count("identical") == 2
    monkeypatch.setattr(controller_replay, "AdaptiveController",
                        functools.partial(controller_replay.AdaptiveController, switch_margin=0.0, band_margin=0.0))
    assert controller_replay.main(["check", str(path)]) == 1
    assert "DIFFERS from step" in capsys.readouterr().out
