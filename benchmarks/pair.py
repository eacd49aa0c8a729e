"""A large pair for the GPU: the embedded pair grown to a real model's shapes, and its speed
and exactness under each speculation setting.

    python -m benchmarks.pair grow --shape llama3-8b --src embedded:tiny-target --out build/grown/target
    python -m benchmarks.pair grow --shape llama3.2-1b --src embedded:tiny-draft --out build/grown/draft
    python -m benchmarks.pair speed --target build/grown/target --draft build/grown/draft [--batch 1 16 64]

**grow.** No larger checkpoints can be downloaded here, and a random-init pair accepts
nothing, so this builds a pair with a large model's shapes and costs (hidden size, heads,
head_dim, layers, MLP width) whose outputs are those of the embedded pair: its acceptance is
the embedded pair's, its step times a large model's.

- the original hidden dims are a prefix of the new ones; every weight that *writes* into
  the residual stream (embedding columns, o_proj, down_proj) holds the original block and
  near-zero noise (std `--tiny`) elsewhere, so the added dims stay near zero;
- every weight that only *reads* (q/k/v, gate/up, rows of new heads and MLP units) is random
  at the usual init scale (0.02), so the matmuls move and multiply real data;
- RMSNorm weights of the original dims are scaled by sqrt(H0 / H) (the mean square now runs
  over H dims, most of them near zero);
- head_dim grows by an integer factor f: original dim i of a head goes to f*i and i+D0/2 to
  f*i+D/2, which keeps its RoPE frequency; q is scaled by sqrt(D / D0) for the new
  1/sqrt(D) attention scale, and the original heads' new q dims are near zero;
- the GQA grouping is kept by placing original q head j of kv group g at new index
  g * ratio + j % ratio0;
- new layers are near identities: random reads, near-zero writes.

The outputs match the original's up to bf16 rounding and the `--tiny` noise (tests check the
greedy tokens on the CPU with a small growth; `--check` compares logits after a build).

**speed.** One engine (one copy of each model) switched between settings with
`set_speculation`: "static0" is plain decoding, "staticD" a chain of depth D, "adaptive" the
controller. Greedy, ignore_eos, held-out prompts. Per batch size and setting: decode tokens/s,
tokens per target pass, and whether the tokens equal static0's token for token. Interleaved
rounds; the median round is reported.
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import sys
import time
from pathlib import Path

import torch

from benchmarks.bench_offline import held_out_prompts
from benchmarks.runinfo import git_commit
from specserve import LLM, SamplingParams

# Shapes of public models (their config.json values), vocab and context kept from the source.
SHAPES = {
    "llama3-8b": dict(hidden_size=4096, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                      head_dim=128, intermediate_size=14336),
    "llama3.2-1b": dict(hidden_size=2048, num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8,
                        head_dim=64, intermediate_size=8192),
    "llama3.2-3b": dict(hidden_size=3072, num_hidden_layers=28, num_attention_heads=24, num_key_value_heads=8,
                        head_dim=128, intermediate_size=8192),
}

READ_STD = 0.02


def _source_dir(src: str) -> Path:
    if src.startswith("embedded:"):
        from specserve.config import ASSETS_DIR

        return ASSETS_DIR / src.removeprefix("embedded:")
    return Path(src)


class Plan:
    """Where each original index goes in the grown model."""

    def __init__(self, old: dict, new: dict):
        self.old, self.new = old, new
        H0, H = old["hidden_size"], new["hidden_size"]
        D0 = old.get("head_dim") or H0 // old["num_attention_heads"]
        D = new["head_dim"]
        q0, kv0 = old["num_attention_heads"], old["num_key_value_heads"]
        q, kv = new["num_attention_heads"], new["num_key_value_heads"]
        L0, L = old["num_hidden_layers"], new["num_hidden_layers"]
        problems = []
        if H < H0 or new["intermediate_size"] < old["intermediate_size"] or L < L0:
            problems.append("every size must grow or stay")
        if D % D0:
            problems.append(f"head_dim {D} is not a multiple of {D0}")
        if kv < kv0 or q % kv or q0 % kv0 or q // kv < q0 // kv0:
            problems.append(f"heads {q}/{kv} cannot hold {q0}/{kv0} with their grouping")
        if problems:
            raise ValueError(f"cannot grow {old['hidden_size']}x{L0} into {H}x{L}: " + "; ".join(problems))
        self.H0, self.H, self.D0, self.D, self.f = H0, H, D0, D, D // D0
        r0, r = q0 // kv0, q // kv
        # head dims: i -> f*i, i + D0/2 -> f*i + D/2 (same RoPE frequency)
        half0 = D0 // 2
        self.dim_map = torch.tensor([self.f * i if i < half0 else self.f * (i - half0) + D // 2 for i in range(D0)])
        self.q_heads = torch.tensor([(j // r0) * r + j % r0 for j in range(q0)])
        self.kv_heads = torch.arange(kv0)
        self.layer_map = [round(i * (L - 1) / max(L0 - 1, 1)) for i in range(L0)] if L0 > 1 else [0]
        self.q_scale = math.sqrt(D / D0)

    def head_rows(self, heads: torch.Tensor) -> torch.Tensor:
        """Row indices (in a [heads * D, ...] projection) of the original dims of these heads."""
        return (heads[:, None] * self.D + self.dim_map[None, :]).reshape(-1)


def _tiny(shape, tiny, gen, device, dtype):
    return (torch.randn(shape, generator=gen, device=device) * tiny).to(dtype)


def _read(shape, gen, device, dtype):
    return (torch.randn(shape, generator=gen, device=device) * READ_STD).to(dtype)


def grow_state(src_state: dict, plan: Plan, tiny: float, seed: int, device, dtype, progress=True) -> dict:
    """The grown model's tensors (HF names), built on `device`, returned on the CPU."""
    old, new = plan.old, plan.new
    gen = torch.Generator(device=device)
    gen.manual_seed(seed)
    H0, H = plan.H0, plan.H
    V = old["vocab_size"]
    I0, I = old["intermediate_size"], new["intermediate_size"]
    q, kv, D = new["num_attention_heads"], new["num_key_value_heads"], plan.D
    hid = torch.arange(H0)
    norm_scale = math.sqrt(H0 / H)
    out = {}

    def src(name):
        return src_state[name].to(device=device, dtype=torch.float32)

    def norm(name):
        w = torch.ones(H, device=device)
        if name is not None:
            w[:H0] = src(name) * norm_scale
        return w.to(dtype)

    emb = _tiny((V, H), tiny, gen, device, torch.float32)
    emb[:, :H0] = src("model.embed_tokens.weight")
    out["model.embed_tokens.weight"] = emb.to(dtype)
    if "lm_head.weight" in src_state and not old.get("tie_word_embeddings", False):
        head = _read((V, H), gen, device, torch.float32)
        head[:, :H0] = src("lm_head.weight")
        out["lm_head.weight"] = head.to(dtype)
    out["model.norm.weight"] = norm("model.norm.weight")

    q_rows, kv_rows = plan.head_rows(plan.q_heads), plan.head_rows(plan.kv_heads)
    orig_heads_all_dims = (plan.q_heads[:, None] * D + torch.arange(D)[None, :]).reshape(-1)
    origin = {n: i for i, n in enumerate(plan.layer_map)}
    L = new["num_hidden_layers"]
    t0 = time.time()
    for layer in range(L):
        p = f"model.layers.{layer}."
        o = origin.get(layer)
        sp = f"model.layers.{o}." if o is not None else None
        wq = _read((q * D, H), gen, device, torch.float32)
        wk = _read((kv * D, H), gen, device, torch.float32)
        wv = _read((kv * D, H), gen, device, torch.float32)
        wo = _tiny((H, q * D), tiny, gen, device, torch.float32)
        w1 = _read((I, H), gen, device, torch.float32)
        w3 = _read((I, H), gen, device, torch.float32)
        w2 = _tiny((H, I), tiny, gen, device, torch.float32)
        if sp is not None:
            # the original heads' added dims must not add to their scores: q there near zero
            wq[orig_heads_all_dims] = _tiny((len(orig_heads_all_dims), H), tiny, gen, device, torch.float32)
            wq[q_rows[:, None], hid[None, :]] = src(sp + "self_attn.q_proj.weight") * plan.q_scale
            wk[kv_rows[:, None], hid[None, :]] = src(sp + "self_attn.k_proj.weight")
            wv[kv_rows[:, None], hid[None, :]] = src(sp + "self_attn.v_proj.weight")
            wo[hid[:, None], q_rows[None, :]] = src(sp + "self_attn.o_proj.weight")
            w1[:I0, :H0] = src(sp + "mlp.gate_proj.weight")
            w3[:I0, :H0] = src(sp + "mlp.up_proj.weight")
            w2[:H0, :I0] = src(sp + "mlp.down_proj.weight")
        names = dict(zip(("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
                          "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"), (wq, wk, wv, wo, w1, w3, w2)))
        for n, w in names.items():
            out[p + n + ".weight"] = w.to(dtype).cpu()
        out[p + "input_layernorm.weight"] = norm(sp + "input_layernorm.weight" if sp else None).cpu()
        out[p + "post_attention_layernorm.weight"] = norm(sp + "post_attention_layernorm.weight" if sp else None).cpu()
        if progress:
            print(f"  layer {layer + 1}/{L} ({'from ' + str(o) if o is not None else 'new'}) "
                  f"{time.time() - t0:.1f} s", flush=True)
    return {k: v.cpu().contiguous() for k, v in out.items()}


