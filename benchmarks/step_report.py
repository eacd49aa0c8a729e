"""Where each sweep cell's time went, from the servers' step logs (sweep --step-logs).

    python -m benchmarks.step_report benchmarks/out/s13a [more sweep dirs] [--concurrency 64]

A sweep dir holds round dirs (round0, round1, ...) or the result files themselves, and the
step logs steps_SETTING[_roundI].jsonl the sweep's servers wrote (specserve/steplog.py; with
sweep --one-process, steps_shared[_roundI].jsonl for the settings one server served). A
cell's steps are those that ended between its result file's started_at and finished_at. Per
setting and concurrency, pooled over cells:

    tok/s      output throughput as the load generator measured it (mean over cells)
    steps      engine steps per cell; mixed: those that also ran a prompt chunk
    mixed %    the mixed steps' share of the engine's step time
    ms/step    mean step time (step_s) of decode-only and of mixed steps
    tok/seq    tokens emitted per decoding sequence per decode-only step
    B          mean decoding sequences of a decode-only step
    ctl ms     step time beyond draft + verify (scheduling, outputs, the controller, the
               server's share of the core), per step
    depths     share of step time at each depth (the largest shares)

With --churn, also the slot-steps that decoded nothing per request served, and how many of them
fell in the drain after the last prompt (see churn()).
"""

from __future__ import annotations

import argparse
import json
import math
import re
import statistics
import sys
from collections import defaultdict
from pathlib import Path

from benchmarks.sweep_report import log_se


def load_steps(path: Path) -> list[dict]:
    steps = []
    with open(path) as f:
        for line in f:
            line = line.strip()
            if line:
                try:
                    steps.append(json.loads(line))
                except json.JSONDecodeError:
                    continue   # a line cut short by a killed server
    return steps


def cells_of(sweep_dir: Path) -> list[tuple[str, int, dict, list[dict]]]:
    """(setting, concurrency, result, the cell's steps) for every result file with a step log."""
    out = []
    round_dirs = sorted(p for p in sweep_dir.glob("round*") if p.is_dir()) or [sweep_dir]
    logs: dict[Path, list[dict]] = {}
    for rd in round_dirs:
        m = re.fullmatch(r"round(\d+)", rd.name)
        for f in sorted(rd.glob("*_c*.json")):
            fm = re.fullmatch(r"(.+)_c(\d+)\.json", f.name)
            if not fm:
                continue
            setting, conc = fm.group(1), int(fm.group(2))
            # A setting's own server's log, else (sweep --one-process) the shared server's:
            # the time window below picks the cell's steps out of it either way.
            candidates = [sweep_dir / f"steps_{name}{suffix}.jsonl" for name in (setting, "shared")
                          for suffix in ([f"_round{m.group(1)}"] if m else []) + [""]]
            log = next((c for c in candidates if c.is_file()), None)
            res = json.loads(f.read_text())
            if log is None or "started_at" not in res:
                continue
            if log not in logs:
                logs[log] = load_steps(log)
            lo, hi = res["started_at"], res["finished_at"]
            out.append((setting, conc, res, [s for s in logs[log] if lo <= s["t"] <= hi]))
    return out


def summarise(cells: list[tuple[str, int, dict, list[dict]]]) -> dict[tuple[str, int], dict]:
    acc: dict[tuple[str, int], dict] = defaultdict(lambda: defaultdict(float))
    depth_time: dict[tuple[str, int], dict[int, float]] = defaultdict(lambda: defaultdict(float))
    for setting, conc, res, steps in cells:
        a = acc[(setting, conc)]
        a["cells"] += 1
        a["tput"] += res["metrics"]["output_throughput"]
        for s in steps:
            mixed = s["prefill_seqs"] > 0
            k = "mix" if mixed else "dec"
            a[k + "_n"] += 1
            a[k + "_t"] += s["step_s"]
            a["rest_t"] += max(0.0, s["step_s"] - s["draft_s"] - s["verify_s"])
            if not mixed and s["decode"]:
                a["dec_B"] += s["decode"]
                a["dec_tok"] += s["emitted"]
            depth_time[(setting, conc)][s["depth"]] += s["step_s"]
    rows = {}
    for key, a in acc.items():
        n = a["cells"]
        steps = a["mix_n"] + a["dec_n"]
        total = a["mix_t"] + a["dec_t"]
        dt = depth_time[key]
        rows[key] = {
            "cells": int(n),
            "tput": a["tput"] / n,
            "steps": steps / n,
            "mixed_steps": a["mix_n"] / n,
            "mixed_share": a["mix_t"] / total if total else 0.0,
            "dec_ms": 1e3 * a["dec_t"] / a["dec_n"] if a["dec_n"] else 0.0,
            "mix_ms": 1e3 * a["mix_t"] / a["mix_n"] if a["mix_n"] else 0.0,
            "tok_per_seq": a["dec_tok"] / a["dec_B"] if a["dec_B"] else 0.0,
            "batch": a["dec_B"] / a["dec_n"] if a["dec_n"] else 0.0,
            "rest_ms": 1e3 * a["rest_t"] / steps if steps else 0.0,
            "depth_share": {d: t / total for d, t in sorted(dt.items())} if total else {},
        }
    return rows


def fixed_depth(setting: str) -> int | None:
    """The depth a fixed setting runs throughout (none: 0, staticN: N); None for a controller."""
    if setting == "none":
        return 0
    return int(setting[6:]) if re.fullmatch(r"static\d+", setting) else None


