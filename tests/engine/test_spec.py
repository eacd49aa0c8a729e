"""Speculative decoding never changes greedy output (float64): for every drafter (the
target itself, a weaker noisy copy, a random model, n-gram lookup), chain depths 1-8,
fixed and dynamic trees, batches, preemption, prefix caching, and stops that land in the
middle of an accepted run. Also: blocks all come back after aborts mid-speculation, and
the speculative counters add up."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
import torch

from specserve import LLM, SamplingParams
from specserve.controller import EarlyStop, Plan
from specserve.spec import SpecTotals
from tests.checkpoints import make_checkpoint, make_noisy_copy

PROMPTS = [
    [5, 6, 7],
    [10, 11, 12, 13, 10, 11, 12, 13, 10, 11],  # repeats itself: n-gram lookup finds matches
    [200 + i for i in range(17)],
]
MAX_TOKENS = 14

GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
TREE_KW = dict(spec__num_nodes=6, spec__topk=3)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("spec")
    target = make_checkpoint(root / "target", "llama", dtype=torch.float64)
    # A weaker draft: the target with noise on every weight (accepts some, rejects some).
    weak = make_noisy_copy(target, root / "weak", seed=5, scale=0.05)
    bad = make_checkpoint(root / "bad", "llama", dtype=torch.float64, seed=1, num_hidden_layers=1)
    return {"target": target, "perfect": target, "weak": weak, "bad": bad}


def make_llm(models, draft: str, tree="chain", depth=4, **kw) -> LLM:
    args = dict(target=str(models["target"]), dtype="float64", device="cpu", progress=False,
                num_blocks=128, block_size=4)
    if draft in ("none", "ngram"):
        args["draft"] = draft
    else:
        args["draft"] = str(models[draft])
    if draft != "none":
        args.update(spec_mode="static", spec_depth=depth, spec_tree=tree)
        if tree == "fixed":
            args["spec__branching"] = kw.pop("branching", [3, 2, 1])
        args.update(TREE_KW)
    args.update(kw)
    return LLM(**args)


@pytest.fixture(scope="module")
def reference(models):
    """Target-only greedy outputs."""
    llm = make_llm(models, "none")
    return [o.token_ids for o in llm.generate(PROMPTS, GREEDY)]


def check_stats(llm, outs, perfect_chain=False):
    totals = llm.engine.spec.totals
    drafts = sum(o.stats.num_drafts for o in outs)
    drafted = sum(o.stats.num_draft_tokens for o in outs)
    accepted = sum(o.stats.num_accepted_tokens for o in outs)
    assert (totals.num_drafts, totals.num_draft_tokens, totals.num_accepted_tokens) == (drafts, drafted, accepted)
    assert drafts > 0, "no speculation happened"
    for o in outs:
        s = o.stats
        assert s.num_accepted_tokens <= s.num_draft_tokens
        assert sum(s.accepted_per_position) == s.num_accepted_tokens
        # Position k can only be accepted when position k-1 was.
        assert all(a >= b for a, b in zip(s.accepted_per_position, s.accepted_per_position[1:]))
        if s.accepted_per_position:
            assert s.accepted_per_position[0] <= s.num_drafts
        if perfect_chain:
            assert s.num_accepted_tokens == s.num_draft_tokens
    per_pos = [sum(o.stats.accepted_per_position[k] if k < len(o.stats.accepted_per_position) else 0 for o in outs)
               for k in range(len(totals.accepted_per_position))]
    assert per_pos == totals.accepted_per_position
    assert totals.num_emitted_tokens == accepted + totals.num_drafts


def run_and_compare(llm, reference, prompts=PROMPTS, params=GREEDY):
    outs = llm.generate(prompts, params)
    for i, (o, ref) in enumerate(zip(outs, reference)):
        assert o.token_ids == ref, f"prompt {i}: speculation changed the greedy output"
        assert o.finish_reason == "length"
    llm.engine.pool.check_all_free()
    return outs


def passes_perfect(depth: int) -> int:
    """Target passes a request of MAX_TOKENS takes with a draft whose path is always the
    target's: the prompt's pass yields one token, then passes of depth + 1, none wasted."""
    return 1 + math.ceil((MAX_TOKENS - 1) / (depth + 1))


@pytest.mark.parametrize("depth", [1, 2, 3, 4, 5, 6, 7, 8])
def test_chain_perfect_draft(models, reference, depth):
    llm = make_llm(models, "perfect", depth=depth)
    outs = run_and_compare(llm, reference)
    check_stats(llm, outs, perfect_chain=True)
    # Every verify pass accepts its whole chain, and no chain is longer than the request can
    # still emit (the scheduler cuts the last one): the fewest passes of at most depth + 1
    # tokens, none wasted.
    emitted_by_drafts = MAX_TOKENS - 1
    for o in outs:
        assert o.stats.num_target_passes == passes_perfect(depth)
        assert o.stats.num_draft_tokens + o.stats.num_drafts <= emitted_by_drafts
    totals = llm.engine.spec.totals
    assert totals.accepted_per_position[0] == totals.num_drafts
    if emitted_by_drafts % (depth + 1) in (0, 1):   # every chain full length (a last single token: plain)
        assert totals.mean_tokens_per_pass == depth + 1
        assert totals.accepted_per_position == [totals.num_drafts] * depth


@pytest.mark.parametrize("draft,depth", [("weak", 1), ("weak", 3), ("weak", 8), ("bad", 2), ("bad", 5)])
def test_chain_imperfect_drafts(models, reference, draft, depth):
    llm = make_llm(models, draft, depth=depth)
    outs = run_and_compare(llm, reference)
    check_stats(llm, outs)
    totals = llm.engine.spec.totals
    assert totals.num_accepted_tokens < totals.num_draft_tokens, "an imperfect draft was never rejected?"


def test_weak_draft_is_partly_accepted(models, reference):
    llm = make_llm(models, "weak", depth=4)
    run_and_compare(llm, reference)
    totals = llm.engine.spec.totals
    assert 0 < totals.num_accepted_tokens < totals.num_draft_tokens


@pytest.mark.parametrize("depth", [1, 3, 6])
def test_ngram_drafter(models, reference, depth):
    llm = make_llm(models, "ngram", depth=depth)
    outs = run_and_compare(llm, reference)
    check_stats(llm, outs)


@pytest.mark.parametrize("draft", ["ngram", "perfect"])
def test_no_draft_deeper_than_the_request_can_emit(models, draft):
    # Depth 8 but only 4 tokens per request: no chain may be longer than the tokens left less
    # one (its pass also emits the bonus token): every proposed token can be emitted.
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    ref = [o.token_ids for o in make_llm(models, "none").generate(PROMPTS, params)]
    llm = make_llm(models, draft, depth=8)
    drafter = llm.engine.spec.drafter
    real = drafter.propose
    longest = []

    def propose(seqs, shape, prefills):
        trees = real(seqs, shape, prefills)
        for s, t in zip(seqs, trees):
            assert t.num_nodes <= s.request.num_tokens_left - 1
            longest.append(t.num_nodes)
        return trees

    drafter.propose = propose
    outs = llm.generate(PROMPTS, params)
    assert [o.token_ids for o in outs] == ref
    assert sum(o.stats.num_drafts for o in outs) > 0
    if draft == "perfect":   # the step after the prompt's drafts the two tokens before the last
        assert max(longest) == 2
    llm.engine.pool.check_all_free()


@pytest.mark.parametrize("draft", ["perfect", "weak", "bad"])
@pytest.mark.parametrize("branching", [[3, 2, 1], [4, 2, 2, 1]])
def test_fixed_tree(models, reference, draft, branching):
    llm = make_llm(models, draft, tree="fixed", depth=len(branching), branching=branching)
    outs = run_and_compare(llm, reference)
    check_stats(llm, outs)
    totals = llm.engine.spec.totals
    n = sum(branching[0] * 1 for _ in [0])
    assert totals.num_draft_tokens <= totals.num_drafts * (3 + 6 + 6 if branching == [3, 2, 1] else 44)
    if draft == "perfect":
        # The draft's top-1 path is in the tree and is the target's argmax path: every pass
        # emits a full path, the last one cut to what the request still needs.
        for o in outs:
            assert o.stats.num_target_passes == passes_perfect(len(branching))
        assert n > 0


@pytest.mark.parametrize("draft", ["perfect", "weak", "bad"])
def test_dynamic_tree(models, reference, draft):
    llm = make_llm(models, draft, tree="dynamic", depth=4)
    outs = run_and_compare(llm, reference)
    check_stats(llm, outs)
    totals = llm.engine.spec.totals
    assert totals.num_draft_tokens <= totals.num_drafts * TREE_KW["spec__num_nodes"]
    if draft == "perfect":
        assert totals.mean_tokens_per_pass > 2.0


def test_mixed_batch_greedy_and_sampled(models, reference):
    """Sampled neighbours in the same verify pass do not disturb greedy requests."""
    llm = make_llm(models, "weak", depth=3)
    sampled = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.8, top_k=20, seed=3, ignore_eos=True)
    outs = llm.generate(PROMPTS + PROMPTS[:2], [GREEDY] * 3 + [sampled] * 2)
    assert [o.token_ids for o in outs[:3]] == reference
    assert all(len(o.token_ids) == MAX_TOKENS for o in outs)
    llm.engine.pool.check_all_free()


@pytest.mark.parametrize("tree", ["chain", "fixed", "dynamic"])
def test_preemption_and_prefix_cache(models, reference, tree):
    # 3 requests of 17, 24 and 31 tokens in all (19 blocks of 4) plus speculation scratch, in 9 blocks.
    llm = make_llm(models, "weak" if tree == "chain" else "perfect", tree=tree, depth=3,
                   num_blocks=9, enable_prefix_caching=True)
    run_and_compare(llm, reference)
    assert llm.engine.scheduler.num_preemptions > 0
    # Again: the prompts' blocks are in the prefix cache now (both models' KV).
    llm.engine.spec.totals = SpecTotals()
    outs = run_and_compare(llm, reference)
    assert llm.engine.pool.prefix_cache_hit_tokens > 0
    assert any(o.stats.num_cached_tokens > 0 for o in outs)
    check_stats(llm, outs)


def test_prefix_cache_shared_prefix_with_draft(models):
    shared = [300 + i for i in range(13)]
    prompts = [shared + [1 + i] for i in range(3)]
    ref = [o.token_ids for o in make_llm(models, "none").generate(prompts, GREEDY)]
    llm = make_llm(models, "weak", tree="fixed", depth=3, enable_prefix_caching=True)
    llm.generate([shared + [50]], GREEDY)
    outs = llm.generate(prompts, GREEDY)
    assert llm.engine.pool.prefix_cache_hit_tokens > 0
    assert [o.token_ids for o in outs] == ref
    llm.engine.pool.check_all_free()


# -- stops in the middle of an accepted run ---------------------------------------------


@pytest.mark.parametrize("max_tokens", [1, 2, 7, 11])
def test_max_tokens_inside_an_accepted_run(models, reference, max_tokens):
    llm = make_llm(models, "perfect", depth=4)  # runs of 5 tokens: 7 and 11 end mid-run
    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True))
    assert [o.token_ids for o in outs] == [r[:max_tokens] for r in reference]
    assert all(o.finish_reason == "length" for o in outs)
    llm.engine.pool.check_all_free()


def test_stop_string_inside_an_accepted_run(models):
    base = make_llm(models, "none")
    prompt = PROMPTS[2]
    ref = base.generate([prompt], GREEDY)[0]
    ascii_at = [i for i, c in enumerate(ref.text) if c.isascii() and c.isalnum()]
    assert len(ascii_at) >= 3
    for tree in ("chain", "fixed"):
        llm = make_llm(models, "perfect", tree=tree, depth=4)
        for i in (ascii_at[1], ascii_at[-1]):
            stop = ref.text[i]
            params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, stop=[stop], ignore_eos=True)
            alone = base.generate([prompt], params)[0]
            out = llm.generate([prompt], params)[0]
            assert out.text == alone.text == ref.text[: ref.text.find(stop)]
            assert out.token_ids == alone.token_ids and out.finish_reason == alone.finish_reason == "stop"
        llm.engine.pool.check_all_free()


def test_eos_inside_an_accepted_run(models, reference, tmp_path):
    ref = reference[2]
    idx = next(i for i in range(3, len(ref)) if ref[i] not in ref[:i])
    tok = ref[idx]
    idx2 = next(i for i in range(idx + 1, len(ref)) if ref[i] not in ref[:i])
    ckpt = tmp_path / "eos"
    shutil.copytree(models["target"], ckpt)
    gen_file = Path(ckpt) / "generation_config.json"
    gen = json.loads(gen_file.read_text())
    gen["eos_token_id"] = [1, tok]
    gen_file.write_text(json.dumps(gen))
    for tree, draft in (("chain", "eos"), ("fixed", "eos"), ("chain", "ngram")):
        llm = LLM(target=str(ckpt), draft=str(ckpt) if draft == "eos" else draft, dtype="float64", device="cpu",
                  progress=False, num_blocks=64, block_size=4, spec_mode="static", spec_depth=4, spec_tree=tree,
                  spec__branching=[3, 2, 1])
        out = llm.generate([PROMPTS[2]], SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0))[0]
        assert out.token_ids == ref[: idx + 1] and out.finish_reason == "stop"
        out = llm.generate([PROMPTS[2]], SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0,
                                                          stop_token_ids=[ref[idx2]], ignore_eos=True))[0]
        assert out.token_ids == ref[: idx2 + 1] and out.finish_reason == "stop"
        llm.engine.pool.check_all_free()


@pytest.mark.parametrize("tree,draft", [("chain", "perfect"), ("fixed", "perfect"), ("chain", "weak"), ("chain", "ngram")])
def test_min_tokens_masks_inside_the_verify_pass(models, tree, draft):
    """min_tokens masks stop ids out of the target's rows in the verify pass too: with any
    draft the output equals target-only generation with the same min_tokens."""
    ref = make_llm(models, "none").generate(
        [PROMPTS[2]], SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True))[0].token_ids
    idx = next(i for i in range(3, len(ref)) if ref[i] not in ref[:i])
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True,
                            stop_token_ids=[ref[idx]], min_tokens=idx + 3)
    alone = make_llm(models, "none").generate([PROMPTS[2]], params)[0].token_ids
    assert ref[idx] not in alone[: idx + 3] and alone[: idx] == ref[: idx]
    llm = make_llm(models, draft, tree=tree)
    out = llm.generate([PROMPTS[2]], params)[0]
    assert out.token_ids == alone
    assert llm.engine.spec.totals.num_drafts > 0
    llm.engine.pool.check_all_free()


# -- aborts --------------------------------------------------------------------------------


@pytest.mark.parametrize("tree", ["chain", "dynamic"])
def test_abort_mid_speculation_frees_every_block(models, reference, tree):
    llm = make_llm(models, "weak", tree=tree, depth=3, enable_prefix_caching=True)
    eng = llm.engine
    for i, p in enumerate(PROMPTS):
        eng.add_request(f"r{i}", p, GREEDY)
    for _ in range(3):
        eng.step()
    assert eng.spec.totals.num_drafts > 0, "speculation had not started"
    eng.abort_request("r1")
    outs = {}
    while eng.has_unfinished_requests():
        for o in eng.step():
            if o.finished:
                outs[o.request_id] = o
    assert outs["r1"].finish_reason == "abort"
    assert outs["r0"].token_ids == reference[0] and outs["r2"].token_ids == reference[2]
    eng.pool.check_all_free()
    # Abort everything mid-speculation.
    for i, p in enumerate(PROMPTS):
        eng.add_request(f"s{i}", p, GREEDY)
    for _ in range(3):
        eng.step()
    for i in range(3):
        eng.abort_request(f"s{i}")
    assert not eng.has_unfinished_requests()
    aborted = eng.step()
    assert sorted(o.request_id for o in aborted) == ["s0", "s1", "s2"] and all(o.finish_reason == "abort" for o in aborted)
    eng.pool.check_all_free()
    eng.pool.check_consistency()


# -- seeds ----------------------------------------------------------------------------------


@pytest.mark.parametrize("draft", ["weak", "ngram"])
def test_seeded_request_is_batch_independent_with_speculation(models, draft):
    """A seeded sampled request gives the same tokens alone or next to others whose trees
    have other sizes. Near the end of the context (max_model_len) its own trees shrink while
    its neighbours' do not, so the batch's widest tree is not its own."""
    llm = make_llm(models, draft, depth=4, max_model_len=24)
    mine = SamplingParams(max_tokens=14, temperature=0.9, seed=77, ignore_eos=True)
    prompt = [10, 11, 12, 13, 10, 11, 12, 13, 10, 11]
    alone = llm.generate([prompt], mine)[0].token_ids
    others = [[20, 21, 20, 21], [30, 31, 30]]
    other_params = [SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True),
                    SamplingParams(max_tokens=20, temperature=0.7, seed=5, ignore_eos=True)]
    mixed = llm.generate(others + [prompt], other_params + [mine])
    assert mixed[-1].token_ids == alone
    assert llm.engine.spec.totals.num_drafts > 0
    llm.engine.pool.check_all_free()


# -- the draft's KV ---------------------------------------------------------------------------


@pytest.mark.parametrize("tree,kw", [
    ("chain", {}),
    ("fixed", {"branching": [3, 2, 1]}),
    ("fixed", {"branching": [1, 1, 1]}),
    ("dynamic", {"spec__num_nodes": 3, "spec__topk": 3}),
    ("dynamic", {"spec__num_nodes": 3, "spec__topk": 2}),  # a chain-shaped result would have been fed as [a, b, a1]
    ("dynamic", {}),
])
def test_draft_kv_it_claims_is_right(models, tree, kw):
    """With the target as its own draft, every position the draft claims to have computed
    (num_draft_computed_tokens) holds exactly the target's K/V there."""
    llm = make_llm(models, "perfect", tree=tree, depth=3, **kw)
    eng = llm.engine
    for i, p in enumerate(PROMPTS):
        eng.add_request(f"r{i}", p, GREEDY)
    bs = eng.pool.block_size
    checked = 0
    while eng.has_unfinished_requests():
        eng.step()
        for req in eng.scheduler.running:
            n = min(req.num_computed_tokens, req.num_draft_computed_tokens)
            slots = torch.tensor([req.block_table[p // bs] * bs + p % bs for p in range(n)])
            for (tk, tv), (dk, dv) in zip(eng.target.kv_caches, eng.draft.kv_caches):
                tk, dk = tk.flatten(0, 1)[slots], dk.flatten(0, 1)[slots]
                assert torch.allclose(tk, dk, atol=1e-9), f"{req}: draft K differs from the target's"
            checked += n
    assert checked > 0
    eng.pool.check_all_free()


# -- other architectures, adaptive depth, odd block sizes and budgets ------------------------


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    # head_dim 32 != hidden / heads, q/k norms: the tree-verify pass goes through them too.
    return make_checkpoint(tmp_path_factory.mktemp("spec_qwen3"), "qwen3", dtype=torch.float64)


@pytest.mark.parametrize("tree", ["chain", "fixed", "dynamic"])
def test_qwen3_speculation(qwen3, tree):
    kw = dict(target=str(qwen3), dtype="float64", device="cpu", progress=False, num_blocks=64, block_size=4)
    ref = [o.token_ids for o in LLM(draft="none", **kw).generate(PROMPTS, GREEDY)]
    llm = LLM(draft=str(qwen3), spec_mode="static", spec_depth=3, spec_tree=tree, spec__branching=[3, 2, 1],
              spec__num_nodes=6, **kw)
    assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY)] == ref
    assert llm.engine.spec.totals.num_accepted_tokens > 0
    llm.engine.pool.check_all_free()


@pytest.mark.parametrize("tree,block_size,budget,mode", [
    ("chain", 1, 5, "static"),      # budget caps the tree: pending token + 4 nodes
    ("fixed", 3, 3, "static"),      # chunked prefill and trees cut by the budget
    ("dynamic", 16, 2048, "adaptive"),
    ("chain", 4, 16, "adaptive"),
])
def test_block_sizes_budgets_and_adaptive_depth(models, reference, tree, block_size, budget, mode):
    llm = make_llm(models, "weak" if tree == "chain" else "perfect", tree=tree, depth=4,
                   block_size=block_size, num_blocks=512 // block_size, max_num_batched_tokens=budget,
                   spec_mode=mode)
    outs = run_and_compare(llm, reference)
    if mode == "static":
        check_stats(llm, outs)
    else:
        ctrl = llm.engine.spec.controller
        assert sum(ctrl.depth_histogram.values()) > 0 and not ctrl.acceptance.requests


@pytest.mark.parametrize("draft_vocab", [416, 400])
def test_draft_with_a_differently_padded_vocabulary(models, tmp_path, draft_vocab):
    """Real pairs share a tokenizer but not always an embedding size (Qwen2.5-7B: 152064,
    Qwen2.5-0.5B: 151936). Target here: vocab 448 (padded); drafts: 416 and 400 = the tokenizer's size."""
    target = make_checkpoint(tmp_path / "t", "llama", dtype=torch.float64, vocab_size=448)
    draft = make_checkpoint(tmp_path / "d", "llama", dtype=torch.float64, seed=3, num_hidden_layers=1,
                            vocab_size=draft_vocab)
    common = dict(target=str(target), dtype="float64", device="cpu", progress=False, num_blocks=64, block_size=4)
    ref = LLM(draft="none", **common).generate(PROMPTS, GREEDY)
    llm = LLM(draft=str(draft), spec_mode="static", spec_depth=3, **common)
    outs = llm.generate(PROMPTS, GREEDY)
    assert [o.token_ids for o in outs] == [o.token_ids for o in ref]
    # Sampled chains carry the draft's distribution into the verifier, padded to the target's width.
    sampled = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.9, seed=11, ignore_eos=True)
    assert all(len(o.token_ids) == MAX_TOKENS for o in llm.generate(PROMPTS, sampled))
    assert llm.engine.spec.totals.num_drafts > 0
    llm.engine.pool.check_all_free()


