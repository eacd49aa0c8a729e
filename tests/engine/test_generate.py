"""The engine core without speculation: greedy output == transformers' generate, token for
token (float64), through batching, chunked prefill, preemption and prefix caching; stop
conditions cut exactly; seeds are batch-independent; every block comes back; bad input is
refused with errors that name what was wrong."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from specserve import LLM, SamplingParams
from specserve.errors import InvalidRequestError
from tests.checkpoints import make_checkpoint

ARCHS = ["llama", "qwen2", "qwen3", "mistral"]
MAX_TOKENS = 12
# Different lengths, including ones that are not multiples of the block size.
PROMPTS = [
    [5, 6, 7],
    [40, 41, 42, 43, 44, 45, 46],
    [100 + 3 * i for i in range(13)],
    [200 + i for i in range(21)],
]


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    return {
        arch: make_checkpoint(tmp_path_factory.mktemp(f"gen_{arch}"), arch=arch, dtype=torch.float64)
        for arch in ARCHS
    }


_HF_CACHE: dict = {}


def hf_greedy(path, prompt: list[int], n: int) -> list[int]:
    """transformers' greedy continuation of exactly n tokens (no EOS set, so it never stops early:
    our ignore_eos). Not min_new_tokens, which would mask EOS out of the argmax."""
    from transformers import AutoModelForCausalLM, GenerationConfig

    key = str(path)
    if key not in _HF_CACHE:
        model = AutoModelForCausalLM.from_pretrained(key, dtype=torch.float64).eval()
        model.generation_config.eos_token_id = None  # else generate() stops at EOS
        _HF_CACHE[key] = model
    model = _HF_CACHE[key]
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt]),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            generation_config=GenerationConfig(
                do_sample=False, max_new_tokens=n, eos_token_id=None, pad_token_id=2, bos_token_id=0
            ),
        )
    assert out.shape[1] == len(prompt) + n
    return out[0, len(prompt) :].tolist()


def hf_min_new_tokens(path, prompt: list[int], stop_ids: list[int], min_new: int, max_new: int) -> list[int]:
    """transformers' greedy output with stop ids `stop_ids` and min_new_tokens: the stop ids are
    masked until min_new tokens exist, then the first one ends generation (and is kept)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float64).eval()
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            max_new_tokens=max_new, min_new_tokens=min_new, do_sample=False, eos_token_id=stop_ids, pad_token_id=0,
        )
    return out[0, len(prompt):].tolist()


def make_llm(path, **kw) -> LLM:
    args = dict(target=str(path), draft="none", dtype="float64", device="cpu", progress=False,
                num_blocks=128, block_size=4)
    args.update(kw)
    return LLM(**args)


GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_batch_matches_transformers(ckpts, arch):
    llm = make_llm(ckpts[arch])
    outs = llm.generate(PROMPTS, GREEDY)
    for prompt, out in zip(PROMPTS, outs):
        assert out.prompt_token_ids == prompt
        assert out.token_ids == hf_greedy(ckpts[arch], prompt, MAX_TOKENS), f"{arch}: prompt of {len(prompt)}"
        assert out.finish_reason == "length"
    llm.engine.pool.check_all_free()


