"""Offline decode speed: specserve against transformers on the same checkpoint and prompts.

    python -m benchmarks.bench_offline [--target DIR] [--draft DIR] [--batch 1 16] [--max-tokens 64]

Without --target it uses the embedded pair. Greedy, ignore_eos, float32, CPU unless CUDA.
Figures (decode tokens/s = generated tokens / wall time after the prompt is in):
  specserve plain, specserve with the draft (chain depths, trees), transformers generate
  (batch 1: one call; batch 16: request by request, and padded batch), transformers
  assisted generation (assistant_model=draft, batch 1 only: transformers does not batch it).
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import time
from pathlib import Path

import torch
from tqdm import tqdm

from specserve import LLM, SamplingParams
from specserve.config import ASSETS_DIR


def held_out_prompts(n: int, num_tokens: int, tokenizer) -> list[list[int]]:
    """Held-out prompts from the embedded pair's corpus when it recorded some, else stdlib text."""
    file = Path(__file__).resolve().parent / "data" / "heldout_prompts.jsonl"  # benchmarks/heldout_prompts.py
    texts = [json.loads(line) for line in file.read_text().splitlines()] if file.is_file() else []
    if not texts:
        import inspect, textwrap, json as _json  # noqa: E401
        texts = [inspect.getsource(f) for f in (_json.dumps, textwrap.wrap, inspect.getsource)]
    out = []
    for i in range(n):
        ids = tokenizer.encode(texts[i % len(texts)])
        out.append(ids[:num_tokens])
    return out


class Clock:
    """Wall time and this process's CPU time. With one torch thread the CPU time is what the
    engine itself costs, whatever else the machine runs (a shared 2-core box here)."""

    def __enter__(self):
        self.wall, self.cpu = time.perf_counter(), time.process_time()
        return self

    def __exit__(self, *exc):
        self.wall, self.cpu = time.perf_counter() - self.wall, time.process_time() - self.cpu


