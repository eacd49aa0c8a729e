"""Replay a sweep's measured per-depth costs against the adaptive controller, offline.

    python -m benchmarks.controller_sim benchmarks/out/s22b --concurrency 8 32 --seeds 16 \\
        --knobs nobias:bias_half_life=0

Why: on the dev CPU one sweep cell reads a setting's throughput to about +-6% (the host's
pace moves by +-25% from one second to the next), and the differences the controller has to
find between depths 3-6 are 3-8%, so a server A/B of a controller change needs hours to show
a 2% effect. Here the environment is what the sweep's fixed settings measured at one
concurrency (their decode-only full-batch steps, `step_report.depth_costs`: step time split
into draft, verify and the rest, and tokens per sequence, by depth), the pace is a random
process with the statistics of those steps (see `Pace`), and every setting runs through the
same pace (step by step) and the same requests (seeded), so adaptive against each static depth
is paired and a dozen seeds read a ratio to about +-0.5%.

Each of B slots serves requests of `max_tokens` tokens (a new one takes a slot as soon as one
ends, with its own ease: every position's acceptance shifted in logit by a normal draw). Each
step runs the controller's plan (static settings: their depth) on the true costs times the
pace, draws each sequence's accepted run from its acceptance, and feeds the controller the
step's timings as the engine does. The controller is calibrated at start-up from the true
costs with the draft's levels read low (bare forwards, as in the engine: `draft_standin`) and
some noise.

With ``--prefill-share`` a request that ends is followed by one whose prompt takes its slot
for a step: that step also pays the prompt's pass (the share of a plain decode pass given)
and is not learnt from, as in the engine, and the batch decodes one sequence fewer (a step of
b < B sequences costs a quarter fixed, the rest in proportion). What it leaves out: contexts
growing, trees, the engine itself. It tests the controller's reading of noisy step costs.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
from dataclasses import dataclass
from pathlib import Path

from specserve.controller import AdaptiveController, StepStats


@dataclass
class Environment:
    """True costs at one batch size: per depth (0..max) seconds of the draft levels, the verify
    pass and the rest of a step, and the acceptance of each position (conditional on the one
    above)."""

    batch_size: int
    draft: list[float]
    verify: list[float]
    rest: list[float]
    acceptance: list[float]
    ease_sd: float = 0.0      # requests' spread: each one's logits shifted by N(0, ease_sd)
    measured_depth: int = 0   # the deepest depth a fixed setting measured (the rest extrapolated)

    @property
    def max_depth(self) -> int:
        return len(self.acceptance)

    def mean_tokens(self, depth: int) -> float:
        """Tokens a sequence a step at `depth`, over the requests' spread (no max_tokens cut)."""
        return 1.0 + sum(_mean_reach(self.acceptance[:k], self.ease_sd) for k in range(1, depth + 1))

    def goodput(self, depth: int) -> float:
        """Tokens a second of full-batch steps at `depth` on a steady host."""
        return self.batch_size * self.mean_tokens(depth) / (self.draft[depth] + self.verify[depth] + self.rest[depth])


def environment_from_costs(batch_size: int, costs: dict[int, dict], max_depth: int = 8,
                           ease_sd: float = 0.7) -> Environment:
    """costs: depth -> {"draft_ms", "verify_ms", "rest_ms", "tok_per_seq"} of the fixed settings
    (step_report.depth_costs, one concurrency). Depths past the measured ones continue each
    part's last step, and their acceptance the last measured position's."""
    depths = sorted(costs)
    if depths[:2] != [0, 1] or depths != list(range(len(depths))):
        raise SystemExit(f"controller_sim: need fixed settings at depths 0, 1, 2, ... without gaps, got {depths}")

    def extend(values: list[float]) -> list[float]:
        out = list(values)
        step = max(0.0, out[-1] - out[-2]) if len(out) > 1 else 0.0
        while len(out) <= max_depth:
            out.append(out[-1] + step)
        return out

    draft = extend([costs[d]["draft_ms"] / 1e3 for d in depths])
    verify = extend([costs[d]["verify_ms"] / 1e3 for d in depths])
    # The rest grows with the tokens a step emits (each one's output handling: on the dev CPU
    # at 32 requests 1.9 ms a plain step, 2.9 at depth 6), which the controller's one overhead
    # figure per batch size does not see.
    rest = extend([costs[d]["rest_ms"] / 1e3 for d in depths])
    tokens = [costs[d]["tok_per_seq"] for d in depths]
    # E(d) = 1 + sum_k reach_k: reach_k = E(k) - E(k-1), and a_k = reach_k / reach_{k-1}
    # (clipped: where a depth measured more gain than the one above it, noise, a_k reads > 1).
    reach = [1.0] + [max(1e-3, tokens[k] - tokens[k - 1]) for k in range(1, len(tokens))]
    acceptance = [min(0.99, max(0.01, reach[k] / reach[k - 1])) for k in range(1, len(reach))]
    while len(acceptance) < max_depth:
        acceptance.append(acceptance[-1])
    return Environment(batch_size, draft, verify, rest, _spread(acceptance[:max_depth], ease_sd),
                       ease_sd=ease_sd, measured_depth=depths[-1])


