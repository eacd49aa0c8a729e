"""Train specserve's embedded draft/target pair from the running interpreter's stdlib.

One command, no downloads, fixed seeds, a wall-clock budget, resumable:

    python scripts/train_pair.py                      # ~45 min on a 2-core CPU
    python scripts/train_pair.py --target-minutes 2 --draft-minutes 1 --work-dir /tmp/smoke \
        --out-dir /tmp/smoke/out                      # smoke test
    python scripts/train_pair.py --threads 1 --target-schedule 955 689 --draft-schedule 824 662 \
        --draft-continue-minutes 24                   # + agreement continuation of the draft
        ... --draft-onpolicy-minutes 16               # + the draft on the target's own output

Stages (each resumes from --work-dir, default build/train_pair/):
  1. corpus     every *.py under sysconfig's stdlib path, test and site-packages folders
                excluded, sorted by path; a file is held out iff sha256(relpath) % 20 == 0.
                Docstring -> code chat examples are cut from each file with `ast`
                (user turn = the function's docstring, assistant turn = its source).
  2. tokenizer  byte-level BPE (`tokenizers`), 4096 ids, trained on the training files only;
                ids 0..4 are <|end|> <|system|> <|user|> <|assistant|> <|pad|>.
                <|end|> ends a chat turn and a document, so it is the one eos id.
  3. target     Llama trained from scratch: next-token CE on 256-token windows, 75% from the
                packed plain-code stream, 25% starting at a chat example.
  4. draft      a much smaller Llama distilled from the target: 0.9 * KL(target || draft)
                on the target's full softmax (the vocabulary is only 4096, so no top-k
                truncation is needed), 0.1 * CE on the data. Forward KL on the target's
                soft outputs is what raises top-1 agreement, the quantity speculation pays on.
  4b. draft continuation (--draft-continue-minutes M, optional): continues distilling the
                trained draft (draft.final.pt) with a loss aimed at top-1 agreement itself:
                w * KL(softmax(target / T) || draft) with T < 1 (a sharpened target) +
                (1 - w) * CE on the target's argmax token (hard distillation); defaults
                w 0.5, T 0.5; fresh AdamW, lr --continue-lr (1e-3) after a 20-step warmup,
                decaying linearly to 0 from 5% of the budget on. Same architecture, so the
                cost ratio is unchanged. Its (steps, decay start) are recorded like the other
                stages' and replayed by --draft-continue-schedule.
  4c. draft on-policy (--draft-onpolicy-minutes M, optional): the draft learns the target's
                own greedy output. Prompts from the training files, cut like the benchmarks'
                held-out ones, are continued by the exported target (specserve, greedy, EOS
                ignored, cached in onpolicy.pt); then CE(draft, target's token) on the
                generated positions only. Teacher-forced windows of data are not what a draft
                sees when serving: there its context is the target's own continuation, which
                is more regular than the data (the first draft agrees with 0.69 of the data's
                positions but ~0.83 of the target's greedy tokens). No teacher forward per
                step, so a step costs a fraction of stage 4b's. A slice of the continuations
                is kept apart and scored before and after (CORPUS.md).
  5. export     Hugging Face folders (config.json, model.safetensors in bfloat16,
                tokenizer.json, tokenizer_config.json with the chat template,
                generation_config.json) to specserve/assets/tiny-{target,draft}/, and
                specserve/assets/CORPUS.md + corpus_manifest.json recording what was used.

Why these sizes (measured on the 2-core dev CPU, transformers, batch 1, one decode step
with a KV cache, float32): a decoder layer costs ~0.45 ms there whatever its width below
~512, because it is op-overhead bound, so depth sets the cost ratio and width is nearly free.
  target  hidden 256, 10 layers, 8 query / 4 KV heads (head_dim 32), MLP 704 (2.75x),
          tied embeddings, 8.4M params = 16.9 MB bf16, ~4.5 ms per decode step.
  draft   hidden 128, 2 layers, 4 query / 2 KV heads (head_dim 32), MLP 384 (3x),
          tied embeddings, 0.9M params = 1.8 MB bf16, ~0.5 ms per decode step.
Two draft layers rather than one let the draft form induction (copy) heads, which is most of
what makes code predictable; the tenth target layer keeps the cost ratio above 8x.
Both fit well under 25 MB together (19.2 MB with tokenizers). Training is compute-bound on
2 cores (a few million tokens per half hour), far below a Chinchilla budget, which is why
the target is no wider. Training runs under bfloat16 autocast where the CPU has
AVX512-BF16/AMX (2x faster steps); on a CPU shared with other jobs --threads 1 was ~5x
faster per step than 2 threads (the shipped pair was trained that way, see CORPUS.md).

Reproducibility: every random draw comes from generators seeded by (--seed, stage, step),
so a resumed run draws the same batches as an uninterrupted one. The learning-rate schedule is
warmup-stable-decay: the decay starts at 80% of the wall-clock budget and its length is fixed
then from the measured step speed; (steps, decay start) are stored in the checkpoint and in
CORPUS.md, and --target-schedule/--draft-schedule replay them exactly on any machine. The corpus depends on the interpreter
version: CORPUS.md records it and the corpus sha256.
"""

from __future__ import annotations

import argparse
import ast
import hashlib
import inspect
import json
import math
import os
import random
import re
import sys
import sysconfig
import textwrap
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm import tqdm

REPO = Path(__file__).resolve().parent.parent
ASSETS = REPO / "specserve" / "assets"

END, SYSTEM, USER, ASSISTANT, PAD = "<|end|>", "<|system|>", "<|user|>", "<|assistant|>", "<|pad|>"
SPECIAL_TOKENS = [END, SYSTEM, USER, ASSISTANT, PAD]  # ids 0..4, in this order
END_ID, PAD_ID = 0, 4
EXCLUDED_DIRS = {"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__"}
HELD_OUT_MOD = 20

