"""How generation ends and what text it produces, end to end through the engine, with and
without speculation, against an oracle that does not use the engine's stop logic.

The oracle: greedy speculative output equals target-only output token for token (float64,
no near-tie flips). So for each prompt the target alone generates ORACLE_TOKENS tokens with
no stop condition at all (ignore_eos, the same logit_bias; min_tokens' mask reproduced by a
-100 bias on the banned ids for the first min_tokens tokens, then a second prompt that
continues from them). From those tokens F the answer a request MUST get is computed here:

  * a stop token (a stop_token_id, or EOS unless ignore_eos) ends it at the first position
    k > min_tokens holding one: finish "stop", token_ids F[:k]; the text is decode(F[:k - 1])
    (as in vLLM, the stop token's text is not output; with include_stop_str_in_output it is);
  * a stop string ends it at the first token k > min_tokens whose text makes one appear,
    ending past the text of the first min_tokens tokens: the text available after k tokens
    is decode(F[:j]) for the last j <= k whose decode does not end in U+FFFD (an incomplete
    character is held until the request ends); the first stop string to complete (the
    earliest end; of two ending at one character the longer) is cut with everything after
    it: finish "stop", token_ids F[:k], text before the stop string (through it, with
    include_stop_str_in_output);
  * else max_tokens: finish "length", token_ids F[:max_tokens], text decode(F[:max_tokens]).
  The earliest of the three wins (a stop string completing in the stop token itself: "stop"
  with the text cut).

Each example runs a batch of requests (duplicates of one request included, as n > 1 makes
them) through LLMEngine.step() on the target alone and on a speculating engine (model draft
with static chains, a fixed tree, the adaptive controller; the ngram drafter), and checks
token_ids, text, finish_reason, the streamed deltas (their concatenation is the final text;
every streamed prefix is a prefix of the expected final text, so no part of a stop string is
ever streamed), logprobs (one entry per output token, the greedy token is the top
alternative, equal to the target-only run's), and that every KV block is free at the end.
"""

from __future__ import annotations

import functools
import os

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from specserve import LLM, SamplingParams
from specserve.engine import LLMEngine

pytestmark = pytest.mark.usefixtures("one_thread")   # tests/engine/conftest.py

EOS = 1                  # tests/checkpoints.py: <|bos|> 0, <|eos|> 1, <|pad|> 2
ORACLE_TOKENS = 28
PROMPTS = ["The quick brown fox", "def fibonacci(n):", "Café, naïve, 東京, Здравствуйте",
           "Hello! How are you", "emoji 🙂🚀 and math ∑ ∫ √ π"]
NEVER = ["\x00zz", "qqqqqqqq"]   # stop strings that do not occur

SETUPS = {
    "chain": dict(spec_mode="static", spec_depth=4, spec_tree="chain"),
    "fixed": dict(spec_mode="static", spec_depth=3, spec_tree="fixed", spec__branching=[2, 2, 1]),
    "adaptive": dict(spec_mode="adaptive", spec__max_depth=4, spec_tree="chain"),
}


def _common(models) -> dict:
    return dict(target=str(models["target"]), dtype="float64", device="cpu", progress=False,
                block_size=4, num_blocks=160, max_num_seqs=8, max_num_batched_tokens=64,
                cpu_threads=1, cpu_compile="off")


@pytest.fixture(scope="module")
def engines(models):
    common = _common(models)
    out = {"ref": LLM(draft="none", enable_prefix_caching=False, **common)}
    for name, kw in SETUPS.items():
        out[name] = LLM(draft=str(models["weak"]), enable_prefix_caching=True, **common, **kw)
    out["ngram"] = LLM(draft="ngram", spec_mode="static", spec_depth=3, enable_prefix_caching=True, **common)
    return out


# -- the oracle ---------------------------------------------------------------------------


def _greedy(llm: LLM, prompt: list[int], n: int, bias: dict[int, float]) -> list[int]:
    if n == 0:
        return []
    p = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True, logit_bias=dict(bias) or None)
    return llm.generate([prompt], p)[0].token_ids


