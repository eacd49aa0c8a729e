"""Our forward over the paged pool == transformers' forward on the same checkpoint.

The reference is AutoModelForCausalLM on the very same directory, fed the whole sequence at
once. Ours is fed through a block table with shuffled, non-contiguous block ids, in one
prefill, in chunks, one token at a time, and batched with another sequence.
"""

from __future__ import annotations

import json
import random

import pytest
import torch

from specserve.model.attention import AttentionMetadata
from specserve.model.llama import CausalLM
from specserve.model.loader import load_model
from tests.checkpoints import make_checkpoint, rewrite_config

ARCHS = ["llama", "qwen2", "qwen3", "mistral"]
BLOCK_SIZE = 4
NUM_BLOCKS = 40


def make_meta(
    seqs: list[tuple[list[int], int, int]],  # per sequence: (block_table, ctx_len, q_len)
    block_size: int,
) -> tuple[AttentionMetadata, torch.Tensor]:
    """Metadata of one flattened step, and the positions [T] of its tokens."""
    slots, positions, cu = [], [], [0]
    for block_table, ctx_len, q_len in seqs:
        for p in range(ctx_len, ctx_len + q_len):
            slots.append(block_table[p // block_size] * block_size + p % block_size)
            positions.append(p)
        cu.append(cu[-1] + q_len)
    max_blocks = max(len(bt) for bt, _, _ in seqs)
    block_tables = torch.tensor([bt + [0] * (max_blocks - len(bt)) for bt, _, _ in seqs], dtype=torch.int32)
    seq_lens = [ctx + q for _, ctx, q in seqs]
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.int64),
        block_tables=block_tables,
        cu_query_lens=torch.tensor(cu, dtype=torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        max_query_len=max(q for _, _, q in seqs),
        max_seq_len=max(seq_lens),
    )
    return meta, torch.tensor(positions, dtype=torch.int64)


def random_block_tables(num_tokens: list[int], seed: int = 0) -> list[list[int]]:
    """Disjoint, shuffled block ids from one pool: one table per sequence."""
    ids = list(range(NUM_BLOCKS))
    random.Random(seed).shuffle(ids)
    tables = []
    for n in num_tokens:
        k = -(-n // BLOCK_SIZE)
        tables.append(ids[:k])
        ids = ids[k:]
    return tables


def prompt_ids(n: int, vocab_size: int, seed: int = 0) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab_size, (n,), generator=g).tolist()  # skip bos/eos/pad


def run_chunks(model: CausalLM, ids: list[int], chunk_lens: list[int], block_table: list[int]) -> torch.Tensor:
    """Feed one sequence through the pool chunk by chunk; logits of every token [len(ids), V]."""
    assert sum(chunk_lens) == len(ids)
    kv_caches = model.make_kv_caches(NUM_BLOCKS, BLOCK_SIZE)
    out, start = [], 0
    for n in chunk_lens:
        meta, positions = make_meta([(block_table, start, n)], BLOCK_SIZE)
        with torch.no_grad():
            hidden = model(torch.tensor(ids[start : start + n]), positions, kv_caches, meta)
            out.append(model.compute_logits(hidden))
        start += n
    return torch.cat(out)


def hf_logits(path, ids: list[int], dtype=torch.float32) -> torch.Tensor:  # [len(ids), V]
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype, attn_implementation="sdpa").eval()
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0]


@pytest.mark.parametrize("arch", ARCHS)
def test_prefill_and_decode_match_transformers(arch, tiny_checkpoints):
    path = tiny_checkpoints[arch]
    model, args = load_model(path, dtype=torch.float32, progress=False)
    ids = prompt_ids(30, args.vocab_size)
    (table,) = random_block_tables([30])
    expected = hf_logits(path, ids)

    one_prefill = run_chunks(model, ids, [30], table)
    assert one_prefill.dtype == torch.float32 and one_prefill.shape == (30, args.vocab_size)
    torch.testing.assert_close(one_prefill, expected, atol=1e-4, rtol=1e-4)

    # Two prefill chunks that end mid-block, then decode steps one token at a time.
    chunked = run_chunks(model, ids, [11, 9] + [1] * 10, table)
    torch.testing.assert_close(chunked, expected, atol=1e-4, rtol=1e-4)


