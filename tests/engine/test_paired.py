"""benchmarks/paired.py: every setting serves the same load in one engine, round after round,
and the ratios are paired by round."""

from __future__ import annotations

import pytest

from benchmarks.paired import paired_ratio, report, run
from specserve import LLM


def test_paired_ratio_and_its_standard_error():
    mean, se = paired_ratio([2.0, 4.0], [1.0, 4.0])
    assert mean == pytest.approx(1.5) and se == pytest.approx(0.5)
    assert paired_ratio([3.0], [2.0]) == (1.5, None)


def test_every_setting_runs_every_round_and_output_stays_exact(tiny_llama):
    llm = LLM(target=str(tiny_llama), draft=str(tiny_llama), dtype="float64", device="cpu", progress=False,
              num_blocks=128, block_size=4, spec_mode="adaptive", max_num_seqs=4)
    prompts = [[5, 6, 7], [10, 11, 12, 13], [20, 21], [30, 31, 32, 33, 34]]
    res = run(llm, 2, ["adaptive", "static0", "static2"], 2, prompts, 6)
    assert {s: len(v) for s, v in res["tokens_per_s"].items()} == {"adaptive": 2, "static0": 2, "static2": 2}
    assert set(res["adaptive_over"]) == {"static0", "static2"} and res["best_static"] in ("static0", "static2")
    assert llm.engine.scheduler.config.max_num_seqs == 2 and llm.engine.speculation() == {"mode": "adaptive"}
    assert "| adaptive |" in report([res])
    llm.engine.pool.check_all_free()