@functools.lru_cache(maxsize=None)
def _oracle_cached(llm_id: int, prompt: tuple, bias: tuple, min_tokens: int, banned: tuple) -> tuple:
    llm = _ORACLE_LLM[llm_id]
    bias = dict(bias)
    head = _greedy(llm, list(prompt), min_tokens, {**bias, **{b: -100.0 for b in banned}})
    tail = _greedy(llm, list(prompt) + head, ORACLE_TOKENS - min_tokens, bias)
    return tuple(head + tail)


_ORACLE_LLM: dict[int, LLM] = {}


def oracle_tokens(llm: LLM, prompt: list[int], bias: dict[int, float] | None, min_tokens: int, banned) -> list[int]:
    """ORACLE_TOKENS greedy tokens of the target alone, with logit_bias `bias`, and `banned`
    masked for the first min_tokens tokens."""
    _ORACLE_LLM[id(llm)] = llm
    key = tuple(sorted((bias or {}).items()))
    return list(_oracle_cached(id(llm), tuple(prompt), key, min_tokens, tuple(sorted(banned))))


def _decode(tok, ids, skip) -> str:
    return tok.decode(ids, skip_special_tokens=skip, clean_up_tokenization_spaces=False)


def expected(tok, F: list[int], p: SamplingParams) -> tuple[list[int], str, str]:
    """(token_ids, text, finish_reason) a request with params p must end with, from the
    unconstrained greedy tokens F, token by token as a client sees them."""
    n = p.max_tokens
    assert len(F) >= n
    skip = p.skip_special_tokens
    k_tok = next((k for k in range(1, n + 1) if k > p.min_tokens and (
        F[k - 1] in p.stop_token_ids or (F[k - 1] == EOS and not p.ignore_eos))), None)
    last = k_tok or n
    include = p.include_stop_str_in_output
    n_text = last - 1 if k_tok and not include else last   # the stop token's text is not output unless asked
    avail, off = "", 0   # text read so far; how much of it came within min_tokens
    for k in range(1, n_text + 1) if p.stop else ():
        t = _decode(tok, F[:k], skip)
        flushed = t.endswith("\ufffd")   # held until the request ends, then read
        if not flushed or k == n_text:
            avail = t
        if k <= p.min_tokens:
            off = len(avail)
            continue
        hits = []
        for s in p.stop:
            i = avail.find(s, max(0, off - len(s) + 1))   # ending past the min_tokens text
            if i >= 0:
                hits.append((i + len(s), -len(s), s))
        if hits:
            end, _, s = min(hits)
            # Read as the token came, the tokens after it go; read at the end, all stay.
            return (F[:last] if flushed else F[:k]), avail[:end if include else end - len(s)], "stop"
    return F[:last], _decode(tok, F[:n_text], skip), ("stop" if k_tok else "length")


# -- running a batch ----------------------------------------------------------------------


def run_batch(llm: LLM, prompts: list[list[int]], params: list[SamplingParams]) -> dict:
    """Every request added at once, stepped to the end; per request: the final output and
    what was streamed."""
    eng = llm.engine
    ids = [eng.add_request(None, pr, p).request_id for pr, p in zip(prompts, params)]
    streams = {i: {"text": "", "tokens": [], "prefixes": []} for i in ids}
    finals = {}
    steps = 0
    while eng.has_unfinished_requests():
        for out in eng.step():
            s = streams[out.request_id]
            s["text"] += out.new_text
            s["tokens"] += out.new_token_ids
            s["prefixes"].append(s["text"])
            assert out.text == s["text"], "RequestOutput.text is not the concatenation of new_text"
            assert out.token_ids == s["tokens"], "token_ids is not the concatenation of new_token_ids"
            if out.finished:
                assert out.request_id not in finals
                finals[out.request_id] = out
        steps += 1
        assert steps < 2000
    eng.pool.check_all_free()
    return {"ids": ids, "finals": finals, "streams": streams}


