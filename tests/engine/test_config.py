"""Config loading: errors name the key, the value and what is allowed; overrides; paths."""

from __future__ import annotations

from pathlib import Path

import pytest

from specserve import config as C
from specserve.errors import ConfigError


def write(tmp_path, text: str, name="c.toml") -> Path:
    p = tmp_path / name
    p.write_text(text)
    return p


def test_defaults_are_the_embedded_pair():
    cfg = C.default()
    assert cfg.target.path == str(C.ASSETS_DIR / "tiny-target")
    assert cfg.draft.path == str(C.ASSETS_DIR / "tiny-draft")
    assert cfg.draft.kind == "model" and cfg.spec.mode == "adaptive"


def test_unknown_key_lists_allowed(tmp_path):
    p = write(tmp_path, "[cache]\nblok_size = 8\n")
    with pytest.raises(ConfigError) as e:
        C.load(p)
    msg = str(e.value)
    assert "cache.blok_size" in msg and "block_size" in msg and "num_blocks" in msg and str(p) in msg


def test_unknown_section(tmp_path):
    with pytest.raises(ConfigError) as e:
        C.load(write(tmp_path, "[scheduller]\nmax_num_seqs = 4\n"))
    assert "scheduller" in str(e.value) and "scheduler" in str(e.value)


def test_section_must_be_a_table():
    with pytest.raises(ConfigError) as e:
        C.from_dict({"cache": 5})
    assert "cache" in str(e.value) and "5" in str(e.value)


def test_wrong_type_names_key_and_value(tmp_path):
    with pytest.raises(ConfigError) as e:
        C.load(write(tmp_path, '[cache]\nblock_size = "big"\n'))
    msg = str(e.value)
    assert "cache.block_size" in msg and "'big'" in msg and "int" in msg


def test_out_of_range_names_key_value_and_bound():
    with pytest.raises(ConfigError) as e:
        C.from_dict({"scheduler": {"max_num_seqs": 0}})
    msg = str(e.value)
    assert "scheduler.max_num_seqs" in msg and "= 0" in msg and ">= 1" in msg
    with pytest.raises(ConfigError) as e:
        C.from_dict({"cache": {"memory_fraction": 1.5}})
    assert "cache.memory_fraction" in str(e.value) and "1.5" in str(e.value) and "<= 1.0" in str(e.value)


def test_bad_list_element_names_the_key():
    with pytest.raises(ConfigError) as e:
        C.from_dict({"spec": {"branching": [2, 0]}})
    assert "spec.branching" in str(e.value) and "0" in str(e.value)


def test_bad_enum_lists_choices():
    with pytest.raises(ConfigError) as e:
        C.from_dict({"spec": {"tree": "bush"}})
    msg = str(e.value)
    assert "spec.tree" in msg and "'bush'" in msg and "'chain'" in msg and "'fixed'" in msg and "'dynamic'" in msg
    with pytest.raises(ConfigError) as e:
        C.from_dict({"device": "tpu"})
    assert "device" in str(e.value) and "'tpu'" in str(e.value) and "'cuda'" in str(e.value)


def test_cross_field_checks():
    with pytest.raises(ConfigError, match="spec.branching"):
        C.from_dict({"spec": {"tree": "fixed"}})
    with pytest.raises(ConfigError, match="ngram_min"):
        C.from_dict({"draft": {"kind": "ngram", "ngram_min": 5, "ngram_max": 2}})
    with pytest.raises(ConfigError, match="max_depth"):
        C.from_dict({"spec": {"depth": 9, "max_depth": 4}})
    with pytest.raises(ConfigError, match="draft.path"):
        C.from_dict({"draft": {"kind": "model", "path": ""}})
    with pytest.raises(ConfigError, match="spec.tree = 'dynamic' needs draft.kind = 'model'.*one chain"):
        C.from_dict({"draft": {"kind": "ngram"}, "spec": {"tree": "dynamic"}})
    with pytest.raises(ConfigError, match="spec.branching makes trees of 1118480 nodes"):
        C.from_dict({"spec": {"tree": "fixed", "branching": [16, 16, 16, 16, 16]}})
    with pytest.raises(ConfigError, match="spec.num_nodes makes trees of 513 nodes; at most 512"):
        C.from_dict({"spec": {"tree": "dynamic", "num_nodes": 513}})
    C.from_dict({"spec": {"tree": "fixed", "branching": [16, 16, 16, 16, 16], "depth": 2, "max_depth": 2}})   # 272 nodes


def test_invalid_toml_and_missing_file(tmp_path):
    with pytest.raises(ConfigError, match="not valid TOML"):
        C.load(write(tmp_path, "[cache\n"))
    with pytest.raises(ConfigError, match="not found"):
        C.load(tmp_path / "nope.toml")


