"""specserve against llama.cpp's server on the same pair, the same prompts, side by side.

    python -m benchmarks.peer [--concurrency 1 4 8] [--rounds 3] [--max-tokens 128] \\
        [--llama-draft-max 3 8] [--out benchmarks/out/peer.json]

What it does, all of it cached outside git (~/.cache/specserve/peer, or $SPECSERVE_PEER_CACHE):
  1. builds `llama-server` from the llama.cpp source that the llama-cpp-python sdist on the
     package registry carries (pip download, cmake; the first build takes 15-25 minutes on two
     cores), with the machine's own instruction set (GGML_NATIVE);
  2. converts the embedded pair to float32 GGUF with that source's convert_hf_to_gguf.py (our
     tokenizer's ByteLevel pre-tokenizer is GPT-2's regex, which the converter only knows by the
     hash of a known model's tokens: the hash of ours is registered as "gpt-2" for the run);
  3. starts specserve (`specserve serve`, its defaults: adaptive speculation) and llama-server
     without a draft and with one per --llama-draft-max, every server with all the cores;
  4. in every round, every server in a rotated order, runs the closed load at each concurrency C:
     C clients each send the next held-out prompt (as token ids, so both servers see the same
     tokens) as soon as their previous one ends, 2C requests (at least 8) a cell, greedy, EOS
     ignored, --max-tokens each, not streamed; tokens/s = completion tokens over the cell's wall
     time. Each server answers a few requests before the first round.

Before the servers start it measures, in process, plain decoding at batch 1 (speculation off,
the compiled forward built first if it is not cached) against this machine's memory-bandwidth
bound for the target: bytes a step must read (every weight once, and the keys and values of the
context) over the memory traffic of a large copy (a 256 MiB float32 tensor copied by torch with
every thread, best of 5; its bytes read plus its bytes written per second). The copy and a
256-step decode alternate (--rounds, at least 5): the machine's memory speed moves by a third
from minute to minute, so each round's ratio compares the two of one minute.

It prints a table (median over rounds and the range), the ratio of specserve to llama.cpp's
best setting at each C, and how many of the first generated tokens the two agree on (they run
the same weights, so a low figure means a broken conversion, not a faster server). The JSON
goes to --out and a plot beside it.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import statistics
import subprocess
import sys
import tarfile
import time
import urllib.request
from hashlib import sha256
from pathlib import Path

import aiohttp

from benchmarks import sweep
from benchmarks.bench_offline import held_out_prompts
from benchmarks.runinfo import git_commit

LLAMA_CPP_PYTHON = "0.3.36"   # the sdist whose vendored llama.cpp is built
ASSETS = Path(__file__).resolve().parent.parent / "specserve" / "assets"
PAIR = {"target": ASSETS / "tiny-target", "draft": ASSETS / "tiny-draft"}


def cache_dir() -> Path:
    path = Path(os.environ.get("SPECSERVE_PEER_CACHE", Path.home() / ".cache" / "specserve" / "peer"))
    path.mkdir(parents=True, exist_ok=True)
    return path


def run(cmd: list[str], log: Path, what: str, **kw) -> None:
    print(f"  {what} (log: {log})", flush=True)
    with open(log, "w") as f:
        rc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, **kw).returncode
    if rc:
        tail = log.read_text().splitlines()[-15:]
        raise SystemExit(f"{what} failed (exit {rc}); the end of {log}:\n" + "\n".join(tail))


def llama_source(cache: Path) -> Path:
    """The llama.cpp tree vendored in the llama-cpp-python sdist, downloaded and unpacked once."""
    root = cache / f"llama_cpp_python-{LLAMA_CPP_PYTHON}"
    src = root / "vendor" / "llama.cpp"
    if (src / "CMakeLists.txt").exists():
        return src
    sdist = cache / f"llama_cpp_python-{LLAMA_CPP_PYTHON}.tar.gz"
    if not sdist.exists():
        run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
             f"llama-cpp-python=={LLAMA_CPP_PYTHON}", "-d", str(cache)], cache / "download.log",
            f"downloading the llama-cpp-python {LLAMA_CPP_PYTHON} sdist")
    print(f"  unpacking {sdist.name}", flush=True)
    with tarfile.open(sdist) as tar:
        tar.extractall(cache, filter="data")
    return src


def llama_server(cache: Path) -> Path:
    """Path of a built llama-server (built once; a finished build is reused)."""
    src = llama_source(cache)
    binary = src / "build" / "bin" / "llama-server"
    if binary.exists():
        return binary
    build = src / "build"
    run(["cmake", "-S", str(src), "-B", str(build), "-DCMAKE_BUILD_TYPE=Release", "-DLLAMA_CURL=OFF",
         "-DLLAMA_OPENSSL=OFF", "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF", "-DGGML_NATIVE=ON"],
        cache / "cmake.log", "configuring llama.cpp")
    run(["cmake", "--build", str(build), "--target", "llama-server", f"-j{os.cpu_count() or 1}"],
        cache / "build.log", "building llama-server (15-25 minutes on two cores, once)")
    return binary


# The converter maps a tokenizer to llama.cpp's pre-tokenizer by the sha256 of the tokens it
# gives for a fixed text; this registers ours, reads our tokenizer as the GPT-2-style BPE it is
# (a Llama checkpoint's vocabulary is otherwise tried as SentencePiece first), then runs the
# converter as its own script does.
_CONVERT = """
import sys
from hashlib import sha256
src, model_dir, outfile, known = sys.argv[1:5]
sys.path[:0] = [src, src + "/gguf-py"]
sys.argv = ["convert_hf_to_gguf.py", model_dir, "--outtype", "f32", "--outfile", outfile]
import conversion.base as base
import conversion.llama as llama
import convert_hf_to_gguf
llama.LlamaModel.set_vocab = lambda self: self._set_vocab_gpt2()
original = base.TextModel.get_vocab_base_pre
def get_vocab_base_pre(self, tokenizer):
    if sha256(str(tokenizer.encode(CHECK_TEXT)).encode()).hexdigest() == known:
        return "gpt-2"
    return original(self, tokenizer)