def test_draft_with_too_small_a_vocabulary_is_refused(models, tmp_path):
    from specserve.errors import ModelLoadError

    draft = make_checkpoint(tmp_path / "d", "llama", dtype=torch.float64, num_hidden_layers=1, with_tokenizer=False,
                            vocab_size=300)
    with pytest.raises(ModelLoadError, match="vocab_size 300"):
        LLM(target=str(models["target"]), draft=str(draft), dtype="float64", progress=False, num_blocks=16)


def test_a_step_costs_from_the_end_of_the_one_before(models):
    """What the caller does between steps (the server's event loop writing an SSE event per
    request per step) is part of each step's cost, unless the engine idled in between: the
    rest of a step the controller learns counts the gap, and not a wait after idle()."""
    import time

    llm = make_llm(models, "weak", spec_mode="adaptive")
    engine, seen = llm.engine, []
    observe = engine.spec.controller.observe

    def record(batch_size, rows, levels, draft_s, verify_s, rest_s, chains, timed=True, context=None):
        seen.append(rest_s)
        observe(batch_size, rows, levels, draft_s, verify_s, rest_s, chains, timed, context)
    engine.spec.controller.observe = record
    for p in PROMPTS:
        engine.add_request(None, p, SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True))
    engine.step()   # the prompts
    engine.step()
    time.sleep(0.2)   # the caller busy with the outputs
    engine.step()
    busy = seen[-1]
    engine.step()
    engine.idle()
    time.sleep(0.2)   # the caller waiting for work
    engine.step()
    idle = seen[-1]
    assert busy >= 0.2
    assert idle < 0.1
    while engine.has_unfinished_requests():
        engine.step()
    engine.pool.check_all_free()


