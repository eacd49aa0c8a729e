"""benchmarks/depth_curve.py: the depth rotation runs every depth, stays lossless, returns every
block, and its summary keeps only the steps it says it keeps."""

from __future__ import annotations

import pytest
import torch

from benchmarks import depth_curve
from specserve import LLM, SamplingParams
from tests.checkpoints import make_checkpoint, make_noisy_copy


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("curve")
    target = make_checkpoint(root / "target", "llama", dtype=torch.float64)
    return target, make_noisy_copy(target, root / "draft", seed=3)   # accepts some, rejects some


def make_llm(pair, **kw) -> LLM:
    target, draft = pair
    args = dict(target=str(target), draft=str(draft), dtype="float64", device="cpu", progress=False,
                num_blocks=256, block_size=4, max_num_seqs=4, spec_mode="adaptive", spec__max_depth=4)
    args.update(kw)
    return LLM(**args)


def test_rotation_runs_every_depth_losslessly_and_returns_every_block(pair):
    prompts = [f"{i} " + "the quick brown fox " * (1 + i % 3) for i in range(12)]
    greedy = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    plain = LLM(target=str(pair[0]), draft="none", dtype="float64", device="cpu", progress=False)
    reference = [o.token_ids for o in plain.generate(prompts, greedy)]

    llm = make_llm(pair)
    controller = llm.engine.spec.controller
    result = depth_curve.measure(llm, prompts, depths=[1, 2, 3, 4], block=2, min_batch=1,
                                 max_tokens=16, progress=False)
    rows = {r["depth"]: r for r in result["depths"]}
    assert set(rows) == {1, 2, 3, 4}
    for d, r in rows.items():
        assert r["steps"] > 0
        assert 1.0 <= r["tokens_per_seq"] <= d + 1          # accepted + bonus, at most the chain
        assert 1.0 <= r["predicted_tokens_per_seq"] <= d + 1
        assert 0.0 < r["predicted_relative"] <= 1.0
        assert r["step_ms"] > 0 and r["predicted_step_ms"] > 0
        assert r["all_steps_tokens_per_s"] > 0
    assert max(r["relative"] for r in rows.values()) == pytest.approx(1.0)
    # The real controller is back in place and saw every step.
    assert llm.engine.spec.controller is controller
    assert controller.num_steps == result["steps"]
    pool = llm.engine.pool
    assert pool.num_free_blocks == pool.num_blocks
    # The rotation changes only the depth: greedy output is the target's.
    again = make_llm(pair)
    depth_curve.measure(again, [], depths=[2], progress=False)   # nothing to run: no steps, no error
    rotation = depth_curve._Rotation(again.engine.spec.controller, [1, 3, 4], 1)
    again.engine.spec.controller = rotation
    outs = [o.token_ids for o in again.generate(prompts, greedy)]
    assert outs == reference
    assert {s.depth for s in rotation.steps} == {1, 3, 4}


def test_depths_beyond_the_controllers_are_clipped_to_it(pair):
    llm = make_llm(pair, spec__max_depth=2, spec_depth=2)
    result = depth_curve.measure(llm, ["a b c d e f"] * 4, depths=[1, 5], block=1, max_tokens=12,
                                 progress=False)
    assert {r["depth"] for r in result["depths"]} <= {1, 2}


def test_needs_the_adaptive_controller(pair):
    llm = make_llm(pair, spec_mode="static", spec_depth=2)
    with pytest.raises(ValueError, match="adaptive"):
        depth_curve.measure(llm, ["a b c"], depths=[1, 2], progress=False)


def _step(depth, **kw):
    args = dict(depth=depth, batch_size=8, decode_only=True, seconds=0.01, tokens=24, sequences=8,
                predicted_goodput=2000.0, predicted_top=2500.0, predicted_tokens=3.0, after_switch=False)
    args.update(kw)
    return depth_curve._Step(**args)


def test_summary_keeps_decode_only_steps_past_the_switch_with_enough_sequences():
    steps = [
        _step(3, after_switch=True, seconds=1.0),      # a block's first step: left out
        _step(3), _step(3),
        _step(3, decode_only=False, seconds=1.0),      # a prefill joined: left out
        _step(3, batch_size=2, sequences=2, tokens=2, seconds=1.0),   # the draining tail: left out
        _step(5, after_switch=True), _step(5, seconds=0.02, tokens=32),
    ]
    rows = {r["depth"]: r for r in depth_curve.summarize(steps, min_batch=4, step_seconds={3: 3.0, 5: 0.03})}
    assert rows[3]["steps"] == 2
    assert rows[3]["tokens_per_s"] == pytest.approx(48 / 0.02)
    assert rows[3]["step_ms"] == pytest.approx(10.0)
    assert rows[3]["tokens_per_seq"] == pytest.approx(3.0)
    assert rows[3]["predicted_relative"] == pytest.approx(0.8)
    assert rows[3]["predicted_step_ms"] == pytest.approx(1e3 * 3.0 * 8 / 2000.0)
    assert rows[3]["all_steps_tokens_per_s"] == pytest.approx((24 * 4 + 2) / 3.0)
    assert rows[5]["tokens_per_s"] == pytest.approx(32 / 0.02)
    assert rows[3]["relative"] == pytest.approx(1.0) and rows[5]["relative"] == pytest.approx(1600 / 2400)


def test_parse_depths_and_prompts():
    assert depth_curve.parse_depths("2-4,7") == [2, 3, 4, 7]
    with pytest.raises(ValueError, match="depths"):
        depth_curve.parse_depths("0-3")
    prompts = depth_curve.load_prompts(450)
    assert len(prompts) == 450 and len(set(prompts)) == 450   # no two alike: no prefix-cache hits
