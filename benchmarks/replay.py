"""The controller's judge: recorded cost landscapes and acceptance traces, replayed through the
adaptive controller and through every static depth on the same requests, noise-free.

    python -m benchmarks.replay judge [--landscape cpu_embedded ...] [--plot replay.png]
    python -m benchmarks.replay record --out benchmarks/landscapes/cpu_embedded.json

A landscape (benchmarks/landscapes/*.json) holds what a step costs on one machine with one
pair: the target's verify pass by batch bucket and rows a sequence, a draft level and the rest
of a step by batch bucket, a prompt token's prefill; and acceptance traces, one per request:
the target's greedy continuation of a held-out prompt and, position by position, whether the
draft's greedy token (teacher-forced on that continuation) equals the target's and the
draft's probability of it. A greedy chain of L nodes from position t is then accepted exactly
min(L, the run of agreements from t) long, and its path probabilities are the products of
those probabilities (exact while the chain agrees, the teacher-forced ones after).

A closed loop of C clients: each request is prefilled (one token), then decodes to max_tokens;
when one finishes the next starts. Every setting serves the same requests in the same order;
goodput = tokens / simulated seconds. The adaptive controller starts from the landscape's
verify and draft costs (what a probe reads) and learns the rest of a step online, as in the
engine (spec.py wires it the same way).
"""

from __future__ import annotations

import argparse
import json
import random
from dataclasses import dataclass
from pathlib import Path

from specserve.controller import AdaptiveController, CapacityCurve, ControllerConfig

LANDSCAPES = Path(__file__).resolve().parent / "landscapes"
CONCURRENCY = (1, 2, 4, 8, 16, 32, 64)


@dataclass
class Landscape:
    name: str
    curve: CapacityCurve               # the truth: never learns
    prefill_s_per_token: float
    traces: list[tuple[list[bool], list[float]]]   # per request: agrees, draft probability, by position
    max_depth: int

    @classmethod
    def load(cls, name_or_path: str) -> Landscape:
        path = Path(name_or_path)
        if not path.suffix:
            path = LANDSCAPES / f"{name_or_path}.json"
        d = json.loads(path.read_text())
        curve = CapacityCurve(d["buckets"], d["verify_s"], d["level_s"], d["rest_s"])
        traces = [([c == "1" for c in t["agree"]], t["q"]) for t in d["traces"]]
        return cls(d["name"], curve, d["prefill_s_per_token"], traces, len(d["verify_s"][0]) - 1)


@dataclass
class _Req:
    id: int
    agree: list[bool]
    q: list[float]
    emitted: int = 0


def _run_length(agree: list[bool], start: int) -> int:
    n = 0
    while start + n < len(agree) and agree[start + n]:
        n += 1
    return n


def simulate(land: Landscape, setting: str | int, concurrency: int, num_requests: int,
             max_tokens: int = 64, prompt_tokens: int = 64) -> dict:
    """Serve num_requests with `setting` ("adaptive" or a static depth); returns tokens/s and
    the mix of depths run."""
    truth = land.curve
    controller = None
    if setting == "adaptive":
        seed = CapacityCurve(truth.buckets, [[truth.level[b] * s for s in row] for b, row in enumerate(truth.shape)],
                             truth.draft)
        controller = AdaptiveController(seed, None, ControllerConfig(max_depth=land.max_depth),
                                        path_probs=True)
    active: list[_Req] = []
    fresh: list[_Req] = []
    started = tokens = 0
    seconds = 0.0
    depths: dict[int, int] = {}
    while started < num_requests or active or fresh:
        while len(active) + len(fresh) < concurrency and started < num_requests:
            agree, q = land.traces[started % len(land.traces)]
            fresh.append(_Req(started, agree, q))
            started += 1
        B = len(active)
        caps = [max(0, max_tokens - r.emitted - 1) for r in active]
        if controller is not None:
            plan = controller.plan([(r.id, cap, False) for r, cap in zip(active, caps)])
            nodes, stop = plan.nodes, plan.early_stop
        else:
            nodes = {r.id: min(setting, cap) for r, cap in zip(active, caps) if min(setting, cap)}
            stop = None
        lengths, paths, levels = _draft(active, nodes, stop)
        depths[levels] = depths.get(levels, 0) + 1
        rows = B + sum(lengths)
        verify_s = truth.verify_s(B, rows) if B else 0.0
        draft_s = truth.level_s(B) * levels
        rest_s = truth.rest_s(max(B, len(fresh)))
        step_s = verify_s + draft_s + rest_s + land.prefill_s_per_token * prompt_tokens * len(fresh)
        seconds += step_s
        chains = []
        for r, n, qs in zip(active, lengths, paths):
            a = min(n, _run_length(r.agree, r.emitted))
            r.emitted += a + 1
            tokens += a + 1
            if n:
                chains.append((r.id, False, n, a, qs))
        tokens += len(fresh)
        for r in fresh:
            r.emitted = 1
        if controller is not None:
            controller.observe(B, rows, levels, draft_s, verify_s, rest_s, chains, timed=not fresh)
        if controller is not None:
            for r in active + fresh:
                if r.emitted >= max_tokens:
                    controller.forget(r.id)
        active = [r for r in active + fresh if r.emitted < max_tokens]
        fresh = []
    return {"tokens_per_s": tokens / seconds, "depths": depths}