def curves(cells: list[tuple[str, int, dict, list[dict]]], full: float = 0.75) -> dict[int, dict]:
    """Per concurrency, the goodput curve over depth as the fixed settings measured it beside
    what the adaptive controller predicted. Only decode-only steps with at least `full` x the
    concurrency decoding count (a cell's ramp and tail say little about the depth).

    measured[d]   tokens/s of such steps of the setting that ran depth d throughout (none: 0)
    predicted[d]  the mean over the adaptive steps of the predicted goodput at depth d relative
                  to the best depth, as read by the evaluation the step's plan came from
    share[d]      the share of the adaptive cells' decode-only step time at depth d
    corrected[d]  as predicted, for the curve the decision read (each depth times its bias
                  factor; only evaluations that logged them)
    own[d]        the adaptive steps at depth d: tokens emitted over the tokens their
                  predicted goodput promised for their time (what the controller's bias
                  correction learns; 1.0 where the model was right)
    step_ms[d], tokens[d]
                  the fixed setting's mean step time and tokens a sequence a step at depth d
    pred_ms[d], pred_tokens[d]
                  what the adaptive controller predicted for depth d at the batch of its
                  steps (logs with "tokens"): where the two part, the cost model or the
                  acceptance model is wrong about that depth
    draft_ms[d], verify_ms[d], rest_ms[d]
                  the fixed setting's step split: draft levels, verify pass, the rest
    pred_draft_ms[d], pred_verify_ms[d], pred_rest_ms[d]
                  what the adaptive controller priced those parts at (logs with
                  "draft_pred"): which part of a wrong step time is wrong
    """
    acc: dict[int, dict] = defaultdict(lambda: {"tok": defaultdict(float), "sec": defaultdict(float),
                                                 "pred": defaultdict(float), "evals": 0,
                                                 "corr": defaultdict(float), "corr_evals": 0,
                                                 "own_tok": defaultdict(float),
                                                 "own_pred": defaultdict(float),
                                                 "share": defaultdict(float),
                                                 "steps": defaultdict(int), "seqs": defaultdict(float),
                                                 "pred_ms": defaultdict(float), "pred_tok": defaultdict(float),
                                                 "tok_evals": defaultdict(int),
                                                 "draft": defaultdict(float), "verify": defaultdict(float),
                                                 "parts": defaultdict(lambda: [0.0, 0.0, 0.0, 0])})
    for setting, conc, _res, steps in cells:
        a = acc[conc]
        fixed = fixed_depth(setting)
        latest = None   # the fresh evaluation the plan in use came from
        for s in steps:
            if s.get("curve"):
                latest = s
            if s["prefill_seqs"] or s["decode"] < full * conc:
                continue
            if fixed is not None and s["depth"] == fixed:
                a["tok"][fixed] += s["emitted"]
                a["sec"][fixed] += s["step_s"]
                a["steps"][fixed] += 1
                a["seqs"][fixed] += s["decode"]
                a["draft"][fixed] += s["draft_s"]
                a["verify"][fixed] += s["verify_s"]
            elif setting == "adaptive":
                a["share"][s["depth"]] += s["step_s"]
                if s.get("predicted"):
                    a["own_tok"][s["depth"]] += s["emitted"]
                    a["own_pred"][s["depth"]] += s["predicted"] * s["step_s"]
                # Each step reads the evaluation its plan came from, so that every step weighs
                # once: evaluations are not spread evenly (near a request's end its depth cap
                # changes every step, and each step is evaluated afresh, at capped depths).
                ev = latest
                curve = ev["curve"] if ev is not None else None
                if curve and max((g for g in curve if g is not None), default=0) > 0:
                    top = max(g for g in curve if g is not None)
                    for d, g in enumerate(curve):
                        if g is not None:
                            a["pred"][d] += g / top
                    a["evals"] += 1
                    tokens = ev.get("tokens")
                    if tokens and len(tokens) == len(curve):
                        for d, (g, e) in enumerate(zip(curve, tokens)):
                            if g and e is not None:
                                a["pred_ms"][d] += 1e3 * s["decode"] * e / g
                                a["pred_tok"][d] += e
                                a["tok_evals"][d] += 1
                    drafts, verifies = ev.get("draft_pred"), ev.get("verify_pred")
                    if drafts and verifies and len(drafts) == len(verifies) == len(curve):
                        for d, (x, y) in enumerate(zip(drafts, verifies)):
                            if x is not None and y is not None:
                                pa = a["parts"][d]
                                pa[0] += x
                                pa[1] += y
                                pa[2] += ev.get("rest_pred", 0.0)
                                pa[3] += 1
                    bias = ev.get("bias")
                    if bias and len(bias) == len(curve):
                        corr = [None if g is None else g * f for g, f in zip(curve, bias)]
                        top = max(g for g in corr if g is not None)
                        for d, g in enumerate(corr):
                            if g is not None:
                                a["corr"][d] += g / top
                        a["corr_evals"] += 1
    out = {}
    for conc, a in sorted(acc.items()):
        total = sum(a["share"].values())
        out[conc] = {
            "measured": {d: a["tok"][d] / a["sec"][d] for d in sorted(a["sec"]) if a["sec"][d] > 0},
            "predicted": {d: v / a["evals"] for d, v in sorted(a["pred"].items())} if a["evals"] else {},
            "share": {d: t / total for d, t in sorted(a["share"].items())} if total else {},
            "evaluations": a["evals"],
            "corrected": ({d: v / a["corr_evals"] for d, v in sorted(a["corr"].items())}
                          if a["corr_evals"] else {}),
            "own": {d: a["own_tok"][d] / a["own_pred"][d] for d in sorted(a["own_pred"])
                    if a["own_pred"][d] > 0},
            "step_ms": {d: 1e3 * a["sec"][d] / a["steps"][d] for d in sorted(a["steps"])},
            "tokens": {d: a["tok"][d] / a["seqs"][d] for d in sorted(a["seqs"]) if a["seqs"][d] > 0},
            "pred_ms": {d: a["pred_ms"][d] / n for d, n in sorted(a["tok_evals"].items())},
            "pred_tokens": {d: a["pred_tok"][d] / n for d, n in sorted(a["tok_evals"].items())},
            "draft_ms": {d: 1e3 * a["draft"][d] / a["steps"][d] for d in sorted(a["steps"])},
            "verify_ms": {d: 1e3 * a["verify"][d] / a["steps"][d] for d in sorted(a["steps"])},
            "rest_ms": {d: 1e3 * (a["sec"][d] - a["draft"][d] - a["verify"][d]) / a["steps"][d]
                        for d in sorted(a["steps"])},
            "pred_draft_ms": {d: v[0] / v[3] for d, v in sorted(a["parts"].items()) if v[3]},
            "pred_verify_ms": {d: v[1] / v[3] for d, v in sorted(a["parts"].items()) if v[3]},
            "pred_rest_ms": {d: v[2] / v[3] for d, v in sorted(a["parts"].items()) if v[3]},
        }
    return out


