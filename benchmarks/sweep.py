"""Concurrency x setting sweep over HTTP: a server per setting, the load generator at every
concurrency, rounds interleaved; a report with plots.

    python -m benchmarks.sweep --out-dir benchmarks/out/sweep [--config configs/tiny.toml]
        [--settings none static2 static4 adaptive] [--concurrency 1 4 16 64] [--rounds 3]
        [--server-cpus 1 --client-cpus 0] -- --max-tokens 64 --prompts-file benchmarks/data/heldout_prompts.jsonl
    python -m benchmarks.sweep --report benchmarks/out/sweep     # the report again, from the cells

Settings: `none` (no draft), `staticD` (chain depth D), `adaptive`. With `--base-url
LABEL=URL` (repeatable) the servers are already running and nothing is started. Arguments
after `--` go to every loadgen run. Each round runs every cell once, the settings' order
rotated per concurrency and round, so a slow spell of a shared machine does not land on one
setting; `--server-cpus`/`--client-cpus` keep servers and load generator on cores of their
own. The report pools the rounds (tokens / seconds per cell) and sets adaptive beside the best
static depth and beside no speculation.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from benchmarks import loadgen, plots
from benchmarks.runinfo import git_commit

SETTINGS = {"none": "--draft-kind none", "adaptive": "--spec-mode adaptive",
            **{f"static{d}": f"--spec-mode static --spec-depth {d}" for d in range(0, 9)}}


def wait_healthy(base_url: str, proc: subprocess.Popen | None, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"server exited with code {proc.returncode} before becoming healthy")
        try:
            with urllib.request.urlopen(base_url + "/health", timeout=2) as resp:
                if resp.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.3)
    raise RuntimeError(f"server at {base_url} not healthy after {timeout:.0f} s")


def start_server(setting: str, config: str | None, port: int, log_path: Path, cpus: str | None) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "specserve.cli", "serve", "--host", "127.0.0.1", "--port", str(port)]
    cmd += (["--config", config] if config else []) + shlex.split(SETTINGS[setting])
    allowed = loadgen.parse_cpus(cpus) if cpus else None   # a bad list fails here, not in the child
    # Its own process group, so stopping it stops its children and nothing else; pinned before it runs.
    return subprocess.Popen(cmd, stdout=open(log_path, "w"), stderr=subprocess.STDOUT, start_new_session=True,
                            preexec_fn=(lambda: os.sched_setaffinity(0, allowed)) if allowed else None)


def stop_server(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def cell_order(settings: list[str], index: int) -> list[str]:
    """The settings rotated by `index`: over len(settings) cells each runs once in every place."""
    k = index % len(settings) if settings else 0
    return settings[k:] + settings[:k]


# -- the report --------------------------------------------------------------------------------

def load_cells(out_dir: Path) -> list[dict]:
    return [json.loads(p.read_text()) for p in sorted(out_dir.glob("round*/*.json"))]


def pooled(cells: list[dict]) -> dict[str, dict[int, dict]]:
    """setting -> concurrency -> tokens/s over every round (tokens / seconds), rounds, and the
    round with the median throughput (whose latencies the table shows)."""
    groups: dict[tuple[str, int], list[dict]] = {}
    for c in cells:
        groups.setdefault((c["config"]["label"], c["config"]["max_concurrency"]), []).append(c)
    out: dict[str, dict[int, dict]] = {}
    for (label, conc), runs in groups.items():
        tokens = sum(r["metrics"]["total_output_tokens"] for r in runs)
        seconds = sum(r["metrics"]["duration_s"] for r in runs)
        median = sorted(runs, key=lambda r: r["metrics"]["output_throughput"])[len(runs) // 2]
        out.setdefault(label, {})[conc] = {"tokens_per_s": tokens / seconds, "rounds": len(runs), "median": median}
    return out


def report(cells: list[dict]) -> str:
    pool = pooled(cells)
    concs = sorted({c for by in pool.values() for c in by})
    settings = sorted(pool, key=lambda s: (s != "none", s != "adaptive", s))
    lines = ["Output tokens/s (pooled over rounds):", "",
             "| setting | " + " | ".join(f"c={c}" for c in concs) + " |", "|---" * (len(concs) + 1) + "|"]
    for s in settings:
        lines.append(f"| {s} | " + " | ".join(f"{pool[s][c]['tokens_per_s']:.0f}" if c in pool[s] else ""
                                              for c in concs) + " |")
    statics = [s for s in settings if s.startswith("static")]
    if "adaptive" in pool and statics:
        lines += ["", "| concurrency | best static | adaptive / best static | adaptive / none | TTFT p50 ms "
                  "(adaptive) | ITL p50 ms (adaptive) |", "|---|---|---|---|---|---|"]
        for c in concs:
            have = [s for s in statics if c in pool[s]]
            if c not in pool["adaptive"] or not have:
                continue
            a = pool["adaptive"][c]
            best = max(have, key=lambda s: pool[s][c]["tokens_per_s"])
            none = pool.get("none", {}).get(c)
            m = a["median"]["metrics"]
            vs_none = f"{a['tokens_per_s'] / none['tokens_per_s']:.3f}" if none else "n/a"
            lines.append(f"| {c} | {best} ({pool[best][c]['tokens_per_s']:.0f}) "
                         f"| {a['tokens_per_s'] / pool[best][c]['tokens_per_s']:.3f} | {vs_none} "
                         f"| {m['ttft_s']['median'] * 1e3:.1f} | {m['itl_s']['median'] * 1e3:.1f} |")
    rounds = max((v["rounds"] for by in pool.values() for v in by.values()), default=0)
    lines += ["", f"{rounds} round(s); commit {cells[0].get('commit', '?') if cells else '?'}"]
    return "\n".join(lines) + "\n"


def write_report(out_dir: Path) -> str:
    cells = load_cells(out_dir)
    text = report(cells)
    (out_dir / "report.md").write_text(text)
    medians = [v["median"] for by in pooled(cells).values() for v in by.values()]
    plots.make_all(medians, out_dir)
    return text


# -- the sweep ---------------------------------------------------------------------------------

def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    extra = argv[argv.index("--") + 1:] if "--" in argv else []
    argv = argv[:argv.index("--")] if "--" in argv else argv
    p = argparse.ArgumentParser(prog="python -m benchmarks.sweep", description=__doc__.split("\n\n")[0])
    p.add_argument("--report", type=Path, help="only write the report of a finished sweep's folder")
    p.add_argument("--config", help="the engine config every server starts from (default: the embedded pair)")
    p.add_argument("--model", help="the served model name (default: read from /v1/models)")
    p.add_argument("--settings", nargs="*", default=["none", "static1", "static2", "static3", "static4", "static5",
                                                     "adaptive"])
    p.add_argument("--base-url", action="append", default=[], metavar="LABEL=URL")
    p.add_argument("--concurrency", nargs="*", type=int, default=[1, 2, 4, 8, 16, 32, 64])
    p.add_argument("--prompts-per-concurrency", type=int, default=4)
    p.add_argument("--min-prompts", type=int, default=16)
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--port", type=int, default=8765)
    p.add_argument("--server-cpus", help="taskset-style CPU list for the servers")
    p.add_argument("--client-cpus", help="taskset-style CPU list for the load generator")
    p.add_argument("--startup-timeout", type=float, default=300.0)
    p.add_argument("--out-dir", type=Path, default=Path("benchmarks/out/sweep"))
    args = p.parse_args(argv)
    if args.report:
        print(write_report(args.report))
        return 0
    for s in args.settings:
        if s not in SETTINGS:
            p.error(f"unknown setting {s!r}; known: {', '.join(SETTINGS)}")
    loadgen.pin_to_cpus(args.client_cpus)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    servers: dict[str, tuple[str, subprocess.Popen | None]] = {}
    try:
        if args.base_url:
            for spec in args.base_url:
                label, _, url = spec.partition("=")
                servers[label] = (url.rstrip("/"), None)
        else:
            for i, s in enumerate(args.settings):
                url = f"http://127.0.0.1:{args.port + i}"
                servers[s] = (url, start_server(s, args.config, args.port + i, args.out_dir / f"{s}.log",
                                                args.server_cpus))
        for url, proc in servers.values():
            wait_healthy(url, proc, args.startup_timeout)
        labels = list(servers)
        model = args.model or json.loads(urllib.request.urlopen(servers[labels[0]][0] + "/v1/models").read())[
            "data"][0]["id"]
        top = max(args.concurrency)
        for label in labels:   # warm-up: every server sees the prompts and its largest batch once
            loadgen.main(["--base-url", servers[label][0], "--model", model, "--num-prompts", str(top),
                          "--max-concurrency", str(top), "--no-progress"] + extra)
        for r in range(args.rounds):
            dest = args.out_dir / f"round{r}"
            dest.mkdir(exist_ok=True)
            for ci, conc in enumerate(args.concurrency):
                n = max(args.min_prompts, args.prompts_per_concurrency * conc)
                for label in cell_order(labels, ci + r):
                    res = loadgen.main(["--base-url", servers[label][0], "--model", model, "--num-prompts", str(n),
                                        "--max-concurrency", str(conc), "--label", label, "--no-progress",
                                        "--seed", str(r)] + extra)
                    res["commit"] = git_commit()
                    (dest / f"{label}_c{conc}.json").write_text(json.dumps(res))
                    print(f"round {r} c={conc} {label}: {res['metrics']['output_throughput']:.1f} tok/s", flush=True)
    finally:
        for _, proc in servers.values():
            if proc is not None:
                stop_server(proc)
    print(write_report(args.out_dir))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