# Renders exactly what render_chat() below produces; the test checks the two agree.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if message['role'] not in ['system', 'user', 'assistant'] %}"
    "{{ raise_exception('roles are system, user and assistant, got ' + message['role']) }}"
    "{% endif %}"
    "{{ '<|' + message['role'] + '|>\\n' + message['content'] + '<|end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% endif %}"
)

TARGET_ARCH = dict(hidden_size=256, num_hidden_layers=10, num_attention_heads=8,
                   num_key_value_heads=4, intermediate_size=704)
DRAFT_ARCH = dict(hidden_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, intermediate_size=384)
CONTEXT = 512


def render_chat(messages: list[dict], add_generation_prompt: bool = False) -> str:
    text = "".join(f"<|{m['role']}|>\n{m['content']}{END}\n" for m in messages)
    return text + ("<|assistant|>\n" if add_generation_prompt else "")


# ----------------------------------------------------------------------------- corpus

def is_held_out(relpath: str) -> bool:
    return int(hashlib.sha256(relpath.encode()).hexdigest(), 16) % HELD_OUT_MOD == 0


def list_stdlib_files() -> tuple[Path, list[str]]:
    root = Path(sysconfig.get_paths()["stdlib"]).resolve()
    files = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in EXCLUDED_DIRS)
        for name in sorted(filenames):
            if name.endswith(".py"):
                files.append(Path(dirpath, name).relative_to(root).as_posix())
    return root, sorted(files)


def chat_examples(source: str) -> list[tuple[str, str]]:
    """(docstring, function source) for every documented function of a module."""
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError):
        return []
    lines = source.split("\n")  # not splitlines(): it also splits on \x0c, ast does not
    out = []
    for node in ast.walk(tree):
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        doc = ast.get_docstring(node)
        if not doc or len(doc) < 20:
            continue
        # whole lines from the first decorator (or the def) to the end of the body
        first = node.decorator_list[0].lineno if node.decorator_list else node.lineno
        code = textwrap.dedent("\n".join(lines[first - 1:node.end_lineno])).strip("\n")
        if 80 <= len(code) <= 2400:
            out.append((inspect.cleandoc(doc), code))
    return out


def build_corpus(work: Path) -> dict:
    path = work / "corpus.json"
    if path.exists():
        return json.loads(path.read_text())
    root, relpaths = list_stdlib_files()
    digest = hashlib.sha256()
    files, skipped = [], []
    for rel in relpaths:
        raw = (root / rel).read_bytes()
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError:
            skipped.append(rel)
            continue
        digest.update(rel.encode() + b"\0" + raw + b"\0")
        files.append({"path": rel, "bytes": len(raw), "sha256": hashlib.sha256(raw).hexdigest(),
                      "held_out": is_held_out(rel), "text": text})
    corpus = {
        "python": sys.version.split()[0], "implementation": sys.implementation.name,
        "stdlib": str(root), "files": files, "skipped_not_utf8": skipped,
        "sha256": digest.hexdigest(),
    }
    path.write_text(json.dumps(corpus))
    return corpus


# ----------------------------------------------------------------------------- tokenizer

