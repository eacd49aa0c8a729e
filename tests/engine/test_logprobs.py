"""Logprobs are the target's: at every emitted position they equal transformers'
log_softmax of the target's logits (float64), with speculation off and on (n-gram and model
drafters, chains and trees); prompt logprobs likewise, across chunked prefill and a prefix-cache
hit and a preemption mid-prompt. They come from the rows the verify pass computes anyway, and
stay aligned with the tokens when a stop cuts an accepted run."""

from __future__ import annotations

import pytest
import torch

from specserve import LLM, SamplingParams
from specserve.errors import InvalidRequestError

PROMPTS = [[5, 6, 7], [10, 11, 12, 13, 10, 11, 12, 13, 10, 11], [200 + i for i in range(21)]]
TOL = 1e-9   # float64 on both sides


def reference_logprobs(hf, ids: list[int], temperature: float = 0.0) -> torch.Tensor:
    """[len(ids), V]: row p is the distribution of token p + 1."""
    with torch.no_grad():
        logits = hf(torch.tensor([ids])).logits[0]
    return torch.log_softmax(logits / (temperature or 1.0), dim=-1)


def make_llm(models, draft: str, tree: str = "chain", **kw) -> LLM:
    args = dict(target=str(models["target"]), dtype="float64", device="cpu", progress=False,
                num_blocks=128, block_size=4)
    if draft == "none":
        args["draft"] = "none"
    else:
        args.update(draft=draft if draft == "ngram" else str(models[draft]), spec_mode="static", spec_depth=4,
                    spec_tree=tree, spec__branching=[3, 2, 1], spec__num_nodes=6, spec__topk=3)
    args.update(kw)
    return LLM(**args)


def check_output(hf, prompt, out, k: int, temperature: float = 0.0) -> None:
    ref = reference_logprobs(hf, prompt + out.token_ids, temperature)
    assert len(out.logprobs) == len(out.token_ids)
    for j, (tok, (lp, top)) in enumerate(zip(out.token_ids, out.logprobs)):
        row = ref[len(prompt) - 1 + j]
        assert abs(lp - row[tok].item()) < TOL, (j, lp, row[tok].item())
        assert len(top) == k
        values = [v for _, v in top]
        assert values == sorted(values, reverse=True)
        for alt, v in top:
            assert abs(v - row[alt].item()) < TOL
            assert alt != tok or v == lp   # the sampled token, where listed, with its own figure
        if k:
            assert abs(values[0] - row.max().item()) < TOL
            if temperature == 0.0:
                assert top[0][0] == tok or abs(values[0] - lp) < TOL   # greedy: the chosen is the best


@pytest.mark.parametrize("draft,tree", [("none", "chain"), ("ngram", "chain"), ("target", "chain"),
                                        ("weak", "chain"), ("weak", "fixed"), ("weak", "dynamic")])
def test_logprobs_equal_transformers_with_and_without_speculation(models, hf, draft, tree):
    llm = make_llm(models, draft, tree)
    params = SamplingParams(max_tokens=14, temperature=0.0, ignore_eos=True, logprobs=3)
    outs = llm.generate(PROMPTS, params)
    for prompt, out in zip(PROMPTS, outs):
        check_output(hf, prompt, out, 3)
    if draft in ("target", "weak"):
        assert llm.engine.spec.totals.num_accepted_tokens > 0, "no draft token was accepted"


def test_sampled_logprobs_follow_the_temperature(models, hf):
    llm = make_llm(models, "weak")
    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=10, temperature=0.7, seed=3, ignore_eos=True,
                                                logprobs=2))
    for prompt, out in zip(PROMPTS, outs):
        check_output(hf, prompt, out, 2, temperature=0.7)


def test_logprobs_stay_aligned_when_a_stop_cuts_an_accepted_run(models, hf):
    llm = make_llm(models, "target")
    full = llm.generate(PROMPTS[2], SamplingParams(max_tokens=14, temperature=0.0, ignore_eos=True))[0]
    stop = llm.tokenizer.decode(full.token_ids[5:7])
    out = llm.generate(PROMPTS[2], SamplingParams(max_tokens=14, temperature=0.0, ignore_eos=True, logprobs=0,
                                                  stop=[stop]))[0]
    assert out.finish_reason == "stop" and len(out.token_ids) < 14
    check_output(hf, PROMPTS[2], out, 0)


@pytest.mark.parametrize("draft", ["none", "weak"])
def test_prompt_logprobs_across_chunks_and_a_prefix_cache_hit(models, hf, draft):
    prompt = [40 + (7 * i) % 97 for i in range(30)]   # 8 blocks of 4, prefilled in chunks of 8
    llm = make_llm(models, draft, max_num_batched_tokens=8)
    warm = llm.generate(prompt, SamplingParams(max_tokens=2, temperature=0.0))[0]   # fills the cache
    asked = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True, prompt_logprobs=2)
    out = llm.generate(prompt, asked)[0]
    assert out.stats.num_cached_tokens == 0, "a request owed prompt logprobs is not served from the cache"
    again = llm.generate(prompt, SamplingParams(max_tokens=2, temperature=0.0))[0]
    assert again.stats.num_cached_tokens > 0 and again.token_ids == warm.token_ids
    ref = reference_logprobs(hf, prompt)
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(prompt)
    for p in range(1, len(prompt)):
        lp, top = out.prompt_logprobs[p]
        assert abs(lp - ref[p - 1, prompt[p]].item()) < TOL
        assert [t for t, _ in top] == ref[p - 1].topk(2).indices.tolist()
    assert out.logprobs is None


def test_prompt_logprobs_of_a_request_preempted_mid_prompt_are_whole(models, hf):
    """A pool of 5 blocks of 4: the long prompt is preempted while prefilling (its blocks go to
    the request ahead of it) and computed again from 0; its prompt logprobs carry on from where
    they stopped, neither cut short nor repeated."""
    llm = make_llm(models, "none", num_blocks=5, max_num_batched_tokens=6, enable_prefix_caching=False)
    prompt = list(range(100, 114))
    ahead = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    asked = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True, prompt_logprobs=0)
    out = llm.generate([[5, 6, 7], prompt], [ahead, asked])[1]
    assert out.stats.num_preemptions > 0
    ref = reference_logprobs(hf, prompt)
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(prompt)
    assert all(abs(out.prompt_logprobs[p][0] - ref[p - 1, prompt[p]].item()) < TOL for p in range(1, len(prompt)))
    llm.engine.pool.check_all_free()


def test_max_tokens_zero_scores_the_prompt_only(models, hf):
    llm = make_llm(models, "weak")
    out = llm.generate(PROMPTS[1], SamplingParams(max_tokens=0, prompt_logprobs=0))[0]
    assert out.token_ids == [] and out.finish_reason == "length" and out.text == ""
    ref = reference_logprobs(hf, PROMPTS[1])
    assert [round(lp, 6) for lp, _ in out.prompt_logprobs[1:]] == [
        round(ref[p - 1, PROMPTS[1][p]].item(), 6) for p in range(1, len(PROMPTS[1]))]
    llm.engine.pool.check_all_free()


@pytest.mark.parametrize("kw,param", [(dict(logprobs=21), "logprobs"), (dict(prompt_logprobs=-1), "prompt_logprobs"),
                                      (dict(max_tokens=0), "max_tokens")])
def test_logprob_settings_are_bounded(kw, param):
    with pytest.raises(InvalidRequestError) as e:
        SamplingParams(**kw)
    assert e.value.param == param
