"""The step log (config step_log): a JSON line per engine step, for every setting, that
accounts for the engine's prompts and outputs exactly."""

from __future__ import annotations

import json

import pytest
import torch

from specserve import LLM, SamplingParams
from specserve.errors import ConfigError
from tests.checkpoints import make_checkpoint

PROMPTS = [[5, 6, 7], [10, 11, 12, 13, 10, 11, 12, 13, 10, 11], [200 + i for i in range(17)], [40, 41]]
KEYS = {"t", "depth", "nodes", "decode", "prefill_seqs", "prefill_tokens", "context", "context_max", "emitted",
        "draft_s", "verify_s", "step_s"}


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("steplog") / "target", "llama", dtype=torch.float64)


SETTINGS = {
    "none": dict(draft="none"),
    "static3": dict(spec_mode="static", spec_depth=3),
    "adaptive": dict(spec_mode="adaptive", spec__max_depth=4),
}


@pytest.mark.parametrize("setting", list(SETTINGS))
def test_every_step_is_logged_and_accounts_for_prompts_and_outputs(target, tmp_path, setting):
    path = tmp_path / "logs" / "steps.jsonl"   # its folder is made
    kw = {"draft": str(target), **SETTINGS[setting]}
    # A token budget of 8 per step: the longer prompts are prefilled in chunks beside decoding rows.
    llm = LLM(target=str(target), dtype="float64", device="cpu", progress=False, num_blocks=128, block_size=4,
              max_num_batched_tokens=8 if setting == "none" else 32, step_log=str(path), **kw)
    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))
    steps = [json.loads(line) for line in path.read_text().splitlines()]

    assert steps and all(KEYS <= set(s) for s in steps)
    assert [s["t"] for s in steps] == sorted(s["t"] for s in steps)
    # Every prompt token was prefilled once, every output token emitted once.
    assert sum(s["prefill_tokens"] for s in steps) == sum(map(len, PROMPTS))
    assert sum(s["emitted"] for s in steps) == sum(len(o.token_ids) for o in outs) == 12 * len(PROMPTS)
    assert sum(s["prefill_seqs"] for s in steps) >= len(PROMPTS)
    for s in steps:
        assert s["verify_s"] > 0 and s["step_s"] >= s["draft_s"] + s["verify_s"] > 0
        assert s["emitted"] <= s["decode"] * (s["depth"] + 1) + s["prefill_seqs"]
    decode_only = [s for s in steps if s["prefill_seqs"] == 0]
    assert decode_only
    # Contexts: the first decode step of a lone prompt reads its prompt; they only grow.
    for s in steps:
        assert s["decode"] * s["context_max"] >= s["context"] >= s["context_max"] >= (1 if s["decode"] else 0)
    assert max(s["context_max"] for s in steps) >= max(map(len, PROMPTS))
    assert max(s["context_max"] for s in steps) < max(map(len, PROMPTS)) + 12
    if setting == "none":
        assert all(s["depth"] == 0 and s["draft_s"] == 0 and "drafted" not in s for s in steps)
        assert any(s["prefill_seqs"] and s["decode"] for s in steps)   # a mixed step, timed too
        assert all(s["emitted"] == s["decode"] for s in decode_only)
    if setting == "static3":
        # A perfect draft: every decode-only step emits depth + 1 tokens per sequence (less
        # only where a request's last tokens cap its tree). (Whether the adaptive controller
        # speculates on this toy model depends on the machine's timings.)
        assert all(s["draft_s"] > 0 for s in decode_only)
        full = [s for s in decode_only if s["emitted"] == s["decode"] * (s["depth"] + 1)]
        assert len(full) >= len(decode_only) // 2
        assert all(s["depth"] == 3 for s in decode_only if s["emitted"] > s["decode"])
        # The nodes verified: a full tree each on most steps, fewer where a request's last
        # tokens cut its tree (the rows the controller books a step at).
        assert all(s["drafted"] <= s["decode"] * s["nodes"] for s in steps if s["nodes"])
        assert sum(s["drafted"] == s["decode"] * 3 for s in decode_only) >= len(decode_only) // 2
        assert any(s["drafted"] < s["decode"] * 3 for s in decode_only)
        assert not any("predicted" in s or "curve" in s for s in steps)
    if setting == "adaptive":
        assert all(s["predicted"] > 0 for s in steps)
        curves = [s["curve"] for s in steps if "curve" in s]
        assert curves and all(len(c) == 5 for c in curves)
        # The plan that ran after a fresh evaluation is one the curve priced.
        assert all(s["curve"][s["depth"]] is not None for s in steps if "curve" in s)
        # With each curve the tokens a sequence each depth was expected to commit: more the deeper.
        for s in steps:
            if "curve" in s:
                tokens = [e for e in s["tokens"] if e is not None]
                assert len(s["tokens"]) == 5 and tokens[0] == 1.0 and tokens == sorted(tokens)
                # And the parts each depth was priced at, which add up to its predicted step:
                # decode x tokens / goodput = draft + verify + the rest.
                assert s["draft_pred"][0] == 0.0 and s["rest_pred"] >= 0.0
                for d, (g, e) in enumerate(zip(s["curve"], s["tokens"])):
                    if g:
                        priced = s["draft_pred"][d] + s["verify_pred"][d] + s["rest_pred"]
                        assert priced == pytest.approx(1e3 * max(1, s["decode"]) * e / g, rel=0.02, abs=0.01)


def test_a_step_log_that_cannot_be_written_fails_before_loading(tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    with pytest.raises(ConfigError, match=r"step_log: cannot write .*a_file/steps\.jsonl"):
        LLM(target=str(tmp_path / "no_such_model"), step_log=str(blocker / "steps.jsonl"), progress=False)


@pytest.mark.parametrize("command", ["serve", "generate"])
def test_serve_and_generate_take_step_log(tmp_path, command, capsys):
    import argparse

    from specserve.cli import _engine_config, main

    args = argparse.Namespace(config=None, target=None, draft=None, draft_kind=None, device=None, dtype=None,
                              spec_mode=None, spec_depth=None, spec_tree=None, num_blocks=None, max_num_seqs=None,
                              cpu_threads=None, step_log=str(tmp_path / "s.jsonl"))
    assert _engine_config(args).step_log == str(tmp_path / "s.jsonl")
    with pytest.raises(SystemExit):
        main([command, "--help"])
    assert "--step-log PATH" in capsys.readouterr().out