def curves_markdown(cs: dict[int, dict]) -> str:
    lines = []
    for conc, c in cs.items():
        m, p, sh = c["measured"], c["predicted"], c["share"]
        corr, own = c.get("corrected", {}), c.get("own", {})
        depths = sorted(set(m) | set(p) | set(sh))
        if not depths:
            continue
        top = max(m.values(), default=0.0)
        lines += [f"\n{conc} requests (decode-only steps with >= {0.75 * conc:g} decoding; "
                  f"{c['evaluations']} adaptive steps read)\n",
                  "| depth | " + " | ".join(str(d) for d in depths) + " |",
                  "|---|" + "---:|" * len(depths),
                  "| fixed setting, tok/s | " + " | ".join(f"{m[d]:.0f}" if d in m else "" for d in depths) + " |",
                  "| same, / best | " + " | ".join(f"{m[d] / top:.2f}" if d in m and top else "" for d in depths) + " |",
                  "| adaptive predicted, / its best | " + " | ".join(f"{p[d]:.2f}" if d in p else "" for d in depths) + " |",
                  "| adaptive time share | " + " | ".join(f"{sh[d]:.0%}" if d in sh else "" for d in depths) + " |"]
        if corr:
            lines.append("| adaptive corrected, / its best | "
                         + " | ".join(f"{corr[d]:.2f}" if d in corr else "" for d in depths) + " |")
        if own:
            lines.append("| adaptive steps, measured / predicted | "
                         + " | ".join(f"{own[d]:.2f}" if d in own else "" for d in depths) + " |")
        for label, key, fmt in (("fixed setting, ms a step", "step_ms", "{:.1f}"),
                                ("adaptive predicted, ms a step", "pred_ms", "{:.1f}"),
                                ("fixed setting, draft ms", "draft_ms", "{:.1f}"),
                                ("adaptive priced, draft ms", "pred_draft_ms", "{:.1f}"),
                                ("fixed setting, verify ms", "verify_ms", "{:.1f}"),
                                ("adaptive priced, verify ms", "pred_verify_ms", "{:.1f}"),
                                ("fixed setting, rest ms", "rest_ms", "{:.1f}"),
                                ("adaptive priced, rest ms", "pred_rest_ms", "{:.1f}"),
                                ("fixed setting, tokens a sequence", "tokens", "{:.2f}"),
                                ("adaptive predicted, tokens a sequence", "pred_tokens", "{:.2f}")):
            row = c.get(key, {})
            if row:
                lines.append(f"| {label} | " + " | ".join(fmt.format(row[d]) if d in row else "" for d in depths) + " |")
    return "\n".join(lines) + "\n"