def test_finished_and_aborted_requests_leave_no_history_in_the_controller(models, reference):
    llm = make_llm(models, "weak", spec_mode="adaptive")
    ctrl = llm.engine.spec.controller
    plan = ctrl.plan
    ctrl.plan = lambda seqs, context=None: Plan(4, {rid: min(4, cap) for rid, cap, _ in seqs if cap})  # every step
    stop = reference[2][5]
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in (3, 7, MAX_TOKENS)]
    params.append(SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True, stop_token_ids=[stop]))
    for p in params:
        outs = llm.generate(PROMPTS, p)
        assert [o.token_ids for o in outs] == [r[: len(o.token_ids)] for r, o in zip(reference, outs)]
        assert not ctrl.acceptance.requests, p
    assert outs[2].finish_reason == "stop"
    assert llm.engine.spec.totals.num_drafts > 0
    ctrl.plan = plan
    eng = llm.engine
    for i, p in enumerate(PROMPTS):
        eng.add_request(f"a{i}", p, GREEDY)
    for _ in range(3):
        eng.step()
    eng.abort_request("a1")
    while eng.has_unfinished_requests():
        eng.step()
    assert not ctrl.acceptance.requests
    llm.engine.pool.check_all_free()


def test_the_controller_learns_sampled_and_greedy_acceptance_apart(models):
    llm = make_llm(models, "weak", spec_mode="adaptive")
    ctrl = llm.engine.spec.controller
    ctrl.plan = lambda seqs, context=None: Plan(3, {rid: min(3, cap) for rid, cap, _ in seqs if cap})
    initial = ctrl.cfg.initial_acceptance
    llm.generate(PROMPTS, GREEDY)
    assert ctrl.acceptance.glob[False][0] != initial and ctrl.acceptance.glob[True][0] == initial
    sampled = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.8, seed=1, ignore_eos=True)
    llm.generate(PROMPTS, [GREEDY, sampled, GREEDY])
    assert ctrl.acceptance.glob[True][0] != initial
    llm.engine.pool.check_all_free()


