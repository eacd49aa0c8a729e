"""Adaptive against every static depth inside one engine: whole runs of one load, settings in turn.

    python -m benchmarks.paired [--concurrency 1 8 64] [--settings adaptive static0 ... static8]
                                [--rounds 6] [--out F.json] [--plot F.png]

A process keeps a pace of its own on a shared machine, so one engine serves every setting
(switched with `set_speculation`, as /admin/speculation does): a round runs the whole load
once per setting, the order rotated each round, and the figures are paired by round. The
adaptive controller keeps its state between its runs, as a long-running server does; static
runs leave it alone. Every setting runs the load once before the rounds (a process's first
pass of a new shape builds what it needs, which a long-running server has done long ago). Each run is a closed loop: `concurrency` sequences at a time (the
scheduler's max_num_seqs), the next prompt admitted as one finishes. Greedy, EOS ignored.

Printed: tokens/s per setting (mean over rounds), adaptive over each static setting (the mean
of the per-round ratios, with its standard error), and adaptive over the best static setting.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

from benchmarks.runinfo import emit, git_commit
from specserve import LLM, SamplingParams

DATA = Path(__file__).resolve().parent / "data" / "heldout_prompts.jsonl"


def paired_ratio(a: list[float], b: list[float]) -> tuple[float, float | None]:
    """Mean of a[i] / b[i] and its standard error (None with one round)."""
    ratios = [x / y for x, y in zip(a, b)]
    mean = sum(ratios) / len(ratios)
    if len(ratios) < 2:
        return mean, None
    var = sum((r - mean) ** 2 for r in ratios) / (len(ratios) - 1)
    return mean, math.sqrt(var / len(ratios))


def _set(llm: LLM, setting: str) -> None:
    if setting == "adaptive":
        llm.engine.set_speculation("adaptive")
    else:
        llm.engine.set_speculation("static", int(setting.removeprefix("static")))


def run_load(llm: LLM, prompts: list[list[int]], max_tokens: int) -> float:
    """Tokens/s of serving every prompt, max_num_seqs at a time."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    start = time.perf_counter()
    outs = llm.generate(prompts, params)
    return sum(len(o.token_ids) for o in outs) / (time.perf_counter() - start)


def run(llm: LLM, concurrency: int, settings: list[str], rounds: int, prompts: list[list[int]],
        max_tokens: int) -> dict:
    llm.engine.scheduler.config.max_num_seqs = concurrency
    for s in settings:   # warm-up: a setting's first run builds what its shapes need (oneDNN primitives)
        _set(llm, s)
        run_load(llm, prompts, max_tokens)
    tps: dict[str, list[float]] = {s: [] for s in settings}
    for r in range(rounds):
        for s in settings[r % len(settings):] + settings[:r % len(settings)]:
            _set(llm, s)
            tps[s].append(run_load(llm, prompts, max_tokens))
    _set(llm, "adaptive")
    res = {"concurrency": concurrency, "tokens_per_s": tps, "mean": {s: sum(v) / len(v) for s, v in tps.items()}}
    if "adaptive" in settings:
        static = [s for s in settings if s != "adaptive"]
        res["adaptive_over"] = {s: paired_ratio(tps["adaptive"], tps[s]) for s in static}
        if static:
            best = max(static, key=lambda s: res["mean"][s])
            res["best_static"] = best
    return res


def report(results: list[dict]) -> str:
    lines = []
    for res in results:
        lines += [f"### {res['concurrency']} sequences", "", "| setting | tokens/s | adaptive / this (+- se) |",
                  "|---|---|---|"]
        for s, mean in res["mean"].items():
            ratio = res.get("adaptive_over", {}).get(s)
            cell = "" if ratio is None else f"{ratio[0]:.3f}" + ("" if ratio[1] is None else f" +- {ratio[1]:.3f}")
            lines.append(f"| {s}{' (best static)' if s == res.get('best_static') else ''} | {mean:.0f} | {cell} |")
        lines.append("")
    return "\n".join(lines)


def plot(out: dict, path: Path) -> Path:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    results = out["results"]
    fig, axes = plt.subplots(1, len(results), figsize=(4.2 * len(results), 3.4), squeeze=False)
    for ax, res in zip(axes[0], results):
        for s, values in res["tokens_per_s"].items():
            ax.plot(range(1, len(values) + 1), values, "o-" if s == "adaptive" else ".-", label=s,
                    lw=2.2 if s == "adaptive" else 0.9)
        ax.set_title(f"{res['concurrency']} sequences", fontsize=9)
        ax.set_xlabel("round")
        ax.set_ylabel("tokens/s")
    axes[0][-1].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    return path


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 64])
    ap.add_argument("--settings", nargs="+", default=["adaptive"] + [f"static{d}" for d in range(9)])
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--num-prompts", type=int, default=None, help="default: 2 x concurrency, at least 8")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--config", help="an engine config (default: the embedded pair)")
    ap.add_argument("--cpu-threads", type=int)
    ap.add_argument("--out")
    ap.add_argument("--plot")
    args = ap.parse_args(argv)
    for s in args.settings:
        if s != "adaptive" and not (s.startswith("static") and s[6:].isdigit()):
            ap.error(f"unknown setting {s!r}: 'adaptive' or 'static<depth>'")
    llm = LLM(args.config, progress=False, spec_mode="adaptive", cpu_threads=args.cpu_threads,
              max_num_seqs=max(args.concurrency))
    texts = [json.loads(line) for line in DATA.open()]
    prompts = [llm.tokenizer.encode(t) for t in texts]
    results = []
    for c in args.concurrency:
        n = args.num_prompts or max(8, 2 * c)
        results.append(run(llm, c, args.settings, args.rounds, (prompts * (n // len(prompts) + 1))[:n],
                           args.max_tokens))
        print(report(results[-1:]), flush=True)
    command = "python -m benchmarks.paired " + " ".join(sys.argv[1:] if argv is None else argv)
    out = {"commit": git_commit(), "command": command, "results": results}
    emit(out, f"commit {out['commit']}: {command}", args.out, args.plot, plot)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
