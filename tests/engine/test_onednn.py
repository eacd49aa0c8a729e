"""Linear layers through oneDNN with packed weights (config `[cpu] linear`).

The packed path must give transformers' logits (as F.linear does), for every family
including Qwen2's biased q/k/v; each row's output must not depend on the rows beside it;
and the engine packs exactly the layers the setting names: all ("onednn"); every layer of a
model of at least 8 MiB and the layers of 1 MiB or more of a smaller one
("auto"); none ("torch"); never those of a float64 model.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch
from torch import nn

from specserve import LLM, SamplingParams
from specserve.config import EngineConfig, with_overrides
from specserve.errors import ConfigError
from specserve.model.llama import linear, onednn_linear_available, pack_onednn
from specserve.model.loader import load_model
from tests.checkpoints import make_checkpoint
from tests.engine.test_model import ARCHS, hf_logits, prompt_ids, random_block_tables, run_chunks

pytestmark = pytest.mark.skipif(not onednn_linear_available(), reason="this torch build has no oneDNN")


def packed_layers(model) -> list[str]:
    return [name for name, m in model.named_modules() if isinstance(m, nn.Linear) and "onednn" in m.__dict__]


def is_packed(model) -> bool:
    """Every linear layer packed (False: none is; a mix fails)."""
    linears = [m for m in model.modules() if isinstance(m, nn.Linear)]
    packed = packed_layers(model)
    assert len(packed) in (0, len(linears)), packed
    return bool(packed)


@pytest.mark.parametrize("arch", ARCHS)
def test_packed_forward_matches_transformers(arch, tiny_checkpoints):
    path = tiny_checkpoints[arch]
    model, args = load_model(path, dtype=torch.float32, progress=False)
    ids = prompt_ids(30, args.vocab_size)
    (table,) = random_block_tables([30])
    plain = run_chunks(model, ids, [11, 9] + [1] * 10, table)
    assert model.pack_for_onednn() == 2 * 4 + 1 and is_packed(model)  # 4 per layer (fused), the head
    assert "ONEDNN_PRIMITIVE_CACHE_CAPACITY" in os.environ   # sized before the first pack (keep_onednn_primitives)
    packed = run_chunks(model, ids, [11, 9] + [1] * 10, table)
    expected = hf_logits(path, ids)
    torch.testing.assert_close(packed, expected, atol=1e-4, rtol=1e-4)
    assert not torch.equal(packed, plain)  # it did take another path (different rounding)


def test_packed_rows_do_not_depend_on_the_batch(tiny_qwen2):
    model, _ = load_model(tiny_qwen2, dtype=torch.float32, progress=False)
    layer = model.layers[0].attention.wqkv  # with a bias (Qwen2)
    pack_onednn(layer)
    x = torch.randn(64, layer.in_features, generator=torch.Generator().manual_seed(0))
    full = linear(x, layer)
    torch.testing.assert_close(full, torch.nn.functional.linear(x, layer.weight, layer.bias), atol=1e-5, rtol=1e-5)
    for rows in (1, 2, 3, 8, 9, 33):
        assert torch.equal(linear(x[:rows], layer), full[:rows]), rows


def test_float64_and_other_devices_stay_unpacked(tiny_llama):
    model, _ = load_model(tiny_llama, dtype=torch.float64, progress=False)
    assert not model.pack_for_onednn() and not is_packed(model)


def make_llm(path, **kw) -> LLM:
    return LLM(target=str(path), draft=str(path), dtype="float32", device="cpu", progress=False,
               num_blocks=64, block_size=4, spec_mode="static", spec_depth=3, **kw)


def test_engine_packs_what_the_setting_says(tiny_llama, monkeypatch):
    # The tiny checkpoint's linears are far below 8 MiB: "auto" leaves them alone.
    from specserve import engine

    monkeypatch.setattr(engine.LLMEngine, "_packed_is_faster", lambda self, runner: True)
    llm = make_llm(tiny_llama)
    assert not is_packed(llm.engine.target.model) and not is_packed(llm.engine.draft.model)
    llm = make_llm(tiny_llama, cpu__linear="onednn")
    assert is_packed(llm.engine.target.model) and is_packed(llm.engine.draft.model)
    monkeypatch.setattr(engine, "_ONEDNN_MIN_MODEL_BYTES", 0)
    llm = make_llm(tiny_llama, cpu__linear="torch")
    assert not is_packed(llm.engine.target.model) and not is_packed(llm.engine.draft.model)
    # "auto": the threshold between the two is the bytes of one model's linears.
    size = llm.engine.target.model.linear_weight_bytes()
    monkeypatch.setattr(engine, "_ONEDNN_MIN_MODEL_BYTES", size + 1)
    assert not is_packed(make_llm(tiny_llama).engine.target.model)
    monkeypatch.setattr(engine, "_ONEDNN_MIN_MODEL_BYTES", size)
    assert is_packed(make_llm(tiny_llama).engine.target.model)


def test_auto_keeps_what_measures_faster(tiny_llama, monkeypatch):
    """"auto" times the packed forward against F.linear on this machine and keeps the faster;
    "onednn" packs whatever it measures."""
    from specserve import engine

    monkeypatch.setattr(engine, "_ONEDNN_MIN_MODEL_BYTES", 0)
    monkeypatch.setattr(engine.LLMEngine, "_packed_is_faster", lambda self, runner: False)
    assert not is_packed(make_llm(tiny_llama).engine.target.model)
    assert is_packed(make_llm(tiny_llama, cpu__linear="onednn").engine.target.model)
    # The measurement itself leaves a packed model packed, whatever it finds.
    llm = make_llm(tiny_llama, cpu__linear="onednn")
    monkeypatch.undo()
    assert llm.engine._packed_is_faster(llm.engine.target) in (True, False)
    assert is_packed(llm.engine.target.model)


def test_auto_packs_the_big_layers_of_a_small_model(tmp_path, monkeypatch):
    """A model below 8 MiB of linears with a 1 MiB LM head (4096 x 64 float32): "auto"
    packs the head only."""
    from specserve import engine

    monkeypatch.setattr(engine.LLMEngine, "_packed_is_faster", lambda self, runner: True)
    path = make_checkpoint(tmp_path / "wide_head", vocab_size=4096)
    llm = LLM(target=str(path), draft="none", dtype="float32", device="cpu", progress=False,
              num_blocks=64, block_size=4)
    assert packed_layers(llm.engine.target.model) == ["output"]
    model, _ = load_model(path, dtype=torch.float32, progress=False)
    assert model.pack_for_onednn(min_layer_bytes=2**20 + 1) == 0 and not packed_layers(model)


def test_packed_engine_generates_like_the_unpacked_one(tiny_llama):
    """Greedy, float32: speculation over packed models gives what target-only decoding over
    unpacked ones gives (the logits differ only in rounding; the tiny checkpoint has no
    near-ties, test_model.test_checkpoint_logits_are_not_degenerate)."""
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    prompts = [[5, 9, 11, 3, 7, 2, 8, 13, 21, 4, 6], [17, 3, 3, 9]]
    plain = LLM(target=str(tiny_llama), draft="none", dtype="float32", device="cpu", progress=False,
                num_blocks=64, block_size=4, cpu__linear="torch")
    expected = [o.token_ids for o in plain.generate(prompts, params)]
    spec = make_llm(tiny_llama, cpu__linear="onednn")
    assert [o.token_ids for o in spec.generate(prompts, params)] == expected
    assert spec.engine.pool.num_free_blocks == spec.engine.pool.num_blocks


def test_bad_setting_is_named():
    with pytest.raises(ConfigError, match="cpu.linear"):
        with_overrides(EngineConfig(), cpu__linear="mkl")


# Each check of the primitive cache in a fresh interpreter: its capacity is read once per
# process, when oneDNN creates its first primitive.
PRIMITIVE_CACHE = """
    import torch
    from torch import nn
    from specserve.model.llama import keep_onednn_primitives, linear, pack_onednn
    print("capacity", keep_onednn_primitives())
    layer = nn.Linear(16, 16, bias=False)
    pack_onednn(layer)
    x = torch.randn(1200, 16)
    for rows in [7] + list(range(8, 1108)):   # 1100 other row counts after a pass of 7
        linear(x[:rows], layer)
    print("MARK", flush=True)
    linear(x[:7], layer)
