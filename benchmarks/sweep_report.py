"""Aggregate repeated sweeps: per (setting, concurrency) the output throughput pooled over the
repetitions (all their tokens over all their time) and the latencies of the repetition with the
median throughput; the table, and the checks issue 6 asks for.

    python -m benchmarks.sweep_report benchmarks/out/sweep1 benchmarks/out/sweep2 ... --out-dir DIR

Checks, on output tokens/s: at every concurrency the adaptive controller reaches >= 0.97x
the best static depth at that concurrency; no single static depth is within 0.97x of
adaptive at every concurrency; at the highest concurrency adaptive is at least 0.97x
no speculation. Settings from `sweep --variant` (another revision's adaptive controller) are
set beside adaptive in a table of their own; `--baseline NAME` reads them against another
setting instead (an A/B sweep of two revisions, `--settings new pre`, has no adaptive).

The best static depth of a concurrency is picked by its measured throughput, so its figure is
the largest of six noisy ones and reads high: where the curve is flat and the noise is ~10% a
cell (the eleventh and twelfth sessions' host), the pick alone is worth a few percent. The report
therefore also compares adaptive with a best static depth picked out of sample: for each
round, the depth best on the other rounds, measured on that round (leave one round out,
pooled over the rounds). That figure reads low where the pick is sometimes wrong, so the
truth lies between the two.

**Rounds kept for pooling.** A round's raw results (``benchmarks/out/...``) are not committed,
but the report writes ``rounds.json`` beside itself: per run its setting, concurrency, seed,
commit, output tokens and seconds, all that pooling reads. Such a file (or a report folder
holding one) may stand among the inputs in place of round folders, so that rounds of one
controller swept in different sessions are pooled into one reading::

    python -m benchmarks.sweep_report benchmarks/sweep_cpu_s40a/rounds.json benchmarks/out/s41a/round* --out-dir DIR

Latencies and plots come from the full rounds only (the compact ones carry none). The
checks table gives each adaptive / best static ratio its standard error, from the spread of
the rounds' own ratios: one sweep of 8 rounds on the dev CPU reads a ratio to +-2-4%, and the
criterion asks 0.97 of seven of them, so rounds pooled across sweeps are how it is read more
closely than that.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
from pathlib import Path

from benchmarks import plots


ROUNDS_FILE = "rounds.json"


def load(dirs: list[Path]) -> dict:
    """{(setting, concurrency): [run, ...]} from sweep round folders (their all_results.json)
    and kept rounds (a rounds.json this module wrote, or a report folder holding one), in the
    order given: the i-th run of every cell is round i."""
    cells: dict = {}
    for d in dirs:
        if d.is_file() or (not (d / "all_results.json").is_file() and (d / ROUNDS_FILE).is_file()):
            runs = read_rounds(d if d.is_file() else d / ROUNDS_FILE)
        else:
            path = d / "all_results.json"
            if not path.is_file():
                # The sweep writes it when the round is done: a round still running, or cut off.
                raise SystemExit(f"sweep_report: {path} not found (is {d} a finished sweep round?)")
            runs = json.loads(path.read_text())
        for r in runs:
            key = (r["config"]["label"], int(r["config"]["max_concurrency"]))
            cells.setdefault(key, []).append(r)
    return cells


def compact_rounds(cells: dict) -> list[dict]:
    """What pooling reads of every run, one small record each (ROUNDS_FILE), in round order."""
    out = []
    for (label, conc), runs in sorted(cells.items()):
        for i, r in enumerate(runs):
            m = r["metrics"]
            out.append({"setting": label, "concurrency": conc, "round": i,
                        "seed": r["config"].get("seed"), "commit": r.get("commit"),
                        "output_tokens": m["total_output_tokens"], "seconds": m["duration_s"]})
    return out


def read_rounds(path: Path) -> list[dict]:
    """Runs from a ROUNDS_FILE, shaped as the sweep's results with only what pooling reads
    (``compact``: no latencies). A SystemExit naming the file and the record that is wrong."""
    try:
        records = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise SystemExit(f"sweep_report: cannot read kept rounds {path}: {e}") from None
    runs = []
    for i, rec in enumerate(records if isinstance(records, list) else [None]):
        try:
            tokens, seconds = int(rec["output_tokens"]), float(rec["seconds"])
            config = {"label": str(rec["setting"]), "max_concurrency": int(rec["concurrency"]),
                      "seed": rec.get("seed")}
        except (TypeError, KeyError, ValueError):
            raise SystemExit(f"sweep_report: {path}: record {i} is not a kept round "
                             "(setting, concurrency, output_tokens, seconds)") from None
        if seconds <= 0:
            raise SystemExit(f"sweep_report: {path}: record {i} has seconds={seconds}, must be > 0")
        runs.append({"config": config, "commit": rec.get("commit"), "compact": True,
                     "metrics": {"output_throughput": tokens / seconds, "total_output_tokens": tokens,
                                 "duration_s": seconds}})
    # Round order within a cell: the record's round index (a file lists cells one after another).
    return [r for _, r in sorted(zip(records, runs), key=lambda x: x[0].get("round", 0))]


def median_run(runs: list[dict]) -> dict:
    """The repetition whose output throughput is the median (its latencies come with it), of
    the full runs where there are any (kept rounds carry no latencies)."""
    full = [r for r in runs if not r.get("compact")] or runs
    ordered = sorted(full, key=lambda r: r["metrics"]["output_throughput"])
    return ordered[len(ordered) // 2]


def _pool(runs: list[dict]) -> float:
    """Output tokens/s over all the runs: all their tokens over all their time."""
    seconds = sum(r["metrics"]["duration_s"] for r in runs)
    return sum(r["metrics"]["total_output_tokens"] for r in runs) / seconds if seconds > 0 else 0.0


def pooled(runs: list[dict]) -> dict:
    """The median repetition (latencies, depth series) with its output throughput replaced by
    the one pooled over every repetition: total output tokens over total duration. On a noisy
    machine one setting's rounds spread by +-15%, and the median of four throws away most of
    what was measured; pooling weighs each round by its length, as one long run would."""
    med = median_run(runs)
    metrics = dict(med["metrics"], output_throughput=_pool(runs),
                   output_throughput_median_round=med["metrics"]["output_throughput"],
                   pooled_rounds=len(runs))
    return dict(med, metrics=metrics)


def held_out_best(cells: dict, statics: list[str], conc: int) -> tuple[float, list[str]] | None:
    """Output throughput of the best static depth picked out of sample: for each round i, the
    depth with the highest throughput pooled over the other rounds, as it measured in round i;
    pooled over the rounds. Returns (throughput, the depth picked per round); None with fewer
    than two rounds (or rounds missing from some setting)."""
    runs = {s: cells.get((s, conc), []) for s in statics}
    num_rounds = min((len(v) for v in runs.values()), default=0)
    if num_rounds < 2 or any(len(v) != num_rounds for v in runs.values()):
        return None
    picks = []
    for i in range(num_rounds):
        others = {s: [r for j, r in enumerate(v) if j != i] for s, v in runs.items()}
        picks.append(max(statics, key=lambda s: _pool(others[s])))
    return _pool([runs[s][i] for i, s in enumerate(picks)]), picks


def log_se(logs: list[float]) -> float | None:
    """Standard error of a ratio pooled over rounds, from the logs of its rounds' own ratios:
    their sd over the square root of their number (relative; None from one round)."""
    if len(logs) < 2:
        return None
    return statistics.stdev(logs) / len(logs) ** 0.5


def cell_noise(cells: dict) -> tuple[float, int] | None:
    """How far one cell's throughput strays on its own: the standard deviation of log output
    tokens/s about a two-way fit (a level per setting and one per round, at each concurrency),
    over every concurrency with the same rounds for every setting. A round's common part (the
    machine's pace that stretch, its prompt draw) cancels in the ratios the checks read; this
    part does not. Returns (sd, degrees of freedom); None with fewer than two rounds."""
    total, dof = 0.0, 0
    for conc in sorted({c for _, c in cells}):
        rows = [[math.log(r["metrics"]["output_throughput"]) for r in runs]
                for (s, c), runs in sorted(cells.items()) if c == conc]
        if len(rows) < 2 or len({len(r) for r in rows}) != 1 or len(rows[0]) < 2:
            continue
        num_settings, num_rounds = len(rows), len(rows[0])
        grand = sum(map(sum, rows)) / (num_settings * num_rounds)
        setting_mean = [sum(r) / num_rounds for r in rows]
        round_mean = [sum(r[j] for r in rows) / num_settings for j in range(num_rounds)]
        total += sum((rows[i][j] - setting_mean[i] - round_mean[j] + grand) ** 2
                     for i in range(num_settings) for j in range(num_rounds))
        dof += (num_settings - 1) * (num_rounds - 1)
    return (math.sqrt(total / dof), dof) if dof else None


def variant_lines(cells: dict, tput: dict, variants: list[str], concs: list[int],
                  noise: tuple[float, int] | None, baseline: str = "adaptive") -> list[str]:
    """Each variant (sweep --variant: another revision's adaptive controller) over the baseline
    setting, per concurrency: pooled, then the geometric mean of the rounds' own ratios with
    its standard error and their range (round i of both ran in one stretch of time, so their
    ratio cancels the machine's pace that stretch)."""
    if not variants:
        return []
    lines = ["", f"| variant / {baseline} | " + " | ".join(f"c={c}" for c in concs) + " | all |",
             "|---|" + "---|" * (len(concs) + 1)]
    for v in variants:
        ratios, logs, round_logs = [], [], []
        for c in concs:
            if (v, c) not in tput or (baseline, c) not in tput:
                ratios.append("n/a")
                continue
            per_round = [math.log(a["metrics"]["output_throughput"] / b["metrics"]["output_throughput"])
                         for a, b in zip(cells[(v, c)], cells[(baseline, c)])]
            r = tput[(v, c)] / tput[(baseline, c)]
            logs.append(math.log(r))
            round_logs.append(statistics.mean(per_round))
            spread = f"{math.exp(min(per_round)):.2f}-{math.exp(max(per_round)):.2f}"
            se = log_se(per_round)
            if se is not None:
                ratios.append(f"{r:.3f} ({math.exp(round_logs[-1]):.3f} +-{se:.3f}; {spread})")
            else:
                ratios.append(f"{r:.3f} ({spread})")
        overall = (f"{math.exp(sum(logs) / len(logs)):.3f} ({math.exp(statistics.mean(round_logs)):.3f})"
                   if logs else "n/a")
        lines.append(f"| {v} | " + " | ".join(ratios) + f" | {overall} |")
    lines.append("\n(pooled ratio; in brackets the geometric mean of the rounds' ratios +- its standard "
                 "error in log, and their min-max; all: geometric mean over the concurrencies of each.)")
    if noise is not None:
        rounds = min(len(x) for x in cells.values())
        se = noise[0] * (2 / rounds) ** 0.5
        lines.append(f"(From the cell noise, one ratio is good to about +-{100 * se:.1f}%, the mean of "
                     f"{len(concs)} to about +-{100 * se / len(concs) ** 0.5:.1f}%.)")
    return lines


def report(cells: dict, baseline: str = "adaptive") -> tuple[str, list[dict]]:
    """The table, issue 6's checks and the variants' ratios. baseline: the setting the
    variants are read against (an A/B of two revisions, `--settings new pre`, has no
    adaptive: `--baseline new`)."""
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
              "| its standard error | adaptive / best static picked on the other rounds | adaptive / none "
              "| adaptive depth (mean over run) |",
              "|---|---|---|---|---|---|---|---|"]
    ok_every = True
    ok_held_out: bool | None = True

    def vs_none(c: int) -> str:   # a sweep of some settings only (--settings) may have no "none"
        return (f"{tput[('adaptive', c)] / tput[('none', c)]:.3f}"
                if ("none", c) in tput and ("adaptive", c) in tput else "n/a")

    has_adaptive = all(("adaptive", c) in tput for c in concs)
    # A sweep of adaptive and its variants only, or of static settings only, has no checks.
    for c in concs if statics and has_adaptive else []:
        best = max(statics, key=lambda s: tput.get((s, c), 0.0))
        ratio = tput[("adaptive", c)] / tput[(best, c)]
        ok_every &= ratio >= 0.97
        # Round i of every setting ran in the same stretch of time: the spread of the per-round
        # ratios shows how far the machine's noise reaches into the pooled one.
        per_round = [a["metrics"]["output_throughput"] / b["metrics"]["output_throughput"]
                     for a, b in zip(cells[("adaptive", c)], cells[(best, c)])]
        se = log_se([math.log(x) for x in per_round])
        series = [d for r in cells[("adaptive", c)] for _, d in (r.get("depth_series") or [])]
        depth = statistics.mean(series) if series else float("nan")
        held = held_out_best(cells, statics, c)
        if held is None:
            ok_held_out, held_text = None, "n/a"
        else:
            held_ratio = tput[("adaptive", c)] / held[0]
            if ok_held_out is not None:
                ok_held_out &= held_ratio >= 0.97
            held_text = f"{held_ratio:.3f} ({', '.join(sorted(set(held[1])))})"
        checks.append(f"| {c} | {best} ({tput[(best, c)]:.0f}) | {ratio:.3f} | "
                      f"{min(per_round):.2f}-{max(per_round):.2f} | "
                      f"{'n/a' if se is None else f'+-{se:.3f}'} | {held_text} | "
                      f"{vs_none(c)} | {depth:.1f} |")
    dominated = [s for s in statics if has_adaptive and all(tput[(s, c)] >= 0.97 * tput[("adaptive", c)] for c in concs)]
    top = concs[-1]
    summary = [
        "",
        f"- adaptive >= 0.97x the best static depth at every concurrency: "
        f"**{'n/a (no static setting)' if not statics else 'n/a (no adaptive)' if not has_adaptive else 'yes' if ok_every else 'no'}**",
        "- the same with the best static depth picked on the other rounds: **"
        + ("n/a (no adaptive)" if not (statics and has_adaptive) else "n/a (one round)" if ok_held_out is None
           else "yes" if ok_held_out else "no") + "**",
        f"- a single static depth within 0.97x of adaptive everywhere: **{', '.join(dominated) or 'none'}**",
        f"- at the highest concurrency ({top}) adaptive / no speculation = "
        f"**{vs_none(top)}**",
        f"- repetitions per cell: {min(len(v) for v in cells.values())} (output tokens/s pooled over them; "
        "latencies from the repetition with the median throughput)",
    ]
    noise = cell_noise(cells)
    if any(s == baseline for s, _ in cells):
        variants = [s for s in settings if s not in ("none", baseline) and s not in statics]
        summary += variant_lines(cells, tput, variants, concs, noise, baseline)
    if noise is not None:
        rounds = min(len(v) for v in cells.values())
        summary.append(
            f"- cell noise: {100 * noise[0]:.1f}% (sd of one cell's log throughput about its setting's and its "
            f"round's levels, {noise[1]} degrees of freedom); a ratio of two settings pooled over {rounds} rounds "
            f"is good to about +-{100 * noise[0] * (2 / rounds) ** 0.5:.1f}% (one standard error)")
    if not (statics and has_adaptive):
        checks = []   # no row to show: an A/B of variants, or static settings only
    return "\n".join(lines + checks + summary) + "\n", list(medians.values())


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("dirs", nargs="+", type=Path,
                    help="sweep round folders (all_results.json), or kept rounds: a rounds.json this "
                         "report wrote, or its folder")
    ap.add_argument("--out-dir", type=Path, required=True)
    ap.add_argument("--baseline", default=None,
                    help="the setting the other adaptive settings (sweep --variant) are read against "
                         "(default adaptive; an A/B sweep of two variants names one of them)")
    args = ap.parse_args()
    cells = load(args.dirs)
    if args.baseline is not None and not any(s == args.baseline for s, _ in cells):
        raise SystemExit(f"sweep_report: --baseline {args.baseline!r} is not a setting of these rounds "
                         f"(they ran {', '.join(sorted({s for s, _ in cells}))})")
    args.out_dir.mkdir(parents=True, exist_ok=True)
    text, medians = report(cells, args.baseline or "adaptive")
    (args.out_dir / "report.md").write_text(text)
    (args.out_dir / "median_results.json").write_text(json.dumps(medians, indent=1))
    (args.out_dir / ROUNDS_FILE).write_text(json.dumps(compact_rounds(cells), indent=0))
    for path in plots.make_all(medians, args.out_dir):
        print(path)
    print(text)


if __name__ == "__main__":
    main()
