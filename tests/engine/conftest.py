"""Fixtures of the logprob and penalty tests: a float64 target, a noisy copy of it as a
draft that is partly accepted, and transformers' model of the target in float64 throughout."""

from __future__ import annotations

import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from tests.checkpoints import make_checkpoint


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("logprobs")
    target = make_checkpoint(root / "target", "llama", dtype=torch.float64)
    weak = root / "weak"   # the target with noise on every weight: accepts some, rejects some
    shutil.copytree(target, weak)
    g = torch.Generator().manual_seed(5)
    sd = {k: v + 0.05 * v.std() * torch.randn(v.shape, generator=g, dtype=v.dtype)
          for k, v in load_file(weak / "model.safetensors").items()}
    save_file(sd, weak / "model.safetensors", metadata={"format": "pt"})
    return {"target": target, "weak": weak}


@pytest.fixture(scope="module")
def hf(models):
    """transformers' model in float64 throughout: its rotary tables and RMSNorms, which
    transformers computes in float32 whatever the model's dtype (1e-6 apart by themselves),
    are made float64."""
    model = AutoModelForCausalLM.from_pretrained(models["target"], dtype=torch.float64).eval()
    cfg = model.config
    dim = cfg.hidden_size // cfg.num_attention_heads
    inv_freq = 1.0 / cfg.rope_parameters["rope_theta"] ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim)

    def rotary(x, position_ids):
        freqs = position_ids[..., None].double() * inv_freq
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(x.dtype), emb.sin().to(x.dtype)

    model.model.rotary_emb.forward = rotary
    for module in model.modules():
        if type(module).__name__ == "LlamaRMSNorm":
            module.forward = lambda x, m=module: m.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True)
                                                                            + m.variance_epsilon))
    return model


@pytest.fixture(scope="module")
def one_thread():
    """Small forwards on a shared 2-core machine: one intra-op thread, restored after the module."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def early_stop_at(monkeypatch, bar: float, depth: int) -> list:
    """Make every plan draft chains of up to `depth` nodes under an EarlyStop that keeps a
    node while its path probability is above `bar` (goodput, ratio and rate 1, no level cost,
    a row costing `bar`); returns the list every drafted tree is appended to."""
    from specserve.controller import EarlyStop, Plan
    from specserve.drafts.model import ModelDrafter
    from specserve.spec import Speculator

    trees = []
    real = ModelDrafter.propose

    def propose(self, seqs, shape, prefills):
        out = real(self, seqs, shape, prefills)
        trees.extend(out)
        return out

    def plan(self, running):
        nodes = {r.request_id: min(depth, r.num_tokens_left - 1) for r in running if r.num_tokens_left > 1}
        B = len(running)
        return Plan(depth, nodes, EarlyStop(1.0, 1.0, 1.0, 0.0, [bar * B * r for r in range(8)], B, rows=B))

    monkeypatch.setattr(ModelDrafter, "propose", propose)
    monkeypatch.setattr(Speculator, "plan", plan)
    return trees