def _normal_nodes() -> list[tuple[float, float]]:
    """Gauss-Hermite nodes and weights for means over a standard normal."""
    from numpy.polynomial.hermite_e import hermegauss
    nodes, weights = hermegauss(24)
    return list(zip(nodes.tolist(), (weights / weights.sum()).tolist()))


def _mean_reach(acceptance: list[float], ease_sd: float) -> float:
    """Mean over requests (logits shifted by N(0, ease_sd)) of the product of `acceptance`."""
    if ease_sd <= 0:
        return math.prod(acceptance)
    logits = [_logit(a) for a in acceptance]
    return sum(w * math.prod(1.0 / (1.0 + math.exp(-(lq + ease_sd * x))) for lq in logits)
               for x, w in _normal_nodes())


def _spread(acceptance: list[float], ease_sd: float) -> list[float]:
    """Each position's acceptance for the median request, such that over requests whose
    logits are shifted by N(0, ease_sd) the mean reach of every depth is what `acceptance`
    gives (the fixed settings measured the mean over their requests, and a mean of products
    of sigmoids is not the product at the mean logit: taken as they stand, a spread of 0.7
    cut depth 3's tokens by 8%)."""
    if ease_sd <= 0:
        return list(acceptance)
    out: list[float] = []
    target = 1.0
    for a in acceptance:
        target *= a
        lo, hi = 0.001, 0.999
        for _ in range(50):   # bisection: the mean reach rises with this position's acceptance
            mid = 0.5 * (lo + hi)
            lo, hi = (mid, hi) if _mean_reach(out + [mid], ease_sd) < target else (lo, mid)
        out.append(0.5 * (lo + hi))
    return out


class Pace:
    """The host's speed over steps: log pace = an AR(1) part (correlation `phi` a step) plus
    independent noise. Defaults fitted to s22b's and s23a's fixed-setting steps at 8-64
    requests (log step time within a cell: sd 0.11, autocorrelation 0.59, 0.29, 0.19, 0.08 at
    lags 1, 4, 8, 16)."""

    def __init__(self, rng: random.Random, sd: float = 0.11, phi: float = 0.85, ar_share: float = 0.65):
        self.rng, self.phi = rng, phi
        self.ar_sd = sd * math.sqrt(ar_share)
        self.iid_sd = sd * math.sqrt(1.0 - ar_share)
        self.x = rng.gauss(0.0, self.ar_sd)

    def next(self) -> float:
        self.x = self.phi * self.x + math.sqrt(1.0 - self.phi ** 2) * self.ar_sd * self.rng.gauss(0.0, 1.0)
        return math.exp(self.x + self.rng.gauss(0.0, self.iid_sd))


def _static_depth(setting: str) -> int:
    """'none' -> 0, 'staticD' -> D (the sweep's names)."""
    if setting == "none":
        return 0
    if setting.startswith("static") and setting[6:].isdigit():
        return int(setting[6:])
    raise ValueError(f"unknown setting {setting!r}: 'adaptive', 'none' or 'staticD'")


def _logit(p: float) -> float:
    return math.log(p / (1.0 - p))