def time_specserve(llm: LLM, prompts, max_tokens: int, batch: int) -> dict:
    """The prompts in groups of `batch`, one group after another (batch 1: one at a time)."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    llm.generate(prompts[:1], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))  # warm-up
    outs = []
    with Clock() as clock:
        for start in range(0, len(prompts), batch):
            outs += llm.generate(prompts[start : start + batch], params)
    n = sum(len(o.token_ids) for o in outs)
    passes = sum(o.stats.num_target_passes for o in outs)
    return dict(tokens=n, wall_s=clock.wall, cpu_s=clock.cpu, tokens_per_pass=n / max(passes, 1))


def time_hf(model, prompts, max_tokens: int, assistant=None) -> dict:
    gen = dict(max_new_tokens=max_tokens, min_new_tokens=max_tokens, do_sample=False, pad_token_id=0)
    if assistant is not None:
        gen["assistant_model"] = assistant
    model.generate(torch.tensor([prompts[0]]), **{**gen, "max_new_tokens": 4, "min_new_tokens": 4})
    n = 0
    with Clock() as clock:
        for p in prompts:  # request by request: transformers has no continuous batching
            out = model.generate(torch.tensor([p]), **gen)
            n += out.shape[1] - len(p)
    return dict(tokens=n, wall_s=clock.wall, cpu_s=clock.cpu, tokens_per_pass=None if assistant else 1.0)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--target", default=str(ASSETS_DIR / "tiny-target"))
    ap.add_argument("--draft", default=str(ASSETS_DIR / "tiny-draft"))
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--prompt-tokens", type=int, default=64)
    ap.add_argument("--num-prompts", type=int, default=8, help="at least `batch`; run in groups of `batch`")
    ap.add_argument("--depths", type=int, nargs="*", default=[])
    ap.add_argument("--trees", action="store_true", help="also a fixed [3,2,1] and a dynamic tree")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--rounds", type=int, default=3, help="interleaved repetitions; the median is reported")
    ap.add_argument("--out", default=None, help="write the figures as JSON here")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    from transformers import AutoModelForCausalLM

    rows = []
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    # The engines get the same thread count as transformers; specserve then runs forwards of
    # fewer than `cpu_parallel_min_rows` rows on one thread (config.py).
    threads = dict(cpu_threads=args.threads) if args.threads else {}
    base = LLM(target=args.target, draft="none", dtype="float32", progress=False, **threads)
    tok = base.tokenizer
    hf = AutoModelForCausalLM.from_pretrained(args.target, dtype=torch.float32).eval()
    hf_draft = None
    if args.draft and Path(args.draft).is_dir():
        hf_draft = AutoModelForCausalLM.from_pretrained(args.draft, dtype=torch.float32).eval()
    settings = [("specserve, no speculation", dict(draft="none"))]
    if hf_draft is not None:
        settings += [(f"specserve, chain depth {d}", dict(draft=args.draft, spec_mode="static", spec_depth=d))
                     for d in args.depths]
        if args.trees:
            settings += [
                ("specserve, fixed tree [3,2,1]", dict(draft=args.draft, spec_mode="static", spec_depth=3,
                                                       spec_tree="fixed", spec__branching=[3, 2, 1])),
                ("specserve, dynamic tree 12 nodes", dict(draft=args.draft, spec_mode="static", spec_depth=4,
                                                          spec_tree="dynamic", spec__num_nodes=12, spec__topk=3)),
            ]
        settings.append(("specserve, adaptive", dict(draft=args.draft, spec_mode="adaptive")))
    # Every setting as a callable, so the rounds can interleave them: a slow spell of the
    # machine then hits every setting alike, and the median over rounds is reported.
    engines = {name: (base if kw == dict(draft="none") else
                      LLM(target=args.target, dtype="float32", progress=False, **threads, **kw))
               for name, kw in settings}
    runs = []
    for batch in args.batch:
        prompts = held_out_prompts(max(batch, args.num_prompts), args.prompt_tokens, tok)
        for name in engines:
            runs.append((name, batch, lambda llm=engines[name], p=prompts, b=batch: time_specserve(llm, p, args.max_tokens, b)))
        runs.append(("transformers generate (request by request)", batch,
                     lambda p=prompts: time_hf(hf, p, args.max_tokens)))
        if hf_draft is not None:
            runs.append(("transformers assisted generation (request by request)", batch,
                         lambda p=prompts: time_hf(hf, p, args.max_tokens, assistant=hf_draft)))
    samples: dict = {}
    bar = tqdm(total=len(runs) * args.rounds, desc="bench")
    for _ in range(args.rounds):
        for name, batch, run in runs:
            samples.setdefault((name, batch), []).append(run())
            bar.update(1)
    for (name, batch), results in samples.items():
        # The median round: by CPU time on one thread (robust to other jobs' slices), by wall
        # time on more (idle threads spin, so CPU time then overcounts).
        clock = "cpu_s" if torch.get_num_threads() == 1 else "wall_s"
        best = sorted(results, key=lambda r: r["tokens"] / r[clock])[len(results) // 2]
        rows.append(dict(engine=name, batch=batch, rounds=len(results), **best))
    bar.close()
    machine = f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} threads, torch {torch.__version__}"
    print(f"\nmachine: {machine}; commit {commit}; {len(prompts)} held-out prompts of <= {args.prompt_tokens} tokens, "
          f"{args.max_tokens} generated each, greedy; median of {args.rounds} interleaved rounds")
    print("| engine | batch | tokens/s (CPU time) | tokens/s (wall) | tokens per target pass |")
    print("|---|---|---|---|---|")
    for r in rows:
        tpp = f"{r['tokens_per_pass']:.2f}" if r["tokens_per_pass"] else "-"
        print(f"| {r['engine']} | {r['batch']} | {r['tokens'] / r['cpu_s']:.1f} | {r['tokens'] / r['wall_s']:.1f} | {tpp} |")
    if args.out:
        Path(args.out).write_text(json.dumps(dict(machine=machine, commit=commit, rows=rows), indent=2))


if __name__ == "__main__":
    main()
