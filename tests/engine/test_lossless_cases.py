"""Lossless sampling in cases tests/engine/test_lossless.py and tests/kernels/test_tree_accept.py
leave out: sampled chains cut by early stop at a node-specific threshold, duplicate and
zero-probability siblings in the acceptance rule, presence/repetition penalties along tree
paths, min_tokens masks on draft nodes, and one batch mixing request parameters under the
n-gram drafter.

Statistics as in test_lossless.py: the empirical joint of the first output tokens from N
seeded requests against the exact target distribution (computed by hand from transformers'
logits), TV bound 0.5 * sqrt(K / N) + sqrt(ln(1000) / 2N) (false alarm < 0.1%; the seeds make
every run identical anyway).
"""

from __future__ import annotations

import math
from collections import Counter

import pytest
import torch

from specserve import LLM, SamplingParams
from specserve.sampling import target_probs
from tests.checkpoints import make_checkpoint
from tests.engine.conftest import early_stop_at
from tests.engine.test_lossless import bound, tv

pytestmark = pytest.mark.usefixtures("one_thread")   # tests/engine/conftest.py

VOCAB = 12
PROMPT = [3, 4, 5, 6]
EOS = 1   # the test tokenizer's EOS id, inside the models' 12-token vocabulary


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("lossless_cases")
    target = make_checkpoint(root / "target", "llama", dtype=torch.float64, vocab_size=VOCAB)
    draft = make_checkpoint(root / "draft", "llama", dtype=torch.float64, seed=1, num_hidden_layers=1,
                            vocab_size=VOCAB)
    return target, draft


@pytest.fixture(scope="module")
def hf(pair):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(pair[0]), dtype=torch.float64).eval()


def _row(hf, prefix: list[int], params: SamplingParams) -> torch.Tensor:
    """The target's sampling distribution after `prefix`, the request's processing done by hand
    (min_tokens mask, logit_bias, repetition, frequency and presence penalties as OpenAI and
    vLLM define them), then temperature / top-k / top-p."""
    with torch.no_grad():
        x = hf(torch.tensor([prefix])).logits[0, -1].double().clone()
    output = prefix[len(PROMPT):]
    if len(output) < params.min_tokens:
        for t in set(params.stop_token_ids) | ({EOS} if not params.ignore_eos else set()):
            x[t] = -math.inf
    for t, b in (params.logit_bias or {}).items():
        x[t] += b
    r = params.repetition_penalty
    for t in set(PROMPT) | set(output):
        x[t] = x[t] / r if x[t] > 0 else x[t] * r
    for t in set(output):
        x[t] -= params.frequency_penalty * output.count(t) + params.presence_penalty
    if params.is_greedy:
        return torch.nn.functional.one_hot(x.argmax(), VOCAB).double()
    return target_probs(x[None], torch.tensor([params.temperature]), torch.tensor([max(params.top_k, 0)]),
                        torch.tensor([params.top_p]))[0]


def exact_joint(hf, params: SamplingParams, length: int) -> dict[tuple[int, ...], float]:
    """Exact law of the output's first `length` tokens (shorter where EOS or a stop id ends it)."""
    stops = set(params.stop_token_ids) | ({EOS} if not params.ignore_eos else set())
    joint = {(): 1.0}
    for _ in range(length):
        nxt: dict[tuple[int, ...], float] = {}
        for prefix, p in joint.items():
            if prefix and prefix[-1] in stops:
                nxt[prefix] = nxt.get(prefix, 0.0) + p
                continue
            probs = _row(hf, PROMPT + list(prefix), params)
            for x in probs.nonzero().flatten().tolist():
                nxt[prefix + (x,)] = p * float(probs[x])
        joint = nxt
    assert abs(sum(joint.values()) - 1.0) < 1e-9
    return joint


def make_llm(target, draft, n: int, tree: str = "chain", depth: int = 2, **kw) -> LLM:
    return LLM(target=str(target), draft=str(draft), dtype="float64", device="cpu", progress=False,
               num_blocks=4 * n, block_size=4, spec_mode="static", spec_depth=depth, spec_tree=tree,
               max_num_seqs=n, max_num_batched_tokens=16 * n, max_waiting_requests=n, **kw)


