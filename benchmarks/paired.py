"""Adaptive against static depths inside one engine: whole runs of one load, settings in turn.

    python -m benchmarks.paired [--concurrency 32] [--settings adaptive static3 static4]
                                [--rounds 6] [--out F.json] [--plot F.png]
                                [--knobs NAME:key=value[,...] ...]

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

Settings: ``adaptive`` (the engine's controller), ``staticD`` (chain depth D), ``staticD@P``
(depth D as a cap, each chain stopping after its first node whose draft path probability is
below P: a hand-set ``[spec] early_stop``), and NAME of a ``--knobs NAME:key=value`` (a copy
of the start-up controller with those constructor arguments changed, made on its first run
and learning from its own runs only, as ``benchmarks/serve_knobs.py`` makes them for a sweep:
``--knobs noearly:stop_scale=0`` is adaptive without its early stop).

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
    """Within the block, the engine plans a static depth with the controller detached (and,
    given `stop`, each chain stops early below that path probability)."""

    def __init__(self, llm: LLM, depth: int, stop: float | None = None):
        self.spec, self.depth, self.stop = llm.engine.spec, depth, stop

    def __enter__(self):
        spec = self.spec.config.spec
        self.controller, self.spec.controller = self.spec.controller, None
        self.saved = spec.depth, spec.early_stop
        spec.depth = self.depth
        if self.stop is not None:
            spec.early_stop = self.stop
        return self

    def __exit__(self, *exc):
        self.spec.controller = self.controller
        self.spec.config.spec.depth, self.spec.config.spec.early_stop = self.saved
        return False


class Attach:
    """Within the block, `controller` plans and learns in the engine's controller's place."""

    def __init__(self, llm: LLM, controller):
        self.spec, self.controller = llm.engine.spec, controller

    def __enter__(self):
        self.saved, self.spec.controller = self.spec.controller, self.controller
        return self

    def __exit__(self, *exc):
        self.spec.controller = self.saved
        return False


def parse_setting(name: str, knobs: dict | None = None) -> int | tuple[int, float] | str | None:
    """'adaptive' -> None, 'staticN' -> N, 'staticN@P' -> (N, P), a knob setting's name -> the name."""
    if name == "adaptive":
        return None
    if knobs and name in knobs:
        return name
    depth, at, stop = name.partition("@")
    if depth.startswith("static") and depth[6:].isdigit():
        if not at:
            return int(depth[6:])
        try:
            p = float(stop)
        except ValueError:
            p = -1.0
        if 0.0 < p <= 1.0:
            return int(depth[6:]), p
    raise ValueError(f"unknown setting {name!r}: 'adaptive', 'static<depth>', 'static<depth>@<path probability "
                     "in (0, 1]>' or the name of a --knobs setting")


def run(llm: LLM, settings: list[str], rounds: int, prompts: list[list[int]], max_tokens: int,
        concurrency: int, step_log: Path, progress: bool = True, warmup: bool = True,
        knobs: dict[str, dict] | None = None) -> dict:
    depths = {s: parse_setting(s, knobs) for s in settings}
    startup = llm.engine.spec.controller
    if any(d is None or isinstance(d, str) for d in depths.values()) and startup is None:
        raise ValueError("the 'adaptive' and knob settings need an engine in adaptive mode with a draft")
    made = {}   # knob controllers, each copied from the start-up one on its first run
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
            d = depths[s]
            if d is None:
                outs = llm.generate(prompts, params)
            elif isinstance(d, str):
                if d not in made:
                    from benchmarks.serve_knobs import knob_controller

                    made[d] = knob_controller(startup, knobs[d])
                with Attach(llm, made[d]):
                    outs = llm.generate(prompts, params)
            else:
                depth, stop = d if isinstance(d, tuple) else (d, None)
                with Detach(llm, depth, stop):
                    outs = llm.generate(prompts, params)
            elapsed = time.perf_counter() - start
            tokens_per_s[s].append(sum(len(o.token_ids) for o in outs) / elapsed)
            records[s] += [json.loads(line) for line in step_log.open().readlines()[first:]]
            bar.set_postfix_str(f"{s} {tokens_per_s[s][-1]:.0f} tok/s")
            bar.update()
    bar.close()
    out = {"settings": {}, "concurrency": concurrency, "rounds": rounds, "prompts": len(prompts),
           "max_tokens": max_tokens, "knobs": knobs or {}}
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
    ap.add_argument("--knobs", action="append", default=[], metavar="NAME:key=value[,...]",
                    help="a setting NAME: the start-up controller with these AdaptiveController arguments")
    ap.add_argument("--no-progress", action="store_true")
    args = ap.parse_args(argv)
    from benchmarks.serve_knobs import parse_knobs

    knobs = parse_knobs(args.knobs) if args.knobs else {}
    for s in args.settings:
        parse_setting(s, knobs)
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
                  progress=not args.no_progress, knobs=knobs)
    res["commit"] = git_commit()
    emit(res, report(res), args.out, args.plot, plot)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
