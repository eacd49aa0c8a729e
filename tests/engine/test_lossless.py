"""Speculative sampling is lossless: at temperature > 0 (with top-k and top-p) the tokens a
speculating engine generates follow the target's own distribution exactly.

Setup: a target and an unrelated draft with a 12-token vocabulary. N seeded requests all
continue the same prompt by 3 tokens (x1 from the prefill, then x2, x3 from a speculative
step: draft proposals verified by tree_accept). The empirical joint of (x1, x2, x3) is
compared with the exact target distribution p(x1) p(x2|x1) p(x3|x1,x2), computed from
transformers' logits with the same temperature/top-k/top-p transform (target_probs).

Bound: with K outcomes in the support and N samples, E[TV] <= 0.5 * sum_i sqrt(p_i/N)
<= 0.5 * sqrt(K/N) (Cauchy-Schwarz), and TV moves by at most 1/N per sample, so
P(TV > E[TV] + t) <= exp(-2 N t^2) (McDiarmid); t = sqrt(ln(1000) / 2N) gives a false
alarm rate below 0.1% (and the seeds make every run identical anyway).

Power: the same test must reject a wrong verifier. An accept-always verifier is run
through the engine and lands far above the bound, and the draft's own distribution is far
from the target's.
"""

from __future__ import annotations

import itertools
import math
from collections import Counter

import pytest
import torch

from specserve import LLM, SamplingParams
from specserve.kernels import ops
from specserve.sampling import target_probs
from tests.checkpoints import make_checkpoint
from tests.engine.conftest import early_stop_at

VOCAB = 12
PROMPT = [3, 4, 5, 6]
N = 2000
TEMPERATURE, TOP_K, TOP_P = 1.0, 3, 0.9


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("lossless")
    # The tokenizer has 400 tokens but the models only 12: prompts are token ids < 12.
    target = make_checkpoint(root / "target", "llama", dtype=torch.float64, vocab_size=VOCAB)
    draft = make_checkpoint(root / "draft", "llama", dtype=torch.float64, seed=1, num_hidden_layers=1,
                            vocab_size=VOCAB)
    return target, draft


def _probs(model, prefix: list[int], penalties: dict | None = None) -> torch.Tensor:
    with torch.no_grad():
        logits = model(torch.tensor([prefix])).logits[0, -1:].double()
    if penalties:   # frequency penalty and logit bias, as OpenAI defines them, on the output so far
        output = prefix[len(PROMPT):]
        for t, b in penalties.get("logit_bias", {}).items():
            logits[0, t] += b
        for t in set(output):
            logits[0, t] -= penalties.get("frequency_penalty", 0.0) * output.count(t)
    return target_probs(logits, torch.tensor([TEMPERATURE]), torch.tensor([TOP_K]), torch.tensor([TOP_P]))[0]


