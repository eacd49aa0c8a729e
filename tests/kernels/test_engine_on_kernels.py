"""The whole engine on the Triton kernels, as a GPU runs it: every KV write, attention call,
slot copy and tree acceptance goes through kernels/*.py (interpreted on the CPU), and the
tokens must equal the torch reference path's.

The kernel tests call each kernel with tensors they build themselves; this test catches what
only the model hands them, and runs the fused forward (kernels/fused.py) a GPU runs. The first H100 run (thirtieth session) failed on such a thing at
once: the q that Attention.forward split out of its joint RoPE tensor was not contiguous, the
reference path never minded, and the kernel's check refused the first forward of more than
one token.
"""

from __future__ import annotations

import pytest

from specserve import LLM, SamplingParams
from specserve.kernels import ops
from tests.checkpoints import make_float32_pair
from tests.kernels._device import INTERPRETED

pytestmark = pytest.mark.skipif(not INTERPRETED, reason="on a GPU the engine tests run these kernels natively")

PROMPTS = [[5, 9, 2, 7, 11, 3], [4, 4, 8], [13, 1, 6, 2, 9, 9, 10, 12, 3]]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    return make_float32_pair(tmp_path_factory.mktemp("on_kernels"))


def generate(models, tree: str, triton: bool, monkeypatch, calls: dict | None = None,
             graphs: bool = False) -> list[list[int]]:
    target, draft = models
    with monkeypatch.context() as m:
        if triton:
            m.setattr(ops, "_use_triton", lambda t: True)
            for name in ("add_rms_norm", "silu_mul", "rope_write_kv", "paged_attention", "tree_accept"):
                def counted(*a, _f=getattr(ops, name), _n=name, **k):
                    calls[_n] = calls.get(_n, 0) + 1
                    return _f(*a, **k)
                m.setattr(ops, name, counted)
        kw = dict(spec__branching=[2, 2, 1]) if tree == "fixed" else {}
        llm = LLM(target=str(target), draft=str(draft), dtype="float32", device="cpu", progress=False,
                  num_blocks=64, block_size=4, spec_mode="static", spec_depth=3, spec_tree=tree,
                  cuda_graphs=graphs, **kw)
        params = [SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True),
                  SamplingParams(max_tokens=10, temperature=0.8, seed=7, ignore_eos=True),
                  SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)]
        outs = llm.generate(PROMPTS, params)
        assert llm.engine.pool.num_free_blocks == llm.engine.pool.num_blocks  # every block came back
    return [o.token_ids for o in outs]


@pytest.mark.parametrize("tree, graphs", [("fixed", False), ("chain", True)])
def test_engine_on_triton_kernels_matches_reference(models, tree, graphs, monkeypatch):
    """graphs: the uniform forwards padded into static buffers as cuda_graphs does (nothing is
    captured on the CPU), so padding rows go through the Triton kernels too."""
    reference = generate(models, tree, triton=False, monkeypatch=monkeypatch)
    calls: dict[str, int] = {}
    on_kernels = generate(models, tree, triton=True, monkeypatch=monkeypatch, calls=calls, graphs=graphs)
    assert on_kernels == reference
    # the fused forward ran (kernels/fused.py): per forward, 2 norms a layer + 1, one RoPE and
    # one SiLU a layer; and the speculative steps went through tree_accept
    assert calls["rope_write_kv"] == calls["paged_attention"] == calls["silu_mul"] > 0
    assert calls["add_rms_norm"] > 2 * calls["rope_write_kv"]
    assert calls["tree_accept"] > 0
    assert all(len(t) == 10 for t in on_kernels)
