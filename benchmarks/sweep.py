"""The same closed-loop load under several settings at every concurrency, rounds interleaved; a
report that sets each setting beside the others, with standard errors paired by round, and plots.

    python -m benchmarks.sweep [--config configs/tiny.toml] [--settings none static2 adaptive]
        [--concurrency 1 4 16 64] [--rounds 3] [--in-process] [--out-dir benchmarks/out/sweep]
        -- --max-tokens 64 --ignore-eos --prompts-file benchmarks/data/heldout_prompts.jsonl
    python -m benchmarks.sweep --report benchmarks/out/sweep     # the report again, from the cells

Settings: `none` (no draft), `staticD` (chain depth D), `adaptive`, each served over HTTP by a
`specserve serve` of its own (the engine core in its own process); `thread` (adaptive, the
engine on a thread of the server: --engine-thread); `in_process` (the config's engine stepped by
this process, no HTTP: what HTTP costs). With `--in-process` every setting (adaptive, staticD)
runs in one engine in this process, switched between runs as /admin/speculation does, so that
one process's pace is common to all. With `--base-url LABEL=URL` (repeatable) the servers are
already running and nothing is started. Arguments after `--` describe the load (loadgen's: the
prompts, max tokens, EOS); in process a request joins as soon as one ends, like loadgen's
clients at --max-concurrency.

Each round runs every cell once, the settings' order rotated per concurrency and round, so a
slow spell of a shared machine does not land on one setting; every setting serves the load once
before the rounds. `--server-cpus`/`--client-cpus` keep servers and load generator on cores of
their own. The compiled forwards are built (or found cached) before anything is timed.
"""

from __future__ import annotations

import argparse
import json
import math
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
            "thread": "--spec-mode adaptive --engine-thread",
            **{f"static{d}": f"--spec-mode static --spec-depth {d}" for d in range(0, 9)}}
IN_PROCESS = "in_process"


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


class InProcess:
    """One engine stepped by this process: the load without HTTP, timed as loadgen times a stream
    (TTFT at the first new tokens, ITL between steps that bring some)."""

    def __init__(self, config: str | None, max_concurrency: int):
        from specserve import config as config_mod
        from specserve.engine import LLMEngine

        cfg = config_mod.load(config) if config else config_mod.default()
        cfg.scheduler.max_num_seqs = max(cfg.scheduler.max_num_seqs, max_concurrency)
        self.engine = LLMEngine(cfg, progress=False)
        self.default = self.engine.speculation()

    def set(self, setting: str) -> None:
        if setting == IN_PROCESS:   # the config's own setting
            if self.default["mode"] != "off":
                self.engine.set_speculation(self.default["mode"], self.default.get("depth"))
        elif setting == "adaptive":
            self.engine.set_speculation("adaptive")
        else:
            self.engine.set_speculation("static", int(setting.removeprefix("static")))

    def run(self, label: str, load: list[str]) -> dict:
        """loadgen's result for `load` (loadgen's arguments) served here."""
        from specserve.sampling import SamplingParams

        args = loadgen.make_parser().parse_args(["--model", IN_PROCESS, "--label", label] + load)
        prompts = [self.engine.tokenizer.encode(p) for p in loadgen.select_prompts(args)]
        params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, ignore_eos=args.ignore_eos)
        width = args.max_concurrency or len(prompts)
        self.set(label)
        queue, live, done = list(range(len(prompts))), {}, []
        self.engine.idle()
        t0 = time.perf_counter()
        while queue or live:
            while queue and len(live) < width:
                i = queue.pop(0)
                rid = f"sweep-{i}-{time.monotonic_ns()}"
                self.engine.add_request(rid, prompts[i], params)
                live[rid] = loadgen.RequestResult(start=time.perf_counter() - t0)
            for out in self.engine.step():
                r, now = live[out.request_id], time.perf_counter() - t0
                if out.new_token_ids:
                    if r.num_chunks == 0:
                        r.ttft = now - r.start
                    else:
                        r.itl.append(now - r.start - r.e2e)
                    r.num_chunks += 1
                    r.e2e = now - r.start   # so far: the last chunk; at the end, the whole request
                r.num_output_tokens = len(out.token_ids)
                if out.finished:
                    r.ok = True
                    done.append(live.pop(out.request_id))
        metrics = loadgen.compute_metrics(done, time.perf_counter() - t0, {})
        return {"config": vars(args), "metrics": metrics}


