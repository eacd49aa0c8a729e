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
import os
import platform
import time
from pathlib import Path

import torch
from tqdm import tqdm

from benchmarks.runinfo import git_commit
from specserve import LLM, SamplingParams
from specserve.config import ASSETS_DIR


def held_out_prompts(n: int, num_tokens: int, tokenizer) -> list[list[int]]:
    """Held-out prompts from the embedded pair's corpus when it recorded some, else stdlib text."""
    file = Path(__file__).resolve().parent / "data" / "heldout_prompts.jsonl"  # scripts/heldout_prompts.py
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
    ap.add_argument("--threads", type=int, nargs="+", default=None,
                    help="torch threads; with several, every setting runs at each (default: torch's)")
    ap.add_argument("--rounds", type=int, default=3, help="interleaved repetitions; the median is reported")
    ap.add_argument("--out", default=None, help="write the figures as JSON here")
    args = ap.parse_args()
    from transformers import AutoModelForCausalLM

    commit = git_commit()
    thread_counts = args.threads or [torch.get_num_threads()]
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
    # One engine per setting and thread count; transformers runs with the process's thread
    # count, set before each run. A small pool: batch 1-16 of a few hundred tokens needs far
    # fewer blocks than the default sizing, and 20-odd engines live at once.
    engines = {(name, t): LLM(target=args.target, dtype="float32", progress=False, cpu_threads=t,
                              num_blocks=1024, **kw)
               for t in thread_counts for name, kw in settings}
    tok = next(iter(engines.values())).tokenizer

    def on_threads(t, fn):
        def run():
            torch.set_num_threads(t)
            return fn()
        return run

    # Every (setting, batch, threads) as a callable, so the rounds can interleave them: a
    # slow spell of the machine then hits every setting alike; the median round is reported.
    runs = []
    for batch in args.batch:
        prompts = held_out_prompts(max(batch, args.num_prompts), args.prompt_tokens, tok)
        for t in thread_counts:
            for name, _ in settings:
                runs.append((name, batch, t, on_threads(t, lambda llm=engines[name, t], p=prompts, b=batch:
                                                        time_specserve(llm, p, args.max_tokens, b))))
            runs.append(("transformers generate (request by request)", batch, t,
                         on_threads(t, lambda p=prompts: time_hf(hf, p, args.max_tokens))))
            if hf_draft is not None:
                runs.append(("transformers assisted generation (request by request)", batch, t,
                             on_threads(t, lambda p=prompts: time_hf(hf, p, args.max_tokens, assistant=hf_draft))))
    samples: dict = {}
    bar = tqdm(total=len(runs) * args.rounds, desc="bench")
    for _ in range(args.rounds):
        for name, batch, t, run in runs:
            samples.setdefault((name, batch, t), []).append(run())
            bar.update(1)
    bar.close()
    rows = []
    for (name, batch, t), results in samples.items():
        # Tokens/s by CPU time on one thread (robust to other jobs' time slices), by wall
        # time on more (waiting threads spin, so CPU time then overcounts); the median round.
        clock = "cpu_s" if t == 1 else "wall_s"
        best = sorted(results, key=lambda r: r["tokens"] / r[clock])[len(results) // 2]
        rows.append(dict(engine=name, batch=batch, threads=t, rounds=len(results), clock=clock,
                         tokens_per_s=best["tokens"] / best[clock], **best))

    def best_of(name: str, batch: int) -> float | None:  # a baseline at its best thread count
        vals = [r["tokens_per_s"] for r in rows if r["engine"] == name and r["batch"] == batch]
        return max(vals) if vals else None

    machine = f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}"
    print(f"\nmachine: {machine}; commit {commit}; {len(prompts)} held-out prompts of <= {args.prompt_tokens} "
          f"tokens, {args.max_tokens} generated each, greedy; median of {args.rounds} interleaved rounds; tokens/s "
          "by CPU time on 1 thread, by wall time on more")
    print("| engine / setting | batch | threads | tokens/s | tokens per target pass | vs our plain decode (best threads) "
          "| vs transformers assisted (best threads) |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        tpp = f"{r['tokens_per_pass']:.2f}" if r["tokens_per_pass"] else "-"
        plain = best_of("specserve, no speculation", r["batch"])
        assisted = best_of("transformers assisted generation (request by request)", r["batch"])
        ratio = lambda base: f"{r['tokens_per_s'] / base:.2f}x" if base else "-"  # noqa: E731
        print(f"| {r['engine']} | {r['batch']} | {r['threads']} | {r['tokens_per_s']:.1f} | {tpp} | "
              f"{ratio(plain)} | {ratio(assisted)} |")
    # Adaptive against transformers assisted, round by round: both ran in the same round, so
    # a slow spell of the machine cancels in their ratio; mean and standard error over rounds.
    paired = []
    for (name, batch, t), ours in samples.items():
        theirs = samples.get(("transformers assisted generation (request by request)", batch, t))
        if name != "specserve, adaptive" or not theirs:
            continue
        clock = "cpu_s" if t == 1 else "wall_s"
        ratios = [(a["tokens"] / a[clock]) / (b["tokens"] / b[clock]) for a, b in zip(ours, theirs)]
        mean = sum(ratios) / len(ratios)
        se = (sum((x - mean) ** 2 for x in ratios) / max(len(ratios) - 1, 1) / len(ratios)) ** 0.5
        paired.append(dict(batch=batch, threads=t, ratios=ratios, mean=mean, se=se))
        print(f"adaptive / transformers assisted, batch {batch}, {t} threads, per round: "
              f"{', '.join(f'{x:.2f}' for x in ratios)}; mean {mean:.2f}x +- {se:.2f} (SE)")
    if args.out:
        Path(args.out).write_text(json.dumps(dict(machine=machine, commit=commit, rows=rows, paired=paired), indent=2))


if __name__ == "__main__":
    main()
