"""Figures of the embedded draft/target pair, for benchmarks/RESULTS.md.

    python scripts/eval_pair.py                       # writes benchmarks/out/results_pair.md

Measures, on the held-out files recorded in specserve/assets/corpus_manifest.json
(re-read from this interpreter's stdlib and checked against their sha256):
  - perplexity of target and draft on held-out code (and on held-out chat examples);
  - top-1 agreement a: how often argmax draft == argmax target at the same position,
    teacher-forced on the held-out text. Under greedy decoding this is the per-token
    acceptance rate of speculation;
  - the cost of one batch-1 single-token decode step with a KV cache (transformers, and
    specserve's own forward when it loads), target over draft;
  - the expected tokens per target pass for chain depth k, E(k) = (1 - a^(k+1)) / (1 - a)
    (Leviathan et al. 2023, "Fast Inference from Transformers via Speculative Decoding",
    eq. 1, i.i.d. acceptance a), and the implied speedup E(k) / (1 + k / c) with c the
    measured cost ratio (their improvement factor, ignoring verification overhead).
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import json
import math
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

REPO = Path(__file__).resolve().parent.parent
ASSETS = REPO / "specserve" / "assets"


def _train_module():
    spec = importlib.util.spec_from_file_location("train_pair", REPO / "scripts" / "train_pair.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def heldout_texts(assets: Path) -> tuple[list[str], list[str]]:
    """Held-out files' texts, in manifest order; raises if a file differs from the record."""
    manifest = json.loads((assets / "corpus_manifest.json").read_text())
    root = Path(manifest["stdlib"])
    texts, mismatched = [], []
    for f in manifest["files"]:
        if not f["held_out"]:
            continue
        file = root / f["path"]
        raw = file.read_bytes() if file.is_file() else b""
        if hashlib.sha256(raw).hexdigest() != f["sha256"]:
            mismatched.append(f["path"])
            continue
        texts.append(raw.decode("utf-8"))
    return texts, mismatched