def check(llm: LLM, run: dict, wants: list, params: list[SamplingParams], name: str, ref_run=None) -> None:
    for j, (rid, want, p) in enumerate(zip(run["ids"], wants, params)):
        out = run["finals"][rid]
        want_ids, want_text, want_reason = want
        what = f"[{name}] request {j} {p!r}"
        assert out.token_ids == want_ids, f"{what}: token_ids {out.token_ids} != {want_ids}"
        assert out.finish_reason == want_reason, f"{what}: finish_reason {out.finish_reason} != {want_reason}"
        assert out.text == want_text, f"{what}: text {out.text!r} != {want_text!r}"
        for s in p.stop if not p.min_tokens and not p.include_stop_str_in_output else ():
            assert s not in out.text, f"{what}: stop string {s!r} in the output text {out.text!r}"
        for prefix in run["streams"][rid]["prefixes"]:
            assert want_text.startswith(prefix), f"{what}: streamed {prefix!r}, not a prefix of {want_text!r}"
        if p.logprobs is None:
            assert out.logprobs is None
            continue
        assert len(out.logprobs) == len(out.token_ids), f"{what}: {len(out.logprobs)} logprobs for {len(out.token_ids)} tokens"
        for t, (lp, alts) in zip(out.token_ids, out.logprobs):
            assert len(alts) == p.logprobs
            if alts:
                assert alts[0][0] == t and abs(alts[0][1] - lp) < 1e-9, f"{what}: greedy token {t} not the top one {alts[0]}"
            assert lp <= 0.0
        if ref_run is not None:
            ref = ref_run["finals"][ref_run["ids"][j]].logprobs
            for (a, aa), (b, bb) in zip(out.logprobs, ref):
                assert abs(a - b) < 1e-8 and [x for x, _ in aa] == [x for x, _ in bb], f"{what}: logprobs differ from target-only"


# -- the property -------------------------------------------------------------------------


@st.composite
def request_case(draw, llm: LLM):
    tok = llm.tokenizer
    prompt = tok.encode(draw(st.sampled_from(PROMPTS)))
    max_tokens = draw(st.integers(1, ORACLE_TOKENS))
    eos_mode = draw(st.sampled_from(["ignore", "ignore", "eos", "eos_ignored"]))
    bias = {EOS: draw(st.sampled_from([4.0, 6.0, 8.0]))} if eos_mode != "ignore" else {}
    if draw(st.integers(0, 3)) == 0:   # a few favoured tokens: repetitive text the ngram drafter predicts
        bias.update({t: 8.0 for t in prompt[:3] if t != EOS})
    ignore_eos = eos_mode != "eos"
    skip = draw(st.booleans()) if draw(st.integers(0, 3)) == 0 else True
    F0 = oracle_tokens(llm, prompt, bias, 0, ())
    stop_ids = []
    if draw(st.booleans()):
        stop_ids = draw(st.lists(st.sampled_from(F0[:max_tokens]), min_size=1, max_size=2, unique=True))
    min_tokens = draw(st.integers(0, max_tokens)) if draw(st.integers(0, 2)) == 0 else 0
    banned = set(stop_ids) | (set() if ignore_eos else {EOS}) if min_tokens else set()
    F = oracle_tokens(llm, prompt, bias, min_tokens, banned)
    text = _decode(tok, F[:max_tokens], skip)
    stops = []
    for _ in range(draw(st.integers(0, 3))):
        kind = draw(st.sampled_from(["sub", "sub", "sub", "never", "fffd"]))
        if kind == "sub" and text:
            a = draw(st.integers(0, len(text) - 1))
            stops.append(text[a:a + draw(st.integers(1, 4))])
        elif kind == "never":
            stops.append(draw(st.sampled_from(NEVER)))
        elif kind == "fffd":
            stops.append("\ufffd")
    logprobs = draw(st.sampled_from([None, None, 0, 2]))
    p = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=ignore_eos, min_tokens=min_tokens,
                       stop=stops, stop_token_ids=stop_ids, skip_special_tokens=skip, logprobs=logprobs,
                       include_stop_str_in_output=draw(st.integers(0, 3)) == 0,
                       logit_bias=bias or None)
    return prompt, p, F


@settings(derandomize=True, max_examples=int(os.environ.get("STOP_ORACLE_EXAMPLES", 14)), deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow,
                                 HealthCheck.data_too_large])