# -- the report --------------------------------------------------------------------------------

def load_cells(out_dir: Path) -> list[dict]:
    return [json.loads(p.read_text()) for p in sorted(out_dir.glob("round*/*.json"))]


def pooled(cells: list[dict]) -> dict[str, dict[int, dict]]:
    """setting -> concurrency -> tokens/s over every round (tokens / seconds), tokens/s of each
    round (by its seed), and the round with the median throughput (whose latencies the tables show)."""
    groups: dict[tuple[str, int], list[dict]] = {}
    for c in cells:
        groups.setdefault((c["config"]["label"], c["config"]["max_concurrency"]), []).append(c)
    out: dict[str, dict[int, dict]] = {}
    for (label, conc), runs in groups.items():
        tokens = sum(r["metrics"]["total_output_tokens"] for r in runs)
        seconds = sum(r["metrics"]["duration_s"] for r in runs)
        median = sorted(runs, key=lambda r: r["metrics"]["output_throughput"])[len(runs) // 2]
        out.setdefault(label, {})[conc] = {
            "tokens_per_s": tokens / seconds, "rounds": len(runs), "median": median,
            "per_round": {r["config"].get("seed"): r["metrics"]["output_throughput"] for r in runs}}
    return out


def paired_se(a: dict, b: dict) -> float | None:
    """The standard error of a's tokens/s over b's, from the ratios of the rounds both ran (None
    with fewer than two)."""
    ratios = [a[k] / b[k] for k in a if k in b and k is not None and b[k] > 0]
    if len(ratios) < 2:
        return None
    mean = sum(ratios) / len(ratios)
    return math.sqrt(sum((r - mean) ** 2 for r in ratios) / (len(ratios) - 1) / len(ratios))


def ratio(a: dict, b: dict) -> str:
    """a's pooled tokens/s over b's, with the paired standard error where there is one."""
    se = paired_se(a["per_round"], b["per_round"])
    return f"{a['tokens_per_s'] / b['tokens_per_s']:.3f}" + ("" if se is None else f" +- {se:.3f}")


def report(cells: list[dict]) -> str:
    pool = pooled(cells)
    concs = sorted({c for by in pool.values() for c in by})
    settings = sorted(pool, key=lambda s: (s != IN_PROCESS, s != "none", s != "adaptive", s))
    lines = ["Output tokens/s (pooled over rounds):", "",
             "| setting | " + " | ".join(f"c={c}" for c in concs) + " |", "|---" * (len(concs) + 1) + "|"]
    for s in settings:
        lines.append(f"| {s} | " + " | ".join(f"{pool[s][c]['tokens_per_s']:.0f}" if c in pool[s] else ""
                                              for c in concs) + " |")
    statics = [s for s in settings if s.startswith("static")]
    plain = "none" if "none" in pool else "static0" if "static0" in pool else None
    if "adaptive" in pool and statics:
        lines += ["", "| concurrency | best static | adaptive / best static | adaptive / plain | TTFT p50 ms "
                  "(adaptive) | ITL p50 ms (adaptive) |", "|---|---|---|---|---|---|"]
        for c in concs:
            have = [s for s in statics if c in pool[s]]
            if c not in pool["adaptive"] or not have:
                continue
            a = pool["adaptive"][c]
            best = max(have, key=lambda s: pool[s][c]["tokens_per_s"])
            m = a["median"]["metrics"]
            vs_plain = ratio(a, pool[plain][c]) if plain and c in pool[plain] else "n/a"
            lines.append(f"| {c} | {best} ({pool[best][c]['tokens_per_s']:.0f}) | {ratio(a, pool[best][c])} "
                         f"| {vs_plain} | {m['ttft_s']['median'] * 1e3:.1f} | {m['itl_s']['median'] * 1e3:.1f} |")
    if IN_PROCESS in pool and len(pool) > 1:
        lines += ["", "| concurrency | setting | tokens/s | / in process | TTFT p50 / p99 ms | ITL p50 / p99 ms |",
                  "|---|---|---|---|---|---|"]
        for c in concs:
            for s in settings:
                if c not in pool[s] or c not in pool[IN_PROCESS]:
                    continue
                m = pool[s][c]["median"]["metrics"]
                vs = "1" if s == IN_PROCESS else ratio(pool[s][c], pool[IN_PROCESS][c])
                lines.append(f"| {c} | {s} | {pool[s][c]['tokens_per_s']:.0f} | {vs}"
                             f" | {1e3 * m['ttft_s']['median']:.0f} / {1e3 * m['ttft_s']['p99']:.0f}"
                             f" | {1e3 * m['itl_s']['median']:.1f} / {1e3 * m['itl_s']['p99']:.1f} |")
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
    p.add_argument("--in-process", action="store_true", help="every setting in one engine in this process")
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
    local = args.settings if args.in_process else [s for s in args.settings if s == IN_PROCESS]
    for s in args.settings:
        if s not in SETTINGS and s != IN_PROCESS:
            p.error(f"unknown setting {s!r}; known: {', '.join(SETTINGS)}, {IN_PROCESS}")
        if args.in_process and not (s == "adaptive" or s.startswith("static")):
            p.error(f"--in-process runs adaptive and staticD in one engine, not {s!r}")
    if local and math.isfinite(loadgen.make_parser().parse_args(["--model", "m"] + extra).request_rate):
        p.error("in process the load is a closed loop: --request-rate does not apply")
    loadgen.pin_to_cpus(args.client_cpus)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    if not args.base_url or local:   # nothing started here runs a cell beside a compiler
        from specserve import config as config_mod
        from specserve.model import compiled

        compiled.build_for(config_mod.load(args.config) if args.config else config_mod.default())
    top = max(args.concurrency)
    servers: dict[str, tuple[str, subprocess.Popen | None]] = {}
    engine = InProcess(args.config, top) if local else None
    try:
        if args.base_url:
            for spec in args.base_url:
                label, _, url = spec.partition("=")
                servers[label] = (url.rstrip("/"), None)
        else:
            for i, s in enumerate(s for s in args.settings if s not in local):
                url = f"http://127.0.0.1:{args.port + i}"
                servers[s] = (url, start_server(s, args.config, args.port + i, args.out_dir / f"{s}.log",
                                                args.server_cpus))
        for url, proc in servers.values():
            wait_healthy(url, proc, args.startup_timeout)
        model = args.model or (json.loads(urllib.request.urlopen(next(iter(servers.values()))[0] + "/v1/models")
                                          .read())["data"][0]["id"] if servers else IN_PROCESS)

        def cell(label: str, load: list[str]) -> dict:
            if label in local:
                return engine.run(label, load + extra)
            return loadgen.main(["--base-url", servers[label][0], "--model", model, "--label", label] + load + extra)

        labels = list(servers) + local
        for label in labels:   # warm-up: every setting sees the prompts and its largest batch once
            cell(label, ["--num-prompts", str(top), "--max-concurrency", str(top), "--no-progress"])
        for r in range(args.rounds):
            dest = args.out_dir / f"round{r}"
            dest.mkdir(exist_ok=True)
            for ci, conc in enumerate(args.concurrency):
                n = max(args.min_prompts, args.prompts_per_concurrency * conc)
                for label in cell_order(labels, ci + r):
                    res = cell(label, ["--num-prompts", str(n), "--max-concurrency", str(conc), "--no-progress",
                                       "--seed", str(r)])
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
