"""Where a decode step's time goes on a GPU: torch.profiler over a few steps of one setting.

    python -m benchmarks.profile_step --target DIR [--draft DIR] [--batch 1] [--setting static0]

Prints the top operators by self CPU time and by device time, and the step's wall time with
and without the profiler. Writes a Chrome trace with --trace FILE.
"""

from __future__ import annotations

import argparse
import time

import torch
from torch.profiler import ProfilerActivity, profile

from benchmarks.bench_offline import held_out_prompts
from specserve import LLM, SamplingParams


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--target", required=True)
    ap.add_argument("--draft", default="none")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--setting", default="static0")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--trace", default=None)
    ap.add_argument("--cuda-graphs", action="store_true", help="replay uniform forwards from CUDA graphs")
    ap.add_argument("--rows", type=int, default=25)
    args = ap.parse_args(argv)
    llm = LLM(target=args.target, draft=args.draft, dtype=args.dtype, num_blocks=2048, progress=False,
              cuda_graphs=args.cuda_graphs,
              **({"spec_mode": "adaptive"} if args.draft != "none" else {}))
    if args.draft != "none":
        if args.setting == "adaptive":
            llm.engine.set_speculation("adaptive")
        else:
            llm.engine.set_speculation("static", int(args.setting.removeprefix("static")))
    eng = llm.engine
    prompts = held_out_prompts(args.batch, 64, llm.tokenizer)
    params = SamplingParams(max_tokens=400, temperature=0.0, ignore_eos=True)
    llm.generate(prompts, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
    for p in prompts:
        eng.add_request(None, p, params)
    for _ in range(5):  # prefill and warm decode steps
        eng.step()
    sync()
    t0 = time.perf_counter()
    for _ in range(args.steps):
        eng.step()
    sync()
    plain_ms = (time.perf_counter() - t0) / args.steps * 1e3
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    with profile(activities=activities) as prof:
        for _ in range(args.steps):
            eng.step()
        sync()
    print(f"batch {args.batch} {args.setting}: {plain_ms:.2f} ms a step without the profiler")
    ka = prof.key_averages()
    print(ka.table(sort_by="self_cpu_time_total", row_limit=args.rows))
    if torch.cuda.is_available():
        print(ka.table(sort_by="self_cuda_time_total", row_limit=args.rows))
    if args.trace:
        prof.export_chrome_trace(args.trace)


if __name__ == "__main__":
    main()