def grow(src: str, out_dir: Path, shape: dict, tiny: float = 1e-6, seed: int = 0, device="cpu",
         dtype=torch.bfloat16, progress=True) -> Path:
    from safetensors import safe_open
    from safetensors.torch import save_file

    src_dir = _source_dir(src)
    old = json.loads((src_dir / "config.json").read_text())
    new = {**old, **shape}
    plan = Plan(old, new)
    state = {}
    for f in sorted(src_dir.glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as fh:
            for k in fh.keys():
                state[k] = fh.get_tensor(k)
    grown = grow_state(state, plan, tiny, seed, device, dtype, progress)
    out_dir.mkdir(parents=True, exist_ok=True)
    for f in src_dir.iterdir():
        if f.suffix != ".safetensors" and f.name != "config.json" and f.is_file():
            shutil.copy(f, out_dir / f.name)
    new["dtype"] = str(dtype).removeprefix("torch.")
    new.pop("torch_dtype", None)
    (out_dir / "config.json").write_text(json.dumps(new, indent=2) + "\n")
    t0 = time.time()
    save_file(grown, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    params = sum(t.numel() for t in grown.values())
    if progress:
        print(f"wrote {out_dir} ({params / 1e9:.2f} B parameters, {time.time() - t0:.1f} s to save)", flush=True)
    return out_dir


@torch.no_grad()
def compare(src: str, grown: Path, tokens: torch.Tensor) -> dict:
    """Both checkpoints through transformers in float32 on the CPU (the reference semantics
    of the HF layout the loader reads), teacher-forced on `tokens` [1, T]: how many next-token
    argmaxes agree, and the logits' relative gap."""
    from transformers import LlamaForCausalLM

    a = LlamaForCausalLM.from_pretrained(str(_source_dir(src)), dtype=torch.float32).eval()
    b = LlamaForCausalLM.from_pretrained(str(grown), dtype=torch.float32).eval()
    la, lb = a(tokens).logits[0], b(tokens).logits[0]
    same = (la.argmax(-1) == lb.argmax(-1)).sum().item()
    gap = ((la - lb).norm() / la.norm()).item()
    return {"positions": la.shape[0], "same_argmax": same, "logits_rel_gap": gap}



def run(llm: LLM, setting: str, prompts, batch: int, max_tokens: int) -> dict:
    base = setting
    if base == "adaptive":
        llm.engine.set_speculation("adaptive")
    else:
        llm.engine.set_speculation("static", int(base.removeprefix("static")))
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    outs = []
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    for start in range(0, len(prompts), batch):
        outs += llm.generate(prompts[start:start + batch], params)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    wall = time.perf_counter() - t0
    tokens = sum(len(o.token_ids) for o in outs)
    passes = sum(o.stats.num_target_passes for o in outs)
    return dict(tokens=tokens, wall_s=wall, tokens_per_s=tokens / wall, tokens_per_pass=tokens / max(passes, 1),
                token_ids=[list(o.token_ids) for o in outs])


def agreement(runs: list[dict], base: list[list[int]]) -> tuple[int, float]:
    """How many sequences equal the baseline's in every round, and the mean length of the
    common prefix (over rounds and sequences)."""
    same = sum(all(r["token_ids"][i] == seq for r in runs) for i, seq in enumerate(base))
    prefixes = []
    for r in runs:
        for got, want in zip(r["token_ids"], base):
            n = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))
            prefixes.append(n)
    return same, sum(prefixes) / max(len(prefixes), 1)



