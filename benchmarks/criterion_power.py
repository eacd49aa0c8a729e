"""How often a sweep would pass issue 6's first criterion, given how noisy its cells are.

    python -m benchmarks.criterion_power benchmarks/sweep_cpu_s40a/rounds.json [more rounds ...]
        [--rounds 8 16 32 64] [--levels 0.98 1.0 1.02] [--plot power.png]

The criterion: at every concurrency, adaptive's pooled output tokens/s is at least 0.97x the
best static depth's. Each pooled figure carries the cell noise (the sd of one cell's log
throughput about its setting's and its round's levels, `sweep_report.cell_noise`) over the
square root of the rounds, and the best static depth is the largest of six such figures, so
it reads high where the curve over depth is flat. A controller exactly as good as the best
depth therefore fails the criterion at some concurrency in most sweeps of a few rounds.

This simulates that. The static depths' true throughputs are taken to be the pooled figures
of the given rounds (their shape at each concurrency; `--flatten F` moves each toward the
best by the fraction F, for a flatter top than measured); adaptive's true throughput at each
concurrency is a level L times the best of them. Each simulated sweep draws every cell of
every round with the measured cell noise (`--noise` to set it), pools the rounds (mean of
the logs: rounds of equal length) and applies the criterion at every concurrency. Printed:
the share of sweeps that pass, per number of rounds and level. The model leaves out what
makes it optimistic: a controller's own run-to-run spread (its start-up calibration is drawn
once per server process) and any correlation between a round's cells beyond the round's level.
"""

from __future__ import annotations

import argparse
import math
import random
from pathlib import Path

from benchmarks import sweep_report
from benchmarks.runinfo import git_commit

THRESHOLD = 0.97


def static_curves(cells: dict) -> dict[int, list[float]]:
    """Per concurrency, the pooled output tokens/s of every static depth."""
    out: dict[int, list[float]] = {}
    for (setting, conc), runs in sorted(cells.items()):
        if setting.startswith("static"):
            out.setdefault(conc, []).append(sweep_report._pool(runs))
    return out


def pass_rate(curves: dict[int, list[float]], level: float, noise: float, rounds: int,
              trials: int = 4000, flatten: float = 0.0, seed: int = 0) -> float:
    """Share of simulated sweeps of `rounds` rounds in which adaptive (true throughput `level`
    x the best static depth's at each concurrency) reads >= THRESHOLD x the best static depth
    at every concurrency."""
    rng = random.Random(seed)
    sd = noise / math.sqrt(rounds)   # a pooled cell's log sd
    truths = {}   # per concurrency, each static depth's true log throughput
    for conc, statics in curves.items():
        top = max(statics)
        truths[conc] = [math.log(s + flatten * (top - s)) for s in statics]
    passed = 0
    for _ in range(trials):
        ok = True
        for conc, logs in truths.items():
            best = max(x + rng.gauss(0.0, sd) for x in logs)
            adaptive = math.log(level) + max(logs) + rng.gauss(0.0, sd)
            if adaptive - best < math.log(THRESHOLD):
                ok = False
                break
        passed += ok
    return passed / trials


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("inputs", nargs="+", type=Path,
                    help="kept rounds (a report's rounds.json, or its folder) or sweep round folders")
    ap.add_argument("--rounds", type=int, nargs="+", default=[8, 16, 32, 64])
    ap.add_argument("--levels", type=float, nargs="+", default=[0.98, 1.0, 1.02, 1.04],
                    help="adaptive's true throughput over the best static depth's")
    ap.add_argument("--noise", type=float, default=None,
                    help="cell noise (sd of a cell's log throughput); default: measured from the inputs")
    ap.add_argument("--flatten", type=float, default=0.0,
                    help="move each static depth toward the best by this fraction (0: as measured)")
    ap.add_argument("--trials", type=int, default=4000)
    ap.add_argument("--plot", type=Path, default=None, help="draw the pass rate over rounds into this PNG")
    args = ap.parse_args(argv)
    if not 0.0 <= args.flatten <= 1.0:
        ap.error(f"--flatten must be in [0, 1], got {args.flatten}")
    if any(r < 1 for r in args.rounds):
        ap.error(f"--rounds must be positive, got {args.rounds}")
    cells = sweep_report.load(args.inputs)
    curves = static_curves(cells)
    if not curves:
        raise SystemExit("criterion_power: the inputs hold no static settings")
    noise = args.noise
    if noise is None:
        measured = sweep_report.cell_noise(cells)
        if measured is None:
            raise SystemExit("criterion_power: fewer than two rounds: give --noise")
        noise = measured[0]
    header = "| rounds | " + " | ".join(f"L = {x:.2f}" for x in args.levels) + " |"
    lines = [f"cell noise {100 * noise:.1f}%, {len(curves)} concurrencies, static depths as pooled over "
             f"{min(len(v) for v in cells.values())} rounds (flatten {args.flatten}); commit {git_commit()}",
             "", "share of sweeps passing criterion 1 (adaptive >= 0.97x the best static at every concurrency), "
             "adaptive's true throughput L x the best static depth's:", "", header,
             "|---|" + "---|" * len(args.levels)]
    table = {}
    for r in args.rounds:
        table[r] = [pass_rate(curves, x, noise, r, args.trials, args.flatten) for x in args.levels]
        lines.append(f"| {r} | " + " | ".join(f"{p:.2f}" for p in table[r]) + " |")
    print("\n".join(lines))
    if args.plot:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(6.5, 4))
        for j, x in enumerate(args.levels):
            ax.plot(args.rounds, [table[r][j] for r in args.rounds], marker="o", label=f"adaptive = {x:.2f} x best")
        ax.set_xscale("log", base=2)
        ax.set_xticks(args.rounds, [str(r) for r in args.rounds])
        ax.set_xlabel("rounds pooled")
        ax.set_ylabel("share of sweeps passing")
        ax.set_ylim(0, 1.02)
        ax.set_title(f"Issue 6 criterion 1 at cell noise {100 * noise:.1f}%")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(args.plot, dpi=120)
        plt.close(fig)
        print(args.plot)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
