"""The controller's own time per step, and a check that a change to it decides exactly as before.

    python -m benchmarks.controller_replay record benchmarks/out/replay.json
    (change specserve/controller.py)
    python -m benchmarks.controller_replay check benchmarks/out/replay.json

Why: at 4-8 requests on the dev CPU the controller's Python (plan and observe) costs ~0.35 ms
of an 18-25 ms engine step, 1.5-2% that a fixed depth does not pay (benchmarks/RESULTS.md,
forty-fifth session), and a server sweep reads one setting to +-2% at best. Making it cheaper
is a rewrite of code whose decisions took many sessions to tune, so the rewrite must decide
exactly as before; that, unlike the speed-up in the server, can be checked to the last bit.

The replay runs an AdaptiveController (early stop on, as ``[spec] early_stop = "auto"`` makes
it) through seeded synthetic steps at several batch sizes: requests of 20-80 tokens, each with
its own acceptance, that leave and are replaced; verify and draft costs from a CPU-like model
with a little noise; contexts that grow. Every step's plan, goodput estimate and early-stop
thresholds are recorded. ``check`` replays with the code as it is now and reports the first
step where anything differs, and each batch size's time per step then and now (plan +
observe, the synthetic step's own work excluded).
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

from specserve.controller import AdaptiveController, StepStats

BATCH_SIZES = (1, 2, 4, 8, 16, 64)


def _verify_s(batch_size: int, num_tokens: int) -> float:
    return 0.004 + 0.00012 * num_tokens + 0.0006 * batch_size


def _draft_level_s(batch_size: int) -> float:
    return 0.0008 + 0.00005 * batch_size


def replay(batch_size: int, steps: int, seed: int, **controller_kw) -> tuple[list[list], float]:
    """(one record per step: depth, nodes, goodput estimate, stop_below, level_below; seconds
    spent in the controller's plan and observe over all steps)."""
    rng = random.Random(seed)
    ctrl = AdaptiveController(**{"stop_scale": 1.0, **controller_kw})
    ctrl.calibrate(_verify_s, _draft_level_s,
                   measure_draft_total=lambda b, d: d * _draft_level_s(b) + 0.0005)
    live: dict[str, list] = {}   # request id -> [tokens left, context, acceptance]
    made = 0

    def admit() -> None:
        nonlocal made
        made += 1
        live[f"q{made}"] = [rng.randint(20, 80), 100 + rng.randint(0, 60), 0.6 + 0.35 * rng.random()]

    for _ in range(batch_size):
        admit()
    records, spent = [], 0.0
    for _ in range(steps):
        ids = list(live)
        caps = [max(0, live[r][0] - 1) for r in ids]
        context = sum(live[r][1] for r in ids)
        start = time.perf_counter()
        plan = ctrl.plan(len(ids), ids, context, caps)
        spent += time.perf_counter() - start
        records.append([plan.depth, plan.num_nodes, ctrl.goodput_estimate, ctrl.stop_below, ctrl.level_below])
        accepted = []
        for r, cap in zip(ids, caps):
            n = 0
            while n < min(plan.depth, cap) and rng.random() < live[r][2]:
                n += 1
            accepted.append(n)
        cut = any(c < plan.depth for c in caps)
        rows = sum(min(plan.num_nodes, c) + 1 for c in caps)
        noise = 1.0 + 0.05 * (rng.random() - 0.5)
        stats = StepStats(batch_size=len(ids), depth=plan.depth, num_nodes=plan.num_nodes,
                          draft_s=plan.depth * _draft_level_s(len(ids)) * noise,
                          verify_s=_verify_s(len(ids), rows) * noise, overhead_s=0.0005 * noise,
                          num_accepted=accepted, request_ids=ids,
                          seq_depths=[min(plan.depth, c) for c in caps] if cut else None,
                          num_tokens=rows if cut else None, context_tokens=context)
        start = time.perf_counter()
        ctrl.observe(stats)
        spent += time.perf_counter() - start
        for r, n in zip(ids, accepted):
            live[r][0] -= n + 1
            live[r][1] += n + 1
            if live[r][0] <= 0:
                del live[r]
                ctrl.forget(r)
                if rng.random() < 0.97:   # now and then the batch shrinks by one for a while
                    admit()
        if not live:
            admit()
    return records, spent


def run_all(batch_sizes, steps: int, repeat: int = 1) -> dict:
    """Each batch size's records, and its time a step: the least of `repeat` runs (one run's
    time on the dev CPU swings by up to half from one run to the next; the least is steadier)."""
    out = {}
    for i, b in enumerate(batch_sizes):
        best = None
        for _ in range(max(1, repeat)):
            records, spent = replay(b, steps, seed=i + 1)
            best = spent if best is None else min(best, spent)
        out[str(b)] = {"records": records, "us_per_step": 1e6 * best / steps}
    return out


def first_difference(a: list[list], b: list[list]) -> int | None:
    """The first step whose record differs (or where one replay ends), None if none does."""
    for i, (x, y) in enumerate(zip(a, b)):
        if list(x) != list(y):
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("mode", choices=("record", "check"))
    ap.add_argument("path", type=Path)
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=list(BATCH_SIZES))
    ap.add_argument("--steps", type=int, default=600)
    ap.add_argument("--repeat", type=int, default=5,
                    help="runs of each replay; its time is the least of them (default 5)")
    args = ap.parse_args(argv)
    if args.mode == "record":
        res = run_all(args.batch_sizes, args.steps, args.repeat)
        args.path.parent.mkdir(parents=True, exist_ok=True)
        args.path.write_text(json.dumps({"steps": args.steps, "cases": res}))
        for b, r in res.items():
            print(f"{b:>3} sequences: {r['us_per_step']:7.1f} us a step in the controller")
        print(f"recorded {len(res)} replays of {args.steps} steps in {args.path}")
        return 0
    ref = json.loads(args.path.read_text())
    batch_sizes = [int(b) for b in ref["cases"]]
    res = run_all(batch_sizes, ref["steps"], args.repeat)
    ok = True
    for b, r in res.items():
        old = ref["cases"][b]
        i = first_difference(old["records"], r["records"])
        verdict = "identical" if i is None else (
            f"DIFFERS from step {i}: {old['records'][i] if i < len(old['records']) else None} "
            f"then, {r['records'][i] if i < len(r['records']) else None} now")
        ok &= i is None
        print(f"{b:>3} sequences: {old['us_per_step']:7.1f} -> {r['us_per_step']:7.1f} us a step; {verdict}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
