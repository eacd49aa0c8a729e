"""The engine under memory pressure: pools barely bigger than one request's need, under every
drafter (none, n-gram, a model chain, fixed and dynamic trees, a perfect draft), static and
adaptive speculation, float64.

- Seeded random mixes (arrivals, aborts, n-like duplicates, shared prefixes and prompts that
  extend an earlier request's prompt + output, long prompts chunked by tiny budgets, requests
  that exactly fill the context, max_tokens 0/1, logprobs, prompt logprobs, stop strings) on
  pools of `need + 0..1` blocks: greedy output and logprobs equal the target alone (a roomy
  pool, no speculation, no prefix cache); every block is free at the end; no request runs
  longer than a bound of steps; with a draft equal to the target every chain node is accepted
  and the draft's KV equals the target's wherever it is claimed (prefix hits, preemptions).
  test_mixed_load.py covers a weak chain/fixed draft on roomier pools; test_pool_state_machine.py
  the scheduler without models.
- Admission at the pool's edge: a request that can never fit is refused at once with a clear
  error; one that fits exactly is served.
"""

from __future__ import annotations

import random

import pytest
import torch

from specserve import LLM, SamplingParams
from specserve.errors import InvalidRequestError
from specserve.kv_pool import blocks_needed

pytestmark = pytest.mark.usefixtures("one_thread")   # tests/engine/conftest.py

TOL = 1e-8
LOW_ID = 3   # prompts draw ids from [LOW_ID, 400): clear of <|bos|>, <|eos|>, <|pad|>


def make(models, draft: str, **kw) -> LLM:
    """draft: none | ngram | weak (a noisy copy of the target) | perfect (the target itself)."""
    args = dict(target=str(models["target"]), dtype="float64", device="cpu", progress=False, cpu_compile="off")
    if draft in ("none", "ngram"):
        args["draft"] = draft
    else:
        args["draft"] = str(models["target"] if draft == "perfect" else models["weak"])
    if draft != "none":
        args.update(spec_mode="static", spec_depth=3, spec_tree="chain", spec__num_nodes=6, spec__topk=3,
                    spec__branching=[3, 2, 1], spec__max_depth=4)
    args.update(kw)
    return LLM(**args)


@pytest.fixture(scope="module")
def reference(models):
    """max_model_len -> the target alone: draft none, a roomy pool, no prefix cache."""
    refs: dict[int | None, LLM] = {}

    def get(max_model_len: int | None) -> LLM:
        if max_model_len not in refs:
            refs[max_model_len] = make(models, "none", num_blocks=512, block_size=4, enable_prefix_caching=False,
                                       max_model_len=max_model_len)
        return refs[max_model_len]

    return get