def _draft(active: list[_Req], nodes: dict, stop) -> tuple[list[int], list[list[float]], int]:
    """Chain lengths as the model drafter grows them (drafts/model.py), their path probabilities
    and the levels run, with the controller's early stop (controller.EarlyStop) if any."""
    paths: list[list[float]] = [[] for _ in active]
    growing = [i for i, r in enumerate(active) if nodes.get(r.id, 0) > 0]
    levels = 0
    while growing:
        levels += 1
        still = []
        for i in growing:
            r, path = active[i], paths[i]
            q = (path[-1] if path else 1.0) * r.q[min(r.emitted + len(path), len(r.q) - 1)]
            if stop is None or stop.keep(q):
                path.append(q)
                if len(path) < nodes[r.id]:
                    still.append(i)
        growing = still
        if growing and stop is not None and not stop.next_level([paths[i][-1] for i in growing]):
            break
    return [len(p) for p in paths], paths, levels


def judge(land: Landscape, concurrency=CONCURRENCY, max_tokens: int = 64) -> list[dict]:
    """Per concurrency: every setting's tokens/s, the best static depth, adaptive over it and
    over plain decoding."""
    rows = []
    for c in concurrency:
        n = max(4 * c, 24)
        static = {d: simulate(land, d, c, n, max_tokens)["tokens_per_s"] for d in range(land.max_depth + 1)}
        adaptive = simulate(land, "adaptive", c, n, max_tokens)
        best = max(static, key=static.get)
        rows.append({"concurrency": c, "static": static, "adaptive": adaptive["tokens_per_s"],
                     "adaptive_depths": adaptive["depths"], "best_static": best,
                     "vs_best": adaptive["tokens_per_s"] / static[best],
                     "vs_plain": adaptive["tokens_per_s"] / static[0]})
    return rows


def _table(name: str, rows: list[dict]) -> str:
    lines = [f"### {name}", "", "| concurrency | plain tok/s | best static | adaptive tok/s | adaptive / best static "
             "| adaptive / plain |", "|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['concurrency']} | {r['static'][0]:.0f} | depth {r['best_static']} "
                     f"({r['static'][r['best_static']]:.0f}) | {r['adaptive']:.0f} | {r['vs_best']:.3f} "
                     f"| {r['vs_plain']:.3f} |")
    return "\n".join(lines)


def _plot(results: dict[str, list[dict]], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(results), figsize=(4.5 * len(results), 3.6), squeeze=False)
    for ax, (name, rows) in zip(axes[0], results.items()):
        cs = [r["concurrency"] for r in rows]
        for d in rows[0]["static"]:
            ax.plot(cs, [r["static"][d] / r["static"][r["best_static"]] for r in rows], color="0.75", lw=0.8)
        ax.plot(cs, [r["vs_best"] for r in rows], "o-", color="C3", label="adaptive")
        ax.axhline(0.97, ls=":", color="k", lw=0.8)
        ax.set_xscale("log", base=2)
        ax.set_title(name, fontsize=9)
        ax.set_xlabel("concurrency")
        ax.set_ylabel("tokens/s over the best static depth")
        ax.set_ylim(0.4, 1.1)
    axes[0][0].legend(loc="lower left", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=90)


# -- recording a landscape on this machine -----------------------------------------------------

