"""tree_accept: the Triton kernel equals the reference; the reference is lossless."""

from __future__ import annotations

import pytest
import torch

from specserve.kernels.reference import tree_accept_reference
from specserve.kernels import ops
from specserve.kernels.tree_accept import tree_accept as _tree_accept

from ._device import DEVICE


def tree_accept(*inputs, **kwargs):
    """The Triton kernel on DEVICE, results back on CPU."""
    return tuple(t.cpu() for t in _tree_accept(*[x.to(DEVICE) for x in inputs], **kwargs))


def make_batch(trees, vocab, greedy_flags, seed, agree=0.5):
    """trees: per sequence a list of (parent, is_sampled). Builds padded kernel inputs where
    node tokens often agree with the target (so that walks go deep) and sometimes do not."""
    gen = torch.Generator().manual_seed(seed)
    batch = len(trees)
    max_nodes = max((len(t) for t in trees), default=0)
    logits = torch.randn(batch, max_nodes + 1, vocab, generator=gen) * 2
    target_probs = torch.softmax(logits, -1)
    target_argmax = target_probs.argmax(-1)
    draft_probs = torch.softmax(torch.randn(batch, max_nodes, vocab, generator=gen) * 2, -1)
    tokens = torch.zeros(batch, max_nodes, dtype=torch.int64)
    parents = torch.full((batch, max_nodes), -1, dtype=torch.int32)
    is_sampled = torch.zeros(batch, max_nodes, dtype=torch.bool)
    for b, tree in enumerate(trees):
        for n, (parent, sampled) in enumerate(tree):
            parents[b, n] = parent
            is_sampled[b, n] = sampled
            if torch.rand((), generator=gen) < agree:
                tokens[b, n] = target_argmax[b, parent + 1]
            elif sampled:
                tokens[b, n] = torch.multinomial(draft_probs[b, n], 1, generator=gen)[0]
            else:
                tokens[b, n] = torch.randint(vocab, (), generator=gen)
    num_nodes = torch.tensor([len(t) for t in trees], dtype=torch.int32)
    is_greedy = torch.tensor(greedy_flags, dtype=torch.bool)
    uniforms = torch.rand(batch, max_nodes + 1, generator=gen)
    return (target_probs, target_argmax, draft_probs, tokens, parents, is_sampled,
            num_nodes, is_greedy, uniforms)  # fmt: skip


CHAIN = [(-1, True), (0, True), (1, True), (2, True)]
TOPK_TREE = [(-1, False), (-1, False), (0, False), (0, False), (1, False), (2, True), (5, True)]
MIXED_TREE = [(-1, True), (-1, False), (-1, True), (0, True), (0, False), (1, True), (3, True), (6, False)]
ONE_NODE = [(-1, True)]


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("vocab", [5, 37])
def test_kernel_equals_reference(seed, vocab):
    trees = [CHAIN, TOPK_TREE, [], MIXED_TREE, ONE_NODE, MIXED_TREE, CHAIN, []]
    greedy = [False, False, False, False, False, True, True, True]
    inputs = make_batch(trees, vocab, greedy, seed, agree=0.6)
    want = tree_accept_reference(*inputs)
    got = tree_accept(*inputs)
    for w, g, name in zip(want, got, ["accepted", "num_accepted", "bonus"]):
        assert torch.equal(w, g), f"{name}: reference {w.tolist()} kernel {g.tolist()}"


def test_nothing_accepted_and_everything_accepted():
    vocab = 7
    inputs = list(make_batch([MIXED_TREE, MIXED_TREE, CHAIN, CHAIN], vocab, [False, True, False, True], seed=3))
    target_probs, target_argmax, _, tokens, parents, is_sampled, *_ = inputs
    # sequences 0, 1: every node's token has target probability 0 -> nothing can be accepted
    for b in (0, 1):
        target_probs[b, :, 6] = 0.0
        target_probs[b] /= target_probs[b].sum(-1, keepdim=True)
        target_argmax[b] = target_probs[b].argmax(-1)
        tokens[b] = 6
    # sequences 2, 3: a chain of the target's argmax drawn with q = p -> everything accepted
    for b in (2, 3):
        for n in range(4):
            tokens[b, n] = target_argmax[b, n]
        inputs[2][b, :4] = target_probs[b, :4]
    want = tree_accept_reference(*inputs)
    got = tree_accept(*inputs)
    assert want[1].tolist() == [0, 0, 4, 4]
    assert want[0][2].tolist() == [0, 1, 2, 3, -1, -1, -1, -1]
    # the greedy bonus after the whole chain is the argmax after the leaf
    assert int(want[2][3]) == int(target_argmax[3, 4])
    assert int(want[2][1]) == int(target_argmax[1, 0])
    for w, g in zip(want, got):
        assert torch.equal(w, g)


