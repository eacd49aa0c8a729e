"""Penalties and logit biases keep speculation exact: greedy speculative output equals
target-only output with each of them on (float64), for model and n-gram drafters, chains and
trees, and target-only output equals a direct computation from transformers' logits. The
lossless test with a frequency penalty and a logit bias is in test_lossless.py."""

from __future__ import annotations

import pytest
import torch

from specserve import SamplingParams
from specserve.errors import InvalidRequestError
from tests.engine.test_logprobs import make_llm

PROMPTS = [[5, 6, 7], [10, 11, 12, 13, 10, 11, 12, 13, 10, 11], [200 + i for i in range(21)]]
MAX_TOKENS = 16
SETTINGS = {
    "none": {},
    "presence": dict(presence_penalty=1.5),
    "frequency": dict(frequency_penalty=1.0),
    "negative_frequency": dict(frequency_penalty=-1.5),   # rewards repeats: long accepted runs of one token
    "repetition": dict(repetition_penalty=1.4),
    "logit_bias": dict(logit_bias={17: 4.0, 33: 2.5, 1: -100.0}),
    "all": dict(presence_penalty=0.5, frequency_penalty=0.5, repetition_penalty=1.2, logit_bias={17: 3.0}),
}


def processed(logits: torch.Tensor, prompt: list[int], output: list[int], kw: dict) -> torch.Tensor:
    """The penalties applied by hand to one row of logits, as OpenAI and vLLM define them."""
    x = logits.clone()
    for t, b in kw.get("logit_bias", {}).items():
        x[t] += b
    r = kw.get("repetition_penalty", 1.0)
    for t in set(prompt) | set(output):
        x[t] = x[t] / r if x[t] > 0 else x[t] * r
    for t in set(output):
        x[t] -= kw.get("frequency_penalty", 0.0) * output.count(t) + kw.get("presence_penalty", 0.0)
    return x


def reference(hf, prompt: list[int], kw: dict) -> list[int]:
    out: list[int] = []
    with torch.no_grad():
        for _ in range(MAX_TOKENS):
            logits = hf(torch.tensor([prompt + out])).logits[0, -1]
            out.append(int(processed(logits, prompt, out, kw).argmax()))
    return out


@pytest.fixture(scope="module")
def target_only(models):
    llm = make_llm(models, "none")
    return {name: [o.token_ids for o in llm.generate(PROMPTS, SamplingParams(
        max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True, **kw))] for name, kw in SETTINGS.items()}


@pytest.mark.parametrize("name", ["frequency", "repetition", "logit_bias", "all"])
def test_target_only_applies_the_penalties(hf, target_only, name):
    assert target_only[name][2] == reference(hf, PROMPTS[2], SETTINGS[name])


@pytest.mark.parametrize("draft,tree", [("target", "chain"), ("weak", "chain"), ("weak", "fixed"),
                                        ("weak", "dynamic"), ("ngram", "chain")])
def test_greedy_speculation_is_exact_under_every_penalty(models, target_only, draft, tree):
    llm = make_llm(models, draft, tree)
    for name, kw in SETTINGS.items():
        params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True, **kw)
        assert [o.token_ids for o in llm.generate(PROMPTS, params)] == target_only[name], name
    assert llm.engine.spec.totals.num_accepted_tokens > 0
    llm.engine.pool.check_all_free()


def test_every_setting_changes_the_output(target_only):
    """Else the exactness test above would prove nothing."""
    for name in SETTINGS:
        assert name == "none" or target_only[name] != target_only["none"], name


@pytest.mark.parametrize("kw,param", [
    (dict(presence_penalty=2.5), "presence_penalty"), (dict(frequency_penalty=float("nan")), "frequency_penalty"),
    (dict(repetition_penalty=0.0), "repetition_penalty"), (dict(logit_bias={3: 101.0}), "logit_bias"),
    (dict(logit_bias={-1: 1.0}), "logit_bias"),
])
def test_penalty_settings_are_bounded(kw, param):
    with pytest.raises(InvalidRequestError) as e:
        SamplingParams(**kw)
    assert e.value.param == param


def test_a_bias_outside_the_vocabulary_is_refused(models):
    llm = make_llm(models, "none")
    with pytest.raises(InvalidRequestError, match="outside the vocabulary") as e:
        llm.engine.add_request(None, [5, 6], SamplingParams(logit_bias={10**6: 1.0}))
    assert e.value.param == "logit_bias"