def train_tokenizer(work: Path, corpus: dict, vocab_size: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    path = work / "tokenizer.json"
    if path.exists():
        return Tokenizer.from_file(str(path))
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=2, show_progress=True,
                                  special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    train_texts = [f["text"] for f in corpus["files"] if not f["held_out"]]
    tok.train_from_iterator(train_texts, trainer=trainer, length=len(train_texts))
    assert [tok.token_to_id(t) for t in SPECIAL_TOKENS] == list(range(len(SPECIAL_TOKENS)))
    tok.save(str(path))
    return tok


def write_tokenizer_files(tok, out: Path) -> None:
    tok.save(str(out / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": None, "eos_token": END, "pad_token": PAD, "unk_token": None,
        "add_bos_token": False, "add_eos_token": False,
        "clean_up_tokenization_spaces": False,  # byte-level BPE must round-trip exactly
        "model_max_length": CONTEXT,
        "chat_template": CHAT_TEMPLATE,
        "added_tokens_decoder": {str(i): {"content": t, "special": True, "lstrip": False,
                                          "rstrip": False, "normalized": False,
                                          "single_word": False}
                                 for i, t in enumerate(SPECIAL_TOKENS)},
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")


# ----------------------------------------------------------------------------- token streams

def encode_streams(work: Path, corpus: dict, tok) -> dict:
    """Token streams: plain code (each file + <|end|>) and chat (one rendered example after
    another, with the offset of each example's first token), for train and held-out files."""
    path = work / "streams.pt"
    if path.exists():
        return torch.load(path)
    streams = {}
    for split, held in (("train", False), ("heldout", True)):
        files = [f for f in corpus["files"] if f["held_out"] == held]
        code_ids: list[int] = []
        for enc in tok.encode_batch([f["text"] for f in files]):
            code_ids.extend(enc.ids)
            code_ids.append(END_ID)
        examples = [render_chat([{"role": "user", "content": d},
                                 {"role": "assistant", "content": c}])
                    for f in files for d, c in chat_examples(f["text"])]
        chat_ids: list[int] = []
        starts: list[int] = []
        for enc in tok.encode_batch(examples):
            starts.append(len(chat_ids))
            chat_ids.extend(enc.ids)
        streams[split] = {"code": torch.tensor(code_ids, dtype=torch.int16),
                          "chat": torch.tensor(chat_ids, dtype=torch.int16),
                          "chat_starts": torch.tensor(starts, dtype=torch.int64),
                          "num_chat_examples": len(examples)}
    torch.save(streams, path)
    return streams


def sample_batch(stream: dict, batch: int, seq: int, chat_fraction: float,
                 gen: torch.Generator) -> torch.Tensor:
    """[batch, seq + 1] int64 windows; a chat window starts at a chat example's first token."""
    code, chat, starts = stream["code"], stream["chat"], stream["chat_starts"]
    rows = []
    for _ in range(batch):
        if torch.rand((), generator=gen).item() < chat_fraction:
            # starts near the end of the stream wrap into a shorter example: clamp instead
            s = starts[torch.randint(len(starts), (), generator=gen)].item()
            s = min(s, len(chat) - seq - 1)
            rows.append(chat[s:s + seq + 1])
        else:
            s = torch.randint(len(code) - seq - 1, (), generator=gen).item()
            rows.append(code[s:s + seq + 1])
    return torch.stack(rows).long()


# ----------------------------------------------------------------------------- models

def make_model(arch: dict, vocab_size: int, seed: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=vocab_size, max_position_embeddings=CONTEXT,
                         rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=True,
                         bos_token_id=None, eos_token_id=END_ID, pad_token_id=PAD_ID,
                         hidden_act="silu", attention_bias=False, mlp_bias=False,
                         initializer_range=0.02, **arch)
    torch.manual_seed(seed)
    return LlamaForCausalLM(config)


def lr_at(step: int, peak: float, warmup: int, decay_start: int | None, total: int | None,
          floor: float = 0.02) -> float:
    """Warmup-stable-decay (Hu et al. 2024, MiniCPM; Hagele et al. 2024): linear warmup, a
    constant peak, then a linear decay to 2% of peak over the last steps. It fits a wall-clock
    budget on a machine of unknown speed: the decay's length is fixed only when it starts."""
    if step < warmup:
        return peak * (step + 1) / warmup
    if decay_start is None or step < decay_start:
        return peak
    progress = min(1.0, (step - decay_start) / max(1, total - decay_start))
    return peak * (floor + (1.0 - floor) * (1.0 - progress))


def train_stage(name: str, model, streams: dict, args, minutes: float, fixed: tuple | None,
                peak_lr: float, loss_fn, work: Path, stage_seed: int, warmup: int | None = None,
                decay_at: float = 0.8, lr_floor: float = 0.02, batch_size: int | None = None,
                seq: int | None = None, draw=None) -> dict:
    """Generic loop: time-budgeted, checkpointed every ~60 s, resumable, deterministic batches.

    The decay phase starts when 80% of the budget has gone, and lasts as many steps as the
    last 20 steps' speed fits into the remaining 20%; (decay_start, total) are recorded, and
    `fixed` = (total, decay_start) replays them exactly whatever the machine's speed.
    loss_fn(model, batch) -> (loss, ce) where ce is the data cross-entropy for the log, or
    (loss, ce, agree) with agree the train top-1 agreement with the target, logged likewise.
    decay_at (fraction of the budget where the decay starts) and lr_floor (final lr / peak)
    default to the from-scratch stages' 0.8 and 0.02. draw(batch_size, seq, gen) -> batch
    replaces the default windows of the training streams."""
    ckpt_path = work / f"{name}.ckpt"
    done_path = work / f"{name}.done.json"
    if done_path.exists():
        model.load_state_dict(torch.load(work / f"{name}.final.pt"))
        return json.loads(done_path.read_text())
    opt = torch.optim.AdamW(model.parameters(), lr=peak_lr, betas=(0.9, 0.95),
                            weight_decay=0.1, eps=1e-8)
    state = {"step": 0, "elapsed": 0.0, "total_steps": None, "decay_start": None, "losses": [],
             "agreements": []}
    warmup = args.warmup if warmup is None else warmup
    batch_size = args.batch if batch_size is None else batch_size
    seq = args.seq if seq is None else seq
    if ckpt_path.exists():
        ck = torch.load(ckpt_path, weights_only=False)
        model.load_state_dict(ck["model"])
        opt.load_state_dict(ck["opt"])
        state = ck["state"]
        print(f"[{name}] resumed at step {state['step']} ({state['elapsed']:.0f}s done)")
    if fixed is not None:  # an explicit schedule wins over a stored plan
        state["total_steps"], state["decay_start"] = fixed
    budget = minutes * 60.0
    model.train()
    bar = tqdm(desc=name, total=state["total_steps"] or None, initial=state["step"],
               dynamic_ncols=True, mininterval=2.0)
    last_ckpt = time.time()
    t_start = time.time() - state["elapsed"]
    window: list[float] = []
    agree_window: list[float] = []
    step_times: list[float] = []
    while True:
        step = state["step"]
        total = state["total_steps"]
        if total is not None and step >= total:
            break
        elapsed = time.time() - t_start
        if fixed is None and total is None and elapsed > decay_at * budget and len(step_times) >= 5:
            per_step = sorted(step_times[-20:])[len(step_times[-20:]) // 2]
            state["decay_start"] = step
            state["total_steps"] = total = step + max(10, int(0.97 * (budget - elapsed) / per_step))
            bar.total = total
            print(f"[{name}] {per_step:.2f} s/step: decay from step {step} to {total}")
        if fixed is None and elapsed > budget * 1.1:  # the machine slowed down during the decay
            print(f"[{name}] hard time cap hit at step {step}/{total}")
            break
        t_step = time.time()
        gen = torch.Generator().manual_seed(args.seed * 1_000_003 + stage_seed * 10_007 + step)
        if draw is None:
            batch = sample_batch(streams["train"], batch_size, seq, args.chat_fraction, gen)
        else:
            batch = draw(batch_size, seq, gen)
        lr = lr_at(step, peak_lr, warmup, state["decay_start"], total, lr_floor)
        for g in opt.param_groups:
            g["lr"] = lr
        loss, ce, *extra = loss_fn(model, batch)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        state["step"] = step + 1
        window.append(ce.item())
        if extra:
            agree_window.append(float(extra[0]))
        step_times.append(time.time() - t_step)
        bar.update(1)
        if state["step"] % 10 == 0:
            mean = sum(window) / len(window)
            state["losses"].append((state["step"], round(mean, 4)))
            if agree_window:
                state.setdefault("agreements", []).append(
                    (state["step"], round(sum(agree_window) / len(agree_window), 4)))
                agree_window = []
            bar.set_postfix(ce=f"{mean:.3f}", lr=f"{lr:.2e}",
                            tok_s=f"{len(window) * batch_size * seq / sum(step_times[-len(window):]):.0f}")
            window = []
        if time.time() - last_ckpt > 60:
            state["elapsed"] = time.time() - t_start
            torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "state": state},
                       ckpt_path.with_suffix(".tmp"))
            os.replace(ckpt_path.with_suffix(".tmp"), ckpt_path)
            last_ckpt = time.time()
    bar.close()
    state["elapsed"] = time.time() - t_start
    model.eval()
    torch.save(model.state_dict(), work / f"{name}.final.pt")
    summary = {"steps": state["step"], "planned_steps": state["total_steps"],
               "decay_start": state["decay_start"],
               "seconds": round(state["elapsed"], 1), "peak_lr": peak_lr,
               "tokens": state["step"] * batch_size * seq, "batch": batch_size, "seq": seq,
               "final_train_ce": state["losses"][-1][1] if state["losses"] else None,
               "loss_curve": state["losses"][::max(1, len(state["losses"]) // 20)]}
    if state.get("agreements"):
        summary["final_train_agreement"] = state["agreements"][-1][1]
        summary["agreement_curve"] = state["agreements"][::max(1, len(state["agreements"]) // 20)]
    done_path.write_text(json.dumps(summary))
    return summary


@torch.no_grad()
def heldout_ce(model, stream: dict, args, num_batches: int = 8) -> float:
    gen = torch.Generator().manual_seed(12345)
    total, count = 0.0, 0
    for _ in range(num_batches):
        batch = sample_batch(stream, args.batch, args.seq, 0.0, gen)
        logits = model(batch[:, :-1]).logits
        total += F.cross_entropy(logits.flatten(0, 1).float(), batch[:, 1:].flatten(),
                                 reduction="sum").item()
        count += batch[:, 1:].numel()
    return total / count


@torch.no_grad()
def heldout_agreement(target, draft, stream: dict, args, num_batches: int = 8) -> float:
    """Top-1 agreement of draft and target on the same held-out windows as heldout_ce."""
    gen = torch.Generator().manual_seed(12345)
    same = count = 0
    for _ in range(num_batches):
        batch = sample_batch(stream, args.batch, args.seq, 0.0, gen)
        a = target(batch[:, :-1]).logits.argmax(-1)
        b = draft(batch[:, :-1]).logits.argmax(-1)
        same += (a == b).sum().item()
        count += a.numel()
    return same / count


def draft_check(target, draft, heldout: dict, args, when: str) -> dict:
    """The quick held-out check of the draft between stages: CE and agreement, printed."""
    draft.eval()
    out = {"ce": heldout_ce(draft, heldout, args),
           "agreement": heldout_agreement(target, draft, heldout, args)}
    print(f"draft {when}: held-out CE {out['ce']:.4f}, agreement {out['agreement']:.4f}")
    return out


# ----------------------------------------------------------------------------- on-policy data

def function_starts(text: str, min_chars: int = 120, max_chars: int = 400) -> list[str]:
    """The first lines of every function or class of a module, cut at a line boundary between
    min_chars and max_chars: code whose continuation a model of the corpus can predict (the
    benchmarks' held-out prompts and the on-policy stage's training prompts are cut so)."""
    out = []
    for m in re.finditer(r"^[ \t]*(?:def|class) \w+", text, flags=re.M):
        chunk = text[m.start():m.start() + max_chars]
        cut = chunk.rfind("\n", min_chars)
        if cut > 0:
            out.append(chunk[:cut + 1])
    return out


def onpolicy_prompts(corpus: dict, tok, num: int, seed: int, chat_fraction: float) -> list[list[int]]:
    """Prompts from the training files only, cut like the benchmarks' held-out ones
    (`function_starts`); `chat_fraction` of them a chat turn whose user message is a
    documented function's docstring, ending with the assistant's tag."""
    code, chat = [], []
    for f in corpus["files"]:
        if f["held_out"]:
            continue
        text = f["text"]
        code.extend(function_starts(text))
        chat.extend(render_chat([{"role": "user", "content": doc}], add_generation_prompt=True)
                    for doc, _ in chat_examples(text))
    rng = random.Random(seed)
    rng.shuffle(code)
    rng.shuffle(chat)
    num_chat = round(num * chat_fraction)
    texts = code[:num - num_chat] + chat[:num_chat]
    rng.shuffle(texts)
    return [enc.ids[:CONTEXT // 4] for enc in tok.encode_batch(texts)]


def onpolicy_data(work: Path, target_dir: Path, prompts: list[list[int]], max_new: int,
                  threads: int) -> dict:
    """The target's greedy continuations of `prompts` (EOS ignored, as the benchmarks run),
    generated by specserve itself from the exported target, so the labels are exactly the
    tokens the served target emits. Cached in work/onpolicy.pt: tokens [N, L] int16 padded
    with <|pad|>, prompt_lens and lengths [N]."""
    path = work / "onpolicy.pt"
    if path.exists():
        return torch.load(path)
    from specserve import LLM, SamplingParams

    llm = LLM(target=str(target_dir), dtype="float32", device="cpu", cpu_threads=threads,
              max_num_seqs=64, max_waiting_requests=len(prompts), progress=False)
    params = SamplingParams(max_tokens=max_new, temperature=0.0, ignore_eos=True)
    t0 = time.time()
    outs = llm.generate(prompts, params, progress=True)
    rows = [p + o.token_ids for p, o in zip(prompts, outs)]
    tokens = torch.full((len(rows), max(map(len, rows))), PAD_ID, dtype=torch.int16)
    for i, r in enumerate(rows):
        tokens[i, :len(r)] = torch.tensor(r, dtype=torch.int16)
    data = {"tokens": tokens,
            "prompt_lens": torch.tensor([len(p) for p in prompts]),
            "lengths": torch.tensor([len(r) for r in rows]),
            "seconds": round(time.time() - t0, 1)}
    torch.save(data, path)
    return data


def onpolicy_rows(data: dict, idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(inputs [B, L-1], labels [B, L-1]) of sequences `idx`, label -100 on the prompt and the
    padding, so only the target's own tokens are learnt."""
    toks = data["tokens"][idx].long()
    pos = torch.arange(1, toks.shape[1])
    keep = (pos[None, :] >= data["prompt_lens"][idx, None]) & (pos[None, :] < data["lengths"][idx, None])
    return toks[:, :-1], toks[:, 1:].masked_fill(~keep, -100)


@torch.no_grad()
def onpolicy_agreement(draft, data: dict, rows: range, batch: int = 32) -> float:
    """Fraction of the target's greedy tokens in `rows` that the draft's argmax predicts: the
    per-token acceptance of greedy speculation on the target's own output."""
    same = count = 0
    for start in range(rows.start, rows.stop, batch):
        inputs, labels = onpolicy_rows(data, torch.arange(start, min(start + batch, rows.stop)))
        keep = labels != -100
        same += (draft(inputs).logits.argmax(-1)[keep] == labels[keep]).sum().item()
        count += keep.sum().item()
    return same / count


# ----------------------------------------------------------------------------- export

def export(model, tok, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    for stale in out.glob("*"):
        stale.unlink()
    model = model.to(torch.bfloat16)
    model.config.dtype = torch.bfloat16
    model.save_pretrained(out, safe_serialization=True)
    model.to(torch.float32)
    for extra in out.glob("*"):  # keep exactly the five files the loader reads
        if extra.name not in {"config.json", "model.safetensors"}:
            extra.unlink()
    write_tokenizer_files(tok, out)
    (out / "generation_config.json").write_text(json.dumps({
        "bos_token_id": None, "eos_token_id": [END_ID], "pad_token_id": PAD_ID,
        "do_sample": False,
    }, indent=2) + "\n")


def budget_text(minutes: float, schedule) -> str:
    """A stage's budget as recorded: a replayed stage ran the steps of its schedule, whatever
    minutes the command line had."""
    return "replayed from its recorded schedule" if schedule is not None else f"budget {minutes} min"


def write_records(corpus: dict, streams: dict, args, results: dict, out_dir: Path) -> None:
    files = corpus["files"]
    manifest = {
        "python": corpus["python"], "stdlib": corpus["stdlib"], "sha256": corpus["sha256"],
        "rule": f"*.py under stdlib, excluding folders {sorted(EXCLUDED_DIRS)}; "
                f"held out iff int(sha256(relpath)) % {HELD_OUT_MOD} == 0",
        "skipped_not_utf8": corpus["skipped_not_utf8"],
        "files": [{k: f[k] for k in ("path", "bytes", "sha256", "held_out")} for f in files],
    }
    (out_dir / "corpus_manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")
    train = [f for f in files if not f["held_out"]]
    held = [f for f in files if f["held_out"]]
    tgt, dft = results["target"], results["draft"]
    cont, cont_md, cont_replay = results.get("draft_continue"), "", ""
    dft_ce = results["draft_pre_continue"]["ce"] if cont else results["draft_heldout_ce"]
    # the continuation's result is what the on-policy stage (if any) started from
    after_cont = results.get("draft_pre_onpolicy") or {"agreement": results["draft_agreement"],
                                                       "ce": results["draft_heldout_ce"]}
    if cont:
        cont_replay = f" --draft-continue-schedule {cont['steps']} {cont['decay_start']}"
        pre = results["draft_pre_continue"]
        cont_md = f"""
## Draft continuation (agreement distillation)
- Starts from the draft above (`draft.final.pt`), fresh AdamW (betas 0.9/0.95, weight decay 0.1),
  batches of {cont['batch']} x {cont['seq']} tokens (the full 512 context: the first stages trained on
  256-token windows only, while the models serve, and `eval_pair.py` scores, 512), batch draws
  seeded by (seed, stage 3, step), training files only.
- Loss: {args.continue_kl_weight} * KL(softmax(target / T) || draft), T = {args.continue_temperature}
  (sharpened target), + {1 - args.continue_kl_weight:.2g} * CE(draft, argmax target) (hard distillation).
- {budget_text(args.draft_continue_minutes, args.draft_continue_schedule).capitalize()}; {cont['steps']} steps (warmup {args.continue_warmup},
  decay from step {cont['decay_start']} to step {cont['planned_steps']}), {cont['tokens']:,} tokens,
  {cont['seconds']:.0f} s; lr {cont['peak_lr']} linearly to 0.
- Quick held-out check (8 x 16 x 256 code windows): agreement {pre['agreement']:.4f} -> {after_cont['agreement']:.4f},
  draft CE {pre['ce']:.4f} -> {after_cont['ce']:.4f}; final train CE {cont['final_train_ce']},
  final train agreement {cont.get('final_train_agreement')}.
- Loss curves (step, mean over the last 10 steps): data CE {cont['loss_curve']}
- train agreement: {cont.get('agreement_curve')}
"""
    onp, onp_md = results.get("draft_onpolicy"), ""
    if onp:
        pre_onp = results["draft_pre_onpolicy"]
        cont_replay += f" --draft-onpolicy-schedule {onp['steps']} {onp['decay_start']}"
        kl_md = "" if args.onpolicy_kl_weight <= 0 else (
            f"\n  Plus {args.onpolicy_kl_weight} x stage 4's loss (0.9 KL(target || draft) + 0.1 CE) on"
            f" {args.onpolicy_kl_batch} data windows of {args.seq} tokens per step: the target's whole"
            f" distribution, which sampled requests accept against.")
        onp_md = f"""
## Draft on the target's own output (on-policy distillation)
- Data: {onp['num_sequences']} prompts from the training files, cut like the benchmarks'
  held-out prompts (the first lines of a function or class, 120-400 characters;
  {args.chat_fraction:.0%} chat turns asking for a documented function), each continued by the
  exported target for {args.onpolicy_new_tokens} tokens, greedy, EOS ignored, by specserve
  itself ({onp['generated_tokens']:,} tokens in {onp['generation_seconds']:.0f} s; cached in
  `onpolicy.pt`). The last {onp['num_val']} sequences are kept apart.
- Loss: CE(draft, the target's greedy token) on the generated positions only; the draft
  reads the target's own continuation as its context, exactly what it sees when serving.{kl_md}
- {budget_text(args.draft_onpolicy_minutes, args.draft_onpolicy_schedule).capitalize()}; {onp['steps']} steps of {onp['batch']} sequences
  (warmup {args.continue_warmup}, decay from step {onp['decay_start']} to step {onp['planned_steps']}),
  {onp['seconds']:.0f} s; lr {onp['peak_lr']} linearly to 0.
- Agreement with the target's greedy tokens on the kept-apart continuations:
  {pre_onp['onpolicy_val_agreement']:.4f} -> {onp['val_agreement']:.4f}; final train agreement
  {onp.get('final_train_agreement')}. Quick held-out check on data windows (teacher-forced):
  agreement {pre_onp['agreement']:.4f} -> {results['draft_agreement']:.4f}, draft CE
  {pre_onp['ce']:.4f} -> {results['draft_heldout_ce']:.4f}.
- Curves (step, mean over the last 10 steps): CE {onp['loss_curve']}
- train agreement: {onp.get('agreement_curve')}
"""
    md = f"""# Corpus and training record of the embedded pair

Written by `scripts/train_pair.py`; the per-file list (path, bytes, sha256, held-out flag)
is `corpus_manifest.json` beside this file.

## Corpus
- Interpreter: {corpus['implementation']} {corpus['python']}
- Standard-library path: `{corpus['stdlib']}`
- Rule: every `*.py` under that path, sorted by relative path, skipping folders named
  {', '.join(f'`{d}`' for d in sorted(EXCLUDED_DIRS))}; files that are not UTF-8 are skipped
  ({len(corpus['skipped_not_utf8'])} skipped).
- Files: {len(files)} ({sum(f['bytes'] for f in files):,} bytes)
- Held out: a file is held out iff `int(sha256(relpath).hexdigest(), 16) % {HELD_OUT_MOD} == 0`:
  {len(held)} files ({sum(f['bytes'] for f in held):,} bytes); training: {len(train)} files
  ({sum(f['bytes'] for f in train):,} bytes).
- sha256 over the files in order, each as `relpath NUL bytes NUL`: `{corpus['sha256']}`
- Chat examples (user = a function's docstring, assistant = its source, `ast`-extracted):
  {streams['train']['num_chat_examples']} train, {streams['heldout']['num_chat_examples']} held out.
- Tokens (4096-id byte-level BPE trained on the training files): train code
  {len(streams['train']['code']):,}, train chat {len(streams['train']['chat']):,};
  held-out code {len(streams['heldout']['code']):,}, held-out chat {len(streams['heldout']['chat']):,}.

## Training
- Command: `{results['command']}`
- Seeds: --seed {args.seed} (model inits: seed+1 target, seed+2 draft; batch draws seeded by
  (seed, stage, step)); torch {torch.__version__}, {torch.get_num_threads()} threads,
  device {results['device']}.
- Batches: {args.batch} x {args.seq} tokens, {args.chat_fraction:.0%} of rows start at a chat example.
- Target {TARGET_ARCH}: {budget_text(args.target_minutes, args.target_schedule)}; {tgt['steps']} steps
  (decay from step {tgt['decay_start']}, planned {tgt['planned_steps']}), {tgt['tokens']:,} tokens, {tgt['seconds']:.0f} s,
  peak lr {tgt['peak_lr']}; final train CE {tgt['final_train_ce']}, held-out code CE
  {results['target_heldout_ce']:.4f} (ppl {math.exp(results['target_heldout_ce']):.2f}).
- Draft {DRAFT_ARCH}: {budget_text(args.draft_minutes, args.draft_schedule)}; {dft['steps']} steps
  (decay from step {dft['decay_start']}, planned {dft['planned_steps']}), {dft['tokens']:,} tokens, {dft['seconds']:.0f} s,
  peak lr {dft['peak_lr']}; loss 0.9 KL(target || draft) + 0.1 CE; final train CE
  {dft['final_train_ce']}, held-out code CE {dft_ce:.4f}
  (ppl {math.exp(dft_ce):.2f}).
- To replay exactly: add `--target-schedule {tgt['steps']} {tgt['decay_start']} --draft-schedule {dft['steps']} {dft['decay_start']}{cont_replay}`.
- Loss curves (step, mean train CE over the last 10 steps):
  - target: {[tuple(x) for x in tgt['loss_curve']]}
  - draft: {[tuple(x) for x in dft['loss_curve']]}
{cont_md}{onp_md}"""
    # sections added by hand (## Notes ...) to an earlier record are kept
    old = out_dir / "CORPUS.md"
    if old.exists() and "\n## Notes" in old.read_text():
        md += "\n## Notes" + old.read_text().split("\n## Notes", 1)[1]
    (out_dir / "CORPUS.md").write_text(md)


# ----------------------------------------------------------------------------- main

def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--work-dir", type=Path, default=REPO / "build" / "train_pair",
                   help="checkpoints and caches; rerun with the same folder to resume")
    p.add_argument("--out-dir", type=Path, default=ASSETS,
                   help="where tiny-target/, tiny-draft/, CORPUS.md go")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--vocab-size", type=int, default=4096)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--chat-fraction", type=float, default=0.25)
    p.add_argument("--warmup", type=int, default=40)
    p.add_argument("--target-minutes", type=float, default=30.0)
    p.add_argument("--draft-minutes", type=float, default=12.0)
    p.add_argument("--target-schedule", type=int, nargs=2, default=None, metavar=("STEPS", "DECAY_START"),
                   help="replay a recorded schedule (CORPUS.md) instead of fitting the budget")
    p.add_argument("--draft-schedule", type=int, nargs=2, default=None, metavar=("STEPS", "DECAY_START"))
    p.add_argument("--target-lr", type=float, default=3e-3)
    p.add_argument("--draft-lr", type=float, default=4e-3)
    p.add_argument("--draft-continue-minutes", type=float, default=0.0,
                   help="continue distilling the trained draft for agreement (0 = skip)")
    p.add_argument("--draft-continue-schedule", type=int, nargs=2, default=None,
                   metavar=("STEPS", "DECAY_START"))
    p.add_argument("--continue-lr", type=float, default=1e-3)
    p.add_argument("--continue-batch", type=int, default=8)
    p.add_argument("--continue-seq", type=int, default=CONTEXT,
                   help="window length of the continuation; the full context, so that the draft "
                        "also learns the target's positions past the first stages' 256")
    p.add_argument("--continue-warmup", type=int, default=20)
    p.add_argument("--continue-temperature", type=float, default=0.5,
                   help="target logits are divided by this (< 1 sharpens)")
    p.add_argument("--continue-kl-weight", type=float, default=0.5,
                   help="weight of the sharpened KL; the rest goes to CE on argmax target")
    p.add_argument("--draft-onpolicy-minutes", type=float, default=0.0,
                   help="then train the draft on the target's own greedy continuations (0 = skip)")
    p.add_argument("--draft-onpolicy-schedule", type=int, nargs=2, default=None,
                   metavar=("STEPS", "DECAY_START"))
    p.add_argument("--onpolicy-prompts", type=int, default=3072)
    p.add_argument("--onpolicy-new-tokens", type=int, default=192)
    p.add_argument("--onpolicy-gen-threads", type=int, default=2,
                   help="torch threads of the generating engine (batched, so both cores help)")
    p.add_argument("--onpolicy-lr", type=float, default=1e-3)
    p.add_argument("--onpolicy-batch", type=int, default=16)
    p.add_argument("--onpolicy-kl-weight", type=float, default=0.0,
                   help="add this weight of stage 4's loss (KL to the target on data windows), "
                        "so that the draft keeps the target's distribution for sampled requests")
    p.add_argument("--onpolicy-kl-batch", type=int, default=8,
                   help="data windows (of --seq tokens) per step for that term")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--fp32", action="store_true", help="no bfloat16 autocast")
    args = p.parse_args()

    torch.set_num_threads(args.threads)
    random.seed(args.seed)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    args.work_dir.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    # bfloat16 autocast halves the step time on CPUs with AVX512-BF16/AMX (and on GPUs);
    # weights, optimizer state and the losses stay float32.
    if device == "cuda":
        use_bf16 = torch.cuda.is_bf16_supported()
    else:
        use_bf16 = bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    use_bf16 = use_bf16 and not args.fp32

    def autocast():
        return torch.autocast(device, dtype=torch.bfloat16, enabled=use_bf16)

    print(f"device {device}, bf16 autocast {use_bf16}")

    corpus = build_corpus(args.work_dir)
    print(f"corpus: {len(corpus['files'])} files from {corpus['stdlib']} ({time.time() - t0:.0f}s)")
    tok = train_tokenizer(args.work_dir, corpus, args.vocab_size)
    print(f"tokenizer: {tok.get_vocab_size()} ids ({time.time() - t0:.0f}s)")
    streams = encode_streams(args.work_dir, corpus, tok)
    print(f"streams: train code {len(streams['train']['code']):,} tokens, chat "
          f"{len(streams['train']['chat']):,} tokens in {streams['train']['num_chat_examples']} "
          f"examples ({time.time() - t0:.0f}s)")

    vocab = tok.get_vocab_size()
    target = make_model(TARGET_ARCH, vocab, args.seed + 1).to(device)
    print(f"target: {sum(p.numel() for p in target.parameters()) / 1e6:.2f}M params")

    def target_loss(model, batch):
        batch = batch.to(device)
        with autocast():
            logits = model(batch[:, :-1]).logits
        ce = F.cross_entropy(logits.flatten(0, 1).float(), batch[:, 1:].flatten())
        return ce, ce.detach()

    tgt_summary = train_stage("target", target, streams, args, args.target_minutes,
                              args.target_schedule, args.target_lr, target_loss, args.work_dir, 1)
    target.eval().requires_grad_(False)

    draft = make_model(DRAFT_ARCH, vocab, args.seed + 2).to(device)
    print(f"draft: {sum(p.numel() for p in draft.parameters()) / 1e6:.2f}M params")

    def draft_loss(model, batch):
        batch = batch.to(device)
        with torch.no_grad(), autocast():
            teacher_logits = target(batch[:, :-1]).logits
        teacher_logp = F.log_softmax(teacher_logits.float(), dim=-1)
        with autocast():
            logits = model(batch[:, :-1]).logits.float()
        logp = F.log_softmax(logits, dim=-1)
        kl = F.kl_div(logp.flatten(0, 1), teacher_logp.flatten(0, 1), log_target=True,
                      reduction="batchmean")
        ce = F.nll_loss(logp.flatten(0, 1), batch[:, 1:].flatten())
        return 0.9 * kl + 0.1 * ce, ce.detach()

    dft_summary = train_stage("draft", draft, streams, args, args.draft_minutes,
                              args.draft_schedule, args.draft_lr, draft_loss, args.work_dir, 2)

    heldout = {"code": streams["heldout"]["code"], "chat": streams["heldout"]["chat"],
               "chat_starts": streams["heldout"]["chat_starts"]}
    cont_summary = pre_continue = None
    if args.draft_continue_minutes > 0 or args.draft_continue_schedule is not None:
        pre_continue = draft_check(target, draft, heldout, args, "before continuation")
        T, w = args.continue_temperature, args.continue_kl_weight

        def agree_loss(model, batch):
            batch = batch.to(device)
            with torch.no_grad(), autocast():
                teacher_logits = target(batch[:, :-1]).logits
            teacher_logits = teacher_logits.float().flatten(0, 1)
            sharp_logp = F.log_softmax(teacher_logits / T, dim=-1)
            top1 = teacher_logits.argmax(-1)
            with autocast():
                logits = model(batch[:, :-1]).logits.float()
            logp = F.log_softmax(logits.flatten(0, 1), dim=-1)
            kl = F.kl_div(logp, sharp_logp, log_target=True, reduction="batchmean")
            hard = F.nll_loss(logp, top1)
            ce = F.nll_loss(logp.detach(), batch[:, 1:].flatten())
            agree = (logp.detach().argmax(-1) == top1).float().mean()
            return w * kl + (1 - w) * hard, ce, agree.item()

        cont_summary = train_stage("draft_continue", draft, streams, args, args.draft_continue_minutes,
                                   args.draft_continue_schedule, args.continue_lr, agree_loss,
                                   args.work_dir, 3, warmup=args.continue_warmup, decay_at=0.05,
                                   lr_floor=0.0, batch_size=args.continue_batch,
                                   seq=args.continue_seq)
    onpolicy_summary = pre_onpolicy = None
    if args.draft_onpolicy_minutes > 0 or args.draft_onpolicy_schedule is not None:
        pre_onpolicy = draft_check(target, draft, heldout, args, "before the on-policy stage")
        # The generator serves what is shipped: the target exported in bfloat16 (export() also
        # rounds the in-memory target, so everything after this sees the shipped weights).
        target.cpu()
        export(target, tok, args.out_dir / "tiny-target")
        target.to(device)
        prompts = onpolicy_prompts(corpus, tok, args.onpolicy_prompts, args.seed,
                                   args.chat_fraction)
        data = onpolicy_data(args.work_dir, args.out_dir / "tiny-target", prompts,
                             args.onpolicy_new_tokens, args.onpolicy_gen_threads)
        # the last sequences are kept apart to tell learning from memorising
        num_val = min(256, len(data["tokens"]) // 8)
        num_train = len(data["tokens"]) - num_val
        val_rows = range(num_train, len(data["tokens"]))
        pre_onpolicy["onpolicy_val_agreement"] = onpolicy_agreement(draft, data, val_rows)
        print(f"on-policy data: {len(data['tokens'])} greedy continuations of "
              f"{args.onpolicy_new_tokens} tokens ({data['seconds']:.0f}s to generate); "
              f"draft agreement on the {num_val} kept apart: {pre_onpolicy['onpolicy_val_agreement']:.4f}")

        kl_weight = args.onpolicy_kl_weight

        def draw(batch_size: int, seq: int, gen: torch.Generator):
            rows = onpolicy_rows(data, torch.randint(num_train, (batch_size,), generator=gen))
            if kl_weight <= 0:
                return rows
            return rows + (sample_batch(streams["train"], args.onpolicy_kl_batch, args.seq,
                                        args.chat_fraction, gen),)

        def onpolicy_loss(model, batch):
            inputs, labels = batch[0].to(device), batch[1].to(device)
            with autocast():
                logits = model(inputs).logits.float()
            ce = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100)
            keep = labels != -100
            agree = (logits.detach().argmax(-1)[keep] == labels[keep]).float().mean()
            if kl_weight <= 0:
                return ce, ce.detach(), agree.item()
            # Stage 4's loss on data windows beside it: the target's whole distribution, which
            # is what sampled requests (temperature > 0) accept against.
            return ce + kl_weight * draft_loss(model, batch[2])[0], ce.detach(), agree.item()

        onpolicy_summary = train_stage("draft_onpolicy", draft, streams, args,
                                       args.draft_onpolicy_minutes, args.draft_onpolicy_schedule,
                                       args.onpolicy_lr, onpolicy_loss, args.work_dir, 4,
                                       warmup=args.continue_warmup, decay_at=0.05, lr_floor=0.0,
                                       batch_size=args.onpolicy_batch,
                                       seq=data["tokens"].shape[1] - 1, draw=draw)
        onpolicy_summary["num_sequences"] = len(data["tokens"])
        onpolicy_summary["generated_tokens"] = int((data["lengths"] - data["prompt_lens"]).sum())
        onpolicy_summary["generation_seconds"] = data["seconds"]
        onpolicy_summary["num_val"] = num_val
        onpolicy_summary["val_agreement"] = onpolicy_agreement(draft.eval(), data, val_rows)
        print(f"draft agreement on the kept-apart continuations: "
              f"{pre_onpolicy['onpolicy_val_agreement']:.4f} -> {onpolicy_summary['val_agreement']:.4f}")
    draft.eval()
    target_ce = heldout_ce(target, heldout, args)
    draft_ce = heldout_ce(draft, heldout, args)
    draft_agree = heldout_agreement(target, draft, heldout, args)
    print(f"held-out agreement (quick check): {draft_agree:.4f}")
    print(f"held-out CE: target {target_ce:.4f} (ppl {math.exp(target_ce):.2f}), "
          f"draft {draft_ce:.4f} (ppl {math.exp(draft_ce):.2f})")

    target.cpu()
    draft.cpu()
    args.out_dir.mkdir(parents=True, exist_ok=True)
    export(target, tok, args.out_dir / "tiny-target")
    export(draft, tok, args.out_dir / "tiny-draft")
    results = {"target": tgt_summary, "draft": dft_summary, "target_heldout_ce": target_ce,
               "draft_heldout_ce": draft_ce, "draft_agreement": draft_agree,
               "draft_continue": cont_summary, "draft_pre_continue": pre_continue,
               "draft_onpolicy": onpolicy_summary, "draft_pre_onpolicy": pre_onpolicy, "device": device + (" bf16 autocast" if use_bf16 else ""),
               "command": "python " + " ".join([Path(sys.argv[0]).as_posix()] + sys.argv[1:])}
    write_records(corpus, streams, args, results, args.out_dir)
    sizes = {d: sum(f.stat().st_size for f in (args.out_dir / d).glob("*"))
             for d in ("tiny-target", "tiny-draft")}
    print(f"exported to {args.out_dir}: {sizes} bytes; total {time.time() - t0:.0f}s")


if __name__ == "__main__":
    main()
