"""Workload shifts: does the adaptive controller follow a server whose load, request lengths
and sampling change from one spell to the next, as well as the best static depth of each?

    python -m benchmarks.workload_shift [--config FILE] [--phases PHASE ...]
        [--settings adaptive static0 static3] [--repeat 1] [--cpu-threads 1]
        [--out FILE.json] [--plot FILE.png]

PHASE is ``B:N:max_tokens[:temperature[:top_p]]``: N requests, at most B in flight (a new
one joins as one ends), each decoding max_tokens tokens (EOS ignored), greedy unless a
temperature is given. Each setting gets an engine of its own, in this process, which runs
every phase in order; the prefix cache is emptied before each phase, so every phase
prefills its prompts whole. The engines are alive together and take turns phase by phase
(the order rotated from one phase to the next), so a slow minute of a shared machine lands
on one phase of every setting rather than on one setting's every phase; ``--one-at-a-time``
runs one engine through all its phases before starting the next (for pairs too large to
hold several engines). With ``--repeat R`` all of it runs R times (fresh engines each time)
and each phase reports its median.

Per phase and setting: output tokens per second over the phase's wall time, its steps, and
the depths they ran; per phase, adaptive over the best static setting. A sweep
(benchmarks/sweep.py) measures one load at a time, each cell after a warm-up at the top
concurrency: what it cannot show is what one load leaves in the controller for the next
(the mean request length, the acceptance, the costs of the depths not run since). The
default phases are the spells that showed two such lock-ins at depth 0 on the embedded pair
(the forty-seventh session, benchmarks/RESULTS.md): short requests before long ones, and
sampled requests before greedy ones.

One run of a phase is one sample of a shared machine's pace (the sweep's cells read about
+-5% on the dev CPU); the figure to look at is a ratio far from 1, or one that holds over
--repeat.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from benchmarks.depth_curve import load_prompts
from benchmarks.runinfo import git_commit

DEFAULT_PHASES = [
    "16:32:4",        # short requests: the mean request length the churn is priced at falls
    "16:48:64",       # then long ones at the same load
    "1:6:64",         # one user
    "16:48:64:1.0",   # sampled: plain decoding is best here on the dev CPU
    "16:48:64",       # greedy again: the sampled spell's acceptance and costs are stale
    "64:96:64",       # a busy server
    "4:8:192",        # a few long requests
]


@dataclass(frozen=True)
class Phase:
    batch: int
    num_requests: int
    max_tokens: int
    temperature: float = 0.0
    top_p: float = 1.0

    @classmethod
    def parse(cls, text: str) -> "Phase":
        parts = text.split(":")
        if not 3 <= len(parts) <= 5:
            raise ValueError(f"phase {text!r}: expected B:N:max_tokens[:temperature[:top_p]]")
        try:
            batch, n, max_tokens = (int(x) for x in parts[:3])
            rest = [float(x) for x in parts[3:]]
        except ValueError:
            raise ValueError(f"phase {text!r}: B, N and max_tokens are integers, temperature and "
                             "top_p numbers") from None
        if batch < 1 or n < 1 or max_tokens < 1:
            raise ValueError(f"phase {text!r}: B, N and max_tokens must be at least 1")
        phase = cls(batch, n, max_tokens, *rest)
        if phase.temperature < 0 or not 0 < phase.top_p <= 1:
            raise ValueError(f"phase {text!r}: temperature >= 0 and top_p in (0, 1]")
        return phase

    def __str__(self) -> str:
        s = f"{self.batch}:{self.num_requests}:{self.max_tokens}"
        if self.temperature or self.top_p < 1:
            s += f":{self.temperature:g}"
        if self.top_p < 1:
            s += f":{self.top_p:g}"
        return s


def parse_setting(name: str) -> tuple[str, int | None]:
    """'adaptive' -> ("adaptive", None); 'staticD' -> ("static", D)."""
    if name == "adaptive":
        return "adaptive", None
    if name.startswith("static") and name[6:].isdigit():
        return "static", int(name[6:])
    raise ValueError(f"setting {name!r}: 'adaptive' or 'staticD' (D a depth)")


def run_phase(llm, phase: Phase, prompts: list[str], seed: int) -> dict:
    """Serve one phase's requests, at most phase.batch at a time; what it produced and ran."""
    from specserve.sampling import SamplingParams

    engine = llm.engine
    engine.reset_prefix_cache()
    pending = list(reversed(prompts))
    running, steps, tokens = 0, 0, 0
    depths: Counter = Counter()
    start = time.perf_counter()
    while pending or engine.has_unfinished_requests():
        while pending and running < phase.batch:
            params = SamplingParams(max_tokens=phase.max_tokens, temperature=phase.temperature,
                                    top_p=phase.top_p, ignore_eos=True,
                                    seed=seed + len(pending) if phase.temperature else None)
            engine.add_request(None, pending.pop(), params)
            running += 1
        for out in engine.step():
            if out.finished:
                running -= 1
                tokens += len(out.token_ids)
        steps += 1
        depths[engine.spec.totals.last_depth] += 1
    seconds = time.perf_counter() - start
    return {"tokens": tokens, "seconds": seconds, "tokens_per_s": tokens / seconds, "steps": steps,
            "depths": {str(d): n for d, n in sorted(depths.items())}}