base.TextModel.get_vocab_base_pre = get_vocab_base_pre
convert_hf_to_gguf.main()
"""


def check_text(src: Path) -> str:
    """The text the converter hashes the tokens of (read from its source, so it cannot drift)."""
    import ast

    tree = ast.parse((src / "conversion" / "base.py").read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef) and node.name == "get_vocab_base_pre":
            for stmt in node.body:
                if isinstance(stmt, ast.Assign) and getattr(stmt.targets[0], "id", "") == "chktxt":
                    return ast.literal_eval(stmt.value)
    raise SystemExit(f"no chktxt in {src}/conversion/base.py: the converter changed shape")


def to_gguf(cache: Path, src: Path, name: str, model_dir: Path) -> Path:
    out = cache / f"{name}-f32.gguf"
    weights = model_dir / "model.safetensors"
    stamp = sha256(weights.read_bytes()).hexdigest()[:16]
    if out.exists() and out.with_suffix(".sha").exists() and out.with_suffix(".sha").read_text() == stamp:
        return out
    from transformers import AutoTokenizer

    text = check_text(src)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    known = sha256(str(tokenizer.encode(text)).encode()).hexdigest()
    script = f"CHECK_TEXT = {text!r}\n" + _CONVERT
    run([sys.executable, "-c", script, str(src), str(model_dir), str(out), known], cache / f"convert-{name}.log",
        f"converting {name} to GGUF (float32)")
    out.with_suffix(".sha").write_text(stamp)
    return out


# -- servers -------------------------------------------------------------------------------------

class Server:
    def __init__(self, name: str, cmd: list[str], port: int, log: Path, payload: dict):
        self.name, self.cmd, self.port, self.log, self.payload = name, cmd, port, log, payload
        self.proc: subprocess.Popen | None = None
        self.base = f"http://127.0.0.1:{port}"

    def start(self) -> None:
        self.proc = subprocess.Popen(self.cmd, stdout=open(self.log, "w"), stderr=subprocess.STDOUT,
                                     start_new_session=True)
        sweep.wait_healthy(self.base, self.proc, 300)
        with urllib.request.urlopen(self.base + "/v1/models", timeout=10) as r:
            self.payload["model"] = json.loads(r.read())["data"][0]["id"]

    def stop(self) -> None:
        if self.proc is not None:
            sweep.stop_server(self.proc)


def servers(cache: Path, out_dir: Path, draft_max: list[int], threads: int) -> list[Server]:
    src = llama_source(cache)
    binary = llama_server(cache)
    target, draft = to_gguf(cache, src, "tiny-target", PAIR["target"]), to_gguf(cache, src, "tiny-draft", PAIR["draft"])
    common = {"temperature": 0.0, "ignore_eos": True}
    made = [Server("specserve", [sys.executable, "-m", "specserve.cli", "serve", "--host", "127.0.0.1",
                                 "--port", "8401"], 8401, out_dir / "specserve.log", dict(common))]
    # 8 slots of 512 tokens (the pair's context), f32 KV like ours; --no-webui: no page to serve.
    llama = [str(binary), "-m", str(target), "--host", "127.0.0.1", "-t", str(threads), "-tb", str(threads),
             "-np", "8", "-c", str(8 * 512), "-ctk", "f32", "-ctv", "f32", "--no-webui", "--log-disable"]
    made.append(Server("llama.cpp", llama + ["--port", "8402"], 8402, out_dir / "llama.log", dict(common)))
    for i, n in enumerate(draft_max):
        port = 8403 + i
        made.append(Server(f"llama.cpp draft {n}", llama + [
            "--port", str(port), "-md", str(draft), "--spec-draft-n-max", str(n), "--spec-draft-n-min", "0",
            "-ctkd", "f32", "-ctvd", "f32", "-td", str(threads)], port, out_dir / f"llama-draft{n}.log", dict(common)))
    return made


# -- plain decoding against the memory-bandwidth bound ---------------------------------------------

def copy_speed() -> float:
    """Memory traffic of a 256 MiB copy, bytes read plus bytes written per second, best of 5."""
    import torch

    src = torch.ones(64 << 20)
    dst = torch.empty_like(src)
    dst.copy_(src)
    best = float("inf")
    for _ in range(5):
        t0 = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - t0)
    return 2 * src.numel() * src.element_size() / best


def plain_decoding(prompt: list[int], max_tokens: int, rounds: int) -> dict:
    """Batch-1 plain decoding of the default setup in this process beside the memory-bandwidth
    bound, measured in alternation (`rounds` times a copy's speed, then `max_tokens` steps) so
    that each ratio compares a decode with the bound of the same minute."""
    from specserve import LLM, SamplingParams
    from specserve import config as config_mod
    from specserve.model import compiled

    compiled.build_for(config_mod.default())
    llm = LLM(progress=False, spec_mode="static", spec_depth=0)
    eng = llm.engine
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    llm.generate([prompt], params)   # warm
    model, args = eng.target.model, eng.target_args
    mean_context = len(prompt) + max_tokens / 2
    step_bytes = model.linear_weight_bytes() + args.kv_bytes_per_block(1, model.dtype) * mean_context
    runs = []
    for r in range(rounds):
        speed = copy_speed()
        eng.add_request(f"plain-{r}", prompt, params)
        eng.step()   # the prefill
        steps, t0 = 0, time.perf_counter()
        while eng.has_unfinished_requests():
            eng.step()
            steps += 1
        rate = steps / (time.perf_counter() - t0)
        runs.append({"steps_per_s": rate, "bound_steps_per_s": speed / step_bytes, "copy_bytes_per_s": speed})
    ratios = [run["steps_per_s"] / run["bound_steps_per_s"] for run in runs]
    return {"runs": runs, "ratio_median": statistics.median(ratios), "ratio_min": min(ratios),
            "ratio_max": max(ratios), "ratio_mean": statistics.fmean(ratios),
            "ratio_sem": statistics.stdev(ratios) / len(ratios) ** 0.5 if len(ratios) > 1 else 0.0,
            "step_bytes": step_bytes, "compiled": eng.target.compiled is not None}


def bound_text(plain: dict) -> str:
    runs = plain["runs"]
    med = lambda key: statistics.median(run[key] for run in runs)  # noqa: E731
    return (f"plain decoding at batch 1 ({'compiled' if plain['compiled'] else 'eager'} forward), {len(runs)} "
            f"alternating rounds: {med('steps_per_s'):.0f} steps/s beside a bound of {med('bound_steps_per_s'):.0f} "
            f"steps/s ({plain['step_bytes'] / 1e6:.1f} MB a step at {med('copy_bytes_per_s') / 1e9:.1f} GB/s, a "
            f"copy's reads and writes; medians): {plain['ratio_median']:.0%} of the bound (rounds "
            f"{plain['ratio_min']:.0%}-{plain['ratio_max']:.0%}, mean {plain['ratio_mean']:.0%} +- "
            f"{plain['ratio_sem']:.0%} s.e.)")


# -- load -----------------------------------------------------------------------------------------

async def closed_loop(server: Server, prompts: list[list[int]], concurrency: int, max_tokens: int) -> dict:
    queue = list(range(len(prompts)))
    texts: dict[int, list[int]] = {}
    tokens = 0

    async def client(session: aiohttp.ClientSession) -> None:
        nonlocal tokens
        while queue:
            i = queue.pop(0)
            body = {"prompt": prompts[i], "max_tokens": max_tokens, **server.payload}
            async with session.post(server.base + "/v1/completions", json=body) as resp:
                data = await resp.json()
                if resp.status != 200:
                    raise RuntimeError(f"{server.name}: HTTP {resp.status}: {data}")
            tokens += data["usage"]["completion_tokens"]
            texts[i] = data["choices"][0]["text"]

    timeout = aiohttp.ClientTimeout(total=600)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        t0 = time.perf_counter()
        await asyncio.gather(*(client(session) for _ in range(concurrency)))
        wall = time.perf_counter() - t0
    return {"tokens_per_s": tokens / wall, "tokens": tokens, "wall_s": wall, "texts": texts}


def agreement(a: dict[int, str], b: dict[int, str], chars: int = 40) -> float:
    """Share of prompts whose first `chars` characters of output the two servers agree on."""
    keys = sorted(set(a) & set(b))
    return sum(a[k][:chars] == b[k][:chars] for k in keys) / max(len(keys), 1)


def summarize(results: dict, names: list[str], concs: list[int]) -> tuple[str, dict]:
    lines = ["| C | " + " | ".join(names) + " | specserve / llama.cpp best |",
             "|---|" + "---|" * (len(names) + 1)]
    ratios = {}
    for c in concs:
        cells, med = [], {}
        for n in names:
            runs = [r["tokens_per_s"] for r in results[n][c]]
            med[n] = statistics.median(runs)
            cells.append(f"{med[n]:.0f} ({min(runs):.0f}-{max(runs):.0f})")
        best = max((n for n in names if n != "specserve"), key=lambda n: med[n])
        # the spread of the ratio: round by round, specserve's run against that round's best llama
        per_round = [results["specserve"][c][k]["tokens_per_s"] / results[best][c][k]["tokens_per_s"]
                     for k in range(len(results["specserve"][c]))]
        ratios[c] = {"median": med["specserve"] / med[best], "best": best, "per_round": per_round}
        lines.append(f"| {c} | " + " | ".join(cells) + f" | {ratios[c]['median']:.2f}x vs {best} "
                     f"({min(per_round):.2f}-{max(per_round):.2f}) |")
    return "\n".join(lines), ratios


def plot(results: dict, names: list[str], concs: list[int], path: Path) -> Path:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5.5, 3.4))
    for n in names:
        meds = [statistics.median(r["tokens_per_s"] for r in results[n][c]) for c in concs]
        lo = [min(r["tokens_per_s"] for r in results[n][c]) for c in concs]
        hi = [max(r["tokens_per_s"] for r in results[n][c]) for c in concs]
        ax.errorbar(concs, meds, yerr=[[m - x for m, x in zip(meds, lo)], [x - m for m, x in zip(meds, hi)]],
                    marker="o", capsize=3, label=n)
    ax.set_xlabel("concurrent requests")
    ax.set_ylabel("output tokens/s")
    ax.set_xticks(concs)
    ax.set_title("embedded pair, greedy, this CPU", fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    return path


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 8])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--llama-draft-max", type=int, nargs="+", default=[3, 8],
                    help="llama.cpp's --spec-draft-n-max settings run (each its own server)")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--out", default="benchmarks/out/peer.json")
    ap.add_argument("--bound-only", action="store_true",
                    help="only plain decoding against the memory-bandwidth bound (no llama.cpp)")
    args = ap.parse_args(argv)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    if not shutil.which("cmake") and not args.bound_only:
        raise SystemExit("cmake is needed to build llama-server (apt-get install cmake g++)")
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(PAIR["target"])
    n = max(2 * max(args.concurrency), 8)
    prompts = held_out_prompts(n + 4, 64, tokenizer)
    warm, prompts = prompts[:4], prompts[4:]
    print("plain decoding at batch 1, in process", flush=True)
    plain = plain_decoding(warm[0], 256, max(args.rounds, 5))
    bound_line = bound_text(plain)
    print(bound_line, flush=True)
    if args.bound_only:
        return 0
    print("preparing llama.cpp", flush=True)
    made = servers(cache_dir(), out.parent, args.llama_draft_max, args.threads)
    names = [s.name for s in made]
    results = {s.name: {c: [] for c in args.concurrency} for s in made}
    try:
        for s in made:
            print(f"starting {s.name}", flush=True)
            s.start()
            asyncio.run(closed_loop(s, warm, 1, args.max_tokens))
        for r in range(args.rounds):
            for s in sweep.cell_order(made, r):
                for c in args.concurrency:
                    cell = asyncio.run(closed_loop(s, prompts[: max(2 * c, 8)], c, args.max_tokens))
                    results[s.name][c].append(cell)
                    print(f"round {r + 1}/{args.rounds} {s.name:>18} C={c}: {cell['tokens_per_s']:.0f} tok/s",
                          flush=True)
    finally:
        for s in made:
            s.stop()
    text, ratios = summarize(results, names, args.concurrency)
    agree = {n: agreement(results["specserve"][args.concurrency[0]][0]["texts"],
                          results[n][args.concurrency[0]][0]["texts"]) for n in names[1:]}
    text += "\n\nfirst 40 characters of output equal to specserve's: " + ", ".join(
        f"{n} {a:.0%}" for n, a in agree.items()) + "\n" + bound_line
    print(text)
    for cells in results.values():
        for runs in cells.values():
            for cell in runs:
                cell.pop("texts")
    out.write_text(json.dumps({"commit": git_commit(), "args": vars(args), "results": results,
                               "ratios": ratios, "agreement": agree, "plain_decoding": plain}, indent=1))
    print(f"plot: {plot(results, names, args.concurrency, out.with_suffix('.png'))}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
