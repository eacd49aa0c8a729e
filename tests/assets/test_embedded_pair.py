"""The embedded pair (specserve/assets/tiny-{target,draft}) as a user meets it: Hugging Face
folders that transformers and specserve both load to the same logits, a tokenizer that
round-trips any text, and a chat template the model answers in its own domain (Python).

SPECSERVE_PAIR_DIR points the tests at another export (e.g. a smoke run of
scripts/train_pair.py) instead of the shipped one."""

from __future__ import annotations

import json
import os
import random
from pathlib import Path

import pytest
import torch

import specserve.assets

ASSETS = Path(os.environ.get("SPECSERVE_PAIR_DIR", Path(specserve.assets.__file__).parent))
MODELS = ["tiny-target", "tiny-draft"]
FILES = ["config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
         "generation_config.json"]
END = "<|end|>"

TEXTS = [
    "",
    "def f(x):\n    return x + 1\n",
    "class A:\n\tdef __init__(self):  # tab\r\n        self.x = {'k': [1, 2.5e-3]}\r\n",
    "naïve café — “quotes” ½ ∑ ∫ ≠ 中文字符 日本語 한국어 עברית العربية",
    "emoji 🐍🚀👩‍💻 flags 🇫🇷 combining e\u0301 zero-width \u200b\u200d nbsp\u00a0end",
    "control \x00\x01\x7f bytes and trailing spaces   \n\n\n   ",
    "  leading spaces, <|end|> and <|user|> typed as text, <notspecial|>",
]


def _random_text(rng: random.Random, n: int) -> str:
    pools = [(0x20, 0x7E), (0x00, 0x1F), (0xA0, 0x24F), (0x370, 0x3FF), (0x4E00, 0x4FFF),
             (0x1F300, 0x1F64F), (0xE000, 0xE0FF)]
    chars = []
    for _ in range(n):
        lo, hi = rng.choice(pools)
        chars.append(chr(rng.randint(lo, hi)))
    return "".join(chars)


@pytest.fixture(scope="module")
def hf_tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(ASSETS / "tiny-target")


@pytest.fixture(scope="module", params=MODELS)
def hf_model(request):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(ASSETS / request.param, dtype=torch.float32)
    return request.param, model.eval()


@pytest.mark.parametrize("name", MODELS)
def test_folder_is_a_hugging_face_checkpoint(name):
    folder = ASSETS / name
    assert sorted(p.name for p in folder.iterdir()) == sorted(FILES)
    config = json.loads((folder / "config.json").read_text())
    assert config["model_type"] == "llama" and config["tie_word_embeddings"] is True
    tok_config = json.loads((folder / "tokenizer_config.json").read_text())
    gen_config = json.loads((folder / "generation_config.json").read_text())
    tokenizer = json.loads((folder / "tokenizer.json").read_text())
    end_id = next(t["id"] for t in tokenizer["added_tokens"] if t["content"] == END)
    assert tok_config["eos_token"] == END and "chat_template" in tok_config
    assert gen_config["eos_token_id"] == [end_id]

    from safetensors import safe_open

    with safe_open(str(folder / "model.safetensors"), framework="pt") as f:
        dtypes = {f.get_slice(k).get_dtype() for k in f.keys()}
    assert dtypes == {"BF16"}


def test_pair_shares_one_tokenizer_and_fits_the_size_budget():
    t, d = ASSETS / "tiny-target", ASSETS / "tiny-draft"
    assert (t / "tokenizer.json").read_bytes() == (d / "tokenizer.json").read_bytes()
    assert (t / "tokenizer_config.json").read_bytes() == (d / "tokenizer_config.json").read_bytes()
    ct, cd = (json.loads((p / "config.json").read_text()) for p in (t, d))
    assert ct["vocab_size"] == cd["vocab_size"]
    # the draft is much smaller: fewer layers is what makes its batch-1 step cheap
    assert cd["num_hidden_layers"] * 4 <= ct["num_hidden_layers"]
    total = sum(f.stat().st_size for p in (t, d) for f in p.iterdir())
    assert total < 25e6, f"embedded pair is {total / 1e6:.1f} MB, budget is 25 MB"


@pytest.mark.parametrize("text", TEXTS)
def test_tokenizer_round_trips_text(hf_tokenizer, text):
    ids = hf_tokenizer.encode(text, add_special_tokens=False)
    assert hf_tokenizer.decode(ids, skip_special_tokens=False) == text