def measure(make_llm, phases: list[Phase], settings: list[str], repeat: int = 1,
            progress: bool = True, lockstep: bool = True) -> dict:
    """Every setting through every phase, `repeat` times in turn. make_llm() -> a fresh LLM
    started in adaptive mode (the static settings switch it). lockstep: every setting's
    engine made first, then each phase run by all of them in turn (else one engine through
    all its phases, then the next). Returns per setting, per phase, the runs and their
    median tokens/s."""
    prompts, offset = [], 0
    all_prompts = load_prompts(sum(p.num_requests for p in phases))
    for p in phases:
        prompts.append(all_prompts[offset: offset + p.num_requests])
        offset += p.num_requests
    runs: dict[str, list[list[dict]]] = {s: [[] for _ in phases] for s in settings}

    def engine_for(setting: str):
        llm = make_llm()
        llm.engine.set_speculation(*parse_setting(setting))
        return llm

    def run(r: int, setting: str, llm, i: int) -> None:
        res = run_phase(llm, phases[i], prompts[i], seed=1000 * i)
        runs[setting][i].append(res)
        if progress:
            print(f"[{r + 1}/{repeat}] {setting:9s} phase {i + 1}/{len(phases)} ({phases[i]}): "
                  f"{res['tokens_per_s']:7.1f} tok/s, {res['steps']} steps, depths {res['depths']}",
                  file=sys.stderr, flush=True)

    for r in range(repeat):
        if lockstep:
            engines = {s: engine_for(s) for s in settings}
            for i in range(len(phases)):
                shift = (r * len(phases) + i) % len(settings)
                for setting in settings[shift:] + settings[:shift]:
                    run(r, setting, engines[setting], i)
            for llm in engines.values():
                llm.engine.pool.check_all_free()
            del engines
        else:
            for setting in settings:
                llm = engine_for(setting)
                for i in range(len(phases)):
                    run(r, setting, llm, i)
                llm.engine.pool.check_all_free()
    out = {"phases": [str(p) for p in phases], "settings": settings, "repeat": repeat, "results": {}}
    for setting in settings:
        out["results"][setting] = [
            {"tokens_per_s": statistics.median(x["tokens_per_s"] for x in rs), "runs": rs} for rs in runs[setting]]
    statics = [s for s in settings if s != "adaptive"]
    if "adaptive" in settings and statics:
        out["adaptive_over_best_static"] = []
        for i in range(len(phases)):
            best = max(statics, key=lambda s: out["results"][s][i]["tokens_per_s"])
            out["adaptive_over_best_static"].append({
                "best": best,
                "ratio": out["results"]["adaptive"][i]["tokens_per_s"] / out["results"][best][i]["tokens_per_s"]})
    return out


