"""What the sampling parameters mean, held to the references a client compares us with:
transformers' logits warpers/processors (TemperatureLogitsWarper -> TopKLogitsWarper ->
TopPLogitsWarper, RepetitionPenaltyLogitsProcessor), and vLLM V1's sampler and OpenAI server
(vllm/v1/sample/sampler.py, vllm/v1/sample/ops/topk_topp_sampler.py, vllm/sampling_params.py,
vllm/entrypoints/openai/protocol.py).

The target-only distribution (exactly and by sampling), penalties, seeds across engines and
batch mates, and how the HTTP fields map: top-k ties, n > 1 seeds, seed -1, the completions
max_tokens default, min_tokens against an explicit max_tokens.
"""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace

import pytest
import torch
from transformers import (AutoModelForCausalLM, RepetitionPenaltyLogitsProcessor, TemperatureLogitsWarper,
                          TopKLogitsWarper, TopPLogitsWarper)

from specserve import LLM, SamplingParams
from specserve.sampling import penalize, target_probs
from specserve.server.app import ApiError, _parse
from tests.checkpoints import make_checkpoint

pytestmark = pytest.mark.usefixtures("one_thread")   # tests/engine/conftest.py

PROMPT = [5, 6, 7]


def ours(logits: torch.Tensor, t: float, k: int, p: float) -> torch.Tensor:
    n = logits.shape[0]
    return target_probs(logits, torch.full((n,), t, dtype=torch.float64), torch.full((n,), k),
                        torch.full((n,), p, dtype=torch.float64))


def transformers_probs(logits: torch.Tensor, t: float, k: int, p: float) -> torch.Tensor:
    """transformers' generate order (and vLLM V1's): temperature, then top-k, then top-p."""
    x = TemperatureLogitsWarper(t)(None, logits.clone())
    if k > 0:
        x = TopKLogitsWarper(k)(None, x)
    if p < 1.0:
        x = TopPLogitsWarper(p)(None, x)
    return torch.softmax(x, dim=-1)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("semantics") / "target", "llama", dtype=torch.float64)


def make_llm(checkpoint) -> LLM:
    return LLM(target=str(checkpoint), dtype="float64", device="cpu", progress=False, num_blocks=256,
               block_size=4, draft="none")


@pytest.fixture(scope="module")
def llm(checkpoint):
    return make_llm(checkpoint)


@pytest.fixture(scope="module")
def raw_logits(checkpoint):
    """transformers' float64 logits of the token after PROMPT."""
    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float64).eval()
    with torch.no_grad():
        return model(torch.tensor([PROMPT])).logits[0, -1]


def parse(body: dict, chat: bool = False, max_model_len: int = 2048, defaults: dict | None = None):
    """server.app._parse on a stand-in server state: the SamplingParams of each choice."""
    state = SimpleNamespace(async_engine=SimpleNamespace(tokenizer=SimpleNamespace(decode=lambda ids: ""),
                                                         max_model_len=max_model_len),
                            max_token_bytes=64, model_name="m", sampling_defaults=defaults or {})
    choices, *_ = asyncio.run(_parse(state, json.dumps(body).encode(), chat))
    return [c.params for c in choices]


# -- what agrees ---------------------------------------------------------------------------------


