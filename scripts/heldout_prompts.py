"""Held-out prompts from the embedded pair's corpus, for the benchmarks.

    python scripts/heldout_prompts.py [--num 200] [--out benchmarks/data/heldout_prompts.jsonl]

The corpus is the running interpreter's standard library; a file is held out by the very
rule scripts/train_pair.py trains with (`is_held_out`), so no prompt was seen in training.
Each prompt is the first lines of a held-out function or class, cut at a line boundary
between --min-chars and --max-chars: code whose continuation a model of the corpus can
predict. One JSON string per line (the load generator's --prompts-file format).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import random
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
DEFAULT_OUT = REPO / "benchmarks" / "data" / "heldout_prompts.jsonl"


def _train_module():
    spec = importlib.util.spec_from_file_location("train_pair", REPO / "scripts" / "train_pair.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def build(num: int, min_chars: int, max_chars: int, seed: int) -> list[str]:
    train = _train_module()
    root, files = train.list_stdlib_files()
    held = [rel for rel in files if train.is_held_out(rel)]
    starts = []
    for rel in held:
        text = (root / rel).read_text(encoding="utf-8", errors="replace")
        starts.extend(train.function_starts(text, min_chars, max_chars))
    rng = random.Random(seed)
    rng.shuffle(starts)
    return starts[:num]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--num", type=int, default=200)
    ap.add_argument("--min-chars", type=int, default=120)
    ap.add_argument("--max-chars", type=int, default=400)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = ap.parse_args()
    prompts = build(args.num, args.min_chars, args.max_chars, args.seed)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text("".join(json.dumps(p) + "\n" for p in prompts))
    print(f"{len(prompts)} held-out prompts -> {args.out}")


if __name__ == "__main__":
    main()
