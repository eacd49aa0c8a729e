"""Is the draft calibrated on what greedy speculation verifies? The premise of early stop.

    python -m benchmarks.draft_calibration [--target DIR --draft DIR] [--prompts 120] [--plot F.png]

Early stop ([spec] early_stop, DESIGN.md §6) ends a chain once the draft's probability of
its path falls below the controller's threshold, taking a node at path probability p to be
accepted with probability p. This measures that: the target alone continues held-out
prompts greedily (specserve, EOS ignored), the draft is teacher-forced on the result, and
each position's draft probability of its own argmax is set beside whether that argmax is
the target's token (what greedy verification accepts). Printed per probability bin: the
positions, their mean draft probability and the share accepted; with --plot, the
reliability diagram. A calibrated draft sits on the diagonal; one above it is
under-confident (the early stop then stops too soon), below it over-confident.
Without --target/--draft: the embedded pair.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from tqdm import tqdm

from specserve.config import ASSETS_DIR

BINS = (0.0, 0.3, 0.5, 0.7, 0.8, 0.9, 0.95, 0.99, 1.0001)
PROMPTS_FILE = Path(__file__).resolve().parent / "data" / "heldout_prompts.jsonl"


def calibration(probs: list[float], accepted: list[bool], bins=BINS) -> list[dict]:
    """Per bin [lo, hi): positions, mean draft probability, share accepted (None when empty)."""
    out = []
    for lo, hi in zip(bins, bins[1:]):
        rows = [(p, a) for p, a in zip(probs, accepted) if lo <= p < hi]
        n = len(rows)
        out.append({"lo": lo, "hi": min(hi, 1.0), "positions": n,
                    "mean_prob": sum(p for p, _ in rows) / n if n else None,
                    "accepted": sum(a for _, a in rows) / n if n else None})
    return out


def measure(target: Path, draft: Path, num_prompts: int, prompt_tokens: int, new_tokens: int,
            progress: bool = True) -> tuple[list[float], list[bool]]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from specserve import LLM, SamplingParams

    tok = AutoTokenizer.from_pretrained(str(target))
    texts = [json.loads(line) for line in PROMPTS_FILE.read_text().splitlines()][:num_prompts]
    ids = [tok.encode(t, add_special_tokens=False)[:prompt_tokens] for t in texts]
    llm = LLM(target=str(target), draft="none", dtype="float32", device="cpu", progress=False,
              max_waiting_requests=max(1, len(ids)))
    outs = llm.generate(ids, SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True),
                        progress=progress)
    model = AutoModelForCausalLM.from_pretrained(str(draft), dtype=torch.float32).eval()
    vocab = len(tok)
    probs, accepted = [], []
    with torch.inference_mode():
        for prompt, out in tqdm(list(zip(ids, outs)), desc="draft, teacher-forced", disable=not progress):
            seq = torch.tensor(prompt + out.token_ids)[None]
            logits = model(seq[:, :-1]).logits[0, len(prompt) - 1:, :vocab].float()
            top, guess = logits.softmax(-1).max(-1)   # row j guesses seq[len(prompt) + j]
            probs += top.tolist()
            accepted += (guess == seq[0, len(prompt):]).tolist()
    return probs, accepted


def plot(table: list[dict], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in table if r["positions"]]
    fig, ax = plt.subplots(figsize=(5, 5))
    ax.plot([0, 1], [0, 1], color="grey", linestyle="--", linewidth=1, label="calibrated")
    ax.plot([r["mean_prob"] for r in rows], [r["accepted"] for r in rows], marker="o", label="draft")
    for r in rows:
        ax.annotate(str(r["positions"]), (r["mean_prob"], r["accepted"]), textcoords="offset points",
                    xytext=(4, -10), fontsize=7)
    ax.set_xlabel("draft probability of its greedy token (bin mean)")
    ax.set_ylabel("share accepted by greedy verification")
    ax.set_xlim(0, 1)
    ax.set_ylim(0, 1.02)
    ax.set_title(title, fontsize=9)
    ax.legend(loc="upper left")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--target", type=Path, default=ASSETS_DIR / "tiny-target")
    p.add_argument("--draft", type=Path, default=ASSETS_DIR / "tiny-draft")
    p.add_argument("--prompts", type=int, default=120, help="held-out prompts (benchmarks/data/heldout_prompts.jsonl)")
    p.add_argument("--prompt-tokens", type=int, default=128)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--plot", type=Path)
    p.add_argument("--json", type=Path)
    p.add_argument("--no-progress", action="store_true")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    probs, accepted = measure(args.target, args.draft, args.prompts, args.prompt_tokens, args.new_tokens,
                              progress=not args.no_progress)
    table = calibration(probs, accepted)
    print(f"{len(probs)} positions, accepted {sum(accepted) / len(accepted):.3f}")
    print("| draft probability | positions | mean probability | share accepted |")
    print("|---|---|---|---|")
    for r in table:
        if r["positions"]:
            print(f"| {r['lo']:.2f}-{r['hi']:.2f} | {r['positions']} | {r['mean_prob']:.3f} | {r['accepted']:.3f} |")
    if args.json:
        args.json.write_text(json.dumps({"positions": len(probs), "table": table}, indent=1))
    if args.plot:
        plot(table, args.plot, f"{args.draft.name} against {args.target.name}, {len(probs)} positions")
        print(f"plot: {args.plot}")


if __name__ == "__main__":
    main()
