"""The same closed-loop load in process and over HTTP, with the engine on a thread of the server
(before the split) and in an engine-core process (after it): output tokens/s, TTFT and ITL.

    python -m benchmarks.split [--config configs/tiny.toml] [--concurrency 1 8 32 64] \\
        [--max-tokens 64] [--out benchmarks/out/split.json]

At each concurrency C, C clients each send a request as soon as their previous one ends, over
the held-out prompts (greedy, EOS ignored, max_tokens each), until 2C (at least 16) are served.
In process the engine is stepped by the benchmark's own thread, a request added as soon as one
finishes; over HTTP the clients are benchmarks.loadgen
against `specserve serve` started with and without --engine-thread. Every mode serves WARMUP
requests one at a time before it is timed. The three modes run one after the other at each
concurrency, their order rotated between concurrencies; the output is a table (and JSON, and
a plot beside it).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from benchmarks import loadgen, sweep
from benchmarks.runinfo import git_commit

PROMPTS = Path(__file__).parent / "data" / "heldout_prompts.jsonl"
WARMUP = 4   # requests served before the timed load, in every mode
MODES = ["in_process", "http_thread", "http_process"]


def in_process(config: str | None, concurrency: int, prompts: list[str], max_tokens: int) -> dict:
    """The closed loop on an LLMEngine stepped by this thread (no HTTP, no second thread): a
    new request is added as soon as one finishes; outputs timed as loadgen times chunks."""
    from specserve import config as config_mod
    from specserve.engine import LLMEngine
    from specserve.sampling import SamplingParams

    cfg = config_mod.load(config) if config else config_mod.default()
    engine = LLMEngine(cfg, progress=False)
    ids = [engine.tokenizer.encode(p) for p in prompts]
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)

    def serve(indices: list[int], width: int) -> list[loadgen.RequestResult]:
        queue, live, done = list(indices), {}, []
        engine.idle()
        while queue or live:
            while queue and len(live) < width:
                i = queue.pop(0)
                rid = f"bench-{i}-{time.monotonic_ns()}"
                engine.add_request(rid, ids[i], params)
                live[rid] = (loadgen.RequestResult(), time.perf_counter(), [None])
            for out in engine.step():
                r, start, last = live[out.request_id]
                now = time.perf_counter()
                if out.new_token_ids:
                    if r.num_chunks == 0:
                        r.ttft = now - start
                    else:
                        r.itl.append(now - last[0])
                    r.num_chunks += 1
                    last[0] = now
                r.num_output_tokens = len(out.token_ids)
                if out.finished:
                    r.e2e, r.ok = now - start, True
                    done.append(r)
                    del live[out.request_id]
        return done

    serve(list(range(min(WARMUP, len(ids)))), 1)   # as over HTTP: the first requests build what shapes need
    t0 = time.perf_counter()
    results = serve(list(range(len(ids))), concurrency)
    return loadgen.compute_metrics(results, time.perf_counter() - t0, {})


def over_http(mode: str, config: str | None, concurrency: int, prompts: list[str], max_tokens: int,
              out_dir: Path) -> dict:
    port = 8300 + concurrency % 97
    sweep.SETTINGS.setdefault("thread", "--engine-thread")
    sweep.SETTINGS.setdefault("process", "")
    proc = sweep.start_server("thread" if mode == "http_thread" else "process", config, port,
                              out_dir / f"{mode}-c{concurrency}.log", None)
    try:
        base = f"http://127.0.0.1:{port}"
        sweep.wait_healthy(base, proc, 300)
        prompts_file = out_dir / f"prompts-c{concurrency}.jsonl"   # these prompts, in loadgen's order
        prompts_file.write_text("".join(json.dumps(p) + "\n" for p in prompts))
        warmup = out_dir / "prompts-warmup.jsonl"
        warmup.write_text("".join(json.dumps(p) + "\n" for p in prompts[:WARMUP]))
        loadgen.main(["--base-url", base, "--model", model_name(base), "--num-prompts", str(WARMUP),
                      "--max-concurrency", "1", "--max-tokens", str(max_tokens), "--ignore-eos",
                      "--prompts-file", str(warmup), "--no-progress"])
        res = loadgen.main(["--base-url", base, "--model", model_name(base), "--num-prompts", str(len(prompts)),
                            "--max-concurrency", str(concurrency), "--max-tokens", str(max_tokens),
                            "--ignore-eos", "--prompts-file", str(prompts_file), "--no-progress"])
        return res["metrics"]
    finally:
        sweep.stop_server(proc)


def model_name(base: str) -> str:
    import urllib.request

    with urllib.request.urlopen(base + "/v1/models", timeout=10) as r:
        return json.loads(r.read())["data"][0]["id"]


def table(results: dict) -> str:
    lines = ["| C | mode | output tok/s | / in process | TTFT p50 / p99 ms | ITL p50 / p99 ms |",
             "|---|---|---|---|---|---|"]
    for c, by_mode in results.items():
        base = by_mode["in_process"]["output_throughput"]
        for mode in MODES:
            m = by_mode[mode]
            lines.append(f"| {c} | {mode} | {m['output_throughput']:.0f} | {m['output_throughput'] / base:.2f} | "
                         f"{1e3 * m['ttft_s']['median']:.0f} / {1e3 * m['ttft_s']['p99']:.0f} | "
                         f"{1e3 * m['itl_s']['median']:.1f} / {1e3 * m['itl_s']['p99']:.1f} |")
    return "\n".join(lines)


def plot(results: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    concs = list(results)
    fig, ax = plt.subplots(figsize=(5.5, 3.4))
    for mode in MODES:
        ax.plot(concs, [results[c][mode]["output_throughput"] for c in concs], "o-", label=mode)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("concurrent requests")
    ax.set_ylabel("output tokens/s")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=90)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32, 64])
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--out", default="benchmarks/out/split.json")
    args = ap.parse_args(argv)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    pool = loadgen.load_prompts_file(PROMPTS)
    results: dict[int, dict] = {}
    for k, c in enumerate(args.concurrency):
        n = max(2 * c, 16)
        prompts = [pool[i % len(pool)] for i in range(n)]
        results[c] = {}
        for mode in sweep.cell_order(MODES, k):
            print(f"c={c}: {mode}", flush=True)
            results[c][mode] = (in_process(args.config, c, prompts, args.max_tokens) if mode == "in_process" else
                                over_http(mode, args.config, c, prompts, args.max_tokens, out.parent))
    text = table(results)
    print(text)
    out.write_text(json.dumps({"commit": git_commit(), "args": vars(args), "results": results}, indent=2))
    plot(results, out.with_suffix(".png"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
