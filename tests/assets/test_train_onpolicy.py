"""scripts/train_pair.py's on-policy stage: prompts only from training files, labels that are
exactly what the served target emits, and a loss mask that covers the target's tokens only."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import torch

from specserve import LLM, SamplingParams

REPO = Path(__file__).resolve().parents[2]


def _train_module():
    spec = importlib.util.spec_from_file_location("train_pair", REPO / "scripts" / "train_pair.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


train = _train_module()

FUNC = '''def add(a, b):
    """Add two numbers and return the sum of them, as a number."""
    total = a + b
    # a comment long enough to push the cut past the minimum of 120 characters
    return total
'''


def _corpus() -> dict:
    files = [{"path": f"mod{i}.py", "held_out": False, "text": FUNC.replace("add", f"add{i}")}
             for i in range(6)]
    files.append({"path": "secret.py", "held_out": True,
                  "text": FUNC.replace("add", "held_out_name")})
    return {"files": files}


class _Tok:
    """Stands in for a `tokenizers.Tokenizer`: one id per character."""

    class _Enc:
        def __init__(self, ids):
            self.ids = ids

    def encode_batch(self, texts):
        return [self._Enc([ord(c) % 100 + 5 for c in t]) for t in texts]


def test_prompts_come_from_training_files_cut_like_the_benchmark_prompts(monkeypatch):
    texts = []
    tok = _Tok()
    original = tok.encode_batch
    monkeypatch.setattr(tok, "encode_batch", lambda t: texts.extend(t) or original(t))
    prompts = train.onpolicy_prompts(_corpus(), tok, num=8, seed=0, chat_fraction=0.25)
    assert len(prompts) == len(texts) == 8
    assert not any("held_out_name" in t for t in texts)
    chats = [t for t in texts if t.startswith("<|user|>")]
    assert len(chats) == 2 and all(t.endswith("<|assistant|>\n") for t in chats)
    for t in texts:
        if t not in chats:
            assert t.startswith("def add") and t.endswith("\n") and 120 <= len(t) <= 400
    assert all(len(p) <= train.CONTEXT // 4 for p in prompts)


def test_rows_label_only_the_generated_tokens():
    data = {"tokens": torch.tensor([[10, 11, 12, 13, 14, 4, 4], [20, 21, 22, 23, 24, 25, 26]],
                                   dtype=torch.int16),
            "prompt_lens": torch.tensor([2, 4]), "lengths": torch.tensor([5, 7])}
    inputs, labels = train.onpolicy_rows(data, torch.tensor([0, 1]))
    assert inputs.tolist() == [[10, 11, 12, 13, 14, 4], [20, 21, 22, 23, 24, 25]]
    # row 0: prompt 10 11, generated 12 13 14, then padding; row 1: prompt of 4, generated 24-26
    assert labels.tolist() == [[-100, 12, 13, 14, -100, -100], [-100, -100, -100, 24, 25, 26]]


def test_data_are_the_served_targets_greedy_tokens(tiny_llama, tmp_path):
    prompts = [[5, 6, 7, 8], [9, 10], [11, 12, 13, 14, 15, 16]]
    data = train.onpolicy_data(tmp_path, tiny_llama, prompts, max_new=6, threads=1)
    assert (tmp_path / "onpolicy.pt").is_file()
    llm = LLM(target=str(tiny_llama), dtype="float32", device="cpu", progress=False)
    outs = llm.generate(prompts, SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))
    for i, (p, o) in enumerate(zip(prompts, outs)):
        n = len(p) + 6
        assert data["prompt_lens"][i] == len(p) and data["lengths"][i] == n
        assert data["tokens"][i, :n].tolist() == p + o.token_ids
        assert (data["tokens"][i, n:] == train.PAD_ID).all()
    # a second call reads the cache instead of generating again
    assert torch.equal(train.onpolicy_data(tmp_path, tiny_llama, [], 6, 1)["tokens"], data["tokens"])