def test_relative_and_embedded_paths(tmp_path):
    sub = tmp_path / "configs"
    sub.mkdir()
    p = write(sub, '[target]\npath = "../models/t"\n[draft]\npath = "embedded:tiny-draft"\n')
    cfg = C.load(p)
    assert Path(cfg.target.path) == (sub / "../models/t").resolve() or Path(cfg.target.path).resolve() == (tmp_path / "models/t").resolve()
    assert Path(cfg.target.path).is_absolute()
    assert cfg.draft.path == str(C.ASSETS_DIR / "tiny-draft")
    # Absolute paths stay as they are; ngram drafts need no path.
    cfg = C.load(write(tmp_path, f'[target]\npath = "{tmp_path}/abs"\n[draft]\nkind = "ngram"\n', "d.toml"))
    assert cfg.target.path == f"{tmp_path}/abs" and cfg.draft.kind == "ngram"


def test_full_config_round_trip(tmp_path):
    p = write(tmp_path, """
device = "cpu"
seed = 7
[target]
path = "t"
dtype = "float64"
[draft]
path = "d"
[spec]
mode = "static"
depth = 3
tree = "fixed"
branching = [3, 2, 1]
[cache]
block_size = 8
num_blocks = 100
[scheduler]
max_num_seqs = 4
max_num_batched_tokens = 64
enable_chunked_prefill = false
""")
    cfg = C.load(p)
    assert cfg.device == "cpu" and cfg.seed == 7 and cfg.target.dtype == "float64"
    assert cfg.target.path == str(tmp_path / "t")
    assert cfg.spec.branching == [3, 2, 1] and cfg.cache.block_size == 8 and cfg.cache.num_blocks == 100
    assert cfg.scheduler.enable_chunked_prefill is False and cfg.scheduler.max_num_batched_tokens == 64


def test_with_overrides():
    base = C.default()
    cfg = C.with_overrides(base, target="/m/t", draft="ngram", dtype="float64", device="cpu", block_size=8,
                           spec_depth=2, spec_tree="chain", spec__num_nodes=5, max_num_seqs=3, seed=11)
    assert cfg.target.path == "/m/t" and cfg.draft.kind == "ngram"
    assert cfg.target.dtype == cfg.draft.dtype == "float64"
    assert cfg.cache.block_size == 8 and cfg.spec.depth == 2 and cfg.spec.tree == "chain"
    assert cfg.spec.num_nodes == 5 and cfg.scheduler.max_num_seqs == 3 and cfg.seed == 11 and cfg.device == "cpu"
    # The base is not modified.
    assert base.cache.block_size == 16 and base.draft.kind == "model"
    # A draft path switches the kind back to model.
    cfg2 = C.with_overrides(cfg, draft="/m/d", spec_tree="dynamic")
    assert cfg2.draft.kind == "model" and cfg2.draft.path == "/m/d" and cfg2.spec.tree == "dynamic"
    # None means "leave as is".
    assert C.with_overrides(base, block_size=None).cache.block_size == 16


def test_with_overrides_errors_name_the_setting():
    base = C.default()
    with pytest.raises(ConfigError) as e:
        C.with_overrides(base, blocksize=8)
    assert "blocksize" in str(e.value) and "block_size" in str(e.value)
    with pytest.raises(ConfigError) as e:
        C.with_overrides(base, block_size=0)
    assert "cache.block_size" in str(e.value) and "0" in str(e.value)
    with pytest.raises(ConfigError) as e:
        C.with_overrides(base, spec_tree="bush")
    assert "'bush'" in str(e.value) and "'chain'" in str(e.value)
    with pytest.raises(ConfigError) as e:
        C.with_overrides(base, spec__nodes=3)
    assert "spec.nodes" in str(e.value)


def test_several_engines_need_engine_processes():
    with pytest.raises(ConfigError) as e:
        C.from_dict({"server": {"engines": 2, "engine_process": False}})
    assert "server.engines = 2" in str(e.value) and "engine_process" in str(e.value)
    assert C.from_dict({"server": {"engines": 2}}).server.engines == 2


def test_a_static_depth_past_the_deepest_names_the_flag(capsys):
    from specserve import cli

    assert cli.main(["generate", "--prompt", "x", "--spec-depth", "99"]) != 0
    assert "--spec-depth 99 is too deep: at most 16" in capsys.readouterr().err


@pytest.mark.parametrize("draft,kind", [("some/dir", "ngram"), ("some/dir", "none"), ("ngram", "model"),
                                        ("none", "ngram")])
def test_a_draft_and_a_kind_that_disagree_are_refused(draft, kind):
    """`--draft PATH --draft-kind ngram` (or LLM(draft=..., draft_kind=...)) names both; agreeing
    pairs pass."""
    with pytest.raises(ConfigError, match=f"draft .*{draft}.* kind '{kind}' disagree"):
        C.with_overrides(C.default(), draft=draft, draft_kind=kind)


def test_a_draft_and_a_kind_that_agree_pass():
    assert C.with_overrides(C.default(), draft="ngram", draft_kind="ngram").draft.kind == "ngram"
    assert C.with_overrides(C.default(), draft="some/dir", draft_kind="model").draft.kind == "model"