def test_tokenizer_round_trips_random_unicode(hf_tokenizer):
    rng = random.Random(0)
    for _ in range(200):
        text = _random_text(rng, rng.randint(1, 80))
        ids = hf_tokenizer.encode(text, add_special_tokens=False)
        assert hf_tokenizer.decode(ids) == text, repr(text)


def test_specserve_tokenizer_matches_transformers(hf_tokenizer):
    from specserve.model.loader import load_eos_token_ids, load_tokenizer

    ours = load_tokenizer(ASSETS / "tiny-target")
    for text in TEXTS:
        assert ours.encode(text, add_special_tokens=False) == hf_tokenizer.encode(text, add_special_tokens=False)
    assert load_eos_token_ids(ASSETS / "tiny-target") == [hf_tokenizer.convert_tokens_to_ids(END)]


def test_chat_template_renders_the_training_format(hf_tokenizer):
    messages = [{"role": "system", "content": "You write Python."},
                {"role": "user", "content": "Return the sum of a and b."},
                {"role": "assistant", "content": "def add(a, b):\n    return a + b"},
                {"role": "user", "content": "Now the product."}]
    text = hf_tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert text == ("<|system|>\nYou write Python.<|end|>\n"
                    "<|user|>\nReturn the sum of a and b.<|end|>\n"
                    "<|assistant|>\ndef add(a, b):\n    return a + b<|end|>\n"
                    "<|user|>\nNow the product.<|end|>\n"
                    "<|assistant|>\n")
    ids = hf_tokenizer.encode(text, add_special_tokens=False)
    specials = [hf_tokenizer.convert_tokens_to_ids(t) for t in ("<|system|>", "<|user|>", "<|assistant|>", END)]
    assert all(s in ids for s in specials)
    without = hf_tokenizer.apply_chat_template(messages[:2], add_generation_prompt=False, tokenize=False)
    assert not without.endswith("<|assistant|>\n")


def test_model_answers_a_chat_prompt_with_python(hf_model, hf_tokenizer):
    name, model = hf_model
    messages = [{"role": "user", "content": "Return a copy of the list with duplicates removed, "
                                            "keeping the first occurrence of each item."}]
    prompt = hf_tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    ids = torch.tensor([hf_tokenizer.encode(prompt, add_special_tokens=False)])
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=48, do_sample=False)
    reply = hf_tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True)
    markers = ["def ", "return", "self", "for ", "if ", " in ", "):", "    "]
    assert sum(m in reply for m in markers) >= 2, f"{name} replied {reply!r}"


@torch.no_grad()
def test_specserve_forward_matches_transformers(hf_model, hf_tokenizer):
    """Prefill in two chunks then decode token by token through the paged KV cache: every
    row's logits equal transformers' full-sequence logits."""
    from specserve.model.attention import AttentionMetadata
    from specserve.model.loader import load_model

    name, hf = hf_model
    ours, _ = load_model(ASSETS / name, dtype=torch.float32, device="cpu", progress=False)
    text = 'def greet(name):\n    """Say hello — naïvely 🐍."""\n    return f"hello {name}"\n'
    ids = torch.tensor(hf_tokenizer.encode(text, add_special_tokens=False))  # [L]
    expected = hf(ids[None]).logits[0].float()  # [L, V]

    block_size = 4
    num_blocks = len(ids) // block_size + 2
    caches = ours.make_kv_caches(num_blocks, block_size)
    block_table = torch.arange(num_blocks, dtype=torch.int32)[None]

    def run(start: int, end: int) -> torch.Tensor:
        meta = AttentionMetadata(
            slot_mapping=torch.arange(start, end, dtype=torch.int64), block_tables=block_table,
            cu_query_lens=torch.tensor([0, end - start], dtype=torch.int32),
            seq_lens=torch.tensor([end], dtype=torch.int32), max_query_len=end - start, max_seq_len=end)
        hidden = ours.forward(ids[start:end], torch.arange(start, end), caches, meta)
        return ours.compute_logits(hidden)

    half = len(ids) // 2
    got = [run(0, half - 3), run(half - 3, half)] + [run(i, i + 1) for i in range(half, len(ids))]
    got = torch.cat(got)
    torch.testing.assert_close(got, expected, atol=2e-4, rtol=2e-4)
    assert torch.equal(got.argmax(-1), expected.argmax(-1))
