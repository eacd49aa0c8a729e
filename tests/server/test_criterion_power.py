"""benchmarks/criterion_power.py: how often a sweep passes issue 6's first criterion."""

import json

import pytest

from benchmarks import criterion_power


def kept_rounds(path, statics: dict[int, list[float]], adaptive: dict[int, float], rounds: int = 2):
    """A rounds.json (sweep_report's kept rounds) of `rounds` identical rounds: one second a
    cell, the given tokens."""
    records = []
    for r in range(rounds):
        for conc, tputs in statics.items():
            for i, t in enumerate(tputs, start=1):
                records.append({"setting": f"static{i}", "concurrency": conc, "round": r,
                                "output_tokens": int(t * (1 + 0.01 * r * (-1) ** i)), "seconds": 1.0})
            records.append({"setting": "adaptive", "concurrency": conc, "round": r,
                            "output_tokens": int(adaptive[conc]), "seconds": 1.0})
    path.write_text(json.dumps(records))
    return path


def test_without_noise_the_criterion_is_its_threshold():
    curves = {1: [100.0, 120.0, 110.0], 8: [500.0, 480.0, 400.0]}
    for level, expected in ((0.969, 0.0), (0.971, 1.0), (1.0, 1.0)):
        assert criterion_power.pass_rate(curves, level, noise=0.0, rounds=8, trials=50) == expected


def test_noise_fails_a_controller_as_good_as_the_best_depth_and_more_rounds_help():
    # A flat top (three depths within 1%) at each of seven concurrencies, 6% cell noise.
    curves = {c: [1000.0, 995.0, 990.0, 900.0] for c in (1, 2, 4, 8, 16, 32, 64)}
    rate = {(r, x): criterion_power.pass_rate(curves, x, noise=0.06, rounds=r, trials=3000)
            for r in (8, 64) for x in (1.0, 1.03)}
    assert rate[(8, 1.0)] < 0.5          # most 8-round sweeps fail an exactly-as-good controller
    assert rate[(64, 1.0)] > rate[(8, 1.0)] + 0.3
    assert rate[(8, 1.03)] > rate[(8, 1.0)] + 0.2
    # Flattening the statics all the way (every depth at the best) makes the pick's bias larger.
    flat = criterion_power.pass_rate(curves, 1.0, noise=0.06, rounds=8, trials=3000, flatten=1.0)
    assert flat < rate[(8, 1.0)]


def test_the_command_reads_kept_rounds_and_draws_the_plot(tmp_path, capsys):
    rounds = kept_rounds(tmp_path / "rounds.json", {1: [100, 120, 110], 4: [300, 320, 310]}, {1: 121, 4: 330})
    plot = tmp_path / "power.png"
    assert criterion_power.main([str(rounds), "--rounds", "4", "16", "--levels", "1.0", "--trials", "200",
                                 "--noise", "0.05", "--plot", str(plot)]) == 0
    out = capsys.readouterr().out
    assert "cell noise 5.0%, 2 concurrencies" in out
    assert "| rounds | L = 1.00 |" in out and "| 4 | " in out and "| 16 | " in out
    assert plot.is_file() and plot.stat().st_size > 0
    # The measured cell noise when none is given.
    assert criterion_power.main([str(rounds), "--rounds", "8", "--trials", "50"]) == 0
    assert "cell noise" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        criterion_power.main([str(rounds), "--flatten", "2"])
