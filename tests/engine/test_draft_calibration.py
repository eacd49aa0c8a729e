"""benchmarks/draft_calibration.py: the bins add up, and the measurement tells a draft that
is the target from one that is not."""

from __future__ import annotations

import pytest
import torch

from benchmarks import draft_calibration as dc
from tests.checkpoints import make_checkpoint


def test_bins_count_every_position_once_with_their_mean_and_share():
    probs = [0.1, 0.2, 0.6, 0.65, 0.97, 1.0]
    accepted = [False, True, True, False, True, True]
    table = dc.calibration(probs, accepted)
    assert sum(r["positions"] for r in table) == len(probs)
    by_lo = {r["lo"]: r for r in table}
    assert by_lo[0.0]["positions"] == 2 and by_lo[0.0]["accepted"] == 0.5
    assert by_lo[0.0]["mean_prob"] == pytest.approx(0.15)
    assert by_lo[0.5]["positions"] == 2 and by_lo[0.5]["mean_prob"] == pytest.approx(0.625)
    assert by_lo[0.99]["positions"] == 1 and by_lo[0.99]["hi"] == 1.0   # p = 1 lands in the top bin
    assert by_lo[0.8]["positions"] == 0 and by_lo[0.8]["accepted"] is None


def test_the_target_as_its_own_draft_is_always_accepted_and_a_stranger_rarely(tmp_path):
    target = make_checkpoint(tmp_path / "target", "llama", dtype=torch.float32)
    stranger = make_checkpoint(tmp_path / "stranger", "llama", dtype=torch.float32, seed=7, num_hidden_layers=1)
    probs, accepted = dc.measure(target, target, num_prompts=3, prompt_tokens=16, new_tokens=8, progress=False)
    assert len(probs) == len(accepted) == 3 * 8
    assert all(0.0 < p <= 1.0 for p in probs)
    assert sum(accepted) >= 23   # float32 engine and transformers may split one near-tie
    _, accepted = dc.measure(target, stranger, num_prompts=3, prompt_tokens=16, new_tokens=8, progress=False)
    assert sum(accepted) < 12