def exact_joint(path, first_from=None, length: int = 3, penalties: dict | None = None) -> dict[tuple[int, ...], float]:
    """Exact distribution of the `length`-token continuation of PROMPT. With `first_from`, x1
    comes from that model (the target: the prefill samples it) and the rest from `path`."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float64).eval()
    first = AutoModelForCausalLM.from_pretrained(str(first_from), dtype=torch.float64).eval() if first_from else model
    joint = {(): 1.0}
    for i in range(length):
        nxt = {}
        for prefix, p in joint.items():
            probs = _probs(first if i == 0 else model, PROMPT + list(prefix), penalties)
            for x in probs.nonzero().flatten().tolist():
                nxt[prefix + (x,)] = p * float(probs[x])
        joint = nxt
    assert abs(sum(joint.values()) - 1.0) < 1e-9
    return joint


def tv(counts: Counter, n: int, exact: dict) -> float:
    keys = set(counts) | set(exact)
    return 0.5 * sum(abs(counts.get(k, 0) / n - exact.get(k, 0.0)) for k in keys)


def bound(k: int, n: int) -> float:
    return 0.5 * math.sqrt(k / n) + math.sqrt(math.log(1000) / (2 * n))


def sample_engine(target, draft, tree: str, n: int = N, seed0: int = 0, check_rejections=True,
                  length: int = 3, penalties: dict | None = None, **kw):
    llm = LLM(target=str(target), draft=str(draft), dtype="float64", device="cpu", progress=False,
              num_blocks=4 * n, block_size=4, spec_mode="static", spec_depth=length - 1, spec_tree=tree,
              spec__branching=[2, 1], max_num_seqs=n, max_num_batched_tokens=16 * n, max_waiting_requests=n, **kw)
    params = [SamplingParams(max_tokens=length, temperature=TEMPERATURE, top_k=TOP_K, top_p=TOP_P, seed=seed0 + i,
                             ignore_eos=True, **(penalties or {})) for i in range(n)]
    outs = llm.generate([PROMPT] * n, params)
    llm.engine.pool.check_all_free()
    totals = llm.engine.spec.totals
    assert totals.num_drafts > 0
    if check_rejections:
        assert 0 < totals.num_accepted_tokens < totals.num_draft_tokens
    return Counter(tuple(o.token_ids) for o in outs), totals


@pytest.fixture(scope="module")
def exact(pair):
    target, draft = pair
    return exact_joint(target)


def test_draft_is_far_from_target(pair, exact):
    """The draft's distribution (x2, x3 taken from the draft unverified) is far outside the
    bound: a verifier that accepted every draft token would fail this test."""
    target, draft = pair
    drafty = exact_joint(draft, first_from=target)
    dist = 0.5 * sum(abs(drafty.get(k, 0.0) - exact.get(k, 0.0)) for k in set(drafty) | set(exact))
    assert dist > 3 * bound(len(exact), N), dist
    print(f'TV(draft-continued, target) = {dist:.3f}')


@pytest.mark.parametrize("tree", ["chain", "fixed"])
def test_speculative_sampling_matches_target_distribution(pair, exact, tree):
    """x1 sampled after the prompt (the step with no nodes), x2 x3 drafted and verified."""
    target, draft = pair
    counts, totals = sample_engine(target, draft, tree)
    assert set(counts) <= set(exact), "a token outside the target's top-k/top-p support was emitted"
    d, b = tv(counts, N, exact), bound(len(exact), N)
    assert d < b, f"{tree}: TV {d:.4f} >= bound {b:.4f} (K={len(exact)}, N={N})"


PENALTIES = dict(frequency_penalty=2.0, logit_bias={2: 1.5, 7: -1.0, 9: 2.0})


@pytest.mark.parametrize("tree", ["chain", "fixed"])
def test_speculative_sampling_with_a_frequency_penalty_and_logit_bias(pair, tree):
    """The verifier penalizes each node's row by the output before it and its own path: the
    output follows the penalized target distribution exactly. (A verifier that left the path
    out, penalizing by the output before the step only, leaves the bound here.)"""
    target, draft = pair
    exact = exact_joint(target, penalties=PENALTIES)
    assert 0.5 * sum(abs(exact_joint(target).get(k, 0.0) - p) for k, p in exact.items()) > 0.1, \
        "the penalties should move the distribution well outside the bound"
    counts, _ = sample_engine(target, draft, tree, seed0=5 * 10**6, penalties=PENALTIES)
    assert set(counts) <= set(exact)
    d, b = tv(counts, N, exact), bound(len(exact), N)
    assert d < b, f"{tree} with penalties: TV {d:.4f} >= bound {b:.4f} (K={len(exact)}, N={N})"


def test_chains_that_stop_early_still_follow_the_target(pair, monkeypatch):
    """Early stop (controller.EarlyStop) ends a chain before its first node whose path
    probability does not pay for its row. A sampled node is kept by its own draw, so it is
    verified against the draft's law restricted to the tokens that pass (test_lossless_cases.py
    holds the bar that cuts first nodes, where verifying against the draft's own law leaves the
    target's distribution); each verified position is the target's, and so is the output.
    Four tokens: x1 from the prefill, then a step that may draft x2 and x3 (x4 is its bonus),
    each kept while the draft's path probability is above 0.15."""
    trees = early_stop_at(monkeypatch, bar=0.15, depth=3)
    target, draft = pair
    exact = exact_joint(target, length=4)
    n = 3000
    counts, _ = sample_engine(target, draft, "chain", n=n, seed0=2 * 10**6, length=4)
    lengths = [t.num_nodes for t in trees]
    assert n // 10 < sum(k < 2 for k in lengths) < len(lengths) - n // 10, "the threshold should stop some chains"
    assert all(p > 0.15 for t in trees for p in t.path_probs)
    assert set(counts) <= set(exact)
    d, b = tv(counts, n, exact), bound(len(exact), n)
    assert d < b, f"early stop: TV {d:.4f} >= bound {b:.4f} (K={len(exact)}, N={n})"


def test_wrong_acceptance_rule_is_detected(pair, exact, monkeypatch):
    """A verifier that accepts every chain node (whatever p and q say) leaves the bound."""
    real = ops.tree_accept

    def accept_always(target_probs, target_argmax, draft_probs, tokens, parents, is_sampled, num_nodes, *rest):
        accepted, num_accepted, bonus = real(target_probs, target_argmax, draft_probs, tokens, parents,
                                             is_sampled, num_nodes, *rest)
        for b, n in enumerate(num_nodes.tolist()):  # chains: node k is the child of node k - 1
            accepted[b, :n] = torch.arange(n, dtype=accepted.dtype)
            num_accepted[b] = n
        return accepted, num_accepted, bonus

    monkeypatch.setattr(ops, "tree_accept", accept_always)
    n = 800
    counts, _ = sample_engine(*pair, "chain", n=n, seed0=10**6, check_rejections=False)
    d, b = tv(counts, n, exact), bound(len(exact), n)
    assert d > b, f"a wrong verifier went unnoticed: TV {d:.4f} <= bound {b:.4f}"


def test_support_enumeration_is_small(exact):
    # top-k = 3 over three tokens: at most 27 outcomes, so N = 2000 samples resolve them.
    assert 8 <= len(exact) <= 27
    assert all(v > 0 for v in exact.values())
    assert len({k[0] for k in exact}) <= TOP_K and itertools  # noqa: B018
