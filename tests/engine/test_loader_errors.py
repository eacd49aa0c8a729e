"""Every way a checkpoint directory can be wrong gives a ModelLoadError naming the file/tensor;
and the valid variants (sharded weights, eos lists, dtype "auto") load."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from specserve.errors import ModelLoadError
from specserve.model.loader import (load_eos_token_ids, load_hf_config, load_model, load_sampling_defaults,
                                    load_tokenizer)
from tests.checkpoints import rewrite_config


@pytest.fixture
def ckpt(tiny_llama, tmp_path):
    """A private copy of the tiny Llama checkpoint that a test may break."""
    return shutil.copytree(tiny_llama, tmp_path / "ckpt")


def edit_weights(path, fn) -> None:
    tensors = load_file(str(path / "model.safetensors"))
    fn(tensors)
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})


def load(path):
    return load_model(path, progress=False)


def test_missing_directory(tmp_path):
    with pytest.raises(ModelLoadError, match="model directory not found: .*nowhere"):
        load(tmp_path / "nowhere")


def test_missing_config(ckpt):
    (ckpt / "config.json").unlink()
    with pytest.raises(ModelLoadError, match=r"config\.json not found in .*ckpt"):
        load(ckpt)


def test_invalid_json_config(ckpt):
    (ckpt / "config.json").write_text('{"architectures": ["LlamaForCausalLM"],')
    with pytest.raises(ModelLoadError, match=r"ckpt/config\.json is not valid JSON"):
        load(ckpt)


def test_unsupported_architecture(ckpt):
    rewrite_config(ckpt, architectures=["GPT2LMHeadModel"])
    with pytest.raises(ModelLoadError) as e:
        load_hf_config(ckpt)
    msg = str(e.value)
    assert "GPT2LMHeadModel" in msg and "config.json" in msg
    for name in ("LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM", "MistralForCausalLM"):
        assert name in msg


def test_no_safetensors(ckpt):
    (ckpt / "model.safetensors").unlink()
    with pytest.raises(ModelLoadError, match=r"no \*\.safetensors weight files in .*ckpt"):
        load(ckpt)


def test_only_pytorch_bin(ckpt):
    (ckpt / "model.safetensors").unlink()
    (ckpt / "pytorch_model.bin").write_bytes(b"not really a pickle")
    with pytest.raises(ModelLoadError, match=r"pytorch_model\*\.bin .*not supported.*convert"):
        load(ckpt)


def test_corrupt_safetensors(ckpt):
    (ckpt / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{garbage header")
    with pytest.raises(ModelLoadError, match=r"model\.safetensors: corrupt or truncated"):
        load(ckpt)


def test_truncated_safetensors(ckpt):
    data = (ckpt / "model.safetensors").read_bytes()
    (ckpt / "model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(ModelLoadError, match=r"ckpt/model\.safetensors: corrupt or truncated"):
        load(ckpt)


def test_missing_tensor(ckpt):
    edit_weights(ckpt, lambda t: t.pop("model.layers.1.mlp.up_proj.weight"))
    with pytest.raises(ModelLoadError, match=r"missing tensor.*model\.safetensors.*model\.layers\.1\.mlp\.up_proj\.weight"):
        load(ckpt)


def test_missing_lm_head_when_untied(ckpt):
    edit_weights(ckpt, lambda t: t.pop("lm_head.weight"))
    with pytest.raises(ModelLoadError, match=r"missing tensor.*lm_head\.weight"):
        load(ckpt)


def test_wrong_shape(ckpt):
    def shrink(t):
        t["model.layers.0.self_attn.k_proj.weight"] = torch.zeros(16, 64)

    edit_weights(ckpt, shrink)
    with pytest.raises(ModelLoadError) as e:
        load(ckpt)
    msg = str(e.value)
    assert "model.layers.0.self_attn.k_proj.weight" in msg and "model.safetensors" in msg
    assert "[16, 64]" in msg and "expected [32, 64]" in msg


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), 1e39])   # 1e39: finite in float64, not in float32
def test_weights_that_are_not_finite_are_named(ckpt, bad):
    def spoil(t):
        t["model.layers.1.mlp.down_proj.weight"] = t["model.layers.1.mlp.down_proj.weight"].double()
        t["model.layers.1.mlp.down_proj.weight"][3, 5] = bad

    edit_weights(ckpt, spoil)
    with pytest.raises(ModelLoadError, match=r"model\.layers\.1\.mlp\.down_proj\.weight in .*model\.safetensors "
                                             r"holds NaN or infinite values \(as torch.float32"):
        load_model(ckpt, dtype="float32", progress=False)


def test_unexpected_tensor(ckpt):
    def add(t):
        t["model.layers.0.mlp.gate_proj.bias"] = torch.zeros(128)

    edit_weights(ckpt, add)
    with pytest.raises(ModelLoadError, match=r"unexpected tensors .*model\.layers\.0\.mlp\.gate_proj\.bias \(in model\.safetensors\)"):
        load(ckpt)


def test_ignorable_extras_load(ckpt):
    """Rotary inv_freq buffers are recomputed, so older checkpoints that carry them still load."""

    def add(t):
        t["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.ones(8)

    edit_weights(ckpt, add)
    model, _ = load(ckpt)
    expected = load_file(str(ckpt / "model.safetensors"))["model.layers.0.self_attn.q_proj.weight"]
    q_rows = expected.shape[0]  # q is the first block of the fused [q; k; v] projection
    assert torch.equal(model.layers[0].attention.wqkv.weight[:q_rows], expected)


def test_tied_checkpoint_may_carry_lm_head(tmp_path):
    from tests.checkpoints import make_checkpoint

    path = make_checkpoint(tmp_path, "qwen2", with_tokenizer=False, tie_word_embeddings=True)
    edit_weights(path, lambda t: t.__setitem__("lm_head.weight", t["model.embed_tokens.weight"].clone()))
    model, args = load(path)
    assert args.tie_word_embeddings and model.output.weight is model.tok_embeddings.weight


def test_sharded_checkpoint_loads_and_missing_shard_is_named(ckpt):
    tensors = load_file(str(ckpt / "model.safetensors"))
    names = sorted(tensors)
    shards = {"model-00001-of-00002.safetensors": names[:10], "model-00002-of-00002.safetensors": names[10:]}
    weight_map = {}
    for shard, shard_names in shards.items():
        save_file({n: tensors[n] for n in shard_names}, str(ckpt / shard), metadata={"format": "pt"})
        weight_map.update({n: shard for n in shard_names})
    (ckpt / "model.safetensors").unlink()
    (ckpt / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))

    model, _ = load(ckpt)
    for hf_name, ours in [("model.norm.weight", model.norm.weight), ("lm_head.weight", model.output.weight)]:
        assert torch.equal(ours, tensors[hf_name])

    (ckpt / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(ModelLoadError, match=r"shard model-00002-of-00002\.safetensors .*index\.json is missing"):
        load(ckpt)


def test_dtype_auto(tmp_path):
    from tests.checkpoints import make_checkpoint

    path = make_checkpoint(tmp_path, "llama", dtype=torch.bfloat16, with_tokenizer=False)
    model, args = load_model(path, dtype="auto", progress=False)
    assert args.torch_dtype == "bfloat16" and model.dtype == torch.float32  # CPU: bf16 -> f32
    model, _ = load_model(path, dtype="bfloat16", progress=False)
    assert model.dtype == torch.bfloat16
    with pytest.raises(ModelLoadError, match="unknown dtype 'float8'"):
        load_model(path, dtype="float8", progress=False)


def test_eos_token_ids(ckpt):
    assert load_eos_token_ids(ckpt) == [1]
    (ckpt / "generation_config.json").write_text(json.dumps({"eos_token_id": [1, 7]}))
    assert load_eos_token_ids(ckpt) == [1, 7]
    (ckpt / "generation_config.json").unlink()
    rewrite_config(ckpt, eos_token_id=5)
    assert load_eos_token_ids(ckpt) == [5]  # falls back to config.json


def test_tokenizer(ckpt):
    tok = load_tokenizer(ckpt)
    assert tok.is_fast and tok.eos_token_id == 1
    text = "def f(x): return x  # Café 東京 🙂"
    assert tok.decode(tok.encode(text, add_special_tokens=False)) == text
    chat = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    assert chat.startswith("<|bos|>") and chat.endswith("<|assistant|>")
    for f in ("tokenizer.json", "tokenizer_config.json"):
        (ckpt / f).unlink()
    with pytest.raises(ModelLoadError, match="no tokenizer.json or tokenizer_config.json in .*ckpt"):
        load_tokenizer(ckpt)


def test_sampling_defaults_from_generation_config(ckpt):
    """generation_config.json's temperature, top_p, top_k and repetition_penalty are the
    model's sampling defaults (vLLM applies them); other keys are not; a value SamplingParams
    refuses names the file."""
    file = ckpt / "generation_config.json"
    base = json.loads(file.read_text()) if file.is_file() else {}
    file.write_text(json.dumps({**base, "temperature": 0.6, "top_p": 0.95, "top_k": 20, "do_sample": True,
                                "max_new_tokens": 9}))
    assert load_sampling_defaults(ckpt) == {"temperature": 0.6, "top_p": 0.95, "top_k": 20}
    file.write_text(json.dumps({**base, "temperature": -1.0}))
    with pytest.raises(ModelLoadError, match="generation_config.json: temperature must be"):
        load_sampling_defaults(ckpt)
    file.unlink()
    assert load_sampling_defaults(ckpt) == {}