def check_draft_kv(eng) -> int:
    """With the target as its own draft: every position the draft claims for a running request,
    and every position of every draft-complete cached block, holds the same K/V in both models."""
    bs = eng.pool.block_size
    slots = []
    for req in eng.scheduler.running:
        n = min(req.num_computed_tokens, req.num_draft_computed_tokens, req.num_tokens)
        slots += [req.block_table[p // bs] * bs + p % bs for p in range(n)]
    for block in eng.pool._cached.values():
        if eng.pool._draft_ok[block]:
            slots += range(block * bs, (block + 1) * bs)
    if slots:
        idx = torch.tensor(slots)
        for (tk, tv), (dk, dv) in zip(eng.target.kv_caches, eng.draft.kv_caches):
            assert torch.allclose(tk.flatten(0, 1)[idx], dk.flatten(0, 1)[idx], atol=1e-9), "draft K != target K"
            assert torch.allclose(tv.flatten(0, 1)[idx], dv.flatten(0, 1)[idx], atol=1e-9), "draft V != target V"
    return len(slots)


# -- seeded mixes on barely big enough pools ------------------------------------------------------

# name: (mix seed, draft, engine settings, extra blocks over the largest request's need)
SCENARIOS = {
    "none-bs2-budget5": (11, "none", dict(block_size=2, max_num_batched_tokens=5, max_model_len=32), 0),
    "ngram-nochunk": (12, "ngram", dict(block_size=4, max_num_batched_tokens=24, enable_chunked_prefill=False), 1),
    "weak-chain-depth4": (13, "weak", dict(block_size=3, max_num_batched_tokens=8, spec_depth=4, max_num_seqs=3), 0),
    "perfect-chain": (14, "perfect", dict(block_size=4, max_num_batched_tokens=16, max_model_len=40), 1),
    "perfect-fixed-graphs": (15, "perfect", dict(block_size=2, spec_tree="fixed", spec_depth=2, cuda_graphs=True,
                                                 max_num_batched_tokens=64), 0),
    "perfect-dynamic-seqs2": (16, "perfect", dict(block_size=1, spec_tree="dynamic", max_num_seqs=2,
                                                  max_num_batched_tokens=12), 2),
    "weak-dynamic-adaptive": (17, "weak", dict(block_size=4, spec_tree="dynamic", spec_mode="adaptive",
                                               max_num_batched_tokens=6, max_model_len=28), 0),
}


def build_mix(rng: random.Random, ref: LLM, max_model_len: int) -> list[dict]:
    cap = min(max_model_len, 40)
    bases = [[rng.randrange(LOW_ID, 400) for _ in range(rng.randint(4, 12))] for _ in range(2)]
    mix, arrival = [], 0
    for i in range(rng.randint(6, 9)):
        r = rng.random()
        if mix and r < 0.15:   # n-like: the same prompt and params again
            prompt, kw = list(mix[-1]["prompt"]), dict(mix[-1]["kw"])
        elif mix and r < 0.35:   # an earlier prompt + its output (cached blocks holding generated tokens)
            src = rng.choice(mix)["prompt"]
            out = ref.generate([src], SamplingParams(max_tokens=max(1, min(10, cap - len(src))), temperature=0.0,
                                                     ignore_eos=True))[0].token_ids
            prompt = (src + out)[:rng.randint(1, len(src) + len(out))][:cap - 1]
            kw = dict(temperature=0.0, ignore_eos=True, max_tokens=max(1, min(rng.randint(1, 20), cap - len(prompt))))
        else:
            if rng.random() < 0.5:
                prompt = rng.choice(bases)[:rng.randint(1, 12)] + [rng.randrange(LOW_ID, 400)
                                                                  for _ in range(rng.randint(0, 5))]
            else:
                prompt = [rng.randrange(LOW_ID, 400) for _ in range(rng.randint(1, 28))]
            prompt = prompt[:cap - 1]
            kw = dict(temperature=0.0, ignore_eos=rng.random() < 0.7)
            r = rng.random()
            if r < 0.12:
                kw.update(max_tokens=0, prompt_logprobs=rng.randint(0, 2))
            elif r < 0.22:
                kw["max_tokens"] = 1
            elif r < 0.4:
                kw["max_tokens"] = cap - len(prompt)   # exactly fills the context (or the cap)
            else:
                kw["max_tokens"] = min(rng.randint(4, 24), cap - len(prompt))
            if rng.random() < 0.3:
                kw["logprobs"] = rng.randint(0, 3)
            if rng.random() < 0.2 and "prompt_logprobs" not in kw:
                kw["prompt_logprobs"] = rng.randint(0, 2)
            if rng.random() < 0.15 and kw["max_tokens"] > 1:   # a stop string the target's output contains
                text = ref.generate([prompt], SamplingParams(**kw))[0].text
                at = [j for j, c in enumerate(text) if c.isascii() and c.isalnum() and j >= len(text) // 3]
                if at:
                    kw["stop"] = [text[at[len(at) // 2]]]
            if rng.random() < 0.15:   # sampled: checked for length and leaks only
                kw.update(temperature=rng.uniform(0.6, 1.2), seed=rng.randrange(1000), ignore_eos=True)
                kw.pop("stop", None)
        arrival += rng.choice([0, 0, 0, 1, 2])
        abort = rng.randint(0, 8) if rng.random() < 0.15 else None
        mix.append(dict(rid=f"q{i}", prompt=prompt, kw=kw, arrival=arrival, abort=abort))
    return mix


def run_mix(eng, mix: list[dict], perfect: bool) -> tuple[dict, int]:
    """Add, abort, step until done; pool invariants (and the perfect draft's KV) after every step."""
    finals: dict = {}
    pending = sorted(mix, key=lambda r: r["arrival"])
    aborts: dict[int, list[str]] = {}
    # Liveness: every request fits the pool alone, so each finishes within a bound of steps.
    limit = 40 + max(r["arrival"] for r in mix) + sum(3 * (len(r["prompt"]) + r["kw"]["max_tokens"]) for r in mix)
    step = checked = 0
    while pending or eng.has_unfinished_requests():
        while pending and pending[0]["arrival"] <= step:
            r = pending.pop(0)
            eng.add_request(r["rid"], r["prompt"], SamplingParams(**r["kw"]))
            if r["abort"] is not None:
                aborts.setdefault(step + r["abort"], []).append(r["rid"])
        for rid in aborts.pop(step, []):
            eng.abort_request(rid)
        for out in eng.step():
            if out.finished:
                assert out.request_id not in finals, f"{out.request_id} finished twice"
                finals[out.request_id] = out
        eng.pool.check_consistency()
        if perfect:
            checked += check_draft_kv(eng)
        step += 1
        assert step < limit, (f"not done after {step} steps: running {eng.scheduler.running}, "
                              f"waiting {list(eng.scheduler.waiting)}")
    for out in eng.step():   # aborts since the last step
        finals.setdefault(out.request_id, out)
    return finals, checked


def compare(r: dict, out, ref) -> list[str]:
    rid, n = r["rid"], len(out.token_ids)
    if out.finish_reason == "abort":
        return [] if ref is None or out.token_ids == ref.token_ids[:n] else [f"{rid}: aborted off the reference"]
    if out.error is not None:
        return [f"{rid}: failed: {out.error}"]
    if ref is None:   # sampled
        ok = n == r["kw"]["max_tokens"] and out.finish_reason == "length"
        return [] if ok else [f"{rid}: sampled, {n} tokens ({out.finish_reason})"]
    if (out.token_ids, out.finish_reason, out.text) != (ref.token_ids, ref.finish_reason, ref.text):
        return [f"{rid}: {out.token_ids} ({out.finish_reason}), the target alone {ref.token_ids} "
                f"({ref.finish_reason}); preempted {out.stats.num_preemptions}x"]
    problems = []
    for name in ("logprobs", "prompt_logprobs"):
        got, want = getattr(out, name), getattr(ref, name)
        if want is None:
            continue
        if got is None or len(got) != len(want):
            problems.append(f"{rid}: {name} has {None if got is None else len(got)} entries, not {len(want)}")
            continue
        for g, w in zip(got, want):
            if (g is None) != (w is None) or g is not None and (
                    abs(g[0] - w[0]) > TOL or [t for t, _ in g[1]] != [t for t, _ in w[1]]):
                problems.append(f"{rid}: {name} {g} != {w}")
                break
    return problems


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_pressure_mix_equals_the_target_alone(models, reference, name):
    seed, draft, settings, extra = SCENARIOS[name]
    max_model_len = settings.get("max_model_len")
    ref = reference(max_model_len)
    rng = random.Random(seed)
    mix = build_mix(rng, ref, max_model_len or 512)
    need = max(blocks_needed(len(r["prompt"]) + r["kw"]["max_tokens"], settings["block_size"]) for r in mix)
    llm = make(models, draft, num_blocks=need + extra, **settings)
    eng = llm.engine
    finals, checked = run_mix(eng, mix, perfect=draft == "perfect")

    assert not eng.has_unfinished_requests()
    eng.pool.check_all_free()
    eng.pool.check_consistency()
    assert set(finals) == {r["rid"] for r in mix}
    problems = []
    for r in mix:
        want = None if r["kw"]["temperature"] else ref.generate([r["prompt"]], SamplingParams(**r["kw"]))[0]
        problems += compare(r, finals[r["rid"]], want)
        if draft == "perfect" and settings.get("spec_tree", "chain") == "chain":
            stats = finals[r["rid"]].stats   # a draft equal to the target: every chain node accepted
            if stats.num_accepted_tokens != stats.num_draft_tokens:
                problems.append(f"{r['rid']}: the perfect draft had {stats.num_accepted_tokens} of "
                                f"{stats.num_draft_tokens} nodes accepted")
    assert not problems, f"{name}:\n" + "\n".join(problems)
    # The mix did what it is for: the pool ran out, the prefix cache hit, the drafter drafted.
    assert eng.scheduler.num_preemptions > 0 and eng.pool.prefix_cache_hit_tokens > 0
    # (The adaptive controller's plans follow measured step times: it may well not speculate here.)
    assert draft == "none" or settings.get("spec_mode") == "adaptive" or eng.spec.totals.num_drafts > 0
    if draft == "perfect":
        assert checked > 0


# -- admission at the pool's edge ------------------------------------------------------------------


@pytest.mark.parametrize("draft", ["none", "ngram", "perfect"])
def test_a_request_larger_than_the_pool_is_refused_at_admission(models, reference, draft):
    """3 blocks of 4: 12 KV positions. A request whose KV needs 13 is refused at once with an error
    naming the pool's size (a prompt-logprobs-only one of 13 prompt tokens too), nothing is queued,
    and the engine serves the next ones exactly."""
    llm = make(models, draft, block_size=4, num_blocks=3)
    eng = llm.engine
    prompt = [LOW_ID + i for i in range(5)]
    with pytest.raises(InvalidRequestError) as e:   # 5 + 9 tokens: KV for 13 positions
        eng.add_request("big", prompt, SamplingParams(max_tokens=9, temperature=0.0))
    assert e.value.param == "max_tokens" and "12" in str(e.value)
    with pytest.raises(InvalidRequestError):   # prompt logprobs of 13 prompt tokens
        eng.add_request("echo", [LOW_ID + i for i in range(13)], SamplingParams(max_tokens=0, prompt_logprobs=1))
    assert not eng.has_unfinished_requests()
    eng.pool.check_all_free()
    params = [SamplingParams(max_tokens=7, temperature=0.0, ignore_eos=True, logprobs=1),
              SamplingParams(max_tokens=0, prompt_logprobs=1, temperature=0.0)]
    prompts = [prompt, [LOW_ID + 7 * i for i in range(12)]]   # 12 KV positions each: the whole pool
    outs = llm.generate(prompts, params)
    refs = reference(None).generate(prompts, params)
    for out, ref in zip(outs, refs):
        assert out.token_ids == ref.token_ids and out.finish_reason == ref.finish_reason
    assert [lp for lp, _ in outs[1].prompt_logprobs[1:]] == pytest.approx(
        [lp for lp, _ in refs[1].prompt_logprobs[1:]], abs=TOL)
    eng.pool.check_all_free()


@pytest.mark.parametrize("draft", ["none", "perfect"])
def test_a_request_whose_kv_fills_the_pool_exactly_is_admitted(models, reference, draft):
    """prompt + max_tokens = pool tokens + 1 fits: the last token never gets KV (5 prompt tokens
    + 8 outputs need KV for 12 positions = 3 blocks of 4), so it is admitted, not refused as
    needing 13."""
    llm = make(models, draft, block_size=4, num_blocks=3)
    prompt = [LOW_ID + i for i in range(5)]
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=2)
    out = llm.generate([prompt], params)[0]
    ref = reference(None).generate([prompt], params)[0]
    assert out.token_ids == ref.token_ids and len(out.token_ids) == 8
    assert out.stats.num_preemptions == 0
    llm.engine.pool.check_all_free()


def test_generate_with_a_refused_prompt_leaves_nothing_queued(models, reference):
    """LLM.generate adds its prompts one by one; when a later one is refused (here: larger than
    the pool), the earlier ones are aborted, as vLLM's LLM does, not left queued for the next
    generate() call to run."""
    llm = make(models, "perfect", block_size=4, num_blocks=4)
    ok, too_big = [LOW_ID, LOW_ID + 1, LOW_ID + 2], [LOW_ID + 5] * 10
    with pytest.raises(InvalidRequestError):
        llm.generate([ok, too_big], SamplingParams(max_tokens=10, temperature=0.0))
    assert not llm.engine.has_unfinished_requests(), (
        f"left queued after the refusal: {list(llm.engine.scheduler.waiting)}")
    llm.engine.step()   # reports what was aborted, if anything
    llm.engine.pool.check_all_free()
