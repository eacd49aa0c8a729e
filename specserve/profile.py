"""The controller's first capacity curve: a cached profile of the same setup, or a probe.

A probe times bare forwards of dummy sequences: the target's verify pass for every batch
bucket (powers of two up to max_num_seqs) at a few row counts per sequence, and one draft
level per bucket. It takes a few seconds; the controller learns the rest online from the
steps it serves. Its dummy rows write no KV (slot -1), so a probe never touches a sequence's
cache. `specserve calibrate` runs a longer probe (every row count, five runs each) and keeps it
in the user's cache directory, keyed by everything that changes the costs: the checkpoints,
device, dtype, threads and this code's version. A profile that is missing, stale or
unreadable is ignored (and said so), never fatal.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import platform
import random
import time
from pathlib import Path

import torch

import specserve
from specserve.controller import CapacityCurve
from specserve.runner import ForwardInput

logger = logging.getLogger("specserve")

FORMAT = 1   # bump when what a profile measures changes


def cache_dir() -> Path:
    base = os.environ.get("SPECSERVE_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "specserve")
    return Path(base) / "profiles"


def _checkpoint_id(path: str | None) -> list | None:
    if path is None:
        return None
    files = sorted(Path(path).glob("*.safetensors"))
    return [str(Path(path).resolve())] + [[f.name, f.stat().st_size, int(f.stat().st_mtime)] for f in files]


def profile_key(engine, buckets: list[int], max_rows: int) -> dict:
    cfg = engine.config
    dev = engine.device
    device = (torch.cuda.get_device_name(dev) if dev.type == "cuda"
              else f"cpu:{platform.processor() or platform.machine()}")
    return {
        "format": FORMAT, "version": specserve.__version__,
        "target": _checkpoint_id(cfg.target.path),
        "draft": _checkpoint_id(cfg.draft.path) if cfg.draft.kind == "model" else cfg.draft.kind,
        "dtype": str(engine.target.model.dtype), "device": device, "threads": torch.get_num_threads(),
        "draft_dtype": str(engine.draft.model.dtype) if engine.draft is not None else None,
        "onednn": [r is not None and any("onednn" in m.__dict__ for m in r.model.modules())
                   for r in (engine.target, engine.draft)],
        # the package each model runs (its name keys the code it was compiled from), else None
        "compiled": [None if r is None or r.compiled is None else r.compiled.name
                     for r in (engine.target, engine.draft)],
        "block_size": engine.pool.block_size,
        "buckets": buckets, "max_rows": max_rows,
    }


def _path(key: dict) -> Path:
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:20]
    return cache_dir() / f"{digest}.json"


def load(key: dict) -> CapacityCurve | None:
    path = _path(key)
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text())
        if data["key"] != key:
            raise ValueError("written for another setup")
        c = data["curve"]
        curve = CapacityCurve(c["buckets"], c["verify_s"], c["level_s"], c.get("rest_s"), c["context"],
                              c["context_s"])
        if curve.max_rows != key["max_rows"] or curve.buckets != key["buckets"]:
            raise ValueError("its table has another shape")
        n = len(key["buckets"])
        if (any(len(row) != key["max_rows"] for row in c["verify_s"])
                or len(c["level_s"]) != n or len(c["context_s"]) != n or any(len(x) != 2 for x in c["context_s"])
                or (c.get("rest_s") is not None and len(c["rest_s"]) != n)):
            raise ValueError("its table has another shape")
        if not all(x > 0 and math.isfinite(x) for row in c["verify_s"] for x in row):
            raise ValueError("it holds non-positive times")
        others = [*c["level_s"], *(c.get("rest_s") or []), *(x for pair in c["context_s"] for x in pair)]
        if not all(isinstance(x, (int, float)) and math.isfinite(x) and x >= 0 for x in others):
            raise ValueError("it holds negative or non-finite times")
        return curve
    except (OSError, ValueError, KeyError, TypeError, AssertionError, IndexError) as e:
        logger.warning("ignoring the cached profile %s: %s", path, e)
        return None


def save(key: dict, curve: CapacityCurve) -> Path:
    path = _path(key)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.stem}.{os.getpid()}.{time.monotonic_ns()}.tmp")   # one per writer
    tmp.write_text(json.dumps({"key": key, "curve": curve.to_dict()}))
    tmp.replace(path)   # atomic: a reader never sees half a profile
    return path


def dummy_input(pool, batch: int, rows: int, context: int, strewn: list[int] | None = None) -> ForwardInput:
    """`batch` dummy sequences of `rows` new rows after `context` cached tokens, on blocks of
    the pool (strewn over it, as a served batch's are), writing no KV (slot -1)."""
    block_size, num_blocks = pool.block_size, pool.num_blocks
    per_seq = -(-(context + rows) // block_size)
    inp = ForwardInput()
    for i in range(batch):
        table = [(strewn[(i * per_seq + j) % num_blocks] if strewn else (i * per_seq + j) % num_blocks)
                 for j in range(per_seq)]
        inp.add([0] * rows, list(range(context, context + rows)), [-1] * rows, table, context + rows,
                logit_rows=list(range(rows)))
    return inp


def probe(engine, buckets: list[int], max_rows: int, thorough: bool = False,
          context: int = 32, longer: int = 256) -> CapacityCurve:
    """Time the target at `buckets` x rows per sequence and the draft at one row per sequence,
    all at `context` cached tokens a sequence; and the target at 1 and max_rows rows at `longer`
    tokens, for what a cached token adds. Quick: rows 1, 2, 3, 5, 9, max_rows (the rest
    interpolated), one run after a warm-up; thorough: every row count, the least of 5 runs."""
    rows = range(1, max_rows + 1) if thorough else sorted({r for r in (1, 2, 3, 5, 9) if r <= max_rows} | {max_rows})
    repeats = 5 if thorough else 1
    budget = engine.config.scheduler.max_num_batched_tokens
    block_size, num_blocks = engine.pool.block_size, engine.pool.num_blocks
    strewn = list(range(num_blocks))
    random.Random(0).shuffle(strewn)   # a served batch's blocks lie all over the pool

    room = engine.max_model_len   # a dummy sequence's positions must exist in the model (rope tables)
    rows = [r for r in rows if r <= room] or [1]
    context = max(0, min(context, room - max(rows)))
    longer = min(longer, room - max(rows))

    def dummy(batch: int, r: int, ctx: int = context) -> ForwardInput:
        per_seq = -(-(ctx + r) // block_size)
        inp = ForwardInput()
        for i in range(batch):
            table = [strewn[(i * per_seq + j) % num_blocks] for j in range(per_seq)]
            inp.add([0] * r, list(range(ctx, ctx + r)), [-1] * r, table, ctx + r, logit_rows=list(range(r)))
        return inp

    def seconds(runner, inp: ForwardInput) -> float:
        best = float("inf")
        for i in range(repeats + 1):   # the first run builds what a new shape needs
            start = time.perf_counter()
            runner.forward(inp)[-1, 0].item()
            if i:
                best = min(best, time.perf_counter() - start)
        return best

    started = time.perf_counter()
    verify, level, per_token = [], [], []
    for b in buckets:
        measured = {r: seconds(engine.target, dummy(b, r)) for r in rows if b * r <= budget}
        verify.append(_fill(measured, max_rows))
        level.append(seconds(engine.draft, dummy(b, 1)) if engine.draft is not None else 1e-5)
        slopes = []
        for r in (1, max_rows):
            r = r if r in measured else max(measured)
            far = seconds(engine.target, dummy(b, r, longer)) if longer > context else measured[r]
            slopes.append(max(0.0, (far - measured[r]) / max(longer - context, 1)))
        per_token.append(slopes)
    logger.info("controller: probed step costs at batch sizes %s in %.1f s", buckets, time.perf_counter() - started)
    return CapacityCurve(buckets, verify, level, context=context, context_s=per_token)


def _fill(measured: dict[int, float], max_rows: int) -> list[float]:
    """Seconds at 1..max_rows rows from the measured ones: linear between them, the last
    segment's slope beyond."""
    xs = sorted(measured)
    out = []
    for r in range(1, max_rows + 1):
        if r in measured:
            out.append(measured[r])
            continue
        lo = max((x for x in xs if x < r), default=None)
        hi = min((x for x in xs if x > r), default=None)
        if lo is None:
            out.append(measured[hi])
        elif hi is not None:
            out.append(measured[lo] + (r - lo) / (hi - lo) * (measured[hi] - measured[lo]))
        else:
            prev = max((x for x in xs if x < lo), default=None)
            slope = 0.0 if prev is None else max(0.0, (measured[lo] - measured[prev]) / (lo - prev))
            out.append(measured[lo] + (r - lo) * slope)
    return out


def initial_curve(engine, buckets: list[int], max_rows: int) -> CapacityCurve:
    """The cached profile of this setup if there is one, else a quick probe."""
    key = profile_key(engine, buckets, max_rows)
    curve = load(key)
    if curve is not None:
        logger.info("controller: step costs from the cached profile %s", _path(key))
        return curve
    return probe(engine, buckets, max_rows)


def calibrate(engine, buckets: list[int], max_rows: int) -> Path:
    """`specserve calibrate`: a thorough probe, kept for later starts of the same setup."""
    key = profile_key(engine, buckets, max_rows)
    return save(key, probe(engine, buckets, max_rows, thorough=True))