def generate(llm: LLM, params: list[SamplingParams], length: int) -> list[tuple[int, ...]]:
    outs = llm.generate([PROMPT] * len(params), params)
    llm.engine.pool.check_all_free()
    return [tuple(o.token_ids[:length]) for o in outs]


def assert_follows(name: str, samples: list[tuple[int, ...]], exact: dict) -> None:
    n = len(samples)
    counts = Counter(samples)
    assert set(counts) <= set(exact), f"{name}: emitted outside the target's support: {set(counts) - set(exact)}"
    d, b = tv(counts, n, exact), bound(len(exact), n)
    assert d < b, f"{name}: TV {d:.4f} >= bound {b:.4f} (K={len(exact)}, N={n})"


# -- early stop cuts a sampled node by its own draft probability --------------------------------


def test_early_stop_that_cuts_a_sampled_node_by_its_own_probability_stays_lossless(pair, hf, monkeypatch):
    """EarlyStop.keep cuts a chain's newest node AFTER it was drawn, by a path probability that
    holds the node's own q(x): a kept node is drawn from q restricted to the tokens that pass,
    so that restricted law (renormalised) must be the q it is verified against. Verified
    against q itself, p = (.5, .5), q = (.8, .2), kept iff q(x) > .3 gives P(emit a) =
    .8 * .5/.8 + .2 * .5 = .6, not .5.

    Setup: max_tokens = 3; the step after the prefill drafts one node x2 (kept iff its draft
    probability > 0.3, as the adaptive controller's EarlyStop does with a row cost of 0.3) and
    emits x2 (accepted, then a bonus x3) or the bonus in its place; (x1, x2) must follow the
    target's joint. Verified against the unrestricted q, the exact TV is ~0.21, far above the
    bound (0.086)."""
    trees = early_stop_at(monkeypatch, bar=0.3, depth=1)
    target, draft = pair
    n = 2000
    params = [SamplingParams(max_tokens=3, temperature=1.0, top_k=4, seed=7 * 10**6 + i, ignore_eos=True)
              for i in range(n)]
    samples = generate(make_llm(target, draft, n, depth=1), params, 2)
    kept = [t.num_nodes for t in trees]
    assert 0 < sum(kept) < len(kept), "the threshold should keep some nodes and cut others"
    assert all(p > 0.3 for t in trees for p in t.path_probs)
    assert_follows("early stop", samples, exact_joint(hf, params[0], 2))


# -- passing checks of cases the existing tests do not cover ------------------------------------


def _first_token_law(tokens: list[int], sampled: list[bool], p: torch.Tensor, q: torch.Tensor, num: int,
                     seed: int) -> torch.Tensor:
    """Empirical law of the first emitted token of tree_accept_reference over `num` draws, root
    children only: sampled children are drawn i.i.d. from q, the others are `tokens`."""
    from specserve.kernels.reference import tree_accept_reference

    g = torch.Generator().manual_seed(seed)
    n, vocab = len(tokens), p.shape[0]
    rows = torch.cat([p[None], torch.softmax(torch.randn(n, vocab, generator=g), -1)])
    toks = torch.tensor(tokens).expand(num, n).clone()
    for i, s in enumerate(sampled):
        if s:
            toks[:, i] = torch.multinomial(q, num, replacement=True, generator=g)
    probs = rows.expand(num, n + 1, vocab).contiguous()
    accepted, num_accepted, bonus = tree_accept_reference(
        probs, probs.argmax(-1), q.expand(num, n, vocab).contiguous(), toks,
        torch.full((num, n), -1, dtype=torch.int32), torch.tensor(sampled).expand(num, n).contiguous(),
        torch.full((num,), n, dtype=torch.int32), torch.zeros(num, dtype=torch.bool),
        torch.rand(num, n + 1, generator=g))
    first = torch.where(num_accepted > 0, toks.gather(1, accepted[:, :1].clamp(min=0).long()).squeeze(1), bonus)
    return torch.bincount(first, minlength=vocab).double() / num


