"""The compiled CPU forward (model/compiled.py) against the eager one: the same logits (float32
rounding), the same keys and values in the pool, for every layout a step makes (a decode row, a
chain, a tree, sequences of different row counts, a prompt chunk), and the engine's greedy
output the same through it as without it, with speculation and without. One package is built
per test session (about a minute on two cores) for a two-layer Qwen3-shaped checkpoint (per-head
q/k norms) and reused."""

from __future__ import annotations

import random

import pytest
import torch

from specserve.model import compiled
from specserve.model.loader import load_model
from specserve.runner import ForwardInput, ModelRunner, slots_for
from tests.checkpoints import make_checkpoint

BLOCK = 4


@pytest.fixture(scope="module")
def package(tmp_path_factory):
    ckpt = make_checkpoint(tmp_path_factory.mktemp("compiled_qwen3"), arch="qwen3", num_hidden_layers=2)
    model, _ = load_model(ckpt, dtype="float32", progress=False)
    path = compiled.build(model, BLOCK, tmp_path_factory.mktemp("pkg") / "forward.pt2")
    return ckpt, path


def runners(ckpt, path):
    """An eager runner and a compiled one over pools of the same (random) contents."""
    out = []
    for use in (False, True):
        model, args = load_model(ckpt, dtype="float32", progress=False)
        r = ModelRunner(model, args, num_blocks=24, block_size=BLOCK, device=torch.device("cpu"))
        torch.manual_seed(0)
        for k, v in r.kv_caches:
            k.normal_()
            v.normal_()
        if use:
            r.use_compiled(compiled.load(path))
        out.append(r)
    return out


def layout(kind: str, rng: random.Random) -> ForwardInput:
    """Sequences on disjoint blocks: (context, new rows, tree mask or None) per sequence."""
    seqs = {
        "decode": [(9, 1, None)],
        "chain": [(13, 6, None)],
        "batch": [(5, 1, None), (17, 1, None), (0, 1, None)],
        "mixed": [(7, 4, None), (3, 1, None), (20, 2, None)],
        "prompt": [(0, 11, None)],
        "tree": [(10, 5, [[1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [1, 0, 1, 0, 0], [1, 1, 0, 1, 0], [1, 0, 1, 0, 1]]),
                 (6, 3, None)],
    }[kind]
    inp, next_block = ForwardInput(), 0
    for ctx, n, mask in seqs:
        blocks = -(-(ctx + n) // BLOCK)
        table = list(range(next_block, next_block + blocks))
        next_block += blocks
        mask = None if mask is None else [[bool(x) for x in row] for row in mask]
        inp.add([rng.randrange(5, 300) for _ in range(n)], list(range(ctx, ctx + n)),
                slots_for(table, BLOCK, ctx, n), table, ctx + n, logit_rows=list(range(n)), mask=mask)
    return inp


@pytest.mark.parametrize("kind", ["decode", "chain", "batch", "mixed", "prompt", "tree"])
def test_same_logits_and_kv_as_eager(package, kind):
    eager, fast = runners(*package)
    inp = layout(kind, random.Random(kind))
    want = eager.forward(inp)
    got = fast.forward(inp)
    assert got.shape == want.shape
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    assert torch.equal(got.argmax(-1), want.argmax(-1))
    for (ke, ve), (kf, vf) in zip(eager.kv_caches, fast.kv_caches):
        torch.testing.assert_close(kf, ke, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(vf, ve, rtol=1e-5, atol=1e-5)


def test_padding_past_the_bound_runs_eagerly(package):
    """A long prompt chunk beside decode rows would be padded to many times its rows: eager."""
    _, fast = runners(*package)
    inp = ForwardInput()
    inp.add(list(range(5, 25)), list(range(20)), slots_for([0, 1, 2, 3, 4], BLOCK, 0, 20), [0, 1, 2, 3, 4], 20)
    for b in range(3):
        table = [6 + 2 * b, 7 + 2 * b]
        inp.add([7], [4], slots_for(table, BLOCK, 4, 1), table, 5, logit_rows=[0])
    assert fast._compiled_forward(inp) is None
    assert fast.forward(inp).shape[0] == 3


def test_unusable_package_is_ignored(tmp_path):
    bad = tmp_path / "bad.pt2"
    bad.write_bytes(b"not a package")
    assert compiled.load(bad) is None


def test_package_key_changes_with_the_checkpoint(tmp_path):
    a = make_checkpoint(tmp_path / "a", num_hidden_layers=1, with_tokenizer=False)
    b = make_checkpoint(tmp_path / "b", num_hidden_layers=2, with_tokenizer=False)
    ma, _ = load_model(a, dtype="float32", progress=False)
    mb, _ = load_model(b, dtype="float32", progress=False)
    assert compiled.package_path(a, ma, 16) != compiled.package_path(b, mb, 16)
    assert compiled.package_path(a, ma, 16) != compiled.package_path(a, ma, 32)
    assert compiled.package_path(a, ma, 16) == compiled.package_path(a, ma, 16)
