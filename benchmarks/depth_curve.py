"""The goodput curve over speculation depth, measured, beside what the controller predicts.

    python -m benchmarks.depth_curve [--config FILE] [--batch-size 8] [--num-prompts 600]
        [--depths 1-8] [--block 8] [--cpu-threads 1] [--out FILE.json] [--plot FILE.png]

One engine process runs the prompts with `--batch-size` sequences at a time, its chain depth
forced in rotation: `--block` steps at each depth of `--depths`, then the next, round and round
until the prompts are done. So every depth runs in the same process, on the same requests,
through the same spells of a shared machine, and a slow minute lands on every depth alike
(static servers compared one after another differ by their process's pace as much as by their
depth). The adaptive controller still observes every step, as it would with every depth
explored all the time, and before each step says what it expects of the forced plan.

Per depth it reports, over the steps that only decode (no prefill joined them), hold at least
`--min-batch` sequences and follow a step at the same depth (the block's first step is left
out, as a switch): the measured committed tokens per second, the same relative to the best
depth, the controller's prediction relative to its own best plan at that step, the mean step
time measured and predicted, and the tokens per sequence per step measured and predicted. Also
the tokens per second over every step at that depth, prefills included (what a client sees).

This is how to check the cost model and the acceptance model against the truth on a new
machine or a new pair: where the measured and predicted curves part, the controller picks
the wrong depth. It cannot tell what the controller makes of depths it has not run lately
(here every depth is run every few blocks); compare with the plan the adaptive server chose.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from benchmarks.runinfo import git_commit

PROMPTS_FILE = Path(__file__).resolve().parent / "data" / "heldout_prompts.jsonl"


def parse_depths(text: str) -> list[int]:
    """'2-7' or '1,3,5' -> a list of depths (each >= 1)."""
    out: list[int] = []
    for part in text.split(","):
        if "-" in part:
            lo, hi = part.split("-", 1)
            out.extend(range(int(lo), int(hi) + 1))
        elif part.strip():
            out.append(int(part))
    if not out or min(out) < 1:
        raise ValueError(f"--depths {text!r}: depths are 1 or more (depth 0 is plain decoding)")
    return out


def load_prompts(n: int, path: Path = PROMPTS_FILE) -> list[str]:
    """n prompts from the held-out file, numbered so that no two are the same text: a repeated
    prompt would be served from the prefix cache and its prefill cost nothing."""
    texts = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    texts = [t["prompt"] if isinstance(t, dict) else t for t in texts]
    return [f"{i}. {texts[i % len(texts)]}" for i in range(n)]


@dataclass
class _Step:
    depth: int
    batch_size: int
    decode_only: bool
    seconds: float            # the whole step: draft, verify and the rest since the previous step
    tokens: int               # committed this step by the decoding sequences (accepted + bonus)
    sequences: int
    predicted_goodput: float  # the controller's figure for the forced plan, tokens/s
    predicted_top: float      # its best plan's at that step
    predicted_tokens: float   # per sequence
    after_switch: bool


@dataclass
class _Rotation:
    """Stands in for the engine's controller: every plan it hands out is the depth whose turn
    it is, and it records what the real controller predicted for that plan and what the step
    then measured. Everything else goes to the real controller (which observes every step)."""

    inner: object
    depths: list[int]
    block: int
    steps: list[_Step] = field(default_factory=list)
    _count: int = 0
    _pending: tuple | None = None
    _last_depth: int | None = None

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def plan(self, batch_size, request_ids=(), context_tokens=None, depth_caps=None, decoded_tokens=None, sampled=None):
        from specserve.controller import Plan

        depth = self.depths[(self._count // self.block) % len(self.depths)]
        self._count += 1
        depth = min(depth, self.inner.max_depth)
        plan = Plan(depth, depth)
        scores = self.inner.evaluate(batch_size, request_ids, context_tokens, depth_caps)
        goodput, tokens = scores.get(plan, (0.0, 0.0))
        top = max((g for g, _ in scores.values()), default=0.0)
        self._pending = (goodput, top, tokens)
        return plan

    def observe(self, stats) -> None:
        self.inner.observe(stats)
        goodput, top, tokens = self._pending or (0.0, 0.0, 0.0)
        self._pending = None
        if stats.batch_size <= 0:   # nothing decoded (the controller skips these too)
            return
        # The steps the controller times as whole (its guard's test): no prefill joined them.
        decode_only = stats.verify_s > 0 and (stats.depth == 0 or stats.draft_s > 0)
        self.steps.append(_Step(
            depth=stats.depth, batch_size=stats.batch_size, decode_only=decode_only,
            seconds=stats.draft_s + stats.verify_s + stats.overhead_s,
            tokens=sum(stats.num_accepted) + len(stats.num_accepted), sequences=len(stats.num_accepted),
            predicted_goodput=goodput, predicted_top=top, predicted_tokens=tokens,
            after_switch=self._last_depth is not None and self._last_depth != stats.depth))
        self._last_depth = stats.depth


def summarize(steps: list[_Step], min_batch: int, step_seconds: dict[int, float] | None = None) -> list[dict]:
    """Per depth: the figures of the module docstring. step_seconds: wall time of every step at
    each depth, prefills included (the engine's own clock), for the all-steps figure."""
    rows = []
    by_depth: dict[int, list[_Step]] = {}
    for s in steps:
        by_depth.setdefault(s.depth, []).append(s)
    for depth in sorted(by_depth):
        all_steps = by_depth[depth]
        kept = [s for s in all_steps if s.decode_only and not s.after_switch and s.batch_size >= min_batch
                and s.seconds > 0 and s.predicted_goodput > 0]
        if not kept:
            continue
        seconds = sum(s.seconds for s in kept)
        tokens = sum(s.tokens for s in kept)
        row = {
            "depth": depth,
            "steps": len(kept),
            "tokens_per_s": tokens / seconds,
            "predicted_relative": statistics.fmean(s.predicted_goodput / s.predicted_top for s in kept),
            "step_ms": 1e3 * seconds / len(kept),
            # The prediction's own step time: expected tokens of the batch over its goodput.
            "predicted_step_ms": 1e3 * statistics.fmean(
                s.predicted_tokens * s.batch_size / s.predicted_goodput for s in kept),
            "tokens_per_seq": tokens / sum(s.sequences for s in kept),
            "predicted_tokens_per_seq": statistics.fmean(s.predicted_tokens for s in kept),
        }
        if step_seconds is not None and step_seconds.get(depth):
            row["all_steps_tokens_per_s"] = sum(s.tokens for s in all_steps) / step_seconds[depth]
        rows.append(row)
    if rows:
        best = max(r["tokens_per_s"] for r in rows)
        for r in rows:
            r["relative"] = r["tokens_per_s"] / best
    return rows


def measure(llm, prompts: list[str], depths: list[int], block: int = 8, min_batch: int = 1,
            max_tokens: int = 64, progress: bool = True) -> dict:
    """Run `prompts` on `llm` (an adaptive-mode specserve LLM) with the depth rotation; the
    per-depth summary and the raw step count."""
    from tqdm import tqdm

    from specserve.sampling import SamplingParams

    spec = llm.engine.spec
    if spec.controller is None:
        raise ValueError("depth_curve needs the adaptive controller: run with the spec mode 'adaptive' "
                         "and a draft (the controller's predictions are half of what it reports)")
    if spec.tree_kind != "chain":
        raise ValueError(f"depth_curve forces chains; this config drafts {spec.tree_kind!r} trees")
    rotation = _Rotation(spec.controller, depths, block)
    spec.controller = rotation
    engine = llm.engine
    step_seconds: dict[int, float] = {}
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    for i, prompt in enumerate(prompts):
        engine.add_request(f"curve-{i}", prompt, params)
    bar = tqdm(total=len(prompts), desc="requests", disable=not progress)
    started = time.perf_counter()
    try:
        while engine.has_unfinished_requests():
            t0 = time.perf_counter()
            outputs = engine.step()
            dt = time.perf_counter() - t0
            depth = spec.totals.last_depth
            step_seconds[depth] = step_seconds.get(depth, 0.0) + dt
            bar.update(sum(1 for o in outputs if o.finished))
    finally:
        bar.close()
        spec.controller = rotation.inner
    return {
        "seconds": time.perf_counter() - started,
        "steps": len(rotation.steps),
        "depths": summarize(rotation.steps, min_batch, step_seconds),
    }


def format_table(rows: list[dict]) -> str:
    lines = ["| depth | steps | tok/s | relative | predicted relative | step ms (predicted) "
             "| tokens/seq (predicted) | tok/s, all steps |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(
            f"| {r['depth']} | {r['steps']} | {r['tokens_per_s']:.1f} | {r['relative']:.3f} "
            f"| {r['predicted_relative']:.3f} | {r['step_ms']:.1f} ({r['predicted_step_ms']:.1f}) "
            f"| {r['tokens_per_seq']:.2f} ({r['predicted_tokens_per_seq']:.2f}) "
            f"| {r.get('all_steps_tokens_per_s', float('nan')):.1f} |")
    return "\n".join(lines)


def plot(rows: list[dict], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    depths = [r["depth"] for r in rows]
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot(depths, [r["relative"] for r in rows], "o-", label="measured")
    ax.plot(depths, [r["predicted_relative"] for r in rows], "s--", label="controller's prediction")
    ax.set_xlabel("chain depth")
    ax.set_ylabel("goodput relative to the best depth")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.depth_curve", description=__doc__.split("\n\n")[0])
    p.add_argument("--config", help="TOML config (default: the embedded pair)")
    p.add_argument("--batch-size", type=int, default=8, help="sequences at a time (the scheduler's max_num_seqs)")
    p.add_argument("--num-prompts", type=int, default=600)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--depths", default="1-8", help="chain depths to rotate through, e.g. 2-7 or 1,3,5")
    p.add_argument("--block", type=int, default=8, help="steps at one depth before the next")
    p.add_argument("--min-batch", type=int, help="steps with fewer sequences are left out (default: "
                   "three quarters of --batch-size: the tail of the run, where the batch drains)")
    p.add_argument("--cpu-threads", type=int, help="torch intra-op threads")
    p.add_argument("--out", help="write the figures as JSON here")
    p.add_argument("--plot", help="write the measured and predicted curves here (PNG)")
    p.add_argument("--no-progress", action="store_true")
    args = p.parse_args(argv)
    if args.batch_size < 1 or args.block < 1 or args.num_prompts < 1:
        p.error("--batch-size, --block and --num-prompts must be at least 1")
    try:
        depths = parse_depths(args.depths)
    except ValueError as e:
        p.error(str(e))

    from specserve import config as config_mod
    from specserve.llm import LLM

    cfg = config_mod.load(args.config) if args.config else config_mod.default()
    overrides = {"spec_mode": "adaptive", "max_num_seqs": args.batch_size}
    if args.cpu_threads:
        overrides["cpu_threads"] = args.cpu_threads
    if max(depths) > cfg.spec.max_depth:
        overrides["spec__max_depth"] = max(depths)
    llm = LLM(config_mod.with_overrides(cfg, **overrides), progress=not args.no_progress)
    result = measure(llm, load_prompts(args.num_prompts), depths, args.block,
                     args.min_batch if args.min_batch is not None else max(1, (3 * args.batch_size) // 4),
                     args.max_tokens, progress=not args.no_progress)
    result.update(batch_size=args.batch_size, num_prompts=args.num_prompts, max_tokens=args.max_tokens,
                  block=args.block, config=args.config or "embedded pair", commit=git_commit(),
                  machine=platform.platform(), processor=platform.processor())
    print(format_table(result["depths"]))
    print(f"{result['steps']} steps in {result['seconds']:.1f} s")
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))
    if args.plot and result["depths"]:
        plot(result["depths"], Path(args.plot), f"batch {args.batch_size}, {args.config or 'embedded pair'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