def record(out: Path, num_traces: int = 48, max_tokens: int = 72) -> None:
    """The embedded pair on this machine: its thorough probe, a step's rest from plain decode
    steps, a prompt token's prefill, and greedy traces of held-out prompts."""
    import time

    import torch
    from transformers import AutoModelForCausalLM

    from specserve import LLM, SamplingParams
    from specserve import profile
    from specserve.config import resolve_path

    llm = LLM(spec_mode="static", spec_depth=0, progress=False)
    engine = llm.engine
    spec = engine.spec
    buckets = spec.buckets()
    curve = profile.probe(engine, buckets, spec.nodes_at(spec.max_depth()) + 1, thorough=True)
    prompts = [json.loads(line) for line in (Path(__file__).parent / "data" / "heldout_prompts.jsonl").open()]
    rest = []
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    for b in buckets:   # plain decode steps of b sequences: the step less its target pass
        forward = engine.target.forward
        spent = []

        def timed(inp, forward=forward, spent=spent):
            start = time.perf_counter()
            out = forward(inp)
            spent.append(time.perf_counter() - start)
            return out
        engine.target.forward = timed
        for p in prompts[:b]:
            engine.add_request(None, p, params)
        engine.step()   # the prompts
        steps = []
        while engine.has_unfinished_requests():
            spent.clear()
            start = time.perf_counter()
            engine.step()
            steps.append(time.perf_counter() - start - sum(spent))
        engine.target.forward = forward
        rest.append(sorted(steps)[len(steps) // 2])
    ids = [engine.tokenizer.encode(p) for p in prompts]
    start = time.perf_counter()
    for p in ids[:16]:
        engine.add_request(None, p, SamplingParams(max_tokens=1))
    while engine.has_unfinished_requests():
        engine.step()
    prefill = (time.perf_counter() - start) / sum(len(p) for p in ids[:16])
    outs = llm.generate(ids[:num_traces], SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True))
    draft = AutoModelForCausalLM.from_pretrained(str(resolve_path("embedded:tiny-draft")), dtype=torch.float32).eval()
    traces = []
    with torch.no_grad():
        for prompt, o in zip(ids, outs):
            full = torch.tensor([prompt + o.token_ids])
            probs = torch.softmax(draft(full).logits[0, len(prompt) - 1:-1].float(), dim=-1)
            q, guess = probs.max(dim=-1)
            agree = "".join("1" if g == t else "0" for g, t in zip(guess.tolist(), o.token_ids))
            traces.append({"agree": agree, "q": [round(x, 4) for x in q.tolist()]})
    land = {"name": "embedded pair, this CPU", "source": f"python -m benchmarks.replay record --out {out}",
            **curve.to_dict(), "rest_s": rest, "prefill_s_per_token": prefill, "traces": traces}
    out.write_text(json.dumps(land))
    print(f"wrote {out}: {len(traces)} traces, agreement {sum(t['agree'].count('1') for t in traces) / sum(len(t['agree']) for t in traces):.3f}")


def synthetic(out: Path, seed: int = 0) -> None:
    """A compute-bound machine: every row costs (a big target at full batch), a draft level is
    cheap; requests differ in how predictable they are (mean acceptance 0.35 to 0.92), and the
    draft is calibrated: each token agrees with the probability the draft gives it."""
    buckets = [1, 2, 4, 8, 16, 32, 64]
    rng = random.Random(seed)
    traces = []
    for i in range(48):
        rate = [0.35, 0.6, 0.8, 0.92][i % 4]
        q = [round(min(0.99, max(0.01, rng.gauss(rate, 0.15))), 3) for _ in range(80)]
        traces.append({"agree": "".join("1" if rng.random() < x else "0" for x in q), "q": q})
    land = {"name": "synthetic compute-bound", "source": "benchmarks/replay.py synthetic(): verify 4 ms + 0.2 ms "
            "a row, a level 1 ms + 0.01 ms a sequence, rest 1 ms",
            "buckets": buckets, "verify_s": [[0.004 + 0.0002 * b * r for r in range(1, 10)] for b in buckets],
            "level_s": [0.001 + 0.00001 * b for b in buckets], "rest_s": [0.001] * len(buckets),
            "prefill_s_per_token": 0.0002, "traces": traces}
    out.write_text(json.dumps(land))


def h100(out: Path, traces_from: Path) -> None:
    """The embedded pair grown to Llama-3.1-8B/3.2-1B shapes on the H100, eager (benchmarks/
    RESULTS.md, "On a GPU"): a host-bound verify pass of 17.9 ms at batch 1, 0.2 ms more a
    sequence, 0.035 ms a row of GPU compute; a draft level of 6 ms; the rest of a step 5.6 ms
    and 0.1 ms a sequence; the embedded pair's acceptance (the grown pair computes what it does)."""
    buckets = [1, 2, 4, 8, 16, 32, 64]
    src = json.loads(traces_from.read_text())
    land = {"name": "grown 8B/1B pair, H100 (from RESULTS.md)", "source": h100.__doc__.replace("\n", " "),
            "buckets": buckets,
            "verify_s": [[0.0179 + 0.0002 * (b - 1) + 0.000035 * b * r for r in range(1, 10)] for b in buckets],
            "level_s": [0.006 + 0.00005 * b for b in buckets],
            "rest_s": [0.0056 + 0.0001 * (b - 1) for b in buckets],
            "prefill_s_per_token": 0.00004, "traces": src["traces"]}
    out.write_text(json.dumps(land))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    j = sub.add_parser("judge", help="replay every landscape through adaptive and every static depth")
    j.add_argument("--landscape", nargs="*", default=["cpu_embedded", "h100_grown", "synthetic_compute"])
    j.add_argument("--concurrency", type=int, nargs="*", default=list(CONCURRENCY))
    j.add_argument("--plot", help="write a plot of adaptive and every static depth over the best")
    j.add_argument("--out", help="write the figures as JSON")
    r = sub.add_parser("record", help="record this machine's landscape with the embedded pair")
    r.add_argument("--out", type=Path, default=LANDSCAPES / "cpu_embedded.json")
    args = ap.parse_args(argv)
    if args.cmd == "record":
        record(args.out)
        h100(LANDSCAPES / "h100_grown.json", args.out)
        synthetic(LANDSCAPES / "synthetic_compute.json")
        return 0
    results = {}
    for name in args.landscape:
        land = Landscape.load(name)
        results[land.name] = judge(land, args.concurrency)
        print(_table(land.name, results[land.name]) + "\n")
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=1))
    if args.plot:
        _plot(results, Path(args.plot))
        print(f"plot: {args.plot}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
