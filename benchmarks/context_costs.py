"""The start-up calibration's verify costs against the passes themselves, by rows and context.

    python -m benchmarks.context_costs [--config FILE] [--batch-sizes 16 32]
        [--contexts 32 80 136 200] [--rounds 9] [--cpu-threads 1] [--out F.json] [--plot F.png]

One engine is built as the server builds it (adaptive mode: the start-up calibration runs),
then every verify pass of `--batch-sizes` sequences with 1..max_depth+1 rows each, at each of
`--contexts` tokens of context per sequence, is timed in interleaved rounds (each round runs
every rows at every context once, the order reversed every other round; the median is kept) and
set beside what the calibrated cost model says the same pass costs (`t_verify` with the same
context). The same process times both, so the machine's pace is common to them.

What the plan compares depths by is the shape over the rows at the contexts it serves, not
the level (the engine's steps correct the level within a few steps): the table's "tilt" is
the spread of predicted / measured over the rows at one context. A tilt of a few percent is
the size of the margins between depths near the top; where deep rows read cheaper than they
measure, the plan runs deeper than the best depth.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch
from tqdm import tqdm

from benchmarks.runinfo import emit, git_commit


def measure(llm, batch_sizes: list[int], contexts: list[int], rounds: int, progress: bool = True) -> dict:
    from specserve.runner import ForwardInput, slots_for

    engine = llm.engine
    costs = engine.spec.controller.costs
    block_size, num_blocks = engine.pool.block_size, engine.pool.num_blocks
    max_rows = engine.spec.controller.max_depth + 1
    room = min(num_blocks * block_size, engine.max_model_len) - max_rows
    contexts = [c for c in contexts if c <= room]

    def batch(b: int, rows: int, ctx: int) -> ForwardInput:
        per_seq = -(-(ctx + rows) // block_size)
        inp = ForwardInput()
        for i in range(b):
            blocks = [(i * per_seq + j) % num_blocks for j in range(per_seq)]
            inp.add([0] * rows, list(range(ctx, ctx + rows)), slots_for(blocks, block_size, ctx, rows), blocks,
                    ctx + rows, logit_rows=list(range(rows)))
        return inp

    def timed(inp: ForwardInput) -> float:
        start = time.perf_counter()
        engine.target.forward(inp)[-1, 0].item()
        return time.perf_counter() - start

    out = {"batch_sizes": {}, "contexts": contexts, "rows": list(range(1, max_rows + 1)), "rounds": rounds}
    bar = tqdm(total=len(batch_sizes) * rounds, desc="rounds timed", disable=not progress)
    with torch.inference_mode():
        for b in batch_sizes:
            rows = out["rows"]
            keys = [(r, c) for c in contexts for r in rows]
            inputs = {k: batch(b, *k) for k in keys}
            for k in keys:   # warm-up
                timed(inputs[k])
            times = {k: [] for k in keys}
            # Every pass of a round, all contexts together: a spell of the machine lifts a
            # round, not one context's passes (timed context after context, the first version
            # read one context 10-20% off the others from one run to the next).
            for i in range(rounds):
                for k in (keys if i % 2 == 0 else keys[::-1]):
                    times[k].append(timed(inputs[k]))
                bar.update()
            per_ctx = {}
            for ctx in contexts:
                measured = [statistics.median(times[(r, ctx)]) for r in rows]
                predicted = [costs.t_verify(b, r * b, b * ctx) for r in rows]
                ratio = [p / m for p, m in zip(predicted, measured)]
                per_ctx[ctx] = {"measured_s": measured, "predicted_s": predicted, "predicted_over_measured": ratio,
                                "tilt": max(ratio) - min(ratio)}
            out["batch_sizes"][b] = per_ctx
    bar.close()
    return out


def report(res: dict) -> str:
    rows = res["rows"]
    lines = ["| sequences | context | " + " | ".join(f"{r} rows" for r in rows) + " | tilt |",
             "|---:|---:|" + "---:|" * len(rows) + "---:|"]
    for b, per_ctx in res["batch_sizes"].items():
        for ctx, e in per_ctx.items():
            cells = " | ".join(f"{1e3 * m:.2f} ({x:.3f})" for m, x in zip(e["measured_s"], e["predicted_over_measured"]))
            lines.append(f"| {b} | {ctx} | {cells} | {e['tilt']:.3f} |")
    lines.append("")
    lines.append("(each cell: the measured pass in ms, median of the rounds, and in brackets the calibrated "
                 "model's prediction over it; tilt: the spread of those ratios over the rows)")
    return "\n".join(lines)


def plot(res: dict, path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sizes = list(res["batch_sizes"])
    fig, axes = plt.subplots(1, len(sizes), figsize=(5 * len(sizes), 3.8), squeeze=False)
    for ax, b in zip(axes[0], sizes):
        for ctx, e in res["batch_sizes"][b].items():
            ax.plot(res["rows"], e["predicted_over_measured"], marker="o", label=f"{ctx} tokens")
        ax.axhline(1.0, color="grey", linewidth=0.8)
        ax.set_title(f"{b} sequences")
        ax.set_xlabel("rows per sequence (depth + 1)")
        ax.set_ylabel("calibrated prediction / measured")
        ax.grid(alpha=0.3)
        ax.legend(title="context a sequence", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--config", default=None, help="TOML config (default: the embedded pair)")
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[16, 32])
    ap.add_argument("--contexts", type=int, nargs="+", default=[32, 80, 136, 200])
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--cpu-threads", type=int, default=1)
    ap.add_argument("--out", default=None, help="write the figures as JSON here")
    ap.add_argument("--plot", default=None, help="draw predicted / measured by rows into this PNG")
    ap.add_argument("--no-progress", action="store_true")
    args = ap.parse_args(argv)
    if any(b < 1 for b in args.batch_sizes) or any(c < 1 for c in args.contexts) or args.rounds < 1:
        ap.error("--batch-sizes, --contexts and --rounds must be positive")
    from specserve import LLM

    llm = LLM(args.config, progress=not args.no_progress, max_num_seqs=max(args.batch_sizes),
              cpu_threads=args.cpu_threads, spec_mode="adaptive")
    res = measure(llm, args.batch_sizes, args.contexts, args.rounds, progress=not args.no_progress)
    res["commit"] = git_commit()
    emit(res, report(res), args.out, args.plot, plot)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