def plot_curves(cs: dict[int, dict], out: Path) -> Path:
    """One panel per concurrency: the fixed settings' measured tokens/s over depth and the
    adaptive controller's predicted curve, both relative to their best, and the share of its
    time at each depth as bars."""
    from benchmarks.plots import plt

    concs = [c for c in cs if cs[c]["measured"] or cs[c]["predicted"]]
    fig, axes = plt.subplots(1, len(concs), figsize=(3.2 * len(concs), 3.6), sharey=True, squeeze=False)
    for ax, conc in zip(axes[0], concs):
        c = cs[conc]
        if c["share"]:
            ax.bar(list(c["share"]), list(c["share"].values()), color="0.85", label="adaptive time share")
        m = c["measured"]
        if m:
            top = max(m.values())
            ax.plot(list(m), [v / top for v in m.values()], "o-", label="measured (fixed depth)")
        if c["predicted"]:
            ax.plot(list(c["predicted"]), list(c["predicted"].values()), "s--", label="adaptive predicted")
        ax.set_title(f"{conc} requests")
        ax.set_xlabel("depth")
        ax.set_ylim(0, 1.05)
    axes[0][0].set_ylabel("goodput / best (bars: share of time)")
    axes[0][-1].legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def markdown(rows: dict[tuple[str, int], dict]) -> str:
    lines = ["| requests | setting | cells | tok/s | steps | mixed | mixed % | ms/step dec | ms/step mixed "
             "| tok/seq | B | ctl ms | depths (share of time) |",
             "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    for (setting, conc), r in sorted(rows.items(), key=lambda kv: (kv[0][1], kv[0][0])):
        top = sorted(r["depth_share"].items(), key=lambda kv: -kv[1])[:4]
        depths = " ".join(f"{d}:{share:.0%}" for d, share in sorted(top))
        lines.append(
            f"| {conc} | {setting} | {r['cells']} | {r['tput']:.0f} | {r['steps']:.0f} | {r['mixed_steps']:.0f} "
            f"| {100 * r['mixed_share']:.0f} | {r['dec_ms']:.1f} | {r['mix_ms']:.1f} | {r['tok_per_seq']:.2f} "
            f"| {r['batch']:.1f} | {r['rest_ms']:.1f} | {depths} |")
    return "\n".join(lines) + "\n"


def mix(rows: dict[tuple[str, int], dict]) -> dict[tuple[str, int], dict]:
    """Per concurrency and controller: what its time at each depth would have yielded at the
    fixed settings' throughput at that depth (none for depth 0), over the best static depth's,
    beside what it measured over the same. The first is the loss (or gain) of the depths it
    chose, its steps priced as the fixed depth's; the gap between the two is what its steps
    cost beyond the fixed depth's (its own work, its switches, its tails). Depths no fixed
    setting ran (7 and 8 in a sweep of static1-6) are left out of the mix, and their share of the
    controller's time is given; past half its time there, no mix is read (at 1-2 requests the
    chains' own stops run depth 8 throughout). Throughputs are the cells' means (summarise's
    tok/s)."""
    out = {}
    for (setting, conc), r in rows.items():
        if fixed_depth(setting) is not None:
            continue
        rates = {fixed_depth(s): rows[(s, c)]["tput"] for s, c in rows
                 if c == conc and fixed_depth(s) is not None}
        statics = [t for d, t in rates.items() if d > 0]
        if not statics:
            continue
        best = max(statics)
        shares = r["depth_share"]
        priced = {d: v for d, v in shares.items() if d in rates}
        covered = sum(priced.values())
        mixed = sum(v * rates[d] for d, v in priced.items()) / covered / best if covered >= 0.5 else None
        out[(setting, conc)] = {"own": r["tput"] / best, "mix": mixed, "unpriced_share": 1.0 - covered}
    return out


def mix_markdown(mx: dict[tuple[str, int], dict]) -> str:
    lines = ["\nThe controllers' depths at the fixed depths' rates, over the best static depth",
             "| requests | setting | measured / best static | its depths at the fixed rates / best static "
             "| share of its time at depths no fixed setting ran |",
             "|---:|---|---:|---:|---:|"]
    for (setting, conc), m in sorted(mx.items(), key=lambda kv: (kv[0][1], kv[0][0])):
        mixed = "-" if m["mix"] is None else f"{m['mix']:.3f}"
        lines.append(f"| {conc} | {setting} | {m['own']:.3f} | {mixed} | {m['unpriced_share']:.0%} |")
    return "\n".join(lines) + "\n"


def churn(cells: list[tuple[str, int, dict, list[dict]]]) -> dict[tuple[str, int], dict]:
    """Per setting and concurrency, pooled over cells: the slot-steps that decoded nothing, per
    request served: (concurrency x the cell's steps - the sequences those steps decoded) over
    the requests the load generator completed. What the controller's churn term prices as
    ``churn_steps`` (see "Churn" in specserve/controller.py): a finished request's slot is empty
    for the step its successor arrives in and that one's prompt step, and as the cell's load
    drains. The drain is counted apart too: the empty slot-steps after the cell's last step
    that ran a prompt (none: the whole cell), when the load generator has nothing left to send
    and the slots empty one by one as the last requests end; it belongs to a load that stops,
    not to a server's steady traffic. A cell without num_completed in its result is left out."""
    acc: dict[tuple[str, int], list[float]] = defaultdict(lambda: [0.0, 0.0, 0.0, 0.0])
    for setting, conc, res, steps in cells:
        done = res.get("metrics", {}).get("num_completed")
        if not done:
            continue
        last_prompt = max((i for i, s in enumerate(steps) if s.get("prefill_seqs")), default=-1)
        a = acc[(setting, conc)]
        a[0] += len(steps)
        a[1] += sum(s["decode"] for s in steps)
        a[2] += done
        a[3] += sum(conc - s["decode"] for s in steps[last_prompt + 1:])
    return {key: {"steps": n, "requests": int(req), "batch": dec / n if n else 0.0,
                  "empty_per_request": (key[1] * n - dec) / req, "drain_per_request": drain / req}
            for key, (n, dec, req, drain) in acc.items()}


def churn_markdown(ch: dict[tuple[str, int], dict]) -> str:
    lines = ["\nEmpty slot-steps a request (concurrency x steps - sequences decoded, over requests served;"
             " of them in the drain: after the cell's last prompt step)",
             "| requests | setting | steps | requests served | B | empty slot-steps a request | of them in the drain |",
             "|---:|---|---:|---:|---:|---:|---:|"]
    for (setting, conc), c in sorted(ch.items(), key=lambda kv: (kv[0][1], kv[0][0])):
        lines.append(f"| {conc} | {setting} | {c['steps']:.0f} | {c['requests']} | {c['batch']:.2f} "
                     f"| {c['empty_per_request']:.2f} | {c['drain_per_request']:.2f} |")
    return "\n".join(lines) + "\n"


def depth_costs(cells: list[tuple[str, int, dict, list[dict]]], full: float = 0.75) -> dict:
    """{concurrency: {(setting, depth): figures}} over the decode-only steps that hold at least
    `full` of the concurrency and follow a decode-only step at the same depth: how many, their
    mean batch, step, draft and verify ms, the rest, and tokens per sequence. The same depth at
    the same batch should cost the same whichever setting ran it; where adaptive's steps at a
    depth cost more than the fixed setting's, the model it learns from reads that depth dear
    (s22b at 8 requests: depth 3 at 28.0 ms against static depth 3's 23.7)."""
    sums: dict[int, dict[tuple[str, int], list[float]]] = {}
    for setting, conc, _, steps in cells:
        prev = None
        for s in steps:
            decode_only = not s.get("prefill_seqs")
            if decode_only and s["decode"] >= max(1.0, full * conc) and s["depth"] == prev and s["step_s"] > 0:
                acc = sums.setdefault(conc, {}).setdefault((setting, s["depth"]), [0.0] * 6)
                for i, x in enumerate((1, s["decode"], s["step_s"], s["draft_s"], s["verify_s"],
                                       s["emitted"] / s["decode"])):
                    acc[i] += x
            prev = s["depth"] if decode_only else None
    out: dict[int, dict[tuple[str, int], dict]] = {}
    for conc, by in sums.items():
        for key, (n, b, step, draft, verify, tok) in by.items():
            out.setdefault(conc, {})[key] = {
                "steps": int(n), "batch": b / n, "step_ms": 1e3 * step / n, "draft_ms": 1e3 * draft / n,
                "verify_ms": 1e3 * verify / n, "rest_ms": 1e3 * (step - draft - verify) / n, "tok_per_seq": tok / n}
    return out


def depth_costs_markdown(dc: dict) -> str:
    lines = []
    for conc in sorted(dc):
        lines += ["", f"{conc} requests: decode-only steps after a step at the same depth", "",
                  "| depth | setting | steps | B | ms a step | draft ms | verify ms | rest ms | tok/seq |",
                  "|---:|---|---:|---:|---:|---:|---:|---:|---:|"]
        for (setting, depth), r in sorted(dc[conc].items(), key=lambda kv: (kv[0][1], kv[0][0])):
            lines.append(f"| {depth} | {setting} | {r['steps']} | {r['batch']:.1f} | {r['step_ms']:.1f} "
                         f"| {r['draft_ms']:.1f} | {r['verify_ms']:.1f} | {r['rest_ms']:.1f} | {r['tok_per_seq']:.2f} |")
    return "\n".join(lines) + "\n"


def _round_of(res: dict) -> str | None:
    """The round a result file belongs to (its out path's folder: one server's round, unique
    across sweeps), None where the result file does not say."""
    out = (res.get("config") or {}).get("out")
    return str(Path(out).parent) if out else None


def paired_costs(cells: list[tuple[str, int, dict, list[dict]]], full: float = 0.75,
                 min_steps: int = 5) -> dict:
    """{concurrency: {(setting, depth, kind): figures}}: a controller's draft + verify time of a
    step at one depth over the fixed setting's at that depth, paired within each round (the
    same server, prompts and minutes of the host) and read as the geometric mean of the rounds'
    ratios of medians, with its standard error: kind "decode" over the decode-only steps near the
    full batch, "mixed" over those that also ran a prompt chunk. Pooled medians (--depth-costs)
    mix the host's spells into both sides; this reads whether the same pass costs more under
    the controller beyond the rounds' spread (the forty-second session: depth 3 at 64 requests,
    1.032x static3's +-0.015 over the 32 rounds of s40a, s40b and s41a)."""
    meds: dict[tuple, float] = {}
    for setting, conc, res, steps in cells:
        rnd = _round_of(res)
        if rnd is None:
            continue
        by: dict[tuple[int, str], list[float]] = {}
        for s in steps:
            if s["decode"] >= max(1.0, full * conc):
                kind = "mixed" if s.get("prefill_seqs") else "decode"
                by.setdefault((s["depth"], kind), []).append(s["draft_s"] + s["verify_s"])
        for (depth, kind), xs in by.items():
            if len(xs) >= min_steps:
                meds[(rnd, setting, conc, depth, kind)] = statistics.median(xs)
    logs: dict[int, dict[tuple[str, int, str], list[float]]] = {}
    for (rnd, setting, conc, depth, kind), m in meds.items():
        if fixed_depth(setting) is not None:
            continue
        fixed = meds.get((rnd, "none" if depth == 0 else f"static{depth}", conc, depth, kind))
        if fixed and m > 0:
            logs.setdefault(conc, {}).setdefault((setting, depth, kind), []).append(math.log(m / fixed))
    out: dict[int, dict] = {}
    for conc, by in logs.items():
        for key, xs in by.items():
            ratio, se = math.exp(statistics.fmean(xs)), log_se(xs)
            out.setdefault(conc, {})[key] = {"rounds": len(xs), "ratio": ratio,
                                             "se": None if se is None else ratio * se}
    return out


def paired_costs_markdown(pc: dict) -> str:
    lines = []
    for conc in sorted(pc):
        lines += ["", f"{conc} requests: a controller's draft + verify ms at a depth over the fixed depth's, "
                      "paired by round (geometric mean of the rounds' ratios of medians)", "",
                  "| depth | setting | steps | rounds | controller / fixed | its standard error |",
                  "|---:|---|---|---:|---:|---:|"]
        for (setting, depth, kind), r in sorted(pc[conc].items(), key=lambda kv: (kv[0][1], kv[0][2], kv[0][0])):
            se = "" if r["se"] is None else f"+-{r['se']:.3f}"
            lines.append(f"| {depth} | {setting} | {kind} | {r['rounds']} | {r['ratio']:.3f} | {se} |")
    return "\n".join(lines) + "\n"


BEFORE = ("same", "deeper", "shallower")


def change_costs(cells: list[tuple[str, int, dict, list[dict]]], full: float = 0.75) -> dict:
    """{concurrency: {(setting, depth, before): figures}} over the decode-only steps that hold at
    least `full` of the concurrency and follow a decode-only step, by that step's depth: the
    same (in a run), deeper, shallower. Setting "*" pools every setting that ran more than one
    depth (the controllers). Figures: steps, and medians of verify and draft ms per decoding
    sequence and of the rest of the step (ms): medians, as one stall in a few tens of steps
    moves a mean by percents. Whether a depth's first step after another costs more than the
    depth does in a run is what the online comparisons, read on such steps, depend on (the
    twenty-eighth session read +11.5% at depth 3 from pooled means; the twenty-ninth's medians
    found none at depths 3-4)."""
    samples: dict[int, dict[tuple[str, int, str], list[tuple[float, float, float]]]] = {}
    depths_run: dict[str, set[int]] = defaultdict(set)
    for setting, conc, _, steps in cells:
        prev = None
        for s in steps:
            decode_only = not s.get("prefill_seqs")
            depths_run[setting].add(s["depth"])
            if decode_only and prev is not None and s["decode"] >= max(1.0, full * conc) and s["step_s"] > 0:
                d = s["depth"]
                before = "same" if prev == d else ("deeper" if prev > d else "shallower")
                x = (1e3 * s["verify_s"] / s["decode"], 1e3 * s["draft_s"] / s["decode"],
                     1e3 * (s["step_s"] - s["verify_s"] - s["draft_s"]))
                samples.setdefault(conc, {}).setdefault((setting, d, before), []).append(x)
            prev = s["depth"] if decode_only else None
    out: dict[int, dict[tuple[str, int, str], dict]] = {}
    for conc, by in samples.items():
        pooled: dict[tuple[str, int, str], list] = defaultdict(list)
        for (setting, d, before), xs in by.items():
            if len(depths_run[setting]) > 1:
                pooled[("*", d, before)] += xs
        for key, xs in list(by.items()) + list(pooled.items()):
            out.setdefault(conc, {})[key] = {
                "steps": len(xs), "verify_ms_seq": statistics.median(x[0] for x in xs),
                "draft_ms_seq": statistics.median(x[1] for x in xs), "rest_ms": statistics.median(x[2] for x in xs)}
    return out


def change_costs_markdown(cc: dict) -> str:
    return _by_kind_markdown(
        cc, "decode-only steps by the depth of the step before (medians)",
        "| depth | setting | before | steps | verify ms/seq | draft ms/seq | rest ms |", BEFORE,
        lambda r: f"{r['steps']} | {r['verify_ms_seq']:.3f} | {r['draft_ms_seq']:.3f} | {r['rest_ms']:.2f}")


def _by_kind_markdown(tables: dict, title: str, header: str, kinds: tuple[str, ...], cells) -> str:
    """Per concurrency, a table of {(setting, depth, kind): figures} rows ordered by depth,
    setting and `kinds`; `cells(figures)` writes a row's columns after its key."""
    lines = []
    for conc in sorted(tables):
        lines += ["", f"{conc} requests: {title}", "", header, "|---:|---|---|" + "---:|" * (header.count("|") - 4)]
        for (setting, depth, kind), r in sorted(tables[conc].items(),
                                                key=lambda kv: (kv[0][1], kv[0][0], kinds.index(kv[0][2]))):
            lines.append(f"| {depth} | {setting} | {kind} | {cells(r)} |")
    return "\n".join(lines) + "\n"


KINDS = ("run", "switch-in", "isolated")


def step_kinds(cells: list[tuple[str, int, dict, list[dict]]], full: float = 0.75) -> dict:
    """{concurrency: {(setting, depth, kind): figures}} for the controllers' decode-only steps
    that hold at least `full` of the concurrency, by where each stood in the run of depths: a
    *run* step follows a step at its depth, a *switch-in* starts a run of two or more, an
    *isolated* step has other depths on both sides (an exploration, a probe, a guard's plain
    sample). Figures: steps, and the means of measured over predicted tokens (emitted over the
    batch times the last fresh evaluation's tokens a sequence at that depth), step time and
    goodput (emitted / step_s over the plan's predicted goodput). An isolated step that reads
    dear against the plan's runs teaches the model and the bias correction that its depth is
    dear (the twenty-fourth session: plain and depth-1 steps at 32-64 requests 1.2-1.4x their
    predicted time)."""
    sums: dict[int, dict[tuple[str, int, str], list[float]]] = {}
    for setting, conc, _, steps in cells:
        tokens = None   # the last fresh evaluation's tokens a sequence per depth
        for i, s in enumerate(steps):
            if s.get("tokens"):
                tokens = s["tokens"]
            if (s.get("prefill_seqs") or s["decode"] < max(1.0, full * conc) or not s.get("predicted")
                    or tokens is None or i == 0 or i + 1 >= len(steps) or s["step_s"] <= 0):
                continue
            d = s["depth"]
            expected = tokens[d] if d < len(tokens) else None
            if not expected:
                continue
            before, after = steps[i - 1]["depth"], steps[i + 1]["depth"]
            kind = "run" if before == d else ("switch-in" if after == d else "isolated")
            predicted_s = s["decode"] * expected / s["predicted"]
            acc = sums.setdefault(conc, {}).setdefault((setting, d, kind), [0.0] * 4)
            for j, x in enumerate((1, s["emitted"] / (s["decode"] * expected), s["step_s"] / predicted_s,
                                   s["emitted"] / s["step_s"] / s["predicted"])):
                acc[j] += x
    return {conc: {key: {"steps": int(n), "tokens": tok / n, "time": t / n, "goodput": g / n}
                   for key, (n, tok, t, g) in by.items()} for conc, by in sums.items()}


def step_kinds_markdown(sk: dict) -> str:
    return _by_kind_markdown(
        sk, "the controller's steps by where they stood, measured / predicted",
        "| depth | setting | kind | steps | tokens | time | goodput |", KINDS,
        lambda r: f"{r['steps']} | {r['tokens']:.3f} | {r['time']:.3f} | {r['goodput']:.3f}")


def regimes(cells: list[tuple[str, int, dict, list[dict]]], full: float = 0.75) -> dict:
    """{concurrency: {setting: {"by_choice": {depth: figures}, "measured": {depth: ms}}}}: a
    controller's decode-only steps near the full batch, grouped by the depth it chose, with
    the mean verify ms it priced *every* depth at on those steps (the step log's verify_pred),
    beside the mean verify ms its steps at each depth measured. The priced value of the depth
    that runs is checked every step; the others' are read through the row's shape at the
    level that depth's steps set. Where a depth's price rises while another runs, the plan
    leaves it and has no reason to come back (the thirtieth session: at 16 requests depth 3
    read 26.05 ms while it ran and 27.4 while 4 or 5 ran, against 25.65 measured)."""
    out: dict[int, dict[str, dict]] = {}
    for setting, conc, _, steps in cells:
        for s in steps:
            if (s.get("prefill_seqs") or s["decode"] < max(1.0, full * conc) or not s.get("verify_pred")
                    or s["step_s"] <= 0):
                continue
            d = s["depth"]
            r = out.setdefault(conc, {}).setdefault(setting, {"by_choice": {}, "measured": {}})
            acc = r["by_choice"].setdefault(d, {"steps": 0, "pred": [0.0] * len(s["verify_pred"])})
            acc["steps"] += 1
            for j, v in enumerate(s["verify_pred"][:len(acc["pred"])]):
                acc["pred"][j] += v
            m = r["measured"].setdefault(d, [0, 0.0])
            m[0] += 1
            m[1] += 1e3 * s["verify_s"]
    for by in out.values():
        for r in by.values():
            for acc in r["by_choice"].values():
                acc["pred"] = [v / acc["steps"] for v in acc["pred"]]
            r["measured"] = {d: t / n for d, (n, t) in r["measured"].items()}
    return out


def regimes_markdown(rg: dict, min_steps: int = 10) -> str:
    lines = []
    for conc in sorted(rg):
        for setting, r in sorted(rg[conc].items()):
            depths = sorted(d for d, a in r["by_choice"].items() if a["steps"] >= min_steps)
            if not depths:
                continue
            lines += ["", f"{conc} requests, {setting}: verify ms priced for each depth, by the depth chosen "
                          "(decode-only steps near the full batch)", "",
                      "| chosen | steps | " + " | ".join(f"d{j}" for j in depths) + " |",
                      "|---:|---:|" + "---:|" * len(depths)]
            for d in depths:
                a = r["by_choice"][d]
                lines.append(f"| {d} | {a['steps']} | " + " | ".join(
                    (f"**{a['pred'][j]:.2f}**" if j == d else f"{a['pred'][j]:.2f}") if j < len(a["pred"]) else "-"
                    for j in depths) + " |")
            lines.append("| measured | | " + " | ".join(f"{r['measured'][j]:.2f}" for j in depths) + " |")
    return "\n".join(lines) + "\n"


def pricing(cells: list[tuple[str, int, dict, list[dict]]], bin_tokens: int = 20,
            min_steps: int = 3) -> dict:
    """{concurrency: {setting: figures}}: what a controller priced each depth's step at
    against what the fixed setting of that depth measured, at matched batch and context.
    Steps: decode-only with every request of the cell decoding, binned by context per
    sequence (`bin_tokens` wide). Per controller (a setting whose steps log "draft_pred" and
    "verify_pred") and depth d, in each bin with at least `min_steps` steps of both: the
    median of the controller's priced draft + verify (and verify alone) over the median of
    static d's measured (none: depth 0); then the mean of the bins' ratios, weighted by the
    controller's steps in each. 1.0 where the price was right; one depth dear beside its
    neighbours is where the plan stays away from it. Figures: draft_verify[d], verify[d],
    steps[d] (the controller's steps read), and held (those steps by the depth that ran; only
    steps whose plan came from a fresh evaluation log the prices)."""
    priced: dict = defaultdict(lambda: defaultdict(list))     # (conc, setting) -> (d, bin) -> [(dv, v)]
    measured: dict = defaultdict(list)                        # (conc, d, bin) -> [(dv, v)]
    held: dict = defaultdict(lambda: defaultdict(int))
    for setting, conc, _res, steps in cells:
        fixed = fixed_depth(setting)
        for s in steps:
            if s["prefill_seqs"] or s["decode"] != conc or s["step_s"] <= 0:
                continue
            b = int(s.get("context", 0) / conc // bin_tokens * bin_tokens)
            if fixed is not None:
                if s["depth"] == fixed:
                    measured[conc, fixed, b].append((1e3 * (s["draft_s"] + s["verify_s"]), 1e3 * s["verify_s"]))
            elif s.get("verify_pred") and s.get("draft_pred"):
                held[conc, setting][s["depth"]] += 1
                for d, (x, y) in enumerate(zip(s["draft_pred"], s["verify_pred"])):
                    if x is not None and y is not None:
                        priced[conc, setting][d, b].append((x + y, y))
    out: dict = {}
    for (conc, setting), by in sorted(priced.items()):
        acc: dict = defaultdict(lambda: [0.0, 0.0, 0])
        for (d, b), xs in by.items():
            ms = measured.get((conc, d, b), [])
            if len(xs) < min_steps or len(ms) < min_steps:
                continue
            a = acc[d]
            a[0] += len(xs) * statistics.median(x[0] for x in xs) / statistics.median(m[0] for m in ms)
            a[1] += len(xs) * statistics.median(x[1] for x in xs) / statistics.median(m[1] for m in ms)
            a[2] += len(xs)
        out.setdefault(conc, {})[setting] = {
            "draft_verify": {d: a[0] / a[2] for d, a in sorted(acc.items())},
            "verify": {d: a[1] / a[2] for d, a in sorted(acc.items())},
            "steps": {d: a[2] for d, a in sorted(acc.items())},
            "held": dict(sorted(held[conc, setting].items())),
        }
    return out


def pricing_markdown(pr: dict) -> str:
    lines = []
    for conc, by in sorted(pr.items()):
        depths = sorted({d for r in by.values() for d in r["steps"]})
        if not depths:
            continue
        lines += ["", f"{conc} requests: priced / measured at matched batch and context (draft + verify; verify)", "",
                  "| setting | " + " | ".join(f"d={d}" for d in depths) + " | steps by depth run |",
                  "|---|" + "---|" * len(depths) + "---|"]
        for setting, r in sorted(by.items()):
            cells = [f"{r['draft_verify'][d]:.3f}; {r['verify'][d]:.3f}" if d in r["steps"] else "-" for d in depths]
            run = ", ".join(f"{d}: {n}" for d, n in r["held"].items())
            lines.append(f"| {setting} | " + " | ".join(cells) + f" | {run} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.step_report", description=__doc__.split("\n\n")[0])
    p.add_argument("sweep_dirs", nargs="+", type=Path)
    p.add_argument("--concurrency", nargs="*", type=int, help="only these concurrencies")
    p.add_argument("--settings", nargs="*", help="only these settings")
    p.add_argument("--curves", action="store_true",
                   help="also, per concurrency, the goodput over depth as the fixed settings measured "
                        "it beside the adaptive controller's predicted curve and where it ran")
    p.add_argument("--plot", type=Path, help="with --curves: also draw them into this PNG")
    p.add_argument("--depth-costs", action="store_true",
                   help="also, per concurrency, each setting's steps by depth (after a step at the same "
                        "depth, near the full batch): what one depth costs under each setting")
    p.add_argument("--step-kinds", action="store_true",
                   help="also, per concurrency, the controllers' steps by depth and by where they stood "
                        "(in a run, starting one, isolated): measured over predicted tokens, time, goodput")
    p.add_argument("--change-costs", action="store_true",
                   help="also, per concurrency, each depth's steps by the depth of the step before (the "
                        "same, deeper, shallower): medians of verify and draft ms per sequence and the rest")
    p.add_argument("--paired-costs", action="store_true",
                   help="also, per concurrency, a controller's draft + verify time at each depth over the "
                        "fixed depth's, paired by round, with its standard error (decode-only and mixed steps)")
    p.add_argument("--regimes", action="store_true",
                   help="also, per concurrency, the controllers' priced verify ms for every depth, by the "
                        "depth they chose, beside what each depth measured")
    p.add_argument("--pricing", action="store_true",
                   help="also, per concurrency, each controller's price of every depth's step over what "
                        "that fixed depth measured, at matched batch and context per sequence")
    p.add_argument("--mix", action="store_true",
                   help="also, per concurrency, each controller's time at each depth priced at the fixed "
                        "settings' throughput there, over the best static depth, beside its own")
    p.add_argument("--churn", action="store_true",
                   help="also, per setting and concurrency, the slot-steps that decoded nothing per request "
                        "served (what the controller's churn_steps stands for), and those after the last prompt")
    p.add_argument("--json", type=Path, help="also write the figures here")
    args = p.parse_args(argv)
    cells = [c for d in args.sweep_dirs for c in cells_of(d)]
    cells = [c for c in cells if (not args.concurrency or c[1] in args.concurrency)
             and (not args.settings or c[0] in args.settings)]
    if not cells:
        print("no result file with started_at and a step log (run the sweep with --step-logs)", file=sys.stderr)
        return 1
    rows = summarise(cells)
    print(markdown(rows), end="")
    if args.curves:
        cs = curves(cells)
        print(curves_markdown(cs), end="")
        if args.plot:
            print(plot_curves(cs, args.plot))
    if args.depth_costs:
        print(depth_costs_markdown(depth_costs(cells)), end="")
    if args.step_kinds:
        print(step_kinds_markdown(step_kinds(cells)), end="")
    if args.change_costs:
        print(change_costs_markdown(change_costs(cells)), end="")
    if args.paired_costs:
        print(paired_costs_markdown(paired_costs(cells)), end="")
    if args.regimes:
        print(regimes_markdown(regimes(cells)), end="")
    if args.pricing:
        print(pricing_markdown(pricing(cells)), end="")
    if args.mix:
        print(mix_markdown(mix(rows)), end="")
    if args.churn:
        print(churn_markdown(churn(cells)), end="")
    if args.json:
        args.json.write_text(json.dumps([{"setting": s, "concurrency": c, **r} for (s, c), r in rows.items()], indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
