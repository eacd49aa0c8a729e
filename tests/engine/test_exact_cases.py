"""Greedy speculation == target-only greedy, token for token (float64), with logprobs equal
and every block free at the end, in corner cases the other exactness tests do not reach:
context ends, block boundaries, prefix-cache hits filled under other speculation settings,
full hits, prompts that are prefixes of running prompts, tiny budgets, one sequence at a
time, padded vocabularies with a logit bias toward ids the draft cannot embed, aborts."""

from __future__ import annotations

import pytest
import torch

from specserve import LLM, SamplingParams
from tests.checkpoints import make_checkpoint, make_noisy_copy

pytestmark = pytest.mark.usefixtures("one_thread")   # tests/engine/conftest.py

BS = 4
TOL = 1e-9


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("exact")
    target = make_checkpoint(root / "target", "llama", dtype=torch.float64, vocab_size=448)
    weak = make_noisy_copy(target, root / "weak", seed=5, scale=0.05)
    small = make_checkpoint(root / "small", "llama", dtype=torch.float64, seed=3, num_hidden_layers=1,
                            vocab_size=400)
    return {"target": target, "weak": weak, "perfect": target, "small": small}


def make(models, draft="weak", **kw) -> LLM:
    args = dict(target=str(models["target"]), dtype="float64", device="cpu", progress=False,
                num_blocks=128, block_size=BS)
    if draft in ("none", "ngram"):
        args["draft"] = draft
    else:
        args["draft"] = str(models[draft])
    if draft != "none":
        args.update(spec_mode="static", spec_depth=4, spec_tree="chain", spec__num_nodes=6, spec__topk=3,
                    spec__branching=[3, 2, 1])
    args.update(kw)
    return LLM(**args)


def greedy(n, **kw):
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True, **kw)


def same(outs, refs, logprobs=False):
    for i, (o, r) in enumerate(zip(outs, refs)):
        assert o.token_ids == r.token_ids, f"request {i}: {o.token_ids} != {r.token_ids}"
        assert o.finish_reason == r.finish_reason, i
        if logprobs:
            assert len(o.logprobs) == len(r.logprobs) == len(o.token_ids)
            for (a, atop), (b, btop) in zip(o.logprobs, r.logprobs):
                assert abs(a - b) < TOL, (i, a, b)
                assert [t for t, _ in atop] == [t for t, _ in btop], (i, atop, btop)
                assert all(abs(x - y) < TOL for (_, x), (_, y) in zip(atop, btop)), (i, atop, btop)


@pytest.fixture(scope="module")
def ref(models):
    return make(models, "none", enable_prefix_caching=False)


def test_context_end(models, ref):
    """Prompts ending at a block boundary and one token before max_model_len."""
    L = 24
    r = make(models, "none", max_model_len=L, enable_prefix_caching=False)
    prompts = [[5 + i for i in range(L - 1)], [50 + i for i in range(L - 6)], [90 + i for i in range(8)],
               [120 + i for i in range(L - 9)]]
    params = [greedy(1, logprobs=2), greedy(6, logprobs=2), greedy(L - 8, logprobs=2), greedy(9, logprobs=2)]
    refs = r.generate(prompts, params)
    for tree in ("chain", "fixed", "dynamic"):
        for draft in ("perfect", "weak"):
            llm = make(models, draft, spec_tree=tree, max_model_len=L)
            same(llm.generate(prompts, params), refs, logprobs=True)
            llm.engine.pool.check_all_free()


# -- a driver that checks the draft's claimed KV and every cached block after each step --------