@pytest.mark.parametrize("vocab", [12, 3000])   # the whole-row sort, and the top-candidates path
def test_target_probs_equal_transformers_warpers_without_ties(vocab):
    """softmax(logits / T) cut by top-k then top-p (the nucleus renormalised after top-k, the
    token that crosses p kept): transformers' warpers give the same vector on untied logits."""
    g = torch.Generator().manual_seed(0)
    for trial in range(150):
        logits = torch.randn(1, vocab, generator=g, dtype=torch.float64) * 3
        t = 0.05 + 2 * float(torch.rand(1, generator=g))
        k = [0, 1, 3, vocab // 2, vocab + 7][trial % 5]
        p = [1.0, 1e-9, 0.3, 0.9][trial % 4]
        expected = transformers_probs(logits, t, k, p)
        got = ours(logits, t, k, p)
        assert torch.equal(got > 0, expected > 0), (t, k, p)
        assert (got - expected).abs().max() < 1e-9, (t, k, p)


@pytest.mark.parametrize("penalty", [0.5, 1.7])   # < 1 rewards repeats
def test_repetition_penalty_equals_transformers_over_prompt_and_output(penalty):
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(2, 40, generator=g, dtype=torch.float64) * 2
    prompt, output = [1, 2, 2, 9], [3, 5, 5]
    x = logits.clone()
    penalize(x, [0, 1], SamplingParams(repetition_penalty=penalty), output, prompt, [[], [11]])
    processor = RepetitionPenaltyLogitsProcessor(penalty)
    assert torch.equal(x[0], processor(torch.tensor([prompt + output]), logits[:1].clone())[0])
    assert torch.equal(x[1], processor(torch.tensor([prompt + output + [11]]), logits[1:].clone())[0])


def test_presence_and_frequency_count_output_tokens_only():
    """vLLM/OpenAI: presence and frequency penalties see the output only (prompt tokens are
    the repetition penalty's); negative values reward."""
    logits = torch.zeros(1, 10, dtype=torch.float64)
    penalize(logits, [0], SamplingParams(presence_penalty=-1.5, frequency_penalty=0.25), [4, 4, 6], [4, 7, 7], [[]])
    expected = torch.zeros(10, dtype=torch.float64)
    expected[4], expected[6] = 1.5 - 0.5, 1.5 - 0.25
    assert torch.equal(logits[0], expected)


def test_target_only_samples_the_reference_distribution(llm, raw_logits):
    """3000 one-token draws with temperature, top-k, logit_bias and repetition penalty against
    the distribution computed from transformers' logits: nothing outside the kept set, and a
    chi-square below the p = 1e-3 critical value (16.27 for 3 degrees of freedom)."""
    kw = dict(temperature=0.5, top_k=4, logit_bias={3: 1.0}, repetition_penalty=1.5)
    x = raw_logits.clone()
    x[3] += 1.0
    for t in set(PROMPT):
        x[t] = x[t] / 1.5 if x[t] > 0 else x[t] * 1.5
    probs = transformers_probs(x[None], 0.5, 4, 1.0)[0]
    draws = []
    for _ in range(3):
        draws += [o.token_ids[0] for o in llm.generate([PROMPT] * 1000, SamplingParams(max_tokens=1, **kw))]
    counts = torch.bincount(torch.tensor(draws), minlength=len(probs)).double()
    support = probs > 0
    assert counts[~support].sum() == 0
    expected = probs[support] * len(draws)
    assert float(((counts[support] - expected) ** 2 / expected).sum()) < 16.27


def test_a_seed_reproduces_across_engines_and_batch_mates(checkpoint, llm):
    """Target-only: a seeded request draws the same tokens alone, beside unseeded, greedy and
    other seeded requests, and on a second engine."""
    params = lambda **kw: SamplingParams(max_tokens=12, ignore_eos=True, **kw)  # noqa: E731
    alone = llm.generate([PROMPT], params(seed=7))[0].token_ids
    crowded = llm.generate([[9, 9], PROMPT, [1, 2, 3, 4]], [params(), params(seed=7), params(temperature=0.0)])
    assert crowded[1].token_ids == alone
    assert llm.generate([PROMPT, [100] * 5], [params(seed=7), params(seed=8, top_k=3)])[0].token_ids == alone
    assert make_llm(checkpoint).generate([PROMPT], params(seed=7))[0].token_ids == alone
    assert llm.generate([PROMPT], params(seed=8))[0].token_ids != alone


def test_http_fields_map_as_vllm_maps_them():
    """n > 1 with a seed: choice i gets seed + i (vLLM's ParentRequest); top_k 0 and -1 are off;
    absent temperature/top_p are 1."""
    seeds = [p.seed for p in parse({"prompt": [1, 2, 3], "n": 3, "seed": 40})]
    assert seeds == [40, 41, 42]
    for top_k in (0, -1):
        (p,) = parse({"prompt": [1, 2, 3], "top_k": top_k})
        assert ours(torch.tensor([[2.0, 1.0, 0.0]]), p.temperature, max(p.top_k, 0), p.top_p).min() > 0
    (p,) = parse({"prompt": [1, 2, 3]})
    assert (p.temperature, p.top_p) == (1.0, 1.0)


def test_top_k_keeps_every_token_tied_with_the_kth():
    """transformers' TopKLogitsWarper removes only `scores < kth value`, and vLLM V1's
    apply_top_k_top_p masks `logits < kth value` too: tokens tied with the k-th logit all stay
    (ties at the boundary are common with bf16 logits)."""
    logits = torch.tensor([[3.0, 2.0, 2.0, 2.0, 1.0, 0.0]], dtype=torch.float64)
    expected = transformers_probs(logits, 1.0, 2, 1.0)          # tokens 0..3 kept
    assert torch.allclose(ours(logits, 1.0, 2, 1.0), expected)


def test_completions_max_tokens_defaults_to_16():
    """A /v1/completions body without max_tokens gets 16 tokens, as from OpenAI's legacy
    Completions API and from vLLM (CompletionRequest.max_tokens = 16); a chat gets the room
    left in the context, as vLLM."""
    (p,) = parse({"prompt": [1, 2, 3]})
    assert p.max_tokens == 16


def test_seed_minus_one_means_no_seed():
    """vLLM's SamplingParams turns seed == -1 into None (random), the "-1 = random" clients
    send: it must not seed every such request alike."""
    assert [p.seed for p in parse({"prompt": [1, 2, 3], "seed": -1, "n": 2})] == [None, None]


def test_min_tokens_above_max_tokens_is_refused():
    """min_tokens above an explicit max_tokens is a 400 naming min_tokens, as vLLM and
    SamplingParams refuse it (not silently lowered)."""
    with pytest.raises(ApiError) as e:
        parse({"prompt": [1, 2, 3], "max_tokens": 10, "min_tokens": 50})
    assert e.value.status == 400 and e.value.param == "min_tokens"


def test_the_models_sampling_defaults_fill_what_a_request_leaves_out():
    """As vLLM: generation_config.json's temperature, top_p, top_k, repetition_penalty stand in
    for fields the request leaves out; a field the request sends wins, -1 and 0 included."""
    defaults = {"temperature": 0.6, "top_p": 0.95, "top_k": 20, "repetition_penalty": 1.1}
    (p,) = parse({"prompt": [1, 2, 3]}, defaults=defaults)
    assert (p.temperature, p.top_p, p.top_k, p.repetition_penalty) == (0.6, 0.95, 20, 1.1)
    (p,) = parse({"prompt": [1, 2, 3], "temperature": 0, "top_p": 1.0, "top_k": -1, "repetition_penalty": 1.0},
                 defaults=defaults)
    assert (p.temperature, p.top_p, p.top_k, p.repetition_penalty) == (0.0, 1.0, -1, 1.0)
