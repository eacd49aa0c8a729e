"""One forward of the embedded target and draft on the CPU, linear layers through torch's
F.linear against oneDNN with packed weights (config `cpu_linear`).

Both paths run in one process on the same models, interleaved round by round (a slow spell
of the machine then hits both), each figure the median over rounds of the mean time of a
forward of `rows` rows at `context` tokens of context:

    python -m benchmarks.bench_cpu_linear --threads 1 2
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from torch import nn

from specserve import LLM
from specserve.model.llama import onednn_linear_available, pack_onednn
from specserve.runner import ForwardInput


def one_sequence(rows: int, context: int, block_size: int) -> ForwardInput:
    table = list(range(10, 10 + -(-(context + rows) // block_size)))
    positions = list(range(context, context + rows))
    inp = ForwardInput()
    inp.add([5] * rows, positions, [table[p // block_size] * block_size + p % block_size for p in positions],
            table, context + rows, logit_rows=list(range(rows)))
    return inp


def set_packed(model: nn.Module, packed: bool) -> None:
    for m in model.modules():
        if isinstance(m, nn.Linear):
            m.__dict__.pop("onednn", None)
            if packed:
                pack_onednn(m)


def mean_us(fn, iters: int) -> float:
    fn()
    start = time.perf_counter()
    for _ in range(iters):
        fn()
    return (time.perf_counter() - start) / iters * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, nargs="+", default=[1])
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    ap.add_argument("--context", type=int, default=150)
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    if not onednn_linear_available():
        raise SystemExit("this torch build has no oneDNN")
    print("| threads | model | rows | F.linear us | oneDNN us | ratio |")
    print("|---|---|---|---|---|---|")
    for threads in args.threads:
        llm = LLM(dtype="float32", progress=False, cpu_threads=threads, cpu_parallel_min_rows=1,
                  cpu_linear="torch", spec_mode="static", spec_depth=1, num_blocks=256)
        runners = {"target": (llm.engine.target, 40), "draft (every layer)": (llm.engine.draft, 200)}
        times: dict = {}
        for _ in range(args.rounds):
            for packed in (False, True):
                for runner, _iters in runners.values():
                    set_packed(runner.model, packed)
                for name, (runner, iters) in runners.items():
                    for rows in args.rows:
                        inp = one_sequence(rows, args.context, runner.block_size)
                        times.setdefault((name, rows, packed), []).append(mean_us(lambda: runner.forward(inp), iters))
        for name in runners:
            for rows in args.rows:
                plain = statistics.median(times[(name, rows, False)])
                packed = statistics.median(times[(name, rows, True)])
                print(f"| {threads} | {name} | {rows} | {plain:.0f} | {packed:.0f} | {packed / plain:.2f} |")


if __name__ == "__main__":
    main()