@pytest.mark.parametrize("seed", range(3))
def test_no_trees_at_all_is_plain_decode(seed):
    """N = 0 for the whole batch: the bonus is the target's own sample (or argmax)."""
    inputs = make_batch([[], [], []], 11, [False, True, False], seed=seed)
    want = tree_accept_reference(*inputs)
    got = tree_accept(*inputs)
    assert want[0].shape == (3, 0) and want[1].tolist() == [0, 0, 0]
    assert int(want[2][1]) == int(inputs[1][1, 0])
    for w, g in zip(want, got):
        assert torch.equal(w, g)


def test_ops_dispatch_on_cpu_is_the_reference():
    inputs = make_batch([MIXED_TREE, [], CHAIN], 6, [False, False, True], seed=9)
    for w, g in zip(tree_accept_reference(*inputs), ops.tree_accept(*inputs)):
        assert torch.equal(w, g)


def test_max_depth_truncates_the_stored_path():
    inputs = make_batch([CHAIN], 5, [True], seed=0, agree=1.0)
    accepted, num_accepted, bonus = tree_accept(*inputs, max_depth=2)
    assert num_accepted.tolist() == [4]
    assert accepted.tolist() == [[0, 1]]


def first_token_distribution(tree, draft_probs_row, target_root, num_samples, seed):
    """Empirical law of the first emitted token (first accepted child, else the bonus)."""
    vocab = target_root.shape[0]
    gen = torch.Generator().manual_seed(seed)
    n = len(tree)
    target_probs = torch.softmax(torch.randn(1, n + 1, vocab, generator=gen), -1)
    target_probs[0, 0] = target_root
    target_argmax = target_probs.argmax(-1)
    draft_probs = draft_probs_row.expand(1, n, vocab).contiguous()
    parents = torch.tensor([[p for p, _ in tree]], dtype=torch.int32)
    is_sampled = torch.tensor([[s for _, s in tree]], dtype=torch.bool)
    counts = torch.zeros(vocab)
    for _ in range(num_samples):
        tokens = torch.zeros(1, n, dtype=torch.int64)
        chosen_top = torch.argsort(draft_probs_row, descending=True)
        k = 0
        for i, (parent, sampled) in enumerate(tree):
            if sampled:  # drawn independently from q
                tokens[0, i] = torch.multinomial(draft_probs_row, 1, generator=gen)[0]
            else:  # deterministic top-k: the k-th most likely draft token
                tokens[0, i] = chosen_top[k]
                k += 1
        uniforms = torch.rand(1, n + 1, generator=gen)
        accepted, num_accepted, bonus = tree_accept_reference(
            target_probs, target_argmax, draft_probs, tokens, parents, is_sampled,
            torch.tensor([n], dtype=torch.int32), torch.tensor([False]), uniforms)  # fmt: skip
        first = int(tokens[0, accepted[0, 0]]) if num_accepted[0] > 0 else int(bonus[0])
        counts[first] += 1
    return counts / num_samples


@pytest.mark.parametrize(
    "tree",
    [
        [(-1, True), (-1, True), (-1, True)],  # three children sampled from q (SpecInfer)
        [(-1, False), (-1, False), (0, True)],  # deterministic top-2 at the root
    ],
    ids=["sampled-siblings", "top-k"],
)
def test_reference_is_lossless(tree):
    """The first emitted token follows the target's root distribution exactly.

    With S samples over V outcomes, E[TV] <= 0.5 * sum_x sqrt(p(x)(1-p(x))/S) <=
    0.5 * sqrt((V-1)/S) ~= 0.032 for V=5, S=4000; the bound 0.06 is ~2x that mean and
    TV concentrates (McDiarmid: P(TV - E[TV] > t) <= exp(-2 S t^2) = exp(-7) for t=0.028).
    A sampler ignoring the residual (emitting draft tokens at q) would give TV ~0.3 here.
    """
    num_samples = 4000
    target_root = torch.tensor([0.05, 0.4, 0.3, 0.15, 0.1])
    draft = torch.tensor([0.5, 0.1, 0.05, 0.3, 0.05])  # deliberately far from the target
    empirical = first_token_distribution(tree, draft, target_root, num_samples, seed=1234)
    tv = 0.5 * (empirical - target_root).abs().sum().item()
    assert tv < 0.06, f"TV {tv:.3f}: empirical {empirical.tolist()} target {target_root.tolist()}"


@pytest.mark.parametrize("seed", range(3))
def test_all_greedy_batch_takes_one_wide_placeholders(seed):
    """Greedy acceptance reads only the argmax, so the engine passes [B, N+1, 1] / [B, N, 1]
    placeholders instead of building probabilities; the result must not change."""
    inputs = make_batch([CHAIN, TOPK_TREE, MIXED_TREE, ONE_NODE], vocab=37, greedy_flags=[True] * 4, seed=seed)
    full = tree_accept_reference(*inputs)
    target_probs, target_argmax, draft_probs, *rest = inputs
    slim = (torch.zeros(*target_probs.shape[:2], 1), target_argmax, torch.zeros(*draft_probs.shape[:2], 1), *rest)
    for got in (tree_accept(*slim), tree_accept_reference(*slim)):
        for a, b in zip(got, full):
            assert torch.equal(a.cpu(), b.cpu())