def test_checkpoint_logits_are_not_degenerate(tiny_llama):
    """The test checkpoints must make greedy decoding move (else agreement tests prove little)."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(tiny_llama), dtype=torch.float32).eval()
    out = hf.generate(torch.tensor([[5, 17, 42]]), max_new_tokens=24, do_sample=False, eos_token_id=None)
    assert len(set(out[0, 3:].tolist())) >= 4
    logits = hf_logits(tiny_llama, prompt_ids(30, hf.config.vocab_size))
    top2 = logits.topk(2, dim=-1).values
    assert (top2[:, 0] - top2[:, 1]).min() > 1e-3  # no near-ties for argmax to flip on


def test_batch_of_two_sequences_in_one_forward(tiny_qwen2):
    """Two sequences of different lengths flattened into one forward: a mixed prefill step,
    then a step with one sequence's second chunk and the other's decode token."""
    model, args = load_model(tiny_qwen2, dtype=torch.float32, progress=False)
    a, b = prompt_ids(30, args.vocab_size, seed=1), prompt_ids(13, args.vocab_size, seed=2)
    table_a, table_b = random_block_tables([30, 13], seed=3)
    kv_caches = model.make_kv_caches(NUM_BLOCKS, BLOCK_SIZE)

    def step(seqs, tokens):
        meta, positions = make_meta(seqs, BLOCK_SIZE)
        with torch.no_grad():
            return model.compute_logits(model(torch.tensor(tokens), positions, kv_caches, meta))

    first = step([(table_a, 0, 19), (table_b, 0, 12)], a[:19] + b[:12])  # [31, V]
    second = step([(table_a, 19, 11), (table_b, 12, 1)], a[19:] + b[12:])  # [12, V]
    ours_a = torch.cat([first[:19], second[:11]])
    ours_b = torch.cat([first[19:], second[11:]])
    torch.testing.assert_close(ours_a, hf_logits(tiny_qwen2, a), atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(ours_b, hf_logits(tiny_qwen2, b), atol=1e-4, rtol=1e-4)


ROPE_SCALINGS = {
    "linear": {"rope_type": "linear", "factor": 4.0},
    "llama3": {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64,
    },
}


@pytest.mark.parametrize("kind", sorted(ROPE_SCALINGS))
def test_rope_scaling_matches_transformers(kind, tmp_path):
    path = make_checkpoint(tmp_path, "llama", rope_theta=500000.0, rope_scaling=dict(ROPE_SCALINGS[kind]))
    model, args = load_model(path, dtype=torch.float32, progress=False)
    assert args.rope_scaling["rope_type"] == kind and args.rope_theta == 500000.0
    ids = prompt_ids(30, args.vocab_size)
    (table,) = random_block_tables([30])
    expected = hf_logits(path, ids)
    torch.testing.assert_close(run_chunks(model, ids, [17, 13], table), expected, atol=1e-4, rtol=1e-4)

    # Scaling really changes the result (else this test could not catch it being ignored).
    default_model, _ = load_model(make_checkpoint(tmp_path / "plain", "llama", rope_theta=500000.0), progress=False)
    plain = run_chunks(default_model, ids, [30], table)
    assert (plain - expected).abs().max() > 1e-2


def test_legacy_rope_fields_in_config_json(tmp_path):
    """Real checkpoints on disk say rope_theta + rope_scaling {"type": ...}, not rope_parameters."""
    path = make_checkpoint(tmp_path, "llama", rope_theta=20000.0, rope_scaling={"rope_type": "linear", "factor": 2.0})
    expected = hf_logits(path, prompt_ids(24, 400))
    rewrite_config(path, rope_parameters=None, rope_theta=20000.0, rope_scaling={"type": "linear", "factor": 2.0})
    assert "rope_parameters" not in json.loads((path / "config.json").read_text())
    model, args = load_model(path, progress=False)
    assert args.rope_theta == 20000.0 and args.rope_scaling == {"rope_type": "linear", "factor": 2.0}
    (table,) = random_block_tables([24])
    torch.testing.assert_close(run_chunks(model, prompt_ids(24, 400), [24], table), expected, atol=1e-4, rtol=1e-4)


def test_tied_and_untied_embeddings(tmp_path, tiny_llama):
    from safetensors import safe_open

    path = make_checkpoint(tmp_path, "qwen2", tie_word_embeddings=True)
    with safe_open(str(path / "model.safetensors"), "pt") as f:
        assert "lm_head.weight" not in f.keys()
    model, args = load_model(path, progress=False)
    assert args.tie_word_embeddings and model.output.weight is model.tok_embeddings.weight
    ids = prompt_ids(20, args.vocab_size)
    (table,) = random_block_tables([20])
    torch.testing.assert_close(run_chunks(model, ids, [20], table), hf_logits(path, ids), atol=1e-4, rtol=1e-4)

    untied, untied_args = load_model(tiny_llama, progress=False)
    assert not untied_args.tie_word_embeddings
    assert not torch.equal(untied.output.weight, untied.tok_embeddings.weight)


def _exact_float64_hf(monkeypatch):
    """transformers computes RMSNorm and the RoPE angles in float32 even for a float64 model;
    make its Llama do them in float64, so it is a float64 reference for ours."""
    from transformers.models.llama import modeling_llama as ml

    def rms_forward(self, x):
        return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon))

    def rope_forward(self, x, position_ids):
        cfg = self.config
        dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        theta = cfg.rope_parameters["rope_theta"]
        inv_freq = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
        freqs = position_ids[..., None].double() * inv_freq  # [1, T, D/2]
        emb = torch.cat([freqs, freqs], dim=-1)
        return emb.cos().to(x.dtype), emb.sin().to(x.dtype)

    monkeypatch.setattr(ml.LlamaRMSNorm, "forward", rms_forward)
    monkeypatch.setattr(ml.LlamaRotaryEmbedding, "forward", rope_forward)


def test_float64_matches_to_1e9(tiny_llama, monkeypatch):
    _exact_float64_hf(monkeypatch)
    model, args = load_model(tiny_llama, dtype=torch.float64, progress=False)
    assert model.rope_cos.dtype == torch.float64
    ids = prompt_ids(30, args.vocab_size)
    (table,) = random_block_tables([30])
    ours = run_chunks(model, ids, [13, 7] + [1] * 10, table)
    assert ours.dtype == torch.float64
    expected = hf_logits(tiny_llama, ids, dtype=torch.float64)
    torch.testing.assert_close(ours, expected, atol=1e-6, rtol=1e-6)
    if not _reference_attention_keeps_float64():
        pytest.xfail("kernels/reference.py paged_attention takes its softmax in float32 for a float64 "
                     "model (scores.float()), so float64 agreement stops near 1e-7")
    torch.testing.assert_close(ours, expected, atol=1e-9, rtol=1e-9)


def _reference_attention_keeps_float64() -> bool:
    """Does the CPU paged attention compute a float64 model's attention in float64?"""
    from specserve.kernels import reference

    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 1, 4, dtype=torch.float64, generator=g)  # [T, H, D]
    k_cache = torch.randn(1, 2, 1, 4, dtype=torch.float64, generator=g)  # [NB, BS, Hkv, D]
    v_cache = torch.randn(1, 2, 1, 4, dtype=torch.float64, generator=g)
    meta, _ = make_meta([([0], 0, 2)], block_size=2)
    out = reference.paged_attention(q, k_cache, v_cache, meta, 0.5)
    k, v = k_cache[0, :, 0], v_cache[0, :, 0]  # [2, D]
    scores = (q[:, 0] @ k.T * 0.5).masked_fill(torch.tensor([[False, True], [False, False]]), float("-inf"))
    exact = torch.softmax(scores, dim=-1) @ v  # [2, D]
    return torch.allclose(out[:, 0], exact, atol=1e-14, rtol=0)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_runs_close_to_float32(dtype, tiny_qwen3):
    model, args = load_model(tiny_qwen3, dtype=dtype, progress=False)
    ref, _ = load_model(tiny_qwen3, dtype=torch.float32, progress=False)
    caches = model.make_kv_caches(NUM_BLOCKS, BLOCK_SIZE)
    assert caches[0][0].dtype == dtype
    ids = prompt_ids(24, args.vocab_size)
    (table,) = random_block_tables([24])
    half = run_chunks(model, ids, [16, 8], table)
    full = run_chunks(ref, ids, [24], table)
    assert half.dtype == torch.float32
    err = (half - full).abs().max().item()
    assert err < 0.05 * full.abs().max().item(), err
    assert (half.argmax(-1) == full.argmax(-1)).float().mean() > 0.8