def _record_schedules(llm):
    """Wrap scheduler.schedule to keep every SchedulerOutput (as (num_batched, [(id, n, is_decode)]))."""
    sched = llm.engine.scheduler
    orig = sched.schedule
    log = []

    def schedule(*a, **k):
        out = orig(*a, **k)
        log.append((out.num_batched_tokens, [(s.request.request_id, s.num_new_tokens, s.is_decode) for s in out.seqs]))
        return out

    sched.schedule = schedule
    return log


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_chunked_prefill_matches_transformers(ckpts, arch):
    llm = make_llm(ckpts[arch], max_num_batched_tokens=8)
    log = _record_schedules(llm)
    outs = llm.generate(PROMPTS, GREEDY)
    for prompt, out in zip(PROMPTS, outs):
        assert out.token_ids == hf_greedy(ckpts[arch], prompt, MAX_TOKENS)
    assert all(n <= 8 for n, _ in log), "the token budget was exceeded"
    # The 21-token prompt must have been split into chunks that produced no token.
    assert any(not dec and n > 0 for _, seqs in log for _, n, dec in seqs)
    llm.engine.pool.check_all_free()


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_preemption_matches_transformers(ckpts, arch):
    # 4 requests of up to 33 tokens (9 blocks of 4) in a pool of 12 blocks: must preempt.
    llm = make_llm(ckpts[arch], num_blocks=12, block_size=4)
    outs = llm.generate(PROMPTS, GREEDY)
    assert llm.engine.scheduler.num_preemptions > 0
    assert sum(o.stats.num_preemptions for o in outs) == llm.engine.scheduler.num_preemptions
    for prompt, out in zip(PROMPTS, outs):
        assert out.token_ids == hf_greedy(ckpts[arch], prompt, MAX_TOKENS)
    llm.engine.pool.check_all_free()


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_prefix_cache_hits_match_transformers(ckpts, arch):
    llm = make_llm(ckpts[arch], enable_prefix_caching=True)
    shared = [300 + i for i in range(18)]
    first = llm.generate([shared + [7, 8]], GREEDY)
    assert llm.engine.pool.prefix_cache_hit_tokens == 0
    second_prompts = [shared + [9], shared + [10, 11, 12], shared[:13]]
    outs = llm.generate(second_prompts, GREEDY)
    assert llm.engine.pool.prefix_cache_hit_tokens > 0
    assert outs[0].stats.num_cached_tokens >= 16
    for prompt, out in zip(second_prompts, outs):
        assert out.token_ids == hf_greedy(ckpts[arch], prompt, MAX_TOKENS)
    assert first[0].token_ids == hf_greedy(ckpts[arch], shared + [7, 8], MAX_TOKENS)
    llm.engine.pool.check_all_free()


def test_abort_mid_generation_frees_every_block(ckpts):
    llm = make_llm(ckpts["llama"], max_num_seqs=2)
    eng = llm.engine
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    for i, p in enumerate(PROMPTS[:3]):
        eng.add_request(f"r{i}", p, params)
    for _ in range(3):
        eng.step()
    assert eng.pool.num_free_blocks < eng.pool.num_blocks
    eng.abort_request("r0")  # running, mid-generation
    eng.abort_request("r2")  # still waiting (max_num_seqs=2)
    eng.abort_request("nope")  # unknown ids are ignored
    finished = {}
    while eng.has_unfinished_requests():
        for out in eng.step():
            if out.finished:
                finished[out.request_id] = out
    assert finished["r0"].finish_reason == "abort" and finished["r2"].finish_reason == "abort"
    assert 0 < len(finished["r0"].token_ids) < 10
    assert finished["r1"].finish_reason == "length"
    assert finished["r1"].token_ids == hf_greedy(ckpts["llama"], PROMPTS[1], 10)
    eng.pool.check_all_free()
    eng.pool.check_consistency()
    # Aborting after the end is harmless.
    eng.abort_request("r1")
    eng.pool.check_all_free()


# -- stop conditions --------------------------------------------------------------------


@pytest.fixture(scope="module")
def reference(ckpts):
    """Target-only greedy generation of 24 tokens with EOS ignored, for the stop tests."""
    llm = make_llm(ckpts["llama"])
    prompt = PROMPTS[2]
    out = llm.generate([prompt], SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True))[0]
    return llm, prompt, out


def _first_new_token(tokens: list[int], start: int) -> tuple[int, int]:
    """A token at index >= start whose first occurrence is at that index: (index, token)."""
    for i in range(start, len(tokens)):
        if tokens[i] not in tokens[:i]:
            return i, tokens[i]
    raise AssertionError("no fresh token in the reference output")


def test_max_tokens_is_length(reference):
    llm, prompt, ref = reference
    for n in (1, 5):
        out = llm.generate([prompt], SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True))[0]
        assert out.token_ids == ref.token_ids[:n] and out.finish_reason == "length"


