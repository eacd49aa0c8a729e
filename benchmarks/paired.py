"""Adaptive against static depths inside one engine: whole runs of one load, settings in turn.

    python -m benchmarks.paired [--concurrency 32] [--settings adaptive static3 static4]
                                [--rounds 6] [--out F.json] [--plot F.png]

Why one engine: on the dev CPU a process keeps a pace of its own. Six fresh processes running
the same load at static depth 3 (32 sequences, 128 prompts of 100 tokens, 64 new tokens each)
ran 1198-1421 tokens/s, a spread wider than what separates neighbouring depths, and a sweep
over HTTP (benchmarks/sweep.py) starts a process per setting. Here one engine (adaptive mode,
start-up calibration included) serves every setting: a round runs the whole load once per
setting, the order rotated each round, and the figures are paired per round. Offline, with
no server: a server's event loop sends an SSE event per request per step, which makes every
step dearer and deep plans relatively cheaper, so the best depth here is not the sweep's (at
32 requests on the dev CPU in one session: static depth 3-4 here, 5 over HTTP). It tells whether a change to
the controller helps the engine, quickly; the sweep is the verdict.

A static setting runs with the controller detached (the engine plans the configured depth,
as in static mode, and nothing reaches the controller), so the adaptive runs learn only from
their own steps; between them the controller keeps its state, as a long-running server's
does. Everything else is shared alike: the KV pool, the prefix cache (each run sends the same
prompts), the process's allocator and caches.

Printed and written (--out): tokens/s per setting and round, the adaptive / static ratio
(mean of the per-round ratios, with its standard error), and per kind of step (decode-only
with at least 3/4 of the concurrency decoding, decode-only with fewer: the tail, and steps
that also prefill) the time, the tokens, the draft and verify time per decoding sequence
and the depths run. --plot draws tokens/s per round. Without --target/--draft: the embedded
pair. Greedy, EOS ignored.
"""

from __future__ import annotations

import argparse
import json
import math
import tempfile
import time
from collections import Counter
from pathlib import Path

from tqdm import tqdm

from benchmarks.runinfo import emit, git_commit

from specserve import LLM, SamplingParams

KINDS = ("full", "tail", "mixed")


def step_kind(record: dict, concurrency: int) -> str:
    """full: decode-only with >= 3/4 of the concurrency decoding; tail: decode-only with fewer;
    mixed: the step also ran a prompt chunk."""
    if record["prefill_seqs"]:
        return "mixed"
    return "full" if record["decode"] >= 0.75 * concurrency else "tail"


def summarise(records: list[dict], concurrency: int) -> dict:
    """Per kind of step: steps, seconds, tokens emitted, tokens/s, draft and verify ms per
    decoding sequence; and the depths run (steps per depth)."""
    out = {}
    for kind in KINDS:
        rows = [r for r in records if step_kind(r, concurrency) == kind]
        seqs = sum(r["decode"] for r in rows)
        seconds = sum(r["step_s"] for r in rows)
        tokens = sum(r["emitted"] for r in rows)
        out[kind] = {
            "steps": len(rows), "seconds": seconds, "tokens": tokens,
            "tokens_per_s": tokens / seconds if seconds > 0 else None,
            "draft_ms_per_seq": 1000 * sum(r["draft_s"] for r in rows) / seqs if seqs else None,
            "verify_ms_per_seq": 1000 * sum(r["verify_s"] for r in rows) / seqs if seqs else None,
        }
    out["depths"] = dict(sorted(Counter(r["depth"] for r in records).items()))
    return out


def paired_ratio(a: list[float], b: list[float]) -> tuple[float, float | None]:
    """Mean of the per-round ratios a / b, and its standard error (None from one round)."""
    ratios = [x / y for x, y in zip(a, b)]
    mean = sum(ratios) / len(ratios)
    if len(ratios) < 2:
        return mean, None
    var = sum((r - mean) ** 2 for r in ratios) / (len(ratios) - 1)
    return mean, math.sqrt(var / len(ratios))


class Detach:
    """Within the block, the engine plans a static depth with the controller detached."""

    def __init__(self, llm: LLM, depth: int):
        self.spec, self.depth = llm.engine.spec, depth

    def __enter__(self):
        self.controller, self.spec.controller = self.spec.controller, None
        self.saved, self.spec.config.spec.depth = self.spec.config.spec.depth, self.depth
        return self

    def __exit__(self, *exc):
        self.spec.controller = self.controller
        self.spec.config.spec.depth = self.saved
        return False


def parse_setting(name: str) -> int | None:
    """'adaptive' -> None, 'staticN' -> N."""
    if name == "adaptive":
        return None
    if name.startswith("static") and name[6:].isdigit():
        return int(name[6:])
    raise ValueError(f"unknown setting {name!r}: 'adaptive' or 'static<depth>'")