@pytest.mark.parametrize("tokens, sampled", [
    ([2, 2, 0, 3], [False, False, True, False]),   # a deterministic sibling repeated, then a draw
    ([0, 4, 0, 1], [False, False, True, True]),    # deterministic siblings outside p's support
    ([0, 0, 0, 0], [True, False, True, False]),    # draws and top-k siblings interleaved
], ids=["duplicate-siblings", "outside-support", "interleaved"])
def test_reference_first_token_with_duplicate_and_zero_probability_siblings(tokens, sampled):
    """The root's emitted token follows p (top-k truncated: zeros on tokens the draft likes)
    whatever the siblings: repeated tokens, tokens p gives 0, draws after rejections. S = 12000
    over 3 outcomes: E[TV] <= 0.5 sqrt(2/S) ~ 0.0065; bound 0.025."""
    p = torch.tensor([0.0, 0.5, 0.3, 0.2, 0.0, 0.0])
    q = torch.tensor([0.3, 0.1, 0.1, 0.1, 0.2, 0.2])
    law = _first_token_law(tokens, sampled, p, q, 12000, seed=sum(tokens) + 17)
    assert law[p == 0].sum() == 0
    assert 0.5 * (law - p.double()).abs().sum() < 0.025, law.tolist()


def test_presence_and_repetition_penalties_along_fixed_tree_paths(pair, hf):
    """Presence and repetition penalties (test_lossless.py has frequency and logit_bias only,
    test_penalties.py greedy only) follow each tree node's own path under sampling."""
    target, draft = pair
    n = 2000
    params = [SamplingParams(max_tokens=3, temperature=1.0, top_k=3, seed=8 * 10**6 + i, ignore_eos=True,
                             presence_penalty=1.5, repetition_penalty=3.0, logit_bias={2: 1.5, 9: 2.0})
              for i in range(n)]
    llm = make_llm(target, draft, n, tree="fixed", spec__branching=[3, 2])
    samples = generate(llm, params, 3)
    assert 0 < llm.engine.spec.totals.num_accepted_tokens
    assert_follows("presence+repetition, fixed tree", samples, exact_joint(hf, params[0], 3))


def test_min_tokens_masks_draft_nodes_by_depth(pair, hf):
    """min_tokens = 2 bans EOS and the stop id at output positions 0 and 1 (the prefill's row,
    the second step's root row) but not at position 2 (that step's depth-1 node rows, and the
    bonus): biased up, they take > 30% of x3, so a node mask off by one depth would show."""
    target, draft = pair
    n = 2000
    params = [SamplingParams(max_tokens=3, temperature=1.0, top_k=3, seed=9 * 10**6 + i, min_tokens=2,
                             stop_token_ids=[5], logit_bias={EOS: 4.0, 5: 4.0, 9: 3.0}) for i in range(n)]
    llm = make_llm(target, draft, n, tree="fixed", spec__branching=[3, 2])
    samples = generate(llm, params, 3)
    exact = exact_joint(hf, params[0], 3)
    assert sum(p for k, p in exact.items() if k[-1] in (EOS, 5)) > 0.3
    assert_follows("min_tokens, fixed tree", samples, exact)


def test_ngram_drafter_with_a_batch_of_mixed_parameters(pair, hf):
    """One batch: top-k at T = 0.5, top-p at T = 1.5, greedy, penalties; the n-gram drafter's
    deterministic (one-hot) proposals verified under each row's own parameters."""
    target, _ = pair
    kinds = [dict(temperature=0.5, top_k=3), dict(temperature=1.5, top_p=0.6), dict(temperature=0.0),
             dict(temperature=1.0, top_k=3, frequency_penalty=1.0, logit_bias={3: 2.0})]
    per = 1200
    params = [SamplingParams(max_tokens=3, seed=10**7 + j * per + i, ignore_eos=True, **kw)
              for j, kw in enumerate(kinds) for i in range(per)]
    llm = make_llm(target, "ngram", len(params), depth=2)
    samples = generate(llm, params, 3)
    assert llm.engine.spec.totals.num_draft_tokens > 0
    for j in range(len(kinds)):
        assert_follows(f"ngram, params {kinds[j]}", samples[j * per:(j + 1) * per],
                       exact_joint(hf, params[j * per], 3))