def check_kv(eng):
    """With the target as its own draft, every position the draft claims (for running
    requests) and every position of every draft-complete cached block holds the target's K/V
    in both models."""
    bs = eng.pool.block_size
    slots = []
    for req in eng.scheduler.running:
        n = min(req.num_computed_tokens, req.num_draft_computed_tokens, req.num_tokens)
        slots += [req.block_table[p // bs] * bs + p % bs for p in range(n)]
    for key, block in eng.pool._cached.items():
        if eng.pool._draft_ok[block]:   # a block cached while the draft lagged holds only the target's
            slots += [block * bs + j for j in range(bs)]
    if not slots:
        return 0
    idx = torch.tensor(slots)
    for (tk, tv), (dk, dv) in zip(eng.target.kv_caches, eng.draft.kv_caches):
        assert torch.allclose(tk.flatten(0, 1)[idx], dk.flatten(0, 1)[idx], atol=1e-9)
        assert torch.allclose(tv.flatten(0, 1)[idx], dv.flatten(0, 1)[idx], atol=1e-9)
    return len(slots)


def drive(eng, plan, check=True):
    """plan: list of (step index, action, args). Actions: add (rid, prompt, params), abort rid,
    spec (mode, depth). Returns {rid: final output}."""
    finals, step, checked = {}, 0, 0
    plan = sorted(plan, key=lambda a: a[0])
    while plan or eng.has_unfinished_requests():
        while plan and plan[0][0] <= step:
            _, action, args = plan.pop(0)
            if action == "add":
                eng.add_request(*args)
            elif action == "abort":
                eng.abort_request(args)
            elif action == "spec":
                eng.set_speculation(*args)
        for out in eng.step():
            if out.finished:
                finals[out.request_id] = out
        if check:
            checked += check_kv(eng)
        step += 1
        assert step < 500
    eng.pool.check_all_free()
    eng.pool.check_consistency()
    return finals


SHARED = [300 + i for i in range(9)]


@pytest.mark.parametrize("tree", ["chain", "fixed", "dynamic"])
@pytest.mark.parametrize("kw", [
    dict(),
    dict(max_num_batched_tokens=5),
    dict(max_num_seqs=1),
    dict(num_blocks=12),
])
def test_prefix_hits_across_settings_keep_both_models_kv(models, ref, tree, kw):
    """Prompts that extend an earlier request's prompt + output (cached blocks holding
    generated tokens), a full hit, a prompt that is a prefix of a running one, the setting
    switched to depth 0 and back mid-run: outputs equal the target's, and the draft KV it
    claims (and every cached block) equals the target's."""
    eng = make(models, "perfect", spec_tree=tree, **kw).engine
    first = ref.generate([SHARED], greedy(10))[0]
    long = SHARED + first.token_ids        # 19 tokens: 4 full blocks of the first request's KV
    prompts = {"a": SHARED, "b": long, "c": long[:12] + [7], "d": long[:8], "e": SHARED + [1, 2, 3],
               "f": long + [9], "g": long[:17]}
    params = greedy(7, logprobs=1)
    plan = [(0, "add", ("a", SHARED, greedy(10, logprobs=1))), (0, "add", ("d0", long[:8], params)),
            (3, "spec", ("static", 0)), (6, "spec", ("static", 3)),
            (8, "add", ("b", long, params)), (8, "add", ("c", prompts["c"], params)),
            (9, "add", ("d", prompts["d"], params)), (10, "spec", ("static", 0)),
            (11, "add", ("e", prompts["e"], params)), (13, "spec", ("static", 3)),
            (14, "add", ("f", prompts["f"], params)), (20, "add", ("g", prompts["g"], params)),
            (21, "add", ("x", long, params)), (22, "abort", "x"), (22, "add", ("y", long, params))]
    finals = drive(eng, plan)
    assert eng.pool.prefix_cache_hit_tokens > 0
    refs = {rid: ref.generate([p], params)[0] for rid, p in prompts.items()}
    refs["a"] = ref.generate([SHARED], greedy(10, logprobs=1))[0]
    refs["y"] = refs["b"]
    refs["d0"] = refs["d"]
    for rid, r in refs.items():
        same([finals[rid]], [r], logprobs=True)
    assert eng.spec.totals.num_drafts > 0


@pytest.mark.parametrize("tree", ["chain", "dynamic"])
def test_output_decoded_while_the_draft_idles_is_cached_for_the_next_turn(models, ref, tree):
    """A first turn decoded plainly (depth 0: the draft computes nothing past the prompt)
    leaves its output's full blocks in the prefix cache with the target's KV only; a second
    turn that extends it hits them all, the draft computes their KV beside the new chunk,
    and speculation on it equals the target alone, the draft's KV checked every step."""
    eng = make(models, "perfect", spec_tree=tree, spec_depth=0).engine
    first = drive(eng, [(0, "add", ("a", SHARED, greedy(16)))])["a"]
    turn = SHARED + first.token_ids + [41, 42, 43]
    cached = (len(SHARED) + len(first.token_ids)) // BS   # full blocks of prompt + output
    assert sum(not eng.pool._draft_ok[b] for b in eng.pool._cached.values()) >= cached - len(SHARED) // BS
    eng.set_speculation("static", 3)
    second = drive(eng, [(0, "add", ("b", turn, greedy(12, logprobs=1)))])["b"]
    assert eng.pool.prefix_cache_hit_tokens == cached * BS
    same([second], ref.generate([turn], greedy(12, logprobs=1)), logprobs=True)
    assert eng.spec.totals.num_drafts > 0
    assert all(eng.pool._draft_ok[b] for b in eng.pool._cached.values())   # the draft caught up


PROMPTS = [[5, 6, 7], [10, 11, 12, 13, 10, 11, 12, 13, 10, 11], [200 + i for i in range(17)], [420, 401, 33, 447]]
PEN = [dict(), dict(logit_bias={430: 6.0, 405: 4.0}), dict(repetition_penalty=1.3, logit_bias={441: 3.0}),
       dict(presence_penalty=0.7, frequency_penalty=0.4), dict(frequency_penalty=-0.8, logit_bias={401: 5.0}),
       dict(min_tokens=5, stop_token_ids=[430], logit_bias={430: 8.0})]


@pytest.mark.parametrize("draft,tree", [(d, t) for d in ("small", "weak") for t in ("chain", "fixed", "dynamic")]
                         + [("ngram", "chain")])   # the n-gram drafter proposes chains only
def test_penalties_and_bias_to_ids_the_draft_cannot_embed(models, ref, draft, tree):
    """Target vocab 448, draft vocab 400: prompts and biased outputs with ids >= 400 (the
    draft reads them as 0); penalties and biases on every tree row."""
    params = [greedy(12, logprobs=3, **kw) for kw in PEN]
    prompts = [p for p in PROMPTS for _ in PEN]
    params = params * len(PROMPTS)
    refs = ref.generate(prompts, params)
    assert any(t >= 400 for r in refs for t in r.token_ids)
    llm = make(models, draft, spec_tree=tree, spec_depth=5 if tree != "fixed" else 3, max_num_batched_tokens=40)
    same(llm.generate(prompts, params), refs, logprobs=True)
    llm.engine.pool.check_all_free()
    assert llm.engine.spec.totals.num_drafts > 0


@pytest.mark.parametrize("kw", [
    dict(max_num_batched_tokens=3, max_num_seqs=1),
    dict(max_num_batched_tokens=6, enable_chunked_prefill=False),
    dict(max_num_batched_tokens=7, num_blocks=10),
    dict(block_size=1, num_blocks=200, max_num_batched_tokens=4),
    dict(block_size=5, max_num_batched_tokens=11),
])
@pytest.mark.parametrize("draft,tree", [("perfect", "fixed"), ("weak", "dynamic"), ("ngram", "chain"),
                                        ("weak", "chain")])
def test_budgets_prompt_logprobs_and_switches(models, ref, kw, draft, tree):
    """Tiny budgets (prompts chunked so that the last chunk is one token and speculates at
    once), prompt logprobs with prefix caching, switches to adaptive and back mid-run."""
    prompts = [PROMPTS[1], PROMPTS[1] + [3, 4, 5], PROMPTS[2], PROMPTS[2][:9], [7] * 11, PROMPTS[0]]
    params = [greedy(9, logprobs=2, prompt_logprobs=1), greedy(13, logprobs=0), greedy(6, prompt_logprobs=2),
              greedy(11, repetition_penalty=1.2), greedy(14, logprobs=1), greedy(1, logprobs=1)]
    refs = ref.generate(prompts, params)
    llm = make(models, draft, spec_tree=tree, spec_depth=3, **kw)
    eng = llm.engine
    plan = [(i // 2, "add", (f"r{i}", p, q)) for i, (p, q) in enumerate(zip(prompts, params))]
    plan += [(3, "spec", ("static", 1)), (5, "spec", ("adaptive", None)), (9, "spec", ("static", 3)),
             (12, "add", ("again", prompts[1], params[1]))]
    finals = drive(eng, plan, check=draft == "perfect")
    for i, r in enumerate(refs):
        o = finals[f"r{i}"]
        same([o], [r], logprobs=r.logprobs is not None)
        if r.prompt_logprobs is not None:
            assert o.prompt_logprobs[0] is None and len(o.prompt_logprobs) == len(r.prompt_logprobs)
            for (a, at), (b, bt) in zip(o.prompt_logprobs[1:], r.prompt_logprobs[1:]):
                assert abs(a - b) < TOL and [t for t, _ in at] == [t for t, _ in bt]
    same([finals["again"]], [refs[1]], logprobs=True)


@pytest.mark.parametrize("tree", ["chain", "fixed"])
def test_a_step_rerun_one_at_a_time_fails_only_the_request_that_breaks_it(models, ref, tree, monkeypatch):
    """When the target forward raises because of one request (its prompt chunk), the step is
    run again one sequence at a time (LLMEngine.step) and only that request fails. The others,
    speculating with a model drafter, must carry on and still equal target-only output."""
    MARK = 444
    llm = make(models, "weak", spec_tree=tree, spec_depth=3)
    eng = llm.engine
    real = eng.target.forward

    def forward(inp):
        if MARK in inp.input_ids:
            raise RuntimeError("simulated fault in this request's rows")
        return real(inp)

    monkeypatch.setattr(eng.target, "forward", forward)
    params = greedy(12)
    refs = ref.generate(PROMPTS[:3], params)
    plan = [(0, "add", (f"ok{i}", p, params)) for i, p in enumerate(PROMPTS[:3])]
    plan.append((3, "add", ("doomed", [5, 6, MARK, 7], params)))
    finals = drive(eng, plan, check=False)
    assert finals["doomed"].finish_reason == "error"
    for i, r in enumerate(refs):
        o = finals[f"ok{i}"]
        assert o.finish_reason == "length", (o.finish_reason, o.error)
        same([o], [r])
    assert eng.num_failed == 1


@pytest.mark.parametrize("tree", ["chain", "dynamic"])
def test_reset_mid_run_then_serve_again(models, ref, tree):
    """LLMEngine.reset() while requests are mid-speculation (as the supervisor does after the
    loop died): the next requests, sharing prefixes with the dropped ones, equal target-only."""
    llm = make(models, "weak", spec_tree=tree, spec_depth=3, num_blocks=24)
    eng = llm.engine
    for i, p in enumerate(PROMPTS):
        eng.add_request(f"old{i}", p, greedy(14))
    for _ in range(4):
        eng.step()
    eng.reset()
    assert not eng.has_unfinished_requests()
    eng.pool.check_all_free()
    params = greedy(12, logprobs=1)
    prompts = [p + [3] for p in PROMPTS] + PROMPTS
    same(llm.generate(prompts, params), ref.generate(prompts, params), logprobs=True)
    same(llm.generate(prompts, params), ref.generate(prompts, params), logprobs=True)
    eng.pool.check_all_free()