"""


def primitive_cache(env: dict[str, str]) -> tuple[int, str]:
    """(the capacity in force, how the last pass of 7 rows found its primitive: 'cache_hit' or
    'cache_miss', from oneDNN's own log)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("ONEDNN_")} | {"ONEDNN_VERBOSE": "2"} | env
    out = subprocess.run([sys.executable, "-c", textwrap.dedent(PRIMITIVE_CACHE)], capture_output=True, text=True,
                         timeout=300, env=env)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    capacity = int(next(line for line in lines if line.startswith("capacity")).split()[1])
    after = lines[lines.index("MARK") + 1:]
    created = [line for line in after if "create:cache_" in line and "mb7ic16oc16" in line]
    assert created, after[:5]
    return capacity, "cache_hit" if "create:cache_hit" in created[-1] else "cache_miss"


def test_the_primitive_cache_keeps_a_row_count_through_a_thousand_others():
    # The engine's default: a pass at a row count seen before, a thousand row counts ago, finds
    # its primitive (no ~1 ms rebuild: see ONEDNN_PRIMITIVE_CACHE).
    assert primitive_cache({}) == (4096, "cache_hit")


def test_an_operators_primitive_cache_capacity_stands():
    # ONEDNN_PRIMITIVE_CACHE_CAPACITY set by whoever starts the process is kept: at oneDNN's own
    # default of 1024 the same sequence of passes evicts the primitive of 7 rows and rebuilds it
    # (which is what the engine's larger default is for).
    assert primitive_cache({"ONEDNN_PRIMITIVE_CACHE_CAPACITY": "1024"}) == (1024, "cache_miss")