def _spy_trees(llm) -> list:
    """(shape, trees) of every propose() from now on."""
    seen = []
    drafter = llm.engine.spec.drafter
    real = drafter.propose

    def propose(seqs, shape, prefills):
        trees = real(seqs, shape, prefills)
        seen.append((shape, [t for t in trees if t.num_nodes]))
        return trees

    drafter.propose = propose
    return seen


def test_early_stop_cuts_chains_by_their_path_probability(models, reference):
    """A calibrated draft's chains are cut while drafted: a node is kept while its path
    probability pays for its row at the plan's goodput. With no cost every chain runs to its
    cap; with a threshold amid the path probabilities chains end at their first node below
    it; with a huge one nothing is verified. The output is the target's throughout."""
    row = 0.01   # seconds a verify row costs

    def run(goodput):
        llm = make_llm(models, "weak", depth=6, spec_mode="adaptive")

        def plan(seqs, context=None):
            nodes = {rid: min(6, cap) for rid, cap, _ in seqs if cap}
            return Plan(max(nodes.values(), default=0), nodes, EarlyStop(
                goodput, 1.0, 0.8, 0.0, [0.05 + row * len(seqs) * r for r in range(10)], len(seqs),
                rows=len(seqs)))
        llm.engine.spec.controller.plan = plan
        seen = _spy_trees(llm)
        outs = run_and_compare(llm, reference)
        return llm, outs, [t for _, ts in seen for t in ts]

    llm, outs, trees = run(0.0)
    check_stats(llm, outs)
    assert max(t.num_nodes for t in trees) == 6
    probs = sorted(p for t in trees for p in t.path_probs)
    threshold = probs[len(probs) // 2]
    llm, outs, trees = run(threshold / row)
    check_stats(llm, outs)
    assert trees and all(t.is_chain for t in trees)
    assert all(p > threshold for t in trees for p in t.path_probs)
    assert any(t.num_nodes < 6 for t in trees) and any(t.num_nodes > 1 for t in trees)
    llm, outs, trees = run(1e9)
    assert not trees and llm.engine.spec.totals.num_drafts == 0