def format_table(res: dict) -> str:
    settings = res["settings"]
    head = "| phase (B:N:max_tokens[:T[:top_p]]) | " + " | ".join(settings) + " |"
    has_ratio = "adaptive_over_best_static" in res
    if has_ratio:
        head += " adaptive / best static |"
    lines = [head, "|" + "---|" * (len(settings) + 1 + has_ratio)]
    for i, phase in enumerate(res["phases"]):
        cells = [f"{res['results'][s][i]['tokens_per_s']:.0f}" for s in settings]
        row = f"| {i + 1}. {phase} | " + " | ".join(cells) + " |"
        if has_ratio:
            r = res["adaptive_over_best_static"][i]
            row += f" {r['ratio']:.3f} ({r['best']}) |"
        lines.append(row)
    return "\n".join(lines)


def plot(res: dict, out: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    settings, phases = res["settings"], res["phases"]
    fig, ax = plt.subplots(figsize=(max(6.0, 1.4 * len(phases)), 4.0))
    width = 0.8 / len(settings)
    for j, s in enumerate(settings):
        xs = [i + (j - (len(settings) - 1) / 2) * width for i in range(len(phases))]
        ax.bar(xs, [res["results"][s][i]["tokens_per_s"] for i in range(len(phases))], width, label=s)
    ax.set_xticks(range(len(phases)), [f"{i + 1}. {p}" for i, p in enumerate(phases)], rotation=20, fontsize=8)
    ax.set_ylabel("output tokens/s")
    ax.set_title("Workload shifts: each phase after the ones before it (B:N:max_tokens[:T])", fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", help="TOML config (default: the embedded pair)")
    p.add_argument("--phases", nargs="+", default=DEFAULT_PHASES, metavar="PHASE")
    p.add_argument("--settings", nargs="+", default=["adaptive", "static0", "static2", "static3", "static5"])
    p.add_argument("--repeat", type=int, default=1)
    p.add_argument("--cpu-threads", type=int, default=None)
    p.add_argument("--out", help="write the figures as JSON here")
    p.add_argument("--plot", help="draw tokens/s per phase and setting into this PNG")
    p.add_argument("--one-at-a-time", action="store_true",
                   help="one engine through all its phases, then the next (not every setting's engine at once)")
    p.add_argument("--no-progress", action="store_true")
    args = p.parse_args(argv)
    try:
        phases = [Phase.parse(x) for x in args.phases]
        for s in args.settings:
            parse_setting(s)
    except ValueError as e:
        p.error(str(e))
    if args.repeat < 1:
        p.error("--repeat must be at least 1")

    from specserve import config as config_mod
    from specserve.llm import LLM

    cfg = config_mod.load(args.config) if args.config else config_mod.default()
    overrides = {"spec_mode": "adaptive", "max_num_seqs": max(ph.batch for ph in phases)}
    if args.cpu_threads:
        overrides["cpu_threads"] = args.cpu_threads
    cfg = config_mod.with_overrides(cfg, **overrides)
    res = measure(lambda: LLM(cfg, progress=False), phases, args.settings, args.repeat,
                  progress=not args.no_progress, lockstep=not args.one_at_a_time)
    res.update(config=args.config or "embedded pair", commit=git_commit(), machine=platform.platform(),
               processor=platform.processor(), command="python -m benchmarks.workload_shift " + " ".join(
                   argv if argv is not None else sys.argv[1:]))
    print(format_table(res))
    if args.out:
        Path(args.out).write_text(json.dumps(res, indent=1))
    if args.plot:
        print(f"plot: {plot(res, Path(args.plot))}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
