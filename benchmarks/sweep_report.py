"""Aggregate repeated sweeps: per (setting, concurrency) the output throughput pooled over the
repetitions (all their tokens over all their time) and the latencies of the repetition with the
median throughput; the table, and the checks issue 6 asks for.

    python -m benchmarks.sweep_report benchmarks/out/sweep1 benchmarks/out/sweep2 ... --out-dir DIR

Checks, on output tokens/s: at every concurrency the adaptive controller reaches >= 0.97x
the best static depth at that concurrency; no single static depth is within 0.97x of
adaptive at every concurrency; at the highest concurrency adaptive is at least 0.97x
no speculation.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

from benchmarks import plots


def load(dirs: list[Path]) -> dict:
    cells: dict = {}
    for d in dirs:
        path = d / "all_results.json"
        if not path.is_file():
            # The sweep writes it when the round is done: a round still running, or cut off.
            raise SystemExit(f"sweep_report: {path} not found (is {d} a finished sweep round?)")
        for r in json.loads(path.read_text()):
            key = (r["config"]["label"], int(r["config"]["max_concurrency"]))
            cells.setdefault(key, []).append(r)
    return cells


def median_run(runs: list[dict]) -> dict:
    """The repetition whose output throughput is the median (its latencies come with it)."""
    ordered = sorted(runs, key=lambda r: r["metrics"]["output_throughput"])
    return ordered[len(ordered) // 2]


def pooled(runs: list[dict]) -> dict:
    """The median repetition (latencies, depth series) with its output throughput replaced by
    the one pooled over every repetition: total output tokens over total duration. On a noisy
    machine one setting's rounds spread by +-15%, and the median of four throws away most of
    what was measured; pooling weighs each round by its length, as one long run would."""
    med = median_run(runs)
    tokens = sum(r["metrics"]["total_output_tokens"] for r in runs)
    seconds = sum(r["metrics"]["duration_s"] for r in runs)
    metrics = dict(med["metrics"], output_throughput=tokens / seconds if seconds > 0 else 0.0,
                   output_throughput_median_round=med["metrics"]["output_throughput"],
                   pooled_rounds=len(runs))
    return dict(med, metrics=metrics)


def report(cells: dict) -> tuple[str, list[dict]]:
    medians = {k: pooled(v) for k, v in cells.items()}
    settings = sorted({s for s, _ in medians}, key=lambda s: (s != "none", s != "adaptive", s))
    concs = sorted({c for _, c in medians})
    tput = {k: r["metrics"]["output_throughput"] for k, r in medians.items()}
    lines = ["| setting | " + " | ".join(f"c={c}" for c in concs) + " |",
             "|---|" + "---|" * len(concs)]
    for s in settings:
        lines.append(f"| {s} | " + " | ".join(f"{tput.get((s, c), float('nan')):.0f}" for c in concs) + " |")
    statics = [s for s in settings if s.startswith("static")]
    checks = ["", "| concurrency | best static | adaptive / best static | same, per round (min-max) "
              "| adaptive / none | adaptive depth (mean over run) |",
              "|---|---|---|---|---|---|"]
    ok_every = True
    for c in concs:
        best = max(statics, key=lambda s: tput.get((s, c), 0.0))
        ratio = tput[("adaptive", c)] / tput[(best, c)]
        ok_every &= ratio >= 0.97
        # Round i of every setting ran in the same stretch of time: the spread of the per-round
        # ratios shows how far the machine's noise reaches into the pooled one.
        per_round = [a["metrics"]["output_throughput"] / b["metrics"]["output_throughput"]
                     for a, b in zip(cells[("adaptive", c)], cells[(best, c)])]
        series = [d for r in cells[("adaptive", c)] for _, d in (r.get("depth_series") or [])]
        depth = statistics.mean(series) if series else float("nan")
        checks.append(f"| {c} | {best} ({tput[(best, c)]:.0f}) | {ratio:.3f} | "
                      f"{min(per_round):.2f}-{max(per_round):.2f} | "
                      f"{tput[('adaptive', c)] / tput[('none', c)]:.3f} | {depth:.1f} |")
    dominated = [s for s in statics if all(tput[(s, c)] >= 0.97 * tput[("adaptive", c)] for c in concs)]
    top = concs[-1]
    summary = [
        "",
        f"- adaptive >= 0.97x the best static depth at every concurrency: **{'yes' if ok_every else 'no'}**",
        f"- a single static depth within 0.97x of adaptive everywhere: **{', '.join(dominated) or 'none'}**",
        f"- at the highest concurrency ({top}) adaptive / no speculation = "
        f"**{tput[('adaptive', top)] / tput[('none', top)]:.3f}**",
        f"- repetitions per cell: {min(len(v) for v in cells.values())} (output tokens/s pooled over them; "
        "latencies from the repetition with the median throughput)",
    ]
    return "\n".join(lines + checks + summary) + "\n", list(medians.values())


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("dirs", nargs="+", type=Path)
    ap.add_argument("--out-dir", type=Path, required=True)
    args = ap.parse_args()
    args.out_dir.mkdir(parents=True, exist_ok=True)
    text, medians = report(load(args.dirs))
    (args.out_dir / "report.md").write_text(text)
    (args.out_dir / "median_results.json").write_text(json.dumps(medians, indent=1))
    for path in plots.make_all(medians, args.out_dir):
        print(path)
    print(text)


if __name__ == "__main__":
    main()