def run(env: Environment, setting: str, knobs: dict, seed: int, steps: int, max_tokens: int = 64,
        part_sd: float = 0.05, draft_standin: float = 0.7,
        calibration_sd: float = 0.05, pace_sd: float = 0.11, warmup_steps: int = 50,
        prefill_share: float = 0.0, empty_steps: float = 0.0,
        calibration_step: tuple[int, float] | None = None) -> dict:
    """One run of `steps` engine steps. setting: "adaptive" (with `knobs` as constructor
    arguments), "none" or "staticD". calibration_step (n, f): the start-up calibration reads
    the verify passes of n nodes a sequence and more f times their cost (a step in the rows
    read flat or steep, as the server's calibration reads the one from four rows to five).
    Returns tokens, seconds, and the steps' depths."""
    B, max_depth = env.batch_size, env.max_depth
    pace = Pace(random.Random(seed * 7919 + 1), sd=pace_sd)
    draws = random.Random(seed * 7919 + 2)   # acceptance: the same requests for every setting
    parts = random.Random(seed * 7919 + 3)
    cal = random.Random(seed * 7919 + 4)
    if setting != "adaptive":
        ctrl = AdaptiveController(mode="static", max_depth=max_depth, static_depth=_static_depth(setting))
    else:
        ctrl = AdaptiveController(max_depth=max_depth, **knobs)

    def noisy(x: float, sd: float, rng: random.Random) -> float:
        return x * math.exp(rng.gauss(0.0, sd))

    def at(b: int) -> float:
        """A step's cost at b decoding sequences over the same at B: a quarter fixed."""
        return 0.25 + 0.75 * b / B

    # The engine calibrates every power-of-two batch size; here B and the bucket below it.
    step_at, step_f = calibration_step or (max_depth + 1, 1.0)
    rows = lambda n: env.verify[min(n, max_depth)] * (step_f if n >= step_at else 1.0)   # noqa: E731  (n nodes a sequence)
    ctrl.calibrate(lambda b, t: noisy(at(b) * rows(t // b - 1), calibration_sd, cal),
                   lambda b: noisy(at(b) * draft_standin * env.draft[1], calibration_sd, cal),
                   batch_sizes=sorted({max(1, B // 2), B}), nodes_per_seq=range(max_depth + 1),
                   measure_draft_total=lambda b, d: noisy(at(b) * draft_standin * env.draft[d], calibration_sd, cal),
                   draft_depths=range(1, max_depth + 1))

    next_id = 0

    def eased(rng: random.Random) -> list[float]:
        shift = rng.gauss(0.0, env.ease_sd)
        return [1.0 / (1.0 + math.exp(-(_logit(a) + shift))) for a in env.acceptance]

    def new_request() -> list:
        nonlocal next_id
        next_id += 1
        return [f"r{next_id}", max_tokens, eased(draws)]

    slots = [new_request() for _ in range(B)]   # [request id, tokens left, per-position acceptance]
    # The sweep reaches a concurrency with a controller that has served the lower ones: it
    # knows the acceptance of such requests. Steps at the deepest plan with no timings teach
    # it that (and nothing of the costs) before the counted steps.
    warm = random.Random(seed * 7919 + 5)
    for _ in range(warmup_steps if setting == "adaptive" else 0):
        accepted = []
        for _s in range(B):
            acc = eased(warm)
            n = 0
            while n < max_depth and warm.random() < acc[n]:
                n += 1
            accepted.append(n)
        ctrl.observe(StepStats(batch_size=B, depth=max_depth, num_nodes=max_depth, draft_s=0.0, verify_s=0.0,
                               num_accepted=accepted, request_ids=[f"w{i}" for i in range(B)]))
    for i in range(B):
        ctrl.forget(f"w{i}")
    tokens_total = seconds_total = 0.0
    depths = []
    pending: set[int] = set()   # slots whose new request waits for its prompt's pass
    empty: dict[int, int] = {}  # slots without a request yet: steps left empty
    gaps = random.Random(seed * 7919 + 6)
    for _ in range(steps):
        live = [i for i in range(B) if i not in pending and i not in empty]
        ids = [slots[i][0] for i in live]
        caps = [max(0, slots[i][1] - 1) for i in live]
        b = len(live)
        p = pace.next()
        scale = at(b)
        prefill_s = p * len(pending) * prefill_share * env.verify[0]
        d = 0
        draft_s = verify_s = rest_s = 0.0
        if b:
            plan = ctrl.plan(b, ids, depth_caps=caps)
            d = plan.depth
            seq_depths = [min(d, c) for c in caps]
            draft_s = noisy(p * scale * env.draft[max(seq_depths)], part_sd, parts) if d else 0.0
            rows_run = sum(sd + 1 for sd in seq_depths)
            # Verify rows cut near the end cost in proportion to the rows that ran.
            verify_s = noisy(p * scale * (env.verify[0] + (env.verify[d] - env.verify[0]) * (rows_run - b) / (b * d)
                                          if d else env.verify[0]), part_sd, parts)
            rest_s = noisy(p * env.rest[d], part_sd, parts)
            accepted = []
            for i, dd in zip(live, seq_depths):
                n = 0
                while n < dd and draws.random() < slots[i][2][n]:
                    n += 1
                accepted.append(n)
            emitted = [min(n + 1, slots[i][1]) for n, i in zip(accepted, live)]
            cut = any(sd < d for sd in seq_depths)
            # A step that also runs a prompt is timed but not learnt from (spec.py: its pass
            # mixes the prompt's rows in); its acceptance counts.
            mixed = bool(pending)
            # A plain step reports no requests (the engine's _decode): nothing to accept.
            ctrl.observe(StepStats(batch_size=b, depth=d, num_nodes=plan.num_nodes,
                                   draft_s=0.0 if mixed else draft_s, verify_s=0.0 if mixed else verify_s,
                                   overhead_s=0.0 if mixed else rest_s, num_accepted=accepted if d else [],
                                   request_ids=ids if d else [],
                                   seq_depths=seq_depths if cut else None,
                                   num_tokens=rows_run if cut else None,
                                   draft_depth=max(seq_depths) if cut else None))
            tokens_total += sum(emitted)
            for i, e in zip(live, emitted):
                slots[i][1] -= e
        tokens_total += len(pending)   # a prompt's pass yields its first token
        for i in pending:
            slots[i][1] -= 1
        pending = set()
        for i in list(empty):
            empty[i] -= 1
            if empty[i] <= 0:
                del empty[i]
                if prefill_share > 0:
                    pending.add(i)
        seconds_total += draft_s + verify_s + rest_s + prefill_s
        depths.append(d)
        for i in live:
            if slots[i][1] <= 0:
                # As the engine does: what it decoded (its prompt's pass yields the first token).
                ctrl.forget(slots[i][0], num_tokens=max_tokens - (1 if prefill_share > 0 else 0))
                slots[i] = new_request()
                wait = gaps.randint(0, 2 * empty_steps) if empty_steps > 0 else 0
                if wait:
                    empty[i] = wait
                elif prefill_share > 0:
                    pending.add(i)
    return {"tokens": tokens_total, "seconds": seconds_total, "depths": depths}


def compare(env: Environment, settings: dict[str, dict], seeds: int, steps: int, pace_sd: float = 0.11,
            progress: str | None = None, prefill_share: float = 0.0, empty_steps: float = 0.0,
            calibration_sd: float = 0.05, calibration_step: tuple[int, float] | None = None) -> dict:
    """Every static depth of the environment and every adaptive setting ({name: knobs}) over
    the same `seeds`. Returns {"static": {name: [tok/s per seed]}, "adaptive": {name: [...]},
    "best": the static setting of highest mean, "ratios": {name: (geometric mean of the
    per-seed ratios to the best, its standard error)}, "depths": {name: {depth: steps}}}."""
    statics = ["none"] + [f"static{d}" for d in range(1, env.measured_depth + 1)]
    out = {"static": {s: [] for s in statics}, "adaptive": {n: [] for n in settings}, "depths": {n: {} for n in settings}}
    for seed in range(seeds):
        for name in statics:
            r = run(env, name, {}, seed, steps, pace_sd=pace_sd, prefill_share=prefill_share,
                    empty_steps=empty_steps, calibration_sd=calibration_sd, calibration_step=calibration_step)
            out["static"][name].append(r["tokens"] / r["seconds"])
        for name, knobs in settings.items():
            r = run(env, "adaptive", knobs, seed, steps, pace_sd=pace_sd, prefill_share=prefill_share,
                    empty_steps=empty_steps, calibration_sd=calibration_sd, calibration_step=calibration_step)
            out["adaptive"][name].append(r["tokens"] / r["seconds"])
            for d in r["depths"]:
                out["depths"][name][d] = out["depths"][name].get(d, 0) + 1
        if progress:
            print(f"\r{progress}: seed {seed + 1}/{seeds}", end="" if seed + 1 < seeds else "\n",
                  file=sys.stderr, flush=True)
    best = max(statics, key=lambda s: sum(out["static"][s]))
    out["best"] = best
    out["ratios"] = {}
    for name, values in out["adaptive"].items():
        logs = [math.log(a / b) for a, b in zip(values, out["static"][best])]
        m = sum(logs) / len(logs)
        se = math.sqrt(sum((x - m) ** 2 for x in logs) / (len(logs) - 1) / len(logs)) if len(logs) > 1 else None
        out["ratios"][name] = (math.exp(m), se)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("sweep_dirs", type=Path, nargs="+",
                   help="sweeps run with --step-logs and the fixed settings none, static1, static2, ... (pooled)")
    p.add_argument("--concurrency", type=int, nargs="+", default=[8, 32])
    p.add_argument("--seeds", type=int, default=12)
    p.add_argument("--steps", type=int, default=400,
                   help="engine steps a run (a 4-round sweep serves about 400 at one concurrency)")
    p.add_argument("--knobs", action="append", default=[], metavar="NAME:key=value[,...]",
                   help="also an adaptive setting with these AdaptiveController arguments (repeatable)")
    p.add_argument("--pace-sd", type=float, default=0.11, help="sd of the host's log pace (0: a steady host)")
    p.add_argument("--prefill-share", type=float, default=0.0,
                   help="each new request's prompt pass, as a share of a plain decode pass (0: no prompts; "
                        "about 0.35 on the dev CPU)")
    p.add_argument("--empty-steps", type=float, default=0.0,
                   help="mean steps a slot stays empty after its request ends (0: refilled at once): the "
                        "decoding batch then moves inside its bucket, as in a server")
    p.add_argument("--calibration-sd", type=float, default=0.05,
                   help="sd of the log error of each start-up calibration point (the server's verify "
                        "shape at 16-32 requests stood 5-19%% off the fixed depths', twenty-fourth session)")
    p.add_argument("--calibration-step", metavar="NODES:FACTOR",
                   help="the calibration reads verify passes of NODES nodes a sequence and more FACTOR times "
                        "their cost (4:0.94: the step from four rows to five read 6%% flat, as the server's "
                        "calibration reads it at 16 requests, twenty-sixth session)")
    p.add_argument("--json", type=Path, help="also write the figures here")
    args = p.parse_args(argv)
    calibration_step = None
    if args.calibration_step:
        try:
            nodes, factor = args.calibration_step.split(":")
            calibration_step = (int(nodes), float(factor))
        except ValueError:
            p.error(f"--calibration-step: NODES:FACTOR (e.g. 4:0.94), got {args.calibration_step!r}")

    from benchmarks.serve_knobs import parse_knobs
    from benchmarks.step_report import cells_of, depth_costs

    settings = {"adaptive": {}, **parse_knobs(args.knobs)}
    cells = [c for d in args.sweep_dirs for c in cells_of(d)]
    if not cells:
        raise SystemExit("controller_sim: no result file with a step log in " +
                         ", ".join(map(str, args.sweep_dirs)) + " (run the sweep with --step-logs)")
    costs = depth_costs(cells)
    report = {}
    for conc in args.concurrency:
        fixed = {depth: v for (setting, depth), v in costs.get(conc, {}).items()
                 if setting == ("none" if depth == 0 else f"static{depth}")}
        env = environment_from_costs(conc, fixed)
        res = compare(env, settings, args.seeds, args.steps, args.pace_sd, progress=f"{conc} requests",
                      prefill_share=args.prefill_share, empty_steps=args.empty_steps,
                      calibration_sd=args.calibration_sd, calibration_step=calibration_step)
        report[conc] = res
        means = {s: sum(v) / len(v) for s, v in res["static"].items()}
        print(f"{conc} requests ({args.seeds} seeds x {args.steps} steps, pace sd {args.pace_sd}, "
              f"prefill share {args.prefill_share}): tok/s " +
              "  ".join(f"{s}={m:.0f}" for s, m in means.items()) + f"  (best {res['best']})")
        for name in settings:
            ratio, se = res["ratios"][name]
            total = sum(res["depths"][name].values())
            mix = " ".join(f"{d}:{100 * n / total:.0f}%" for d, n in sorted(res["depths"][name].items())
                           if n / total >= 0.02)
            print(f"  {name:>12} / {res['best']}: {ratio:.3f}" + (f" +- {se:.3f}" if se else "") + f"   depths {mix}")
    if args.json:
        args.json.write_text(json.dumps({str(c): r for c, r in report.items()}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
