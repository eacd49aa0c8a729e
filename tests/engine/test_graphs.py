"""cuda_graphs = true: uniform forwards go through padded static buffers (specserve/graphs.py).
On the CPU nothing is captured and the same padded forward runs eagerly: what is checked here
is the padding and the buffers (the outputs equal the plain runner's, padding rows write no
KV, every block comes back); the capture itself needs a GPU."""

from __future__ import annotations

import pytest
import torch

from specserve import LLM, SamplingParams
from specserve.graphs import ForwardGraphs
from specserve.runner import ForwardInput
from tests.checkpoints import make_float32_pair

PROMPTS = [[5, 9, 2, 7, 11, 3], [4, 4, 8], [13, 1, 6, 2, 9, 9, 10, 12, 3], [7, 7, 7, 1, 2]]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    return make_float32_pair(tmp_path_factory.mktemp("graphs"))


def run(models, graphs: bool, **kw):
    target, draft = models
    kw = {"draft": str(draft), **kw}
    llm = LLM(target=str(target), dtype="float32", device="cpu", progress=False,
              num_blocks=64, block_size=4, cuda_graphs=graphs, **kw)
    params = [SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True),
              SamplingParams(max_tokens=9, temperature=0.7, seed=3, ignore_eos=True),
              SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True),
              SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)]
    outs = llm.generate(PROMPTS, params)
    pool = llm.engine.pool
    assert pool.num_free_blocks == pool.num_blocks   # every block came back
    return [o.token_ids for o in outs], llm.engine


@pytest.mark.parametrize("kw", [dict(draft="none"), dict(spec_mode="static", spec_depth=3),
                                dict(spec_mode="adaptive")], ids=["plain", "chain3", "adaptive"])
def test_padded_buffers_give_the_plain_runners_tokens(models, kw):
    want, _ = run(models, False, **kw)
    got, engine = run(models, True, **kw)
    if kw.get("spec_mode") == "adaptive":
        # its depths follow measured times, and a seeded sample follows the depths it met:
        # only the greedy requests are the same whatever the plans
        got, want = [got[i] for i in (0, 2, 3)], [want[i] for i in (0, 2, 3)]
    assert got == want
    assert engine.target.graphs is not None and engine.target.graphs.replays > 0
    if kw.get("draft") != "none":
        assert engine.draft.graphs.replays > 0
        # the draft's levels, and catch-ups of a few rows a sequence (the last one's logits)
        assert 1 in {q for _, q in engine.draft.graphs.entries}
        # a verify pass of depth 3 is 4 rows a sequence: captured shapes of more than one row
        assert any(q > 1 for _, q in engine.target.graphs.entries) or kw["spec_mode"] == "adaptive"


def _forward_input(query_lens, masks=None, all_logits=True) -> ForwardInput:
    inp = ForwardInput()
    for i, q in enumerate(query_lens):
        ctx = 5 + i
        rows = list(range(q)) if all_logits else [q - 1]
        inp.add([1] * q, list(range(ctx, ctx + q)), [10 * i + j for j in range(q)], [i, i + 1], ctx + q, rows,
                None if masks is None else masks[i])
    return inp


def test_which_forwards_the_graphs_take():
    graphs = ForwardGraphs(torch.nn.Identity(), [], torch.device("cpu"), max_batch=8, max_rows=4, max_blocks=3)
    assert graphs.sizes == [1, 2, 4, 8]
    assert graphs.eligible(_forward_input([1, 1, 1]))                     # a decode step
    assert graphs.eligible(_forward_input([4, 4]))                        # a chain verify pass
    assert not graphs.eligible(_forward_input([1, 3]))                    # rows differ (a prompt chunk)
    assert not graphs.eligible(_forward_input([5]))                       # more rows than captured
    assert not graphs.eligible(_forward_input([2, 2], masks=[[[True, False], [True, True]], None]))   # a tree
    assert graphs.eligible(_forward_input([2, 2], all_logits=False))      # logits of the last rows (a catch-up)
    assert not graphs.eligible(_forward_input([1] * 9))                   # more sequences than captured
    graphs.rows = {1, 2}   # as capture_all leaves it on CUDA: only the captured row counts
    assert graphs.eligible(_forward_input([2, 2])) and not graphs.eligible(_forward_input([3, 3]))
    graphs.rows = None
    none = _forward_input([2, 2])
    none.logit_rows.clear()
    assert not graphs.eligible(none)                                      # a chunk that only writes KV


def test_padding_rows_write_no_kv(models):
    """A decode step of 3 sequences padded to 4: the pool holds exactly the 3 real rows' K/V."""
    _, engine = run(models, True, draft="none")
    runner = engine.target
    k0 = runner.kv_caches[0][0]
    before = k0.clone()
    inp = _forward_input([1, 1, 1])
    inp.slot_mapping[:] = [40, 41, 42]
    runner.forward(inp)
    changed = (k0 != before).flatten(2).any(-1).flatten().nonzero().flatten().tolist()
    assert changed == [40, 41, 42]
    assert (4, 1) in runner.graphs.entries


@pytest.mark.skipif(not torch.cuda.is_available(), reason="capturing needs a CUDA device (the CPU runs above cover the buffers)")
def test_captured_graphs_replay_the_eager_tokens_on_cuda(models):
    target, draft = models
    outs = {}
    for graphs in (False, True):
        llm = LLM(target=str(target), draft=str(draft), dtype="float32", device="cuda", progress=False,
                  num_blocks=64, block_size=4, spec_mode="static", spec_depth=3, cuda_graphs=graphs)
        outs[graphs] = [o.token_ids for o in llm.generate(PROMPTS, SamplingParams(max_tokens=12, temperature=0.0,
                                                                                   ignore_eos=True))]
        if graphs:
            entries = llm.engine.target.graphs.entries
            assert entries and all(e.graph is not None for e in entries.values())
    assert outs[True] == outs[False]
