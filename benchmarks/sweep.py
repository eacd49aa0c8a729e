"""Concurrency x setting sweep: for each setting start a server (or use a running one), run
the load generator at every concurrency, write a markdown table and plots.

    python -m benchmarks.sweep --model M --config configs/embedded.toml \\
        --server-cmd "specserve serve --config {config} --host 127.0.0.1 --port {port} {overrides}" \\
        --server-cpus 1 --client-cpus 0 --out-dir results/sweep -- --num-prompts 64 --max-tokens 128

Settings: ``none`` (no speculation), ``static1`` .. ``static6``, ``adaptive``. With
``--base-url`` (repeatable as ``label=url``) the servers are already running and nothing is
started. Extra arguments after ``--`` go to every loadgen run.

``--variant NAME REV`` adds a setting NAME: the adaptive controller as git revision REV has it
(exported to OUT/trees/NAME and served from there with benchmarks.serve_tree), to compare two
versions inside one sweep (interleaved, same rounds, same prompts) rather than across sweeps,
which on a shared machine differ by more than the change: ``sweep_report`` then sets each
variant beside adaptive.

``--one-process`` (with ``--interleave``) serves ``adaptive`` and every ``staticN`` from one
server process per round, started in adaptive mode with ``--admin-api``: before each of their
cells the sweep switches it with ``POST /admin/speculation`` (a static setting detaches the
controller, which neither plans nor learns until switched back). A process keeps a pace of its
own, and with a process per setting that pace is in every comparison between settings; in one
process it cancels. ``none`` (no draft at all) and the variants keep servers of their own.

``--knobs NAME:key=value[,key=value]`` (with ``--one-process``) adds a setting NAME served by
that same process: a copy of its adaptive controller with those AdaptiveController arguments
changed (benchmarks/serve_knobs.py), to compare controller settings without the pace of two
processes in the comparison.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tarfile
import time
import urllib.error
import urllib.request
from pathlib import Path

from benchmarks import loadgen, plots

CONCURRENCIES = (1, 2, 4, 8, 16, 32, 64)
SHARED = "shared"   # --one-process: the server adaptive and the static settings share
SETTINGS = {
    "none": "--draft-kind none",
    **{f"static{d}": f"--spec-mode static --spec-depth {d}" for d in range(1, 7)},
    "adaptive": "--spec-mode adaptive",
}


def _through(cmd: str, option: str, launcher: str) -> str:
    """The server command `cmd`, which must start with `specserve`, run by `python -m launcher`
    (a module that takes its own arguments, then specserve's)."""
    head, _, rest = cmd.strip().partition(" ")
    if head != "specserve":
        raise SystemExit(f"sweep: {option} needs a --server-cmd that starts with 'specserve', got {cmd!r}")
    return f"{shlex.quote(sys.executable)} -m {launcher} {rest}"


def variant_command(cmd: str, tree: Path) -> str:
    """The server command `cmd` run from source tree `tree` (benchmarks.serve_tree)."""
    return _through(cmd, "--variant", f"benchmarks.serve_tree {shlex.quote(str(tree))}")


def knobs_command(cmd: str, knobs: list[str]) -> str:
    """The server command `cmd` run with the knob settings `knobs` (benchmarks.serve_knobs)."""
    flags = " ".join(f"--knobs {shlex.quote(k)}" for k in knobs)
    return _through(cmd, "--knobs", f"benchmarks.serve_knobs {flags}")


def export_revision(rev: str, dest: Path) -> Path:
    """The files of git revision `rev` of this repository, written to `dest` (replaced)."""
    repo = Path(__file__).resolve().parents[1]
    found = subprocess.run(["git", "-C", str(repo), "rev-parse", "--verify", "--quiet", f"{rev}^{{commit}}"],
                           capture_output=True, text=True)
    if found.returncode != 0:
        raise SystemExit(f"sweep: --variant revision {rev!r} is not a commit of {repo}")
    if dest.exists():
        shutil.rmtree(dest)
    dest.mkdir(parents=True)
    archive = subprocess.run(["git", "-C", str(repo), "archive", "--format=tar", found.stdout.strip()],
                             capture_output=True, check=True).stdout
    with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
        tar.extractall(dest, filter="data")
    (dest / "REVISION").write_text(found.stdout)
    return dest


def _post_admin(base_url: str, path: str, body: dict, what: str) -> dict:
    """POST `body` to an admin route; an HTTP error becomes a RuntimeError saying `what` failed."""
    req = urllib.request.Request(base_url + path, data=json.dumps(body).encode(), method="POST",
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=30) as resp:
            return json.loads(resp.read())
    except urllib.error.HTTPError as e:
        raise RuntimeError(f"{what}: HTTP {e.code} {e.read().decode(errors='replace')}") from None


def switch_setting(base_url: str, setting: str) -> dict:
    """POST /admin/speculation on a server started with --admin-api: 'staticN', or 'adaptive' or
    a knob setting's name (served by benchmarks.serve_knobs)."""
    if setting.startswith("static") and setting[6:].isdigit():
        body = {"mode": "static", "depth": int(setting[6:])}
    else:
        body = {"mode": setting}
    return _post_admin(base_url, "/admin/speculation", body, f"switching {base_url} to {setting}")


def reset_prefix_cache(base_url: str) -> dict:
    """POST /admin/reset_prefix_cache on a server started with --admin-api (--cold-prompts)."""
    return _post_admin(base_url, "/admin/reset_prefix_cache", {},
                       f"resetting the prefix cache of {base_url} (--cold-prompts needs servers with "
                       "--admin-api, of a revision that has POST /admin/reset_prefix_cache)")


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
        time.sleep(0.5)
    raise RuntimeError(f"server at {base_url} not healthy after {timeout:.0f} s")


def start_server(template: str, config: str, port: int, overrides: str, log_path: Path,
                 cpus: str | None = None, tree: Path | None = None,
                 knobs: list[str] | None = None) -> subprocess.Popen:
    """cpus: run the server (every thread it starts) on these CPUs only (taskset syntax).
    tree: run the template's `specserve` command from this source tree (serve_tree).
    knobs: serve these knob settings beside adaptive (serve_knobs)."""
    cmd = template.format(config=config, port=port, overrides=overrides)
    if tree is not None:
        cmd = variant_command(cmd, tree)
    elif knobs:
        cmd = knobs_command(cmd, knobs)
    allowed = loadgen.parse_cpus(cpus) if cpus else None   # a bad list fails here, not in the child
    log = open(log_path, "w")
    # Own process group, so stopping it stops its children and nothing else. The affinity is
    # set in the child before it runs the command, so no thread of it starts elsewhere.
    return subprocess.Popen(shlex.split(cmd), stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                            preexec_fn=(lambda: os.sched_setaffinity(0, allowed)) if allowed else None)


def stop_server(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


# The most prompts of a prompts file the warm-up sends (every one of a smaller file).
WARMUP_MAX_PROMPTS = 512


def warmup_args(base_url: str, model: str, requests: int, concurrencies: list[int], extra: list[str]) -> list[str]:
    """loadgen arguments of a server's warm-up: at the sweep's largest concurrency, at least one
    request per unit of it (see warm_up in main), and with a prompts file every prompt of it (up
    to WARMUP_MAX_PROMPTS). A cell's prompts are a seeded draw from the file, the same for every
    setting of a round, and the prefix cache keeps what a server has seen: a prompt the sweep has
    not sent before is prefilled whole by the first setting to send it and from the cache by the
    others. A full sweep's first round sends the whole file by its 64-request cell, but in one
    over 16 and 32 requests the first setting of each cell prefilled up to 7x the prompt tokens of
    the others and ran up to 17% slower (the twenty-seventh session). With every prompt sent
    first, every cell finds them all cached."""
    top = max(concurrencies)
    n = max(requests, top)
    if "--prompts-file" in extra:
        i = extra.index("--prompts-file")
        if i + 1 < len(extra):
            n = max(n, min(WARMUP_MAX_PROMPTS, len(loadgen.load_prompts_file(extra[i + 1]))))
    return ["--base-url", base_url, "--model", model, "--num-prompts", str(n),
            "--max-concurrency", str(top), "--no-progress"] + extra


def cell_order(settings: list[str], index: int) -> list[str]:
    """The order of the settings' cells at one concurrency of one round (``index`` = concurrency
    position + round): the rows of a Williams square, so that over ``len(settings)`` indices
    each setting runs once in every place and right after every other setting once (twice over
    the 2n indices of an odd number n). The plain rotation this replaced kept every setting's
    neighbours for good: in the full sweeps adaptive always followed static6 in the server they
    share, and static3 static2, so whatever a cell leaves in the process (its KV blocks' order
    in the pool, the allocator's heap) reached one setting only; at 64 requests adaptive's
    depth-3 passes ran 3% dearer than static3's over 32 rounds (the forty-second session), and
    1.001x as dear over the 17 rounds of this order (s44a).
    The balance is within a row: with --one-process the settings served apart (none, the
    variants) run between the shared server's cells, and one concurrency's last cell always
    comes before the next one's first."""
    n = len(settings)
    if not n:
        return []
    base, lo, hi = [0], 1, n - 1   # 0, 1, n-1, 2, n-2, ...: for even n every step between cells once
    while len(base) < n:
        base.append(lo)
        lo += 1
        if len(base) < n:
            base.append(hi)
            hi -= 1
    row = index % (n if n % 2 == 0 else 2 * n)
    order = [(b + row % n) % n for b in base]
    if row >= n:   # odd n: the mirrored rows take the steps the first n repeat
        order.reverse()
    return [settings[i] for i in order]


def markdown_table(results: list[dict]) -> str:
    head = ("| setting | conc | req/s | out tok/s | TTFT p50 ms | TTFT p99 ms | ITL p50 ms | ITL p99 ms "
            "| TPOT p50 ms | mean acc. len |\n|---|---|---|---|---|---|---|---|---|---|")
    rows = []
    for r in results:
        m, acc = r["metrics"], r.get("acceptance") or {}
        mal = acc.get("mean_acceptance_length")
        rows.append(
            f"| {r['config'].get('label')} | {r['config'].get('max_concurrency')} "
            f"| {m['request_throughput']:.2f} | {m['output_throughput']:.1f} "
            f"| {m['ttft_s']['median']*1e3:.1f} | {m['ttft_s']['p99']*1e3:.1f} "
            f"| {m['itl_s']['median']*1e3:.1f} | {m['itl_s']['p99']*1e3:.1f} "
            f"| {m['tpot_s']['median']*1e3:.1f} | {'' if mal is None else f'{mal:.2f}'} |")
    return head + "\n" + "\n".join(rows) + "\n"


def main(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    extra = []
    if "--" in argv:
        i = argv.index("--")
        argv, extra = argv[:i], argv[i + 1:]
    p = argparse.ArgumentParser(prog="python -m benchmarks.sweep")
    p.add_argument("--model", required=True)
    p.add_argument("--config", default="")
    # One intra-op thread: the load generator shares this machine, and a 2-thread torch on a
    # 2-core box stalls whenever the client runs (timings then swing 10x).
    p.add_argument("--server-cmd", default="specserve serve --config {config} --host 127.0.0.1 "
                                             "--port {port} --cpu-threads 1 {overrides}")
    p.add_argument("--warmup-requests", type=int, default=8,
                   help="requests sent to each server before the measured runs (not recorded), at least "
                        "one per unit of the largest concurrency, sent at that concurrency")
    p.add_argument("--cold-prompts", action="store_true",
                   help="empty each server's prefix cache before every cell (POST /admin/reset_prefix_cache; "
                        "the servers the sweep starts get --admin-api): every cell prefills its prompts "
                        "whole, as distinct users' prompts are, instead of finding the ones an earlier "
                        "cell sent cached")
    p.add_argument("--base-url", action="append", default=[], metavar="LABEL=URL",
                   help="use an already running server per setting instead of starting one")
    p.add_argument("--port", type=int, default=8765)
    p.add_argument("--settings", nargs="*", default=list(SETTINGS),
                   help=f"of {', '.join(SETTINGS)}, and the --variant names (default: all of them)")
    p.add_argument("--variant", nargs=2, action="append", default=[], metavar=("NAME", "REV"),
                   help="also run setting NAME: the adaptive controller of git revision REV (exported to "
                        "OUT/trees/NAME); repeatable. Compares two versions inside one sweep")
    p.add_argument("--knobs", action="append", default=[], metavar="NAME:KEY=VALUE[,KEY=VALUE]",
                   help="with --one-process: also run setting NAME, the shared process's adaptive controller "
                        "with these AdaptiveController arguments changed (benchmarks/serve_knobs.py); "
                        "repeatable")
    p.add_argument("--concurrency", nargs="*", type=int, default=list(CONCURRENCIES))
    p.add_argument("--prompts-per-concurrency", type=int, default=4,
                   help="num prompts = max(--min-prompts, this x concurrency) unless --num-prompts is passed after --")
    p.add_argument("--min-prompts", type=int, default=16,
                   help="fewest prompts per cell: low concurrencies finish a handful of prompts in a few "
                        "seconds, too short a run to compare settings a few percent apart")
    p.add_argument("--startup-timeout", type=float, default=600.0)
    p.add_argument("--interleave", action="store_true",
                   help="start every setting's server at once (ports --port, --port + 1, ...) and run the "
                        "settings one after another at each concurrency, in an order that changes with the "
                        "concurrency and round (cell_order: each setting in every place and after every "
                        "other setting alike): a slow spell of the machine then hits every setting "
                        "alike instead of whichever setting's turn it was")
    p.add_argument("--rounds", type=int, default=1,
                   help="with --interleave: repeat the whole schedule, each round with its own prompt draw "
                        "(loadgen --seed i); round i is written to OUT/round{i} (aggregate with "
                        "benchmarks.sweep_report)")
    p.add_argument("--restart-per-round", action="store_true",
                   help="with --interleave --rounds: fresh servers for every round. A server process keeps "
                        "its own pace for life: four identical static-depth-3 servers on the dev CPU ran "
                        "883-935 tok/s at 4 requests over four rounds, the slowest the slowest every round; "
                        "kept across rounds, that offset is in every round of a setting, and the best of "
                        "six static settings is partly the luckiest process")
    p.add_argument("--one-process", action="store_true",
                   help="with --interleave: serve adaptive and the static depths from one server process per "
                        "round, switched before each cell by POST /admin/speculation, so that the pace of a "
                        "process (which differs between identical processes by more than neighbouring depths "
                        "differ) is the same for all of them; none and variants keep their own servers")
    p.add_argument("--server-cpus", metavar="CPUS",
                   help="run the servers on these CPUs only (taskset syntax, e.g. 1 or 2-15; Linux)")
    p.add_argument("--client-cpus", metavar="CPUS",
                   help="run the load generator (this process) on these CPUs only. With --server-cpus "
                        "disjoint from it, server and client stop trading cores: on the 2-core dev CPU "
                        "that took the difference between two identical servers at 64 requests from "
                        "up to 20%% to 3-7%%")
    p.add_argument("--step-logs", action="store_true",
                   help="each server started writes a step log (specserve serve --step-log) to "
                        "OUT/steps_SETTING[_roundI].jsonl; summarise with benchmarks.step_report")
    p.add_argument("--out-dir", default="results/sweep")
    args = p.parse_args(argv)
    loadgen.pin_to_cpus(args.client_cpus)
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    running = dict(s.split("=", 1) for s in args.base_url)
    variants = dict(args.variant)
    knobs = {k.partition(":")[0]: k for k in args.knobs}
    if knobs and not args.one_process:
        p.error("--knobs needs --one-process (the knob settings are controllers inside the shared process)")
    for name in [*variants, *knobs]:
        if (name in SETTINGS or name == SHARED or not name.replace("_", "").replace("-", "").isalnum()
                or name.startswith("static")):
            p.error(f"--variant or --knobs name {name!r} must be a word of its own (not a setting, not static..., not "
                    f"{SHARED!r})")
    if len(variants) + len(knobs) != len({*variants, *knobs}) or len(knobs) != len(args.knobs):
        p.error("each --variant and --knobs name must be different")
    settings = list(running) if running else list(dict.fromkeys(
        args.settings + [v for v in [*variants, *knobs] if "--settings" not in argv]))
    unknown = [s for s in settings if s not in SETTINGS and s not in variants and s not in knobs and s not in running]
    if unknown:
        p.error(f"unknown setting(s) {', '.join(unknown)}; choose from {', '.join([*SETTINGS, *variants, *knobs])}")
    trees = {name: export_revision(rev, out / "trees" / name) for name, rev in variants.items() if name in settings}
    if args.one_process and not args.interleave:
        p.error("--one-process needs --interleave (one server serves several settings in turn)")
    if args.one_process and running:
        p.error("--one-process starts its servers itself; it does not take --base-url")
    # The settings one shared server switches between (--one-process), and the server each
    # setting is served by: its own name, or SHARED.
    shared = ([s for s in settings if s == "adaptive" or s.startswith("static") or s in knobs]
              if args.one_process else [])
    server_of = {s: (SHARED if s in shared else s) for s in settings}

    def overrides(setting: str, suffix: str = "") -> str:
        if setting == SHARED:
            flags = SETTINGS["adaptive"] + " --admin-api"
        else:
            flags = SETTINGS.get(setting, SETTINGS["adaptive"])   # a variant: its own adaptive controller
            if args.cold_prompts:
                flags += " --admin-api"
        if args.step_logs:
            flags += " --step-log " + shlex.quote(str((out / f"steps_{setting}{suffix}.jsonl").resolve()))
        return flags

    def run_cell(setting: str, base: str, conc: int, dest: Path, round_index: int = 0) -> dict:
        lg = ["--base-url", base, "--model", args.model, "--max-concurrency", str(conc),
              "--label", setting, "--out", str(dest / f"{setting}_c{conc}.json"), "--scrape-interval", "0.5"]
        if args.client_cpus:   # already pinned; passed on so that the result file records it
            lg += ["--cpus", args.client_cpus]
        if "--seed" not in extra:
            # Each round draws its own prompts: re-sending a round's prompts would hit the
            # prefix cache and make later rounds a different workload from the first.
            lg += ["--seed", str(round_index)]
        if "--num-prompts" not in extra:
            lg += ["--num-prompts", str(max(args.min_prompts, args.prompts_per_concurrency * conc))]
        print(f"== {setting} concurrency {conc}", file=sys.stderr)
        if setting in shared:
            switch_setting(base, setting)
        if args.cold_prompts:
            reset_prefix_cache(base)
        return loadgen.main(lg + extra)

    def warm_up(setting: str, base: str) -> None:
        # The first requests pay one-off costs (allocator, caches), and a process's first pass at
        # a size touches that much memory for the first time: warmed at 4 requests only, fresh
        # servers ran each round's 16- and 32-request cells cold, speculation (more rows per
        # pass) the more so, and plain decoding came out ahead of every static depth at 32
        # requests. So the warm-up runs at the sweep's largest concurrency.
        if args.warmup_requests:
            print(f"== {setting} warm-up", file=sys.stderr)
            loadgen.main(warmup_args(base, args.model, args.warmup_requests, args.concurrency, extra))

    def finish(results: list[dict], dest: Path) -> None:
        (dest / "summary.md").write_text(markdown_table(results))
        (dest / "all_results.json").write_text(json.dumps(results, indent=1))
        for path in plots.make_all(results, dest):
            print(path)
        print(dest / "summary.md")

    if args.interleave:
        procs, bases = [], {}

        def start_all(round_index: int) -> None:
            # One server at a time: each calibrates its controller's cost model at start-up, and
            # eight servers loading and calibrating at once on a small machine would hand the
            # adaptive one a cost curve measured under contention (its shape, deep against
            # shallow, is what the online measurements scale; the fifth session's sweeps had
            # adaptive at depth ~3 where alone it runs 4-6).
            suffix = f"_round{round_index}" if args.restart_per_round else ""
            servers = list(dict.fromkeys(server_of[s] for s in settings))
            for i, server in enumerate(servers):
                bases[server] = running.get(server)
                if bases[server] is None:
                    port = args.port + i
                    bases[server] = f"http://127.0.0.1:{port}"
                    procs.append(start_server(args.server_cmd, args.config, port, overrides(server, suffix),
                                              out / f"server_{server}{suffix}.log", args.server_cpus,
                                              trees.get(server),
                                              knobs=[knobs[s] for s in settings if s in knobs] if server == SHARED else None))
                    wait_healthy(bases[server], procs[-1], args.startup_timeout)
            for server in servers:
                wait_healthy(bases[server], None, args.startup_timeout)
                if server == SHARED:
                    switch_setting(bases[server], "adaptive")   # warmed up as a server in adaptive mode is
                warm_up(server, bases[server])
            for setting in settings:
                bases[setting] = bases[server_of[setting]]

        try:
            for r in range(args.rounds):
                if r == 0 or args.restart_per_round:
                    while procs:
                        stop_server(procs.pop())
                    start_all(r)
                dest = out / f"round{r}" if args.rounds > 1 else out
                dest.mkdir(parents=True, exist_ok=True)
                results = []
                for j, conc in enumerate(args.concurrency):
                    for setting in cell_order(settings, j + r):
                        results.append(run_cell(setting, bases[setting], conc, dest, r))
                finish(results, dest)
        finally:
            for proc in procs:
                stop_server(proc)
        return

    results = []
    for setting in settings:
        proc = None
        base = running.get(setting)
        if base is None:
            base = f"http://127.0.0.1:{args.port}"
            proc = start_server(args.server_cmd, args.config, args.port, overrides(setting),
                                out / f"server_{setting}.log", args.server_cpus, trees.get(setting))
        try:
            wait_healthy(base, proc, args.startup_timeout)
            warm_up(setting, base)
            for conc in args.concurrency:
                results.append(run_cell(setting, base, conc, out))
        finally:
            if proc is not None:
                stop_server(proc)
    finish(results, out)

if __name__ == "__main__":
    main()
