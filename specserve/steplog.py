"""A JSON-lines record of every engine step, for finding out where a benchmark's time went.

Set `step_log = "PATH"` in the config (or `specserve serve --step-log PATH`). Each step appends
one object:

    t               wall clock at the step's end (time.time(), to line steps up with a
                    benchmark's result files)
    depth, nodes    the plan that ran (0, 0: plain decode)
    decode          sequences that decoded (verified a tree or sampled one token)
    prefill_seqs    sequences that ran a prompt chunk in the same target pass
    prefill_tokens  the prompt tokens of those chunks
    context         tokens already cached of the decoding sequences, summed (what the cost
                    model's context term reads)
    context_max     the longest of them (on the CPU the sequences that verify the same number
                    of rows run one attention, padded to the longest: kernels/reference.py)
    emitted         tokens the step produced (accepted + bonus, or one per plain row)
    draft_s         the draft's share of the step (0 when it did not run)
    verify_s        the target pass (the whole pass, prefill chunks included)
    step_s          the step's whole cost, from the end of the step before (what the
                    controller is charged with; the caller's handling of outputs included)
    predicted       the adaptive controller's predicted tokens/s for the plan (absent: no
                    adaptive controller)
    curve           on steps whose plan came from a fresh evaluation: the predicted tokens/s
                    of each chain depth 0..max_depth (best node budget per depth)
    bias            with curve: the factor each depth's prediction was corrected by for the
                    decision (its measured over predicted goodput, shrunk toward 1 or toward
                    what the depths share; the controller's module docstring, "Bias")
    tokens          with curve: the expected tokens per sequence of each depth's best plan
                    (so the predicted step time is decode x tokens / curve)
    draft_pred, verify_pred, rest_pred
                    with curve: the milliseconds that evaluation priced each depth's draft
                    levels and verify pass at, and the rest of a step (which part of the
                    predicted step time is off, set beside the fixed depths' steps)
    drafted         on speculative steps: the tree nodes verified over all decoding
                    sequences (below nodes x decode where trees were cut near a request's
                    max_tokens or the context's end, or chains stopped early): decode + drafted
                    is the verify pass's decoding rows, what the controller books its cost at
                    (on a step that also prefills, with [spec] speculate_prompts, drafted also
                    counts the trees after prompts, which decode leaves out)
    stop            with early stop ([spec] early_stop): the path probability below which
                    the step's chains stopped growing
    level_stop      with early stop "auto": the sum of the growing chains' path
                    probabilities (each less stop) below which the draft ran no more levels

Unlike the controller's own step statistics, steps that also prefill are logged with their
timings: at high load they are most of the target's time. A line is written per step
(line-buffered), so a server stopped by a signal loses nothing already done.
`python -m benchmarks.step_report` summarises the logs a sweep wrote.
"""

from __future__ import annotations

from pathlib import Path
from typing import IO

import msgspec

from specserve.errors import ConfigError


class StepLog:
    def __init__(self, path: str | Path):
        path = Path(path)
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            # Unbuffered: each line reaches the file as the step ends (one write call, as
            # line buffering made it).
            self._file: IO[bytes] | None = open(path, "ab", buffering=0)
        except OSError as e:
            raise ConfigError(f"step_log: cannot write {path}: {e.strerror or e}") from e
        self.path = path

    def write(self, record: dict) -> None:
        # msgspec: a sixth of json.dumps's time, which every step of a benchmark pays (about
        # 16 us a record on the dev CPU against 3; a non-finite float is written as null).
        if self._file is not None:
            self._file.write(_ENCODER.encode(record) + b"\n")

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


_ENCODER = msgspec.json.Encoder()