def grow_main(argv=None):
    p = argparse.ArgumentParser(description="grow a checkpoint to a model's shapes", formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--src", required=True, help="a checkpoint directory or embedded:NAME")
    p.add_argument("--shape", required=True, choices=sorted(SHAPES))
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--tiny", type=float, default=1e-6, help="std of the near-zero writes")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    p.add_argument("--check", action="store_true",
                   help="then compare both through transformers on the CPU (slow for 8B shapes)")
    args = p.parse_args(argv)
    out = grow(args.src, args.out, SHAPES[args.shape], args.tiny, args.seed, args.device, getattr(torch, args.dtype))
    if args.check:
        torch.manual_seed(0)
        print(compare(args.src, out, torch.randint(5, 4096, (1, 64))), flush=True)



def speed_main(argv=None) -> None:
    ap = argparse.ArgumentParser(description="each setting's speed and exactness", formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", required=True)
    ap.add_argument("--draft", required=True)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--num-blocks", type=int, default=4096)
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 16, 64])
    ap.add_argument("--settings", nargs="+", default=["static0", "static1", "static2", "static3", "static4",
                                                      "static6", "adaptive"])
    ap.add_argument("--num-prompts", type=int, default=16, help="per batch size: at least the batch")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--prompt-tokens", type=int, default=96)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--out", default=None)
    ap.add_argument("--cuda-graphs", action="store_true", help="replay uniform forwards from CUDA graphs")
    args = ap.parse_args(argv)
    if "static0" not in args.settings:
        args.settings.insert(0, "static0")

    t0 = time.time()
    llm = LLM(target=args.target, draft=args.draft, dtype=args.dtype, device=args.device,
              num_blocks=args.num_blocks, spec_mode="adaptive", cuda_graphs=args.cuda_graphs)
    print(f"loaded and calibrated in {time.time() - t0:.0f} s on {llm.engine.device}", flush=True)
    device = (torch.cuda.get_device_name() if llm.engine.device.type == "cuda" else "cpu")
    # Warm every (batch, setting) once before timing: a Triton kernel compiles a variant at
    # the first use of a new shape or value class, which would fall inside a short cell.
    for batch in args.batch:
        warm = held_out_prompts(batch, 32, llm.tokenizer)
        for s in args.settings:
            run(llm, s, warm, batch, 8)

    samples: dict = {}
    for r in range(args.rounds):
        for batch in args.batch:
            prompts = held_out_prompts(max(batch, args.num_prompts), args.prompt_tokens, llm.tokenizer)
            order = args.settings[r % len(args.settings):] + args.settings[:r % len(args.settings)]
            for s in order:
                res = run(llm, s, prompts, batch, args.max_tokens)
                samples.setdefault((batch, s), []).append(res)
                print(f"round {r} batch {batch} {s}: {res['tokens_per_s']:.1f} tok/s, "
                      f"{res['tokens_per_pass']:.2f} tok/pass", flush=True)

    commit = git_commit()
    print(f"\ndevice: {device}; commit {commit}; dtype {args.dtype}; cuda_graphs {args.cuda_graphs}; {args.num_prompts}+ held-out prompts of <= "
          f"{args.prompt_tokens} tokens, {args.max_tokens} generated each, greedy; median of {args.rounds} rounds")
    print("| batch | setting | tokens/s | tokens per target pass | vs static0 | sequences equal to static0's "
          "(all rounds) | mean tokens before the first difference |")
    print("|---|---|---|---|---|---|---|")
    rows = []
    for batch in args.batch:
        base = sorted(samples[batch, "static0"], key=lambda x: x["tokens_per_s"])[args.rounds // 2]
        for s in args.settings:
            runs = samples[batch, s]
            med = sorted(runs, key=lambda x: x["tokens_per_s"])[args.rounds // 2]
            same_seqs, prefix = agreement(runs, base["token_ids"])
            rows.append(dict(batch=batch, setting=s, tokens_per_s=med["tokens_per_s"],
                             tokens_per_pass=med["tokens_per_pass"], same_sequences=same_seqs,
                             sequences=len(base["token_ids"]), mean_common_prefix=prefix))
            print(f"| {batch} | {s} | {med['tokens_per_s']:.1f} | {med['tokens_per_pass']:.2f} | "
                  f"{med['tokens_per_s'] / base['tokens_per_s']:.2f}x | {same_seqs}/{len(base['token_ids'])} "
                  f"| {prefix:.1f} |")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(device=device, commit=commit, args=vars(args), rows=rows), f, indent=2)



def main(argv=None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    commands = {"grow": grow_main, "speed": speed_main}
    if not argv or argv[0] not in commands:
        sys.exit("usage: python -m benchmarks.pair grow|speed ... (see the module docstring)")
    commands[argv[0]](argv[1:])


if __name__ == "__main__":
    main()
