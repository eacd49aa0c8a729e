"""configs/: every file loads, the draft is swapped by editing [draft] only, and tiny.toml is the default."""

from pathlib import Path

import pytest

from specserve import config as config_mod

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
FILES = sorted(CONFIGS.glob("*.toml"))


def test_expected_configs_exist():
    names = {f.name for f in FILES}
    assert {"tiny.toml", "ngram.toml", "nospec.toml", "llama3.1-8b+3.2-1b.toml", "qwen2.5-7b+0.5b.toml"} <= names


@pytest.mark.parametrize("path", FILES, ids=lambda p: p.name)
def test_config_loads(path):
    cfg = config_mod.load(path)
    assert Path(cfg.target.path).is_absolute()
    if cfg.draft.kind == "model":
        assert Path(cfg.draft.path).is_absolute()


def test_tiny_is_the_default():
    assert config_mod.load(CONFIGS / "tiny.toml") == config_mod.default()


def test_draft_swap_changes_only_the_draft_table():
    tiny, ngram, nospec = (config_mod.load(CONFIGS / n) for n in ("tiny.toml", "ngram.toml", "nospec.toml"))
    assert (ngram.draft.kind, nospec.draft.kind, tiny.draft.kind) == ("ngram", "none", "model")
    for other in (ngram, nospec):
        assert other.target == tiny.target
        assert other.spec == tiny.spec and other.cache == tiny.cache and other.scheduler == tiny.scheduler


@pytest.mark.parametrize("name", ["llama3.1-8b+3.2-1b.toml", "qwen2.5-7b+0.5b.toml"])
def test_example_pairs_point_at_models(name):
    cfg = config_mod.load(CONFIGS / name)
    assert cfg.target.path.startswith("/models/") and cfg.draft.path.startswith("/models/")
    assert cfg.draft.kind == "model" and cfg.spec.mode == "adaptive"
