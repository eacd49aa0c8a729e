"""Tiny random Hugging Face checkpoints for tests: `from tests.checkpoints import make_checkpoint, make_tokenizer`.

make_checkpoint writes a real HF directory (config.json, model.safetensors,
generation_config.json, tokenizer files) built by transformers itself, so our loader and
forward are compared against the reference implementation on exactly the same files.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

BOS, EOS, PAD = "<|bos|>", "<|eos|>", "<|pad|>"
# `brief` is a template variable of the kind chat_template_kwargs set (Qwen3's enable_thinking).
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}"
    "{% if not (loop.last and continue_final_message) %}{{ eos_token }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% if brief %}In short:{% endif %}{% endif %}"
)

# Fixed training text: English, code and some non-ASCII, so that merges are varied and
# multi-byte characters exist in the vocabulary.
CORPUS = [
    "The quick brown fox jumps over the lazy dog. The dog sleeps in the sun all day.",
    "Speculative decoding lets a small draft model propose tokens that a large model verifies.",
    "Once upon a time there was a little cat who liked to read books about the sea and the stars.",
    "def fibonacci(n):\n    a, b = 0, 1\n    for _ in range(n):\n        a, b = b, a + b\n    return a\n",
    "for (int i = 0; i < n; ++i) { sum += values[i] * weights[i]; }",
    "import torch\nx = torch.randn(4, 8)\nprint(x.shape, x.mean().item())\n",
    "Café, naïve, résumé, 東京, Здравствуйте, مرحبا, emoji 🙂🚀 and math ∑ ∫ √ π ≈ 3.14159.",
    "Hello! How are you today? I am fine, thank you. What would you like to talk about?",
    "Tokens, blocks, slots and caches: the paged attention kernel reads keys from many blocks.",
] * 4


def make_tokenizer(dir) -> object:
    """Train a ~400-token byte-level BPE on CORPUS and save it (a PreTrainedTokenizerFast with
    bos/eos/pad and a chat template) into dir. Returns the transformers tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    dir = Path(dir)
    dir.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=[BOS, EOS, PAD],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS, trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=BOS, eos_token=EOS, pad_token=PAD)
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(str(dir))
    return fast


_CONFIGS = {
    "llama": ("LlamaConfig", {}),
    "qwen2": ("Qwen2Config", {}),
    # Qwen3: head_dim deliberately != hidden_size / num_heads (64 / 4 = 16).
    "qwen3": ("Qwen3Config", {"head_dim": 32}),
    "mistral": ("MistralConfig", {"sliding_window": None}),
}


def make_checkpoint(
    dir,
    arch: str = "llama",
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
    with_tokenizer: bool = True,
    **config_overrides,
) -> Path:
    """A tiny random-init `arch` checkpoint saved by transformers into dir (created).

    Weights are drawn with initializer_range 0.15 (and random norm weights and biases), so
    logits are spread out and greedy generation does not repeat one token forever.
    config_overrides go to the transformers config (e.g. num_hidden_layers=3,
    tie_word_embeddings=True, rope_scaling={...}, rope_theta=...).
    """
    import transformers
    from transformers import AutoModelForCausalLM, GenerationConfig

    if arch not in _CONFIGS:
        raise ValueError(f"arch must be one of {sorted(_CONFIGS)}, got {arch!r}")
    dir = Path(dir)
    dir.mkdir(parents=True, exist_ok=True)
    if with_tokenizer:
        tokenizer = make_tokenizer(dir)
        vocab_size, bos_id, eos_id, pad_id = len(tokenizer), tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id
    else:
        vocab_size, bos_id, eos_id, pad_id = 384, 0, 1, 2
    class_name, arch_kwargs = _CONFIGS[arch]
    kwargs = dict(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        rms_norm_eps=1e-6,
        initializer_range=0.15,
        tie_word_embeddings=False,
        bos_token_id=bos_id,
        eos_token_id=eos_id,
        pad_token_id=pad_id,
    )
    kwargs.update(arch_kwargs)
    kwargs.update(config_overrides)
    config = getattr(transformers, class_name)(**kwargs)

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:  # all-ones norms would hide a mixed-up norm weight
                p.uniform_(0.5, 1.5)
            elif name.endswith("bias"):  # zero biases would hide a missing bias
                p.normal_(0.0, 0.1)
    model = model.to(dtype)
    model.save_pretrained(str(dir))
    GenerationConfig(bos_token_id=bos_id, eos_token_id=eos_id, pad_token_id=pad_id).save_pretrained(str(dir))
    assert (dir / "model.safetensors").is_file(), "expected transformers to write model.safetensors"
    return dir


def make_float32_pair(root) -> tuple[Path, Path]:
    """A 2-layer float32 target and an unrelated 1-layer draft (random init, the same
    tokenizer) under root: a small pair whose draft is accepted now and then."""
    root = Path(root)
    target = make_checkpoint(root / "target", "llama", dtype=torch.float32, num_hidden_layers=2)
    draft = make_checkpoint(root / "draft", "llama", dtype=torch.float32, seed=1, num_hidden_layers=1)
    return target, draft


def make_noisy_copy(src, dest, seed: int, scale: float = 0.05) -> Path:
    """A copy of the checkpoint at src with noise on every weight (scale times the weight's
    std): a draft of src that accepts some tokens and rejects others."""
    import shutil

    from safetensors.torch import load_file, save_file

    dest = Path(dest)
    shutil.copytree(src, dest)
    sd = load_file(dest / "model.safetensors")
    g = torch.Generator().manual_seed(seed)
    sd = {k: v + scale * v.std() * torch.randn(v.shape, generator=g, dtype=v.dtype) for k, v in sd.items()}
    save_file(sd, dest / "model.safetensors", metadata={"format": "pt"})
    return dest


def rewrite_config(dir, **changes) -> dict:
    """Edit config.json in place (None deletes a key); returns the new contents."""
    file = Path(dir) / "config.json"
    data = json.loads(file.read_text())
    for key, value in changes.items():
        if value is None:
            data.pop(key, None)
        else:
            data[key] = value
    file.write_text(json.dumps(data, indent=2))
    return data