def test_kv_cache_shapes_and_bytes(tiny_qwen3):
    model, args = load_model(tiny_qwen3, progress=False)
    caches = model.make_kv_caches(num_blocks=7, block_size=8)
    assert len(caches) == args.num_layers == 2
    for k, v in caches:
        assert k.shape == v.shape == (7, 8, 2, 32)  # Qwen3 head_dim 32 != 64 / 4
        assert k.dtype == torch.float32 and not k.any()
    total = sum(k.nbytes + v.nbytes for k, v in caches)
    assert args.kv_bytes_per_block(8, torch.float32) * 7 == total
    assert args.kv_bytes_per_block(8, torch.bfloat16) * 2 == args.kv_bytes_per_block(8, torch.float32)


def test_transposed_weight_views_give_the_same_logits(tiny_qwen2):
    """keep_transposed_weights (what the loader does on CUDA): every linear becomes one
    torch.mm / addmm against a transposed view; the logits are F.linear's (qkv biases too)."""
    model, args = load_model(tiny_qwen2, dtype=torch.float32, progress=False)
    ids = prompt_ids(17, args.vocab_size, seed=4)
    table = random_block_tables([17], seed=5)[0]
    before = run_chunks(model, ids, [9, 8], table)
    assert model.keep_transposed_weights() == sum(isinstance(m, torch.nn.Linear) for m in model.modules())
    assert model.layers[0].attention.wqkv.bias is not None   # the addmm path runs
    after = run_chunks(model, ids, [9, 8], table)
    torch.testing.assert_close(after, before, rtol=1e-6, atol=1e-6)
