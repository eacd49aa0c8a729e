"""benchmarks/pair.py grow: a grown checkpoint has the new shapes and computes what the
embedded pair computes (through transformers, the reference of the HF layout, and through
our own engine), and a shape that cannot hold the original is refused by name."""

from __future__ import annotations

import json

import pytest
import torch

from benchmarks import pair as grow_pair
from specserve import LLM, SamplingParams

# head_dim 32 -> 64, GQA ratio 2 -> 4, 10 -> 13 layers (new layers between the old ones).
SMALL_TARGET = dict(hidden_size=512, num_hidden_layers=13, num_attention_heads=16, num_key_value_heads=4,
                    head_dim=64, intermediate_size=1024)


@pytest.fixture(scope="module")
def grown(tmp_path_factory):
    out = tmp_path_factory.mktemp("grown") / "target"
    grow_pair.grow("embedded:tiny-target", out, SMALL_TARGET, dtype=torch.float32, progress=False)
    return out


def test_grown_checkpoint_has_the_new_shapes(grown):
    config = json.loads((grown / "config.json").read_text())
    for key, value in SMALL_TARGET.items():
        assert config[key] == value
    assert (grown / "tokenizer.json").is_file()


def test_grown_target_computes_the_original(grown):
    torch.manual_seed(0)
    tokens = torch.randint(5, 4096, (1, 48))
    result = grow_pair.compare("embedded:tiny-target", grown, tokens)
    assert result["same_argmax"] == result["positions"] == 48
    assert result["logits_rel_gap"] < 2e-3


def test_grown_target_generates_the_originals_tokens(grown):
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    prompts = ["def parse(self, text):\n", "import os\n\nclass Cache:\n"]
    small = LLM(target="embedded:tiny-target", draft="none", dtype="float32", device="cpu", progress=False)
    big = LLM(target=str(grown), draft="none", dtype="float32", device="cpu", progress=False)
    want = [o.token_ids for o in small.generate(prompts, params)]
    got = [o.token_ids for o in big.generate(prompts, params)]
    assert got == want


@pytest.mark.parametrize("shape, words", [
    (dict(SMALL_TARGET, head_dim=48, num_attention_heads=8, hidden_size=384), "head_dim 48"),
    (dict(SMALL_TARGET, num_key_value_heads=16), "heads 16/16"),
    (dict(SMALL_TARGET, num_hidden_layers=4), "every size must grow"),
])
def test_shapes_that_cannot_hold_the_original_are_refused(tmp_path, shape, words):
    with pytest.raises(ValueError, match=words):
        grow_pair.grow("embedded:tiny-target", tmp_path / "x", shape, dtype=torch.float32, progress=False)
