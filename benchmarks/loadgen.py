"""Latency benchmark client for any OpenAI-compatible server (streaming SSE over HTTP).

Per request it measures TTFT (time to the first content chunk), every inter-token latency
(ITL, between consecutive content chunks), TPOT = (e2e - ttft) / (n_out - 1), end-to-end
latency, and the output token count from the server's usage chunk
(``stream_options.include_usage``), compared with the number of content chunks: a
speculative server may send several tokens in one chunk, so ITL is then per chunk while
TPOT stays per token.

    python -m benchmarks.loadgen --base-url http://127.0.0.1:8000 --model M --num-prompts 200 \\
        --max-concurrency 16 --request-rate 8 --burstiness 1 --max-tokens 128 --out results.json

Arrivals: all at once (``--request-rate inf``) or a gamma process with mean rate R; the
shape ``--burstiness`` K gives inter-arrival CV = 1/sqrt(K) (K = 1: Poisson; K < 1 burstier).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import aiohttp
import numpy as np

from benchmarks.runinfo import git_commit

SPEC_COUNTERS = {
    "specserve_spec_num_drafts_total": "num_drafts",
    "specserve_spec_num_draft_tokens_total": "num_draft_tokens",
    "specserve_spec_num_accepted_tokens_total": "num_accepted_tokens",
}
PER_POSITION = "specserve_spec_accepted_per_position_total"
DEPTH_GAUGE = "specserve_spec_depth"


# ------------------------------------------------------------------------- prompts
_WORDS = ("the of and to in is was for on that with as by at from his her they which an be this "
          "time river light stone winter city music garden letter morning paper table window road "
          "under over after before between quickly slowly bright quiet ancient simple open").split()


def random_prompts(n: int, min_words: int, max_words: int, rng: random.Random) -> list[str]:
    """n prompts of uniformly random length in words (token-ish: common short words)."""
    if not 1 <= min_words <= max_words:
        raise ValueError(f"need 1 <= min_words <= max_words, got {min_words}, {max_words}")
    return [" ".join(rng.choice(_WORDS) for _ in range(rng.randint(min_words, max_words)))
            for _ in range(n)]


def load_prompts_file(path: str | Path) -> list[str]:
    """One JSON string per line; a directory means every *.jsonl / *.txt file in it, sorted."""
    path = Path(path)
    files = sorted(p for p in path.iterdir() if p.suffix in (".jsonl", ".txt")) if path.is_dir() else [path]
    prompts = []
    for f in files:
        for lineno, line in enumerate(f.read_text(encoding="utf-8").splitlines(), 1):
            if not line.strip():
                continue
            value = json.loads(line)
            if not isinstance(value, str):
                raise ValueError(f"{f}:{lineno}: expected a JSON string per line, got {type(value).__name__}")
            prompts.append(value)
    if not prompts:
        raise ValueError(f"no prompts found in {path}")
    return prompts


def load_sharegpt(path: str | Path) -> list[str]:
    """First human turn of every ShareGPT conversation ([{"conversations": [{"from", "value"}]}])."""
    data = json.loads(Path(path).read_text(encoding="utf-8"))
    prompts = []
    for item in data:
        for turn in item.get("conversations", []):
            if turn.get("from") in ("human", "user") and turn.get("value"):
                prompts.append(turn["value"])
                break
    if not prompts:
        raise ValueError(f"no human turns found in ShareGPT file {path}")
    return prompts


# ------------------------------------------------------------------------- arrivals
def arrival_delays(n: int, request_rate: float, burstiness: float, rng: random.Random) -> list[float]:
    """Inter-arrival gaps in seconds: gamma(shape=K, scale=1/(R*K)), mean 1/R, CV 1/sqrt(K);
    all zero when R is infinite (every request at once)."""
    if burstiness <= 0:
        raise ValueError(f"burstiness must be > 0, got {burstiness}")
    if math.isinf(request_rate):
        return [0.0] * n
    if request_rate <= 0:
        raise ValueError(f"request rate must be > 0 (or inf), got {request_rate}")
    theta = 1.0 / (request_rate * burstiness)
    return [rng.gammavariate(burstiness, theta) for _ in range(n)]


# ------------------------------------------------------------------------- statistics
@dataclass
class RequestResult:
    ok: bool = False
    error: str = ""
    start: float = 0.0                 # seconds since the benchmark started
    ttft: float = 0.0
    e2e: float = 0.0
    itl: list[float] = field(default_factory=list)   # gaps between content chunks
    num_output_tokens: int = 0         # from the usage chunk, else the content chunk count
    num_chunks: int = 0                # content chunks received
    usage_reported: bool = False
    text: str = ""

    @property
    def tpot(self) -> float | None:
        if self.num_output_tokens < 2:
            return None
        return (self.e2e - self.ttft) / (self.num_output_tokens - 1)


def summarize(values) -> dict:
    """mean, median, p90, p99 (numpy linear percentiles); zeros for no data."""
    v = np.asarray([x for x in values if x is not None], dtype=float)
    if v.size == 0:
        return {"mean": 0.0, "median": 0.0, "p90": 0.0, "p99": 0.0, "count": 0}
    return {"mean": float(v.mean()), "median": float(np.percentile(v, 50)),
            "p90": float(np.percentile(v, 90)), "p99": float(np.percentile(v, 99)), "count": int(v.size)}


def parse_goodput(specs: list[str] | None) -> dict[str, float]:
    """['ttft:500', 'tpot:50'] -> {'ttft': 0.5, 'tpot': 0.05} (milliseconds in, seconds out)."""
    targets = {}
    for spec in specs or []:
        key, _, ms = spec.partition(":")
        if key not in ("ttft", "tpot", "e2e") or not ms:
            raise ValueError(f"goodput target must be ttft:MS, tpot:MS or e2e:MS, got {spec!r}")
        targets[key] = float(ms) / 1000.0
    return targets


def meets(r: RequestResult, targets: dict[str, float]) -> bool:
    if not r.ok:
        return False
    if "ttft" in targets and r.ttft > targets["ttft"]:
        return False
    if "tpot" in targets and r.tpot is not None and r.tpot > targets["tpot"]:
        return False
    if "e2e" in targets and r.e2e > targets["e2e"]:
        return False
    return True


def compute_metrics(results: list[RequestResult], duration: float, targets: dict[str, float]) -> dict:
    ok = [r for r in results if r.ok]
    out_tokens = sum(r.num_output_tokens for r in ok)
    return {
        "num_requests": len(results),
        "num_completed": len(ok),
        "num_failed": len(results) - len(ok),
        "duration_s": duration,
        "request_throughput": len(ok) / duration if duration > 0 else 0.0,
        "output_throughput": out_tokens / duration if duration > 0 else 0.0,
        "total_output_tokens": out_tokens,
        "ttft_s": summarize(r.ttft for r in ok),
        "tpot_s": summarize(r.tpot for r in ok),
        "itl_s": summarize(x for r in ok for x in r.itl),
        "e2e_s": summarize(r.e2e for r in ok),
        "output_tokens": summarize(r.num_output_tokens for r in ok),
        "tokens_per_chunk": (out_tokens / max(1, sum(r.num_chunks for r in ok))),
        "usage_mismatches": sum(1 for r in ok if r.usage_reported and r.num_chunks > r.num_output_tokens),
        "goodput_targets_s": targets,
        "goodput_requests_per_s": (sum(meets(r, targets) for r in results) / duration
                                   if targets and duration > 0 else None),
    }


# ------------------------------------------------------------------------- server metrics
def parse_spec_metrics(text: str) -> dict:
    """Speculative counters from Prometheus text; missing ones are absent (other engines)."""
    from prometheus_client.parser import text_string_to_metric_families

    out: dict = {}
    per_position: dict[int, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name in SPEC_COUNTERS:
                out[SPEC_COUNTERS[s.name]] = out.get(SPEC_COUNTERS[s.name], 0.0) + s.value
            elif s.name == PER_POSITION and "position" in s.labels:
                k = int(s.labels["position"])
                per_position[k] = per_position.get(k, 0.0) + s.value
            elif s.name == DEPTH_GAUGE:
                out["depth"] = s.value
    if per_position:
        out["accepted_per_position"] = per_position
    return out


def acceptance_figures(before: dict, after: dict) -> dict:
    """Differences of the counters over the run: acceptance rate, mean accepted length
    (accepted per draft + the bonus token), acceptance per position."""
    d = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in SPEC_COUNTERS.values() if k in after}
    if not d:
        return {}
    out = dict(d)
    if d.get("num_draft_tokens"):
        out["acceptance_rate"] = d["num_accepted_tokens"] / d["num_draft_tokens"]
    if d.get("num_drafts"):
        out["mean_acceptance_length"] = 1.0 + d["num_accepted_tokens"] / d["num_drafts"]
        pa, pb = after.get("accepted_per_position", {}), before.get("accepted_per_position", {})
        out["acceptance_per_position"] = {
            str(k): (pa[k] - pb.get(k, 0.0)) / d["num_drafts"] for k in sorted(pa)}
    return out


async def scrape(session: aiohttp.ClientSession, base_url: str) -> dict:
    try:
        async with session.get(base_url + "/metrics", timeout=aiohttp.ClientTimeout(total=10)) as resp:
            if resp.status != 200:
                return {}
            return parse_spec_metrics(await resp.text())
    except (aiohttp.ClientError, asyncio.TimeoutError, ValueError):
        return {}


# ------------------------------------------------------------------------- one request
def build_payload(endpoint: str, model: str, prompt: str, max_tokens: int, temperature: float,
                  ignore_eos: bool) -> dict:
    payload = {"model": model, "max_tokens": max_tokens, "temperature": temperature, "stream": True,
               "stream_options": {"include_usage": True}}
    if ignore_eos:
        payload["ignore_eos"] = True
    if endpoint == "chat":
        payload["messages"] = [{"role": "user", "content": prompt}]
    else:
        payload["prompt"] = prompt
    return payload


async def stream_request(session: aiohttp.ClientSession, url: str, payload: dict,
                         t0: float) -> RequestResult:
    """POST a streaming request and time its SSE events (``data: <json>`` lines)."""
    r = RequestResult()
    start = time.perf_counter()
    r.start = start - t0
    last = start
    parts = []
    try:
        async with session.post(url, json=payload) as resp:
            if resp.status != 200:
                r.error = f"HTTP {resp.status}: {(await resp.text())[:500]}"
                return r
            buf = b""
            done = False
            async for data in resp.content.iter_any():
                buf += data
                while b"\n" in buf and not done:
                    line, buf = buf.split(b"\n", 1)
                    line = line.strip()
                    if not line.startswith(b"data:"):
                        continue
                    body = line[5:].strip()
                    if body == b"[DONE]":
                        done = True
                        break
                    chunk = json.loads(body)
                    now = time.perf_counter()
                    if chunk.get("usage"):
                        r.num_output_tokens = int(chunk["usage"].get("completion_tokens", 0))
                        r.usage_reported = True
                    for choice in chunk.get("choices") or []:
                        text = choice.get("text")
                        if text is None:
                            text = (choice.get("delta") or {}).get("content")
                        if not text:
                            continue
                        if r.num_chunks == 0:
                            r.ttft = now - start
                        else:
                            r.itl.append(now - last)
                        last = now
                        r.num_chunks += 1
                        parts.append(text)
                if done:
                    break
        r.e2e = time.perf_counter() - start   # to the end of the stream
        if not r.usage_reported:
            r.num_output_tokens = r.num_chunks
        r.text = "".join(parts)
        r.ok = r.num_chunks > 0 or (done and r.usage_reported)
        if not r.ok:
            r.error = "stream ended without content"
    except (aiohttp.ClientError, asyncio.TimeoutError, json.JSONDecodeError) as e:
        r.error = f"{type(e).__name__}: {e}"
    return r


# ------------------------------------------------------------------------- the run
async def run_benchmark(args: argparse.Namespace, prompts: list[str]) -> dict:
    from tqdm.asyncio import tqdm

    endpoint = "chat" if args.endpoint == "chat" else "completions"
    url = args.base_url.rstrip("/") + ("/v1/chat/completions" if endpoint == "chat" else "/v1/completions")
    rng = random.Random(args.seed)
    delays = arrival_delays(len(prompts), args.request_rate, args.burstiness, rng)
    sem = asyncio.Semaphore(args.max_concurrency) if args.max_concurrency else None
    timeout = aiohttp.ClientTimeout(total=args.timeout)
    connector = aiohttp.TCPConnector(limit=0)
    depth_series: list[tuple[float, float]] = []
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:
        before = await scrape(session, args.base_url.rstrip("/"))
        pbar = tqdm(total=len(prompts), disable=args.no_progress, desc="requests")
        t0, started_at = time.perf_counter(), time.time()
        stop = asyncio.Event()

        async def scraper():
            while not stop.is_set():
                m = await scrape(session, args.base_url.rstrip("/"))
                if "depth" in m:
                    depth_series.append((time.perf_counter() - t0, m["depth"]))
                try:
                    await asyncio.wait_for(stop.wait(), args.scrape_interval)
                except asyncio.TimeoutError:
                    pass

        async def one(prompt: str) -> RequestResult:
            payload = build_payload(endpoint, args.model, prompt, args.max_tokens, args.temperature,
                                    args.ignore_eos)
            if sem is None:
                res = await stream_request(session, url, payload, t0)
            else:
                async with sem:
                    res = await stream_request(session, url, payload, t0)
            pbar.update(1)
            return res

        scrape_task = asyncio.create_task(scraper()) if args.scrape_interval > 0 else None
        tasks = []
        for prompt, gap in zip(prompts, delays):
            if gap > 0:
                await asyncio.sleep(gap)
            tasks.append(asyncio.create_task(one(prompt)))
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - t0
        stop.set()
        if scrape_task:
            await scrape_task
        pbar.close()
        after = await scrape(session, args.base_url.rstrip("/"))
    out = {
        "config": {k: (str(v) if isinstance(v, float) and math.isinf(v) else v) for k, v in vars(args).items()},
        "commit": git_commit(),
        # Wall-clock bounds of the measured run, to find its steps in a server's step log.
        "started_at": started_at, "finished_at": started_at + duration,
        "metrics": compute_metrics(results, duration, parse_goodput(args.goodput)),
        "acceptance": acceptance_figures(before, after),
        "depth_series": depth_series,
        "errors": sorted({r.error for r in results if not r.ok})[:20],
    }
    if args.save_requests:
        out["requests"] = [{k: v for k, v in asdict(r).items() if k != "text"} for r in results]
    return out


def format_summary(res: dict) -> str:
    m = res["metrics"]
    lines = [f"requests: {m['num_completed']}/{m['num_requests']} ok in {m['duration_s']:.2f} s",
             f"request throughput: {m['request_throughput']:.2f} req/s, "
             f"output: {m['output_throughput']:.1f} tok/s"]
    for key in ("ttft_s", "tpot_s", "itl_s", "e2e_s"):
        s = m[key]
        lines.append(f"{key[:-2]:>5} ms: mean {s['mean']*1e3:8.2f}  median {s['median']*1e3:8.2f}  "
                     f"p90 {s['p90']*1e3:8.2f}  p99 {s['p99']*1e3:8.2f}")
    if m["goodput_requests_per_s"] is not None:
        lines.append(f"goodput: {m['goodput_requests_per_s']:.2f} req/s meeting {m['goodput_targets_s']}")
    acc = res.get("acceptance") or {}
    if "mean_acceptance_length" in acc:
        lines.append(f"mean acceptance length: {acc['mean_acceptance_length']:.3f}, "
                     f"acceptance rate: {acc.get('acceptance_rate', 0):.3f}")
    return "\n".join(lines)


def parse_cpus(spec: str) -> set[int]:
    """A CPU list as taskset takes it: "0", "2,3", "0-3,6" -> {0, ...}."""
    cpus: set[int] = set()
    try:
        for part in spec.split(","):
            lo, _, hi = part.strip().partition("-")
            cpus.update(range(int(lo), int(hi or lo) + 1))
    except ValueError:
        raise ValueError(f"not a CPU list: {spec!r} (expected e.g. 0 or 0-3,6)") from None
    if not cpus:
        raise ValueError(f"not a CPU list: {spec!r}")
    return cpus


def pin_to_cpus(spec: str | None, pid: int = 0) -> None:
    """Run `pid` (0: this process, and the threads it starts from now on) on the CPUs of
    `spec` only. On a small machine the load generator and the server under test otherwise
    trade cores at the scheduler's whim: on the dev CPU (2 cores), two identical servers timed
    one after the other differed by up to 20% at 64 requests, and by 3-7% with the server
    and the client each on a core of its own (benchmarks/RESULTS.md)."""
    if spec:
        os.sched_setaffinity(pid, parse_cpus(spec))


def make_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m benchmarks.loadgen", description=__doc__.splitlines()[0])
    p.add_argument("--base-url", default="http://127.0.0.1:8000")
    p.add_argument("--model", required=True)
    p.add_argument("--endpoint", choices=["completions", "chat"], default="completions")
    p.add_argument("--num-prompts", type=int, default=100)
    p.add_argument("--max-concurrency", type=int, default=0, help="0 = unlimited")
    p.add_argument("--request-rate", type=float, default=math.inf, help="requests/s; inf = all at once")
    p.add_argument("--burstiness", type=float, default=1.0, help="gamma shape; 1 = Poisson")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--ignore-eos", action="store_true")
    p.add_argument("--prompts-file", help="one JSON string per line (file or directory)")
    p.add_argument("--sharegpt", help="ShareGPT-format JSON file")
    p.add_argument("--min-words", type=int, default=16)
    p.add_argument("--max-words", type=int, default=256)
    p.add_argument("--goodput", nargs="*", metavar="KEY:MS", help="e.g. ttft:500 tpot:50")
    p.add_argument("--scrape-interval", type=float, default=0.0, help="seconds between /metrics scrapes; 0 = off")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=600.0, help="per-request total timeout, seconds")
    p.add_argument("--out", help="JSON result file")
    p.add_argument("--label", default="", help="setting name stored in the result (plots group by it)")
    p.add_argument("--save-requests", action="store_true", help="keep per-request timings in the JSON")
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--cpus", help="run the client on these CPUs only (taskset syntax, e.g. 0 or 0-3; Linux), "
                                  "so that it does not take the cores of the server under test")
    return p


def select_prompts(args: argparse.Namespace) -> list[str]:
    rng = random.Random(args.seed)
    if args.prompts_file:
        pool = load_prompts_file(args.prompts_file)
    elif args.sharegpt:
        pool = load_sharegpt(args.sharegpt)
    else:
        return random_prompts(args.num_prompts, args.min_words, args.max_words, rng)
    return [pool[i % len(pool)] for i in range(args.num_prompts)] if len(pool) < args.num_prompts \
        else rng.sample(pool, args.num_prompts)


def main(argv: list[str] | None = None) -> dict:
    args = make_parser().parse_args(argv)
    pin_to_cpus(args.cpus)
    res = asyncio.run(run_benchmark(args, select_prompts(args)))
    print(format_summary(res), file=sys.stderr)
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        Path(args.out).write_text(json.dumps(res, indent=2))
    return res


if __name__ == "__main__":
    main()