def run(llm: LLM, settings: list[str], rounds: int, prompts: list[list[int]], max_tokens: int,
        concurrency: int, step_log: Path, progress: bool = True, warmup: bool = True) -> dict:
    depths = {s: parse_setting(s) for s in settings}
    if any(d is None for d in depths.values()) and llm.engine.spec.controller is None:
        raise ValueError("the 'adaptive' setting needs an engine in adaptive mode with a draft")
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    if warmup:   # the first run of a load is slower whatever the setting (adaptive: as a server's first traffic)
        llm.generate(prompts, params)
    tokens_per_s = {s: [] for s in settings}
    records = {s: [] for s in settings}
    bar = tqdm(total=rounds * len(settings), desc="paired runs", disable=not progress)
    for r in range(rounds):
        k = r % len(settings)
        for s in settings[k:] + settings[:k]:
            first = sum(1 for _ in step_log.open())
            start = time.perf_counter()
            if depths[s] is None:
                outs = llm.generate(prompts, params)
            else:
                with Detach(llm, depths[s]):
                    outs = llm.generate(prompts, params)
            elapsed = time.perf_counter() - start
            tokens_per_s[s].append(sum(len(o.token_ids) for o in outs) / elapsed)
            records[s] += [json.loads(line) for line in step_log.open().readlines()[first:]]
            bar.set_postfix_str(f"{s} {tokens_per_s[s][-1]:.0f} tok/s")
            bar.update()
    bar.close()
    out = {"settings": {}, "concurrency": concurrency, "rounds": rounds, "prompts": len(prompts),
           "max_tokens": max_tokens}
    for s in settings:
        entry = {"tokens_per_s": tokens_per_s[s], "mean_tokens_per_s": sum(tokens_per_s[s]) / rounds,
                 "steps": summarise(records[s], concurrency)}
        if "adaptive" in settings and s != "adaptive":
            mean, se = paired_ratio(tokens_per_s["adaptive"], tokens_per_s[s])
            entry["adaptive_over_this"] = {"mean": mean, "se": se}
        out["settings"][s] = entry
    return out


def report(res: dict) -> str:
    lines = [f"{res['concurrency']} at a time, {res['prompts']} prompts x {res['max_tokens']} tokens, "
             f"{res['rounds']} rounds", "",
             "| setting | tokens/s (mean) | adaptive / this | full steps tok/s | tail tok/s | mixed tok/s "
             "| verify ms/seq (full) | draft ms/seq (full) | depths (steps) |",
             "|---|---:|---|---:|---:|---:|---:|---:|---|"]

    def f(x, fmt="{:.0f}"):
        return "-" if x is None else fmt.format(x)

    for s, e in res["settings"].items():
        st = e["steps"]
        ratio = e.get("adaptive_over_this")
        ratio_s = "-" if ratio is None else (f"{ratio['mean']:.3f}" + ("" if ratio["se"] is None else f" +- {ratio['se']:.3f}"))
        lines.append(f"| {s} | {e['mean_tokens_per_s']:.0f} | {ratio_s} | {f(st['full']['tokens_per_s'])} | "
                     f"{f(st['tail']['tokens_per_s'])} | {f(st['mixed']['tokens_per_s'])} | "
                     f"{f(st['full']['verify_ms_per_seq'], '{:.2f}')} | {f(st['full']['draft_ms_per_seq'], '{:.2f}')} | "
                     + " ".join(f"{d}:{n}" for d, n in st["depths"].items()) + " |")
    return "\n".join(lines)


def plot(res: dict, path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for s, e in res["settings"].items():
        ax.plot(range(1, res["rounds"] + 1), e["tokens_per_s"], marker="o", label=s,
                linewidth=2.5 if s == "adaptive" else 1.2)
    ax.set_xlabel("round (one run of the whole load per setting, same engine)")
    ax.set_ylabel("output tokens/s")
    ax.set_title(f"{res['concurrency']} at a time: settings in turn inside one engine")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def main(argv=None) -> int:
    from benchmarks.bench_offline import held_out_prompts

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--target", default=None, help="target model directory (default: the embedded pair)")
    ap.add_argument("--draft", default=None)
    ap.add_argument("--concurrency", type=int, default=32, help="sequences at a time (max_num_seqs)")
    ap.add_argument("--prompts", type=int, default=None, help="prompts per run (default: 4 x concurrency)")
    ap.add_argument("--prompt-tokens", type=int, default=100, help="held-out prompts cut to this many tokens")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--settings", nargs="+", default=["adaptive", "static3", "static4"])
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--cpu-threads", type=int, default=1)
    ap.add_argument("--out", default=None, help="write the figures as JSON here")
    ap.add_argument("--plot", default=None, help="draw tokens/s per round into this PNG")
    ap.add_argument("--no-progress", action="store_true")
    args = ap.parse_args(argv)
    for s in args.settings:
        parse_setting(s)
    overrides = {"max_num_seqs": args.concurrency, "cpu_threads": args.cpu_threads}
    if args.target:
        overrides["target"] = args.target
        if args.draft:
            overrides["draft"] = args.draft
    with tempfile.TemporaryDirectory() as tmp:
        log = Path(tmp) / "steps.jsonl"
        log.touch()
        llm = LLM(progress=not args.no_progress, step_log=str(log), **overrides)
        prompts = held_out_prompts(args.prompts or 4 * args.concurrency, args.prompt_tokens, llm.tokenizer)
        res = run(llm, args.settings, args.rounds, prompts, args.max_tokens, args.concurrency, log,
                  progress=not args.no_progress)
    res["commit"] = git_commit()
    emit(res, report(res), args.out, args.plot, plot)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
