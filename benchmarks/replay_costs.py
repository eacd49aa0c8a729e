"""Replay a sweep's logged steps through the controller's cost model, offline.

    python -m benchmarks.replay_costs benchmarks/out/s29e --setting adaptive --concurrency 16

What a cost-model change does to the verify rows on real steps, in seconds instead of a
10-minute A/B: a fresh start-up calibration (``LLM()`` on the embedded pair, one thread, as
the server calibrates; ~30 s), then every decode-only step the setting logged (sweep
--step-logs), in order over its cells, fed to ``CostModel.observe_verify`` as the controller
feeds its own (batch, the pass's rows, verify seconds, context). After each cell it prints
what the row reads per sequence at ``--concurrency`` sequences for each row count, over the
median of the steps that ran that row count in a run at that concurrency (any setting of the
sweep, near the full batch, no tree cut): 1.000 is the row as the steps measured it; a row count that drifts
off it is one the plan prices wrong. What decides a plan is the tilt between row counts more
than the level: ``--rows 6`` prints each reading over six rows'.

The twenty-ninth session found with it that a point's place moves with the batch inside its
bucket (benchmarks/RESULTS.md); it did not foretell what that fix did in a server.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

from benchmarks.step_report import cells_of


def run_medians(cells, concurrency: int, full: float = 0.75) -> dict[int, float]:
    """Rows per sequence -> the median verify seconds per sequence of the decode-only steps at
    `concurrency` that follow a step at the same depth, hold `full` of the batch and verified
    every tree whole (every setting; row counts with fewer than 10 such steps left out)."""
    by_rows: dict[int, list[float]] = {}
    for _, conc, _, steps in cells:
        if conc != concurrency:
            continue
        prev = None
        for s in steps:
            decode_only = not s.get("prefill_seqs")
            if (decode_only and s["decode"] >= full * conc and s["depth"] == prev and s["verify_s"] > 0
                    and s.get("drafted", s["decode"] * s["nodes"]) == s["decode"] * s["nodes"]):
                by_rows.setdefault(s["nodes"] + 1, []).append(s["verify_s"] / s["decode"])
            prev = s["depth"] if decode_only else None
    return {r: statistics.median(v) for r, v in sorted(by_rows.items()) if len(v) >= 10}


def replay(cells, setting: str, costs, concurrency: int, truth: dict[int, float]) -> list[dict]:
    """Feeds `setting`'s decode-only steps, cell by cell in time order, to `costs` (a CostModel)
    and returns, per cell, its concurrency, the steps fed so far, and each row count's reading
    at `concurrency` sequences over `truth` (its run median)."""
    out = []
    fed = 0
    B = concurrency
    mine = sorted((c for c in cells if c[0] == setting), key=lambda c: c[2]["started_at"])
    for _, conc, _, steps in mine:
        for s in steps:
            if s.get("prefill_seqs") or s["decode"] < 1 or s["verify_s"] <= 0:
                continue
            b = s["decode"]
            # The rows the controller booked it at: fewer than the plan's where trees were cut
            # (logs from before the twenty-ninth session lack "drafted": the plan's).
            tokens = b + s["drafted"] if "drafted" in s else b * (s["nodes"] + 1)
            costs.observe_verify(b, tokens, s["verify_s"], context_tokens=s.get("context"))
            fed += 1
        read = {r: costs.t_verify(B, B * r) / (B * t) for r, t in truth.items()}
        out.append({"concurrency": conc, "steps": fed, "read": read})
    return out


def markdown(rows: list[dict], relative_to: int | None) -> str:
    counts = sorted(rows[0]["read"]) if rows else []
    head = "| cell | requests | steps fed | " + " | ".join(f"{r} rows" for r in counts) + " |"
    lines = [head, "|" + "---:|" * (3 + len(counts))]
    for i, row in enumerate(rows):
        base = row["read"].get(relative_to, 1.0) if relative_to else 1.0
        cols = " | ".join(f"{row['read'][r] / base:.3f}" for r in counts)
        lines.append(f"| {i} | {row['concurrency']} | {row['steps']} | {cols} |")
    return "\n".join(lines) + "\n"


def start_up_costs():
    """The cost model of a fresh server's start-up calibration (the embedded pair, one thread)."""
    import torch

    from specserve import LLM

    torch.set_num_threads(1)
    llm = LLM(progress=True)
    return llm.engine.spec.adaptive.costs


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.replay_costs", description=__doc__.split("\n\n")[0])
    p.add_argument("sweep_dirs", nargs="+", type=Path)
    p.add_argument("--setting", default="adaptive", help="whose steps to replay")
    p.add_argument("--concurrency", type=int, default=16, help="read the rows at this many sequences")
    p.add_argument("--rows", type=int, default=None,
                   help="print each reading over this row count's (default: over the run median only)")
    args = p.parse_args(argv)
    cells = [c for d in args.sweep_dirs for c in cells_of(d)]
    if not any(c[0] == args.setting for c in cells):
        print(f"no cells of setting {args.setting!r} with a step log in {', '.join(map(str, args.sweep_dirs))}",
              file=sys.stderr)
        return 1
    truth = run_medians(cells, args.concurrency)
    if not truth:
        print(f"no runs of one depth at {args.concurrency} requests to read the rows against", file=sys.stderr)
        return 1
    print("run medians, verify ms per sequence:", {r: round(1e3 * t, 3) for r, t in truth.items()})
    print(markdown(replay(cells, args.setting, start_up_costs(), args.concurrency, truth), args.rows), end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
