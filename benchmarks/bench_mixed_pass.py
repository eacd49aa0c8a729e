"""What one target pass costs when its sequences do not all verify the same rows.

    python -m benchmarks.bench_mixed_pass --batch 16 64 --rows 3 5 7 [--tree DIR]

For each batch size and rows per sequence, times (medians of --repeats runs, the cases
interleaved so a slow spell of the machine hits them alike) a pass of B sequences of
--context tokens verifying `rows` rows each; the same with one sequence two rows short (a
tree cut near its max_tokens); the same beside a prompt chunk of --chunk tokens (a step that
also prefills); and the chunk alone. A serving engine's passes are mostly of the last three
kinds under load, the start-up calibration times the first kind only. `--tree DIR` times
another source tree (an export of another revision: `git archive REV | tar -x -C DIR`), so a
change can be set against what came before on the same machine.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m benchmarks.bench_mixed_pass")
    p.add_argument("--batch", type=int, nargs="+", default=[16, 64])
    p.add_argument("--rows", type=int, nargs="+", default=[1, 3, 5, 7])
    p.add_argument("--context", type=int, default=170, help="cached tokens per decoding sequence")
    p.add_argument("--chunk", type=int, default=100, help="prompt chunk tokens")
    p.add_argument("--repeats", type=int, default=9)
    p.add_argument("--cpu-threads", type=int, default=1)
    p.add_argument("--tree", type=Path, help="time this source tree's engine instead of the installed one")
    args = p.parse_args(argv)
    if args.tree is not None:
        from benchmarks.serve_tree import use_tree

        use_tree(args.tree)
    from specserve.llm import LLM
    from specserve.runner import ForwardInput, slots_for

    engine = LLM(progress=False, spec_mode="static", cpu_threads=args.cpu_threads).engine
    block_size, num_blocks = engine.pool.block_size, engine.pool.num_blocks

    def build(seqs: list[tuple[int, int]]) -> ForwardInput:
        """seqs: (cached tokens, rows) per sequence, each on blocks of its own."""
        inp, first = ForwardInput(), 0
        for ctx, rows in seqs:
            count = -(-(ctx + rows) // block_size)
            blocks = [(first + j) % num_blocks for j in range(count)]
            first += count
            inp.add([0] * rows, list(range(ctx, ctx + rows)), slots_for(blocks, block_size, ctx, rows), blocks,
                    ctx + rows, logit_rows=list(range(rows)) if ctx else [rows - 1])
        return inp

    chunk = (0, args.chunk)
    cases = {"chunk": build([chunk])}
    for b in args.batch:
        for r in args.rows:
            seqs = [(args.context, r)] * b
            cases[b, r, "uniform"] = build(seqs)
            cases[b, r, "cut"] = build(seqs[:-1] + [(args.context, max(1, r - 2))])
            cases[b, r, "chunk"] = build(seqs + [chunk])
    for inp in cases.values():   # warm-up
        engine.target.forward(inp)[-1, 0].item()
    times: dict = {k: [] for k in cases}
    for i in range(args.repeats):
        for k, inp in cases.items():
            start = time.perf_counter()
            engine.target.forward(inp)[-1, 0].item()
            times[k].append(time.perf_counter() - start)
        print(f"round {i + 1}/{args.repeats}", file=sys.stderr)
    ms = {k: 1e3 * statistics.median(v) for k, v in times.items()}
    print(f"median ms of {args.repeats} runs; {args.context} tokens cached per sequence, prompt chunk "
          f"{args.chunk} tokens alone: {ms['chunk']:.1f} ms\n")
    print("| sequences x rows | uniform | one 2 rows short | beside the chunk | uniform + chunk apart |")
    print("|---|---:|---:|---:|---:|")
    for b in args.batch:
        for r in args.rows:
            print(f"| {b} x {r} | {ms[b, r, 'uniform']:.1f} | {ms[b, r, 'cut']:.1f} | {ms[b, r, 'chunk']:.1f} "
                  f"| {ms[b, r, 'uniform'] + ms['chunk']:.1f} |")


if __name__ == "__main__":
    main()
