"""benchmarks/context_costs.py: every rows at every context that fits is timed and set beside
the calibrated cost model's figure for the same pass."""

from __future__ import annotations

import pytest
import torch

from benchmarks import context_costs
from specserve import LLM
from tests.checkpoints import make_checkpoint


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    root = tmp_path_factory.mktemp("ctxcosts")
    target = make_checkpoint(root / "target", "llama", dtype=torch.float32)
    draft = make_checkpoint(root / "draft", "llama", dtype=torch.float32, seed=1)
    return LLM(target=str(target), draft=str(draft), device="cpu", progress=False, num_blocks=64,
               block_size=4, max_num_seqs=4, spec_mode="adaptive", spec__depth=2,
               spec__max_depth=3)


def test_every_rows_and_context_is_timed_beside_the_model(llm, tmp_path):
    # room: min(64 blocks x 4 tokens, max_model_len) less the rows; 10_000 does not fit
    res = context_costs.measure(llm, [2, 4], [8, 40, 10_000], rounds=2, progress=False)
    assert res["contexts"] == [8, 40] and res["rows"] == [1, 2, 3, 4]
    costs = llm.engine.spec.controller.costs
    for b in (2, 4):
        for ctx in (8, 40):
            e = res["batch_sizes"][b][ctx]
            assert all(m > 0 for m in e["measured_s"])
            assert e["predicted_s"] == [pytest.approx(costs.t_verify(b, r * b, b * ctx)) for r in (1, 2, 3, 4)]
            ratios = [p / m for p, m in zip(e["predicted_s"], e["measured_s"])]
            assert e["predicted_over_measured"] == pytest.approx(ratios)
            assert e["tilt"] == pytest.approx(max(ratios) - min(ratios))
    table = context_costs.report(res)
    assert table.count("\n| 2 |") == 2 and table.count("\n| 4 |") == 2
    path = context_costs.plot(res, tmp_path / "ctx.png")
    assert path.stat().st_size > 0