@given(data=st.data())
def test_stops_match_oracle_under_speculation(engines, data):
    ref = engines["ref"]
    setup = data.draw(st.sampled_from(["chain", "fixed", "adaptive", "ngram"]))
    cases = data.draw(st.lists(request_case(ref), min_size=1, max_size=4))
    if len(cases) > 1 and data.draw(st.booleans()):   # n > 1: the same request again
        cases.append(cases[0])
    prompts = [c[0] for c in cases]
    params = [c[1] for c in cases]
    wants = [expected(ref.tokenizer, c[2], c[1]) for c in cases]
    ref_run = run_batch(ref, prompts, params)
    check(ref, ref_run, wants, params, "target-only")
    run = run_batch(engines[setup], prompts, params)
    check(engines[setup], run, wants, params, setup, ref_run)


def test_oracle_text_is_plain_decode(engines):
    """Sanity of the oracle: with no stop, the engine's text is decode() of its tokens."""
    ref = engines["ref"]
    for text in PROMPTS:
        prompt = ref.tokenizer.encode(text)
        out = ref.generate([prompt], SamplingParams(max_tokens=ORACLE_TOKENS, temperature=0.0, ignore_eos=True))[0]
        assert out.text == _decode(ref.tokenizer, out.token_ids, True)


# -- cases the property found --------------------------------------------------------------


def _letter_then_partial_char(tok) -> int:
    """A token whose text is a complete character followed by the first byte(s) of another
    (byte-level BPE merges such as b"a\\xd0"): decoded alone it ends in U+FFFD."""
    for i in range(len(tok)):
        t = _decode(tok, [i], True)
        if t.endswith("\ufffd") and t.rstrip("\ufffd") and t[0].isalpha():
            return i
    pytest.skip("the tiny tokenizer has no such token")


@pytest.mark.parametrize("setup", ["ref", "chain"])
def test_stop_string_in_flushed_tail_is_cut(engines, setup):
    """A stop string whose text only becomes available when the request ends (held because
    the last token ends in an incomplete UTF-8 character, then emitted by flush()) is cut
    like any other: finish_reason "stop", the text before it."""
    llm = engines[setup]
    tok = llm.tokenizer
    t = _letter_then_partial_char(tok)
    stop = _decode(tok, [t], True).rstrip("\ufffd")          # e.g. "a"
    prompt = tok.encode("The quick brown fox")
    # The bias makes the token the greedy choice; one token, so it is the last one.
    p = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True, stop=[stop], logit_bias={t: 100.0})
    out = llm.generate([prompt], p)[0]
    assert out.token_ids == [t]
    assert stop not in out.text, f"stop string {stop!r} in the output text {out.text!r}"
    assert out.finish_reason == "stop"
    assert out.text == ""
    llm.engine.pool.check_all_free()


def test_logprobs_cut_with_tokens_when_not_detokenizing(engines):
    """With LLMEngine(detokenize=False) (the engine-core process of the API server), a stop
    token accepted in the middle of a speculative step cuts the logprobs with the tokens:
    one entry per token, as with detokenize=True."""
    ref = engines["ref"]
    prompt = ref.tokenizer.encode("emoji 🙂🚀 and math ∑ ∫ √ π")
    F = oracle_tokens(ref, prompt, None, 0, ())
    eng = LLMEngine(engines["chain"].config, progress=False, detokenize=False)
    wrong = []
    # Each token of the greedy output (at its first occurrence) as the stop token: some sit
    # inside a multi-token speculative step, followed by accepted tokens.
    for k in [k for k in range(1, len(F)) if F[k] not in F[:k]]:
        p = SamplingParams(max_tokens=ORACLE_TOKENS, temperature=0.0, ignore_eos=True, stop_token_ids=[F[k]],
                           logprobs=1)
        eng.add_request(f"k{k}", prompt, p)
        while eng.has_unfinished_requests():
            for out in eng.step():
                final = out
        assert final.finished and final.finish_reason == "stop" and final.token_ids == F[:k + 1]
        if len(final.logprobs) != len(final.token_ids):
            wrong.append((k, len(final.logprobs), len(final.token_ids)))
    assert eng.spec.totals.mean_tokens_per_pass > 1.0   # the draft was accepted: multi-token steps
    assert not wrong, f"(stop at, logprob entries, tokens): {wrong}"
    eng.pool.check_all_free()
