"""Offline decode speed of one draft/target pair under each speculation setting, in one engine.

    python -m benchmarks.pair_speed --target DIR --draft DIR [--batch 1 16 64] [--settings static0 static3 adaptive]

One engine (one copy of each model, which matters for an 8B-shaped target) is switched
between settings with `set_speculation`, so every setting runs on the same process and pool;
"static0" is plain decoding (the draft idles); a setting with "+prompts" appended (e.g.
"static3+prompts") runs with [spec] speculate_prompts on. Greedy, ignore_eos, held-out prompts. For each
batch size and setting: decode tokens/s by wall clock (the device is synchronised by the
engine's own host reads every step), tokens per target pass, and whether the tokens equal
static0's token for token. Interleaved rounds; the median round is reported. Prints a
markdown table with the device and commit, and writes JSON with --out.
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from benchmarks.bench_offline import held_out_prompts
from benchmarks.runinfo import git_commit
from specserve import LLM, SamplingParams


def run(llm: LLM, setting: str, prompts, batch: int, max_tokens: int) -> dict:
    # "SETTING+prompts": the same with [spec] speculate_prompts (a prompt's step drafts too).
    base, _, extra = setting.partition("+")
    llm.engine.scheduler.speculate_prompts = extra == "prompts"
    if base == "adaptive":
        llm.engine.set_speculation("adaptive")
    else:
        llm.engine.set_speculation("static", int(base.removeprefix("static")))
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    outs = []
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    for start in range(0, len(prompts), batch):
        outs += llm.generate(prompts[start:start + batch], params)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    wall = time.perf_counter() - t0
    tokens = sum(len(o.token_ids) for o in outs)
    passes = sum(o.stats.num_target_passes for o in outs)
    return dict(tokens=tokens, wall_s=wall, tokens_per_s=tokens / wall, tokens_per_pass=tokens / max(passes, 1),
                token_ids=[list(o.token_ids) for o in outs])


def agreement(runs: list[dict], base: list[list[int]]) -> tuple[int, float]:
    """How many sequences equal the baseline's in every round, and the mean length of the
    common prefix (over rounds and sequences)."""
    same = sum(all(r["token_ids"][i] == seq for r in runs) for i, seq in enumerate(base))
    prefixes = []
    for r in runs:
        for got, want in zip(r["token_ids"], base):
            n = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))
            prefixes.append(n)
    return same, sum(prefixes) / max(len(prefixes), 1)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", required=True)
    ap.add_argument("--draft", required=True)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--num-blocks", type=int, default=4096)
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 16, 64])
    ap.add_argument("--settings", nargs="+", default=["static0", "static1", "static2", "static3", "static4",
                                                      "static6", "adaptive"])
    ap.add_argument("--num-prompts", type=int, default=16, help="per batch size: at least the batch")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--prompt-tokens", type=int, default=96)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--out", default=None)
    ap.add_argument("--cuda-graphs", action="store_true", help="replay uniform forwards from CUDA graphs")
    args = ap.parse_args(argv)
    if "static0" not in args.settings:
        args.settings.insert(0, "static0")

    t0 = time.time()
    llm = LLM(target=args.target, draft=args.draft, dtype=args.dtype, device=args.device,
              num_blocks=args.num_blocks, spec_mode="adaptive", cuda_graphs=args.cuda_graphs)
    print(f"loaded and calibrated in {time.time() - t0:.0f} s on {llm.engine.device}", flush=True)
    device = (torch.cuda.get_device_name() if llm.engine.device.type == "cuda" else "cpu")
    # Warm every (batch, setting) once before timing: a Triton kernel compiles a variant at
    # the first use of a new shape or value class (about a second each on the H100), and a
    # cell of 16 x 64 tokens lasts one or two seconds there. On the H100 run with CUDA graphs,
    # depth-3 cells warmed at batch 2 only read 0.45x and 0.09x plain decoding at batch 1 and
    # 16, most likely such compiles (not yet confirmed by a profile).
    for batch in args.batch:
        warm = held_out_prompts(batch, 32, llm.tokenizer)
        for s in args.settings:
            run(llm, s, warm, batch, 8)

    samples: dict = {}
    for r in range(args.rounds):
        for batch in args.batch:
            prompts = held_out_prompts(max(batch, args.num_prompts), args.prompt_tokens, llm.tokenizer)
            order = args.settings[r % len(args.settings):] + args.settings[:r % len(args.settings)]
            for s in order:
                res = run(llm, s, prompts, batch, args.max_tokens)
                samples.setdefault((batch, s), []).append(res)
                print(f"round {r} batch {batch} {s}: {res['tokens_per_s']:.1f} tok/s, "
                      f"{res['tokens_per_pass']:.2f} tok/pass", flush=True)

    commit = git_commit()
    print(f"\ndevice: {device}; commit {commit}; dtype {args.dtype}; cuda_graphs {args.cuda_graphs}; {args.num_prompts}+ held-out prompts of <= "
          f"{args.prompt_tokens} tokens, {args.max_tokens} generated each, greedy; median of {args.rounds} rounds")
    print("| batch | setting | tokens/s | tokens per target pass | vs static0 | sequences equal to static0's "
          "(all rounds) | mean tokens before the first difference |")
    print("|---|---|---|---|---|---|---|")
    rows = []
    for batch in args.batch:
        base = sorted(samples[batch, "static0"], key=lambda x: x["tokens_per_s"])[args.rounds // 2]
        for s in args.settings:
            runs = samples[batch, s]
            med = sorted(runs, key=lambda x: x["tokens_per_s"])[args.rounds // 2]
            same_seqs, prefix = agreement(runs, base["token_ids"])
            rows.append(dict(batch=batch, setting=s, tokens_per_s=med["tokens_per_s"],
                             tokens_per_pass=med["tokens_per_pass"], same_sequences=same_seqs,
                             sequences=len(base["token_ids"]), mean_common_prefix=prefix))
            print(f"| {batch} | {s} | {med['tokens_per_s']:.1f} | {med['tokens_per_pass']:.2f} | "
                  f"{med['tokens_per_s'] / base['tokens_per_s']:.2f}x | {same_seqs}/{len(base['token_ids'])} "
                  f"| {prefix:.1f} |")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(device=device, commit=commit, args=vars(args), rows=rows), f, indent=2)


if __name__ == "__main__":
    main()