def test_eos_from_generation_config(ckpts, reference, tmp_path):
    _, prompt, ref = reference
    idx, tok = _first_new_token(ref.token_ids, 3)
    path = tmp_path / "eos_ckpt"
    shutil.copytree(ckpts["llama"], path)
    gen = json.loads((path / "generation_config.json").read_text())
    gen["eos_token_id"] = [1, tok]  # a list, as Llama 3 has
    (path / "generation_config.json").write_text(json.dumps(gen))
    llm = make_llm(path)
    assert tok in llm.engine.eos_token_ids
    out = llm.generate([prompt], SamplingParams(max_tokens=24, temperature=0.0))[0]
    assert out.token_ids == ref.token_ids[: idx + 1], "EOS must stop generation, EOS included"
    assert out.finish_reason == "stop"
    out = llm.generate([prompt], SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True))[0]
    assert out.token_ids == ref.token_ids and out.finish_reason == "length"
    # min_tokens: EOS cannot be generated before it (masked, as transformers' min_new_tokens
    # and vLLM do), so the output follows the masked argmax; it stops at a later EOS.
    out = llm.generate([prompt], SamplingParams(max_tokens=24, min_tokens=idx + 2, temperature=0.0))[0]
    assert out.token_ids == hf_min_new_tokens(path, prompt, [1, tok], idx + 2, 24)
    assert len(out.token_ids) >= idx + 2 and tok not in out.token_ids[: idx + 2]
    assert out.token_ids[idx] != tok  # the EOS of the unconstrained output was masked away
    llm.engine.pool.check_all_free()


def test_stop_token_ids_and_min_tokens(reference):
    llm, prompt, ref = reference
    idx, tok = _first_new_token(ref.token_ids, 2)
    out = llm.generate([prompt], SamplingParams(max_tokens=24, temperature=0.0, stop_token_ids=[tok]))[0]
    assert out.token_ids == ref.token_ids[: idx + 1] and out.finish_reason == "stop"
    # stop_token_ids apply with ignore_eos too (ignore_eos concerns EOS only).
    out = llm.generate([prompt], SamplingParams(max_tokens=24, temperature=0.0, stop_token_ids=[tok], ignore_eos=True))[0]
    assert out.token_ids == ref.token_ids[: idx + 1]
    # min_tokens masks stop_token_ids as well as EOS (SamplingParams' contract).
    out = llm.generate(
        [prompt], SamplingParams(max_tokens=24, min_tokens=idx + 2, temperature=0.0, stop_token_ids=[tok], ignore_eos=True)
    )[0]
    assert out.token_ids == hf_min_new_tokens(llm.config.target.path, prompt, [tok], idx + 2, 24)
    assert len(out.token_ids) >= idx + 2 and tok not in out.token_ids[: idx + 2]


def test_stop_string_cut_exactly(reference):
    llm, prompt, ref = reference
    text = ref.text
    assert len(text) > 12
    eng = llm.engine
    checked = 0
    # ASCII stops (random weights also emit lone UTF-8 bytes, shown as U+FFFD): a 1- and a
    # 2-character stop early, a 3-character one later in the text.
    ascii_at = [i for i, c in enumerate(text) if c.isascii() and c.isalnum()]
    pairs = [i for i in ascii_at if i + 1 in ascii_at]
    triples = [i for i in pairs if i + 2 in ascii_at]
    cases = [(ascii_at[0], 1)] + ([(pairs[0], 2)] if pairs else []) + ([(triples[-1], 3)] if triples else [])
    for start, length in cases:
        stop = text[start : start + length]
        cut = text[: text.find(stop)]
        eng.add_request("s", prompt, SamplingParams(max_tokens=24, temperature=0.0, stop=[stop], ignore_eos=True))
        streamed, final = "", None
        while eng.has_unfinished_requests():
            for out in eng.step():
                assert stop not in out.new_text
                streamed += out.new_text
                final = out
        assert final.finished and final.finish_reason == "stop"
        assert final.text == cut, f"stop {stop!r}"
        assert streamed == cut
        assert stop not in final.text
        # The tokens stop at the one that completed the stop string.
        n = len(final.token_ids)
        assert final.token_ids == ref.token_ids[:n]
        decoded = llm.tokenizer.decode(final.token_ids)
        assert stop in decoded and stop not in llm.tokenizer.decode(final.token_ids[:-1])
        checked += 1
    assert checked >= 2
    eng.pool.check_all_free()