def load_hf(path: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


@torch.no_grad()
def score(target, draft, windows: list[torch.Tensor]) -> dict:
    """Teacher-forced CE of both models and top-1 agreement, over [1, L] windows."""
    nll_t = nll_d = 0.0
    agree = count = 0
    per_window = []
    for ids in windows:
        logits_t = target(ids[:, :-1]).logits.float()[0]  # [L-1, V]
        logits_d = draft(ids[:, :-1]).logits.float()[0]
        labels = ids[0, 1:]
        nll_t += F.cross_entropy(logits_t, labels, reduction="sum").item()
        nll_d += F.cross_entropy(logits_d, labels, reduction="sum").item()
        same = (logits_t.argmax(-1) == logits_d.argmax(-1))
        agree += same.sum().item()
        count += labels.numel()
        per_window.append(same.float().mean().item())
    return {"tokens": count, "target_ce": nll_t / count, "draft_ce": nll_d / count,
            "target_ppl": math.exp(nll_t / count), "draft_ppl": math.exp(nll_d / count),
            "agreement": agree / count}


def code_windows(tok, texts: list[str], end_id: int, length: int, max_windows: int) -> list:
    ids: list[int] = []
    for text in texts:
        ids.extend(tok.encode(text, add_special_tokens=False))
        ids.append(end_id)
    n = min(max_windows, len(ids) // length)
    return [torch.tensor(ids[i * length:(i + 1) * length + 1])[None] for i in range(n)]


def chat_windows(tok, texts: list[str], train, max_examples: int) -> list:
    out = []
    for text in texts:
        for doc, code in train.chat_examples(text):
            messages = [{"role": "user", "content": doc}, {"role": "assistant", "content": code}]
            ids = tok.apply_chat_template(messages, tokenize=True)
            if hasattr(ids, "keys"):  # BatchEncoding in newer transformers
                ids = ids["input_ids"]
            out.append(torch.tensor(ids[:512])[None])
            if len(out) >= max_examples:
                return out
    return out


@torch.no_grad()
def time_hf_decode(models: dict, prefix: int, steps: int, rounds: int) -> dict:
    """Median seconds of one batch-1 single-token step with a KV cache, per model.
    Target and draft alternate in rounds, so a burst of load on the machine hits both."""
    samples = {name: [] for name in models}
    for _ in range(rounds):
        for name, model in models.items():
            ids = torch.randint(5, model.config.vocab_size, (1, prefix), generator=torch.Generator().manual_seed(0))
            out = model(ids, use_cache=True)
            cache, token = out.past_key_values, ids[:, -1:]
            for _ in range(steps):
                t0 = time.perf_counter()
                out = model(token, past_key_values=cache, use_cache=True)
                samples[name].append(time.perf_counter() - t0)
                cache = out.past_key_values
    return {name: statistics.median(ts) for name, ts in samples.items()}


@torch.no_grad()
def time_specserve_decode(paths: dict, prefix: int, steps: int, rounds: int) -> dict:
    from specserve.model.attention import AttentionMetadata
    from specserve.model.loader import load_model

    block_size = 16
    num_blocks = (prefix + steps + block_size) // block_size + 1
    models = {name: load_model(path, dtype=torch.float32, device="cpu", progress=False)[0]
              for name, path in paths.items()}
    block_table = torch.arange(num_blocks, dtype=torch.int32)[None]

    def meta(start: int, length: int) -> AttentionMetadata:
        return AttentionMetadata(
            slot_mapping=torch.arange(start, start + length, dtype=torch.int64),
            block_tables=block_table,
            cu_query_lens=torch.tensor([0, length], dtype=torch.int32),
            seq_lens=torch.tensor([start + length], dtype=torch.int32),
            max_query_len=length, max_seq_len=start + length)

    samples = {name: [] for name in models}
    for _ in range(rounds):
        for name, model in models.items():
            caches = model.make_kv_caches(num_blocks, block_size)
            ids = torch.randint(5, model.args.vocab_size, (prefix,), generator=torch.Generator().manual_seed(0))
            model.compute_logits(model.forward(ids, torch.arange(prefix), caches, meta(0, prefix))[-1:])
            token = ids[-1:]
            for i in range(steps):
                pos = prefix + i
                t0 = time.perf_counter()
                hidden = model.forward(token, torch.tensor([pos]), caches, meta(pos, 1))
                model.compute_logits(hidden)
                samples[name].append(time.perf_counter() - t0)
    return {name: statistics.median(ts) for name, ts in samples.items()}


@torch.no_grad()
def onpolicy_runs(target_dir: Path, draft, tok, texts: list[str], train, num_prompts: int,
                  new_tokens: int) -> dict:
    """Greedy speculation measured offline. The target alone (specserve) continues held-out
    prompts (cut like the benchmarks': `function_starts`) greedily, EOS ignored; the draft is
    teacher-forced on those sequences. While the draft's argmax equals the target's token a
    greedy chain proposes exactly that token, so the run of matches starting at a position is
    the accepted length of a chain started there: tokens per pass at depth k = 1 + the mean
    over positions of min(run, k)."""
    import random

    from specserve import LLM, SamplingParams

    prompts = [start for text in texts for start in train.function_starts(text)]
    random.Random(0).shuffle(prompts)
    ids = [tok.encode(p, add_special_tokens=False)[:128] for p in prompts[:num_prompts]]
    llm = LLM(target=str(target_dir), dtype="float32", device="cpu", progress=False,
              max_waiting_requests=max(1, len(ids)))
    outs = llm.generate(ids, SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True))
    matches, runs = [], []
    for prompt, out in zip(ids, outs):
        seq = torch.tensor(prompt + out.token_ids)[None]
        pred = draft(seq[:, :-1]).logits.argmax(-1)[0]   # pred[j] guesses seq[j + 1]
        match = (pred[len(prompt) - 1:] == seq[0, len(prompt):]).tolist()
        run, seq_runs = 0, []
        for m in reversed(match):
            run = run + 1 if m else 0
            seq_runs.append(run)
        matches += match
        runs += seq_runs
    return {"prompts": len(ids), "tokens": len(matches), "agreement": sum(matches) / len(matches),
            "tokens_per_pass": {k: 1 + sum(min(r, k) for r in runs) / len(runs) for k in range(1, 9)}}


def expected_tokens(a: float, k: int) -> float:
    return float(k + 1) if a >= 1.0 else (1 - a ** (k + 1)) / (1 - a)


def machine() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{cpu}, {torch.get_num_threads()} threads, torch {torch.__version__}, Python {sys.version.split()[0]}"


def commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True,
                              text=True, check=True).stdout.strip()
    except Exception:
        return "unknown"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--assets", type=Path, default=ASSETS)
    p.add_argument("--out", type=Path, default=REPO / "benchmarks" / "out" / "results_pair.md")
    p.add_argument("--window", type=int, default=512, help="tokens per held-out window")
    p.add_argument("--max-windows", type=int, default=100_000)
    p.add_argument("--max-chat", type=int, default=100_000)
    p.add_argument("--onpolicy-prompts", type=int, default=200,
                   help="held-out prompts the target continues for the on-policy figures")
    p.add_argument("--onpolicy-tokens", type=int, default=128)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--timing-steps", type=int, default=40)
    p.add_argument("--timing-rounds", type=int, default=5)
    args = p.parse_args()
    torch.set_num_threads(args.threads)

    from transformers import AutoTokenizer

    train = _train_module()
    target_dir, draft_dir = args.assets / "tiny-target", args.assets / "tiny-draft"
    tok = AutoTokenizer.from_pretrained(target_dir)
    target, draft = load_hf(target_dir), load_hf(draft_dir)
    texts, mismatched = heldout_texts(args.assets)
    if mismatched:
        print(f"warning: {len(mismatched)} held-out files differ from the manifest, skipped: {mismatched[:5]}")

    code = score(target, draft, code_windows(tok, texts, train.END_ID, args.window, args.max_windows))
    chat = score(target, draft, chat_windows(tok, texts, train, args.max_chat))
    print("held-out code:", code)
    print("held-out chat:", chat)

    onp = onpolicy_runs(target_dir, draft, tok, texts, train, args.onpolicy_prompts, args.onpolicy_tokens)
    print("target's own greedy output:", onp)

    hf_times = time_hf_decode({"target": target, "draft": draft}, 64, args.timing_steps, args.timing_rounds)
    print("transformers decode step:", hf_times)
    try:
        ss_times = time_specserve_decode({"target": target_dir, "draft": draft_dir}, 64,
                                         args.timing_steps, args.timing_rounds)
        print("specserve decode step:", ss_times)
    except Exception as e:  # the engine's forward is optional for these figures
        ss_times = None
        print(f"specserve timing skipped: {type(e).__name__}: {e}")

    sizes = {d.name: {f.name: f.stat().st_size for f in sorted(d.glob("*"))} for d in (target_dir, draft_dir)}
    params = {name: sum(p.numel() for p in m.parameters()) for name, m in (("target", target), ("draft", draft))}
    ratio_hf = hf_times["target"] / hf_times["draft"]
    ratio_ss = ss_times["target"] / ss_times["draft"] if ss_times else None
    a = code["agreement"]
    rows = []
    for k in range(1, 9):
        e = expected_tokens(a, k)
        rows.append((k, e, e / (1 + k / ratio_hf), e / (1 + k / ratio_ss) if ratio_ss else None))

    total_bytes = sum(sum(v.values()) for v in sizes.values())
    weights = {d: v["model.safetensors"] for d, v in sizes.items()}
    cfg_t, cfg_d = target.config, draft.config
    lines = [
        "# Embedded pair (specserve/assets/tiny-target, tiny-draft)",
        "",
        f"Machine: {machine()}; commit {commit()}. Produced by `python {' '.join([Path(sys.argv[0]).as_posix()] + sys.argv[1:])}`.",
        "Held-out data: the files of `specserve/assets/corpus_manifest.json` marked held out "
        f"({len(texts)} files; sha256 checked), never seen by the tokenizer or either model.",
        "",
        "| model | layers x hidden | heads / kv heads | params | model.safetensors (bf16) |",
        "|---|---|---|---|---|",
        f"| target | {cfg_t.num_hidden_layers} x {cfg_t.hidden_size} | {cfg_t.num_attention_heads} / "
        f"{cfg_t.num_key_value_heads} | {params['target'] / 1e6:.2f}M | {weights['tiny-target'] / 1e6:.2f} MB |",
        f"| draft | {cfg_d.num_hidden_layers} x {cfg_d.hidden_size} | {cfg_d.num_attention_heads} / "
        f"{cfg_d.num_key_value_heads} | {params['draft'] / 1e6:.2f}M | {weights['tiny-draft'] / 1e6:.2f} MB |",
        "",
        f"Both folders together (weights, tokenizer, configs): {total_bytes / 1e6:.2f} MB.",
        "",
        "## Quality on held-out text (teacher-forced)",
        "",
        "| text | tokens | target ppl | draft ppl | top-1 agreement |",
        "|---|---|---|---|---|",
        f"| code ({args.window}-token windows) | {code['tokens']:,} | {code['target_ppl']:.2f} | "
        f"{code['draft_ppl']:.2f} | {code['agreement']:.3f} |",
        f"| chat (docstring -> code) | {chat['tokens']:,} | {chat['target_ppl']:.2f} | "
        f"{chat['draft_ppl']:.2f} | {chat['agreement']:.3f} |",
        "",
        "Top-1 agreement = fraction of positions where argmax draft == argmax target, i.e. the",
        "per-token acceptance rate of greedy speculation on text like the data.",
        "",
        "## On the target's own greedy output (what greedy speculation verifies)",
        "",
        f"{onp['prompts']} held-out prompts (first lines of a function or class, as the benchmarks cut",
        f"them) continued by the target alone for {args.onpolicy_tokens} tokens, greedy, EOS ignored;",
        "the draft teacher-forced on them. A greedy chain started at a position is accepted for as",
        "long as the draft's argmax keeps matching, so tokens per pass at depth k is 1 + the mean",
        "over start positions of min(run of matches, k).",
        "",
        f"Agreement with the target's tokens: {onp['agreement']:.3f} over {onp['tokens']:,} tokens.",
        "",
        "| k | " + " | ".join(str(k) for k in range(1, 9)) + " |",
        "|---|" + "---|" * 8,
        "| tokens per pass | " + " | ".join(f"{onp['tokens_per_pass'][k]:.2f}" for k in range(1, 9)) + " |",
        "",
        "## Cost of one decode step (batch 1, one token, KV cache of 64+ tokens, float32)",
        "",
        "| forward | target | draft | target / draft |",
        "|---|---|---|---|",
        f"| transformers | {hf_times['target'] * 1e3:.3f} ms | {hf_times['draft'] * 1e3:.3f} ms | {ratio_hf:.1f}x |",
    ]
    if ss_times:
        lines.append(f"| specserve (reference CPU path) | {ss_times['target'] * 1e3:.3f} ms | "
                     f"{ss_times['draft'] * 1e3:.3f} ms | {ratio_ss:.1f}x |")
    else:
        lines.append("| specserve | not measured (model could not be loaded) | | |")
    lines += [
        "",
        f"Medians of {args.timing_rounds} x {args.timing_steps} steps, target and draft alternating; the",
        "machine was shared with other jobs, so absolute times are noisy, the ratio less so.",
        "",
        f"## Expected tokens per target pass, chain depth k (a = {a:.3f})",
        "",
        "E(k) = (1 - a^(k+1)) / (1 - a) (Leviathan et al. 2023); speedup = E(k) / (1 + k / c), with c",
        "the measured cost ratio (verification of k+1 tokens taken as one target step).",
        "",
        "| k | E(k) | speedup (c from transformers) | speedup (c from specserve) |",
        "|---|---|---|---|",
    ]
    for k, e, s_hf, s_ss in rows:
        lines.append(f"| {k} | {e:.3f} | {s_hf:.2f} | {f'{s_ss:.2f}' if s_ss else '-'} |")
    lines.append("")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text("\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