def test_stop_string_never_found_keeps_everything(reference):
    llm, prompt, ref = reference
    out = llm.generate([prompt], SamplingParams(max_tokens=24, temperature=0.0, stop=["\x00never"], ignore_eos=True))[0]
    assert out.token_ids == ref.token_ids and out.text == ref.text and out.finish_reason == "length"


# -- seeds --------------------------------------------------------------------------------


def test_seeded_request_is_batch_independent(ckpts):
    llm = make_llm(ckpts["llama"])
    target = SamplingParams(max_tokens=10, temperature=0.9, top_k=50, top_p=0.95, seed=1234)
    alone = llm.generate([PROMPTS[1]], target)[0]
    others = [SamplingParams(max_tokens=7, temperature=1.0), SamplingParams(max_tokens=12, temperature=0.7, seed=9),
              SamplingParams(max_tokens=5, temperature=0.0)]
    mixed = llm.generate([PROMPTS[0], PROMPTS[1], PROMPTS[2], PROMPTS[3]], [others[0], target, others[1], others[2]])
    assert mixed[1].token_ids == alone.token_ids
    again = llm.generate([PROMPTS[3], PROMPTS[1]], [others[1], target])
    assert again[1].token_ids == alone.token_ids
    # The seed matters: other seeds give another output (10 tokens from a 400 vocabulary).
    outs = [llm.generate([PROMPTS[1]], SamplingParams(max_tokens=10, temperature=0.9, seed=s))[0].token_ids
            for s in (1, 2, 3)]
    assert len({tuple(o) for o in outs}) > 1
    llm.engine.pool.check_all_free()


# -- bad input ----------------------------------------------------------------------------


def test_prompt_longer_than_context(ckpts):
    llm = make_llm(ckpts["llama"], max_model_len=32)
    with pytest.raises(InvalidRequestError) as e:
        llm.engine.add_request(None, list(range(3, 43)), SamplingParams(max_tokens=4))
    assert "32" in str(e.value) and "40" in str(e.value)
    assert e.value.param == "prompt"
    with pytest.raises(InvalidRequestError) as e:
        llm.engine.add_request(None, list(range(3, 23)), SamplingParams(max_tokens=20))
    assert "32" in str(e.value) and "20" in str(e.value) and e.value.param == "max_tokens"
    assert not llm.engine.has_unfinished_requests()
    llm.engine.pool.check_all_free()


@pytest.mark.parametrize(
    "field,value",
    [("temperature", -0.5), ("top_p", 0.0), ("top_k", -3), ("max_tokens", 0), ("min_tokens", 99),
     ("stop", [""]), ("seed", "x"), ("stop_token_ids", [-1])],
)
def test_bad_sampling_params_name_the_field(field, value):
    with pytest.raises(InvalidRequestError) as e:
        SamplingParams(**{field: value})
    assert e.value.param == field and field in str(e.value)


def test_bad_params_refused_by_add_request(ckpts):
    llm = make_llm(ckpts["llama"])
    params = SamplingParams(max_tokens=4)
    params.top_p = 1.5  # mutated after construction: add_request validates again
    with pytest.raises(InvalidRequestError) as e:
        llm.engine.add_request(None, [5, 6], params)
    assert e.value.param == "top_p" and "1.5" in str(e.value)
    with pytest.raises(InvalidRequestError) as e:
        llm.engine.add_request(None, [5, 400], SamplingParams(max_tokens=4))
    assert e.value.param == "prompt" and "400" in str(e.value)
    with pytest.raises(InvalidRequestError):
        llm.engine.add_request(None, [], SamplingParams(max_tokens=4))
    llm.engine.add_request("dup", [5, 6], SamplingParams(max_tokens=2))
    with pytest.raises(InvalidRequestError) as e:
        llm.engine.add_request("dup", [5, 6], SamplingParams(max_tokens=2))
    assert "dup" in str(e.value)
