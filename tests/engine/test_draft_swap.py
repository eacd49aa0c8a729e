"""Swapping the draft in a config file, end to end through the CLI's config path
(`specserve generate --config FILE`): for every draft a user may name, the engine either starts
and its greedy speculative output equals the target's own (static depth 3 and adaptive), or the
start is refused with one line (no traceback) naming what is wrong. Also: relative and `~` paths,
leftover keys when `[draft] kind` changes, and the profile and compile caches keyed by the pair."""

from __future__ import annotations

import argparse
import json
import logging
import shutil
from pathlib import Path

import pytest
import torch

from specserve import cli
from specserve import profile
from specserve.errors import SpecserveError
from specserve.llm import LLM
from specserve.sampling import SamplingParams
from tests.checkpoints import make_checkpoint, make_noisy_copy, rewrite_config

PROMPTS = ["The quick brown fox", "def fibonacci(n):\n", "Café, naïve 東京 🙂"]
MAX_TOKENS = 24


# -- helpers ------------------------------------------------------------------------------------


def _toml_value(v) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, str):
        return json.dumps(v)
    return str(v)


def write_config(folder: Path, target, draft: dict | None, name="pair.toml", spec=None, target_extra=None) -> Path:
    """A config file as a user writes one: the pair, a small pool, eager forwards, one thread."""
    folder.mkdir(parents=True, exist_ok=True)
    lines = ['device = "cpu"', "[target]", f"path = {_toml_value(str(target))}"]
    lines += [f"{k} = {_toml_value(v)}" for k, v in (target_extra or {}).items()]
    lines += ["[draft]"] + [f"{k} = {_toml_value(v)}" for k, v in (draft or {"kind": "none"}).items()]
    lines += ["[spec]"] + [f"{k} = {_toml_value(v)}" for k, v in (spec or {"mode": "static", "depth": 3}).items()]
    lines += ["[cache]", "num_blocks = 96", "[scheduler]", "max_num_seqs = 4", "[cpu]", 'compile = "off"', "threads = 1"]
    path = folder / name
    path.write_text("\n".join(lines) + "\n")
    return path


def cli_args(config: Path | None, **flags) -> argparse.Namespace:
    """The Namespace `specserve generate` parses, with every engine flag unset but `flags`."""
    names = ("target", "draft", "draft_kind", "device", "dtype", "spec_mode", "spec_depth", "spec_tree",
             "num_blocks", "max_num_seqs", "cpu_threads", "cpu_compile")
    return argparse.Namespace(config=str(config) if config else None, **{n: flags.get(n) for n in names})


def start(config: Path, **flags) -> LLM:
    """The engine `specserve generate --config FILE [flags]` starts."""
    return LLM(cli._engine_config(cli_args(config, **flags)), progress=False)


def greedy(llm: LLM, prompts=PROMPTS) -> list[list[int]]:
    outs = llm.generate(list(prompts), SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0))
    return [o.token_ids for o in outs]


_reference: dict[tuple, list[list[int]]] = {}


def target_only(target: Path, dtype: str = "auto") -> list[list[int]]:
    key = (str(target), dtype)
    if key not in _reference:
        cfg = write_config(target.parent / "ref-configs", target, {"kind": "none"}, name=f"ref-{dtype}.toml",
                           target_extra={"dtype": dtype})
        _reference[key] = greedy(start(cfg))
    return _reference[key]


def assert_exact(tmp_path: Path, target: Path, draft: dict, target_dtype: str = "auto") -> list[LLM]:
    """Greedy speculative output == target-only output, static depth 3 and adaptive."""
    want = target_only(target, target_dtype)
    llms = []
    for spec in ({"mode": "static", "depth": 3}, {"mode": "adaptive", "max_depth": 4}):
        cfg = write_config(tmp_path / spec["mode"], target, draft, spec=spec, target_extra={"dtype": target_dtype})
        llm = start(cfg)
        assert greedy(llm) == want, f"{spec}: speculative output differs from the target's own"
        llms.append(llm)
    return llms


def refused_in_one_line(config: Path, capfd, *flags) -> str:
    """`specserve generate --config FILE` refuses: exit 2, one line on stderr, no traceback."""
    rc = cli.main(["generate", "--config", str(config), "--max-tokens", "2", *flags])
    err = capfd.readouterr().err
    lines = [ln for ln in err.splitlines() if ln.startswith("specserve: error:")]
    assert rc == 2, err
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


# -- fixtures -----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("swap")


@pytest.fixture(scope="module")
def target(root) -> Path:
    return make_checkpoint(root / "target", "llama", dtype=torch.float32)


@pytest.fixture(scope="module")
def noisy(root, target) -> Path:
    """A draft of the target (its weights with noise): accepts some tokens, rejects others."""
    return make_noisy_copy(target, root / "noisy", seed=3, scale=0.3)


@pytest.fixture(autouse=True)
def _quiet(caplog):
    caplog.set_level(logging.WARNING, logger="specserve")


# -- vocabularies and tokenizers ----------------------------------------------------------------


def test_a_draft_with_a_padded_embedding_is_exact(tmp_path, root, target):
    """A draft whose embedding (512 rows) is wider than the tokenizer (400 tokens) and the target's."""
    draft = make_checkpoint(root / "padded", "llama", seed=4, vocab_size=512)
    llms = assert_exact(tmp_path, target, {"path": str(draft)})
    assert llms[0].engine.draft.args.vocab_size == 512


def test_a_padded_target_with_an_unpadded_draft_is_exact(tmp_path, root):
    """The reverse: the target's embedding is padded (512 rows), the draft's is the tokenizer's."""
    padded_target = make_checkpoint(root / "padded-target", "llama", vocab_size=512)
    draft = make_noisy_copy(padded_target, root / "padded-target-draft", seed=2, scale=0.3)
    from safetensors.torch import load_file, save_file

    sd = load_file(draft / "model.safetensors")   # cut the draft's embedding and head to the tokenizer's 400
    sd = {k: v[:400].contiguous() if k in ("model.embed_tokens.weight", "lm_head.weight") else v for k, v in sd.items()}
    save_file(sd, draft / "model.safetensors", metadata={"format": "pt"})
    rewrite_config(draft, vocab_size=400)
    assert_exact(tmp_path, padded_target, {"path": str(draft)})


def _swap_two_vocab_ids(dir: Path) -> None:
    """Same size, same merges, two token ids swapped in tokenizer.json."""
    file = dir / "tokenizer.json"
    data = json.loads(file.read_text())
    vocab = data["model"]["vocab"]
    a, b = "Ġthe", "Ġdog"
    vocab[a], vocab[b] = vocab[b], vocab[a]
    file.write_text(json.dumps(data))


def _other_merges(dir: Path) -> None:
    """A tokenizer of the same vocabulary whose merges differ (the last ten dropped)."""
    file = dir / "tokenizer.json"
    data = json.loads(file.read_text())
    merges = data["model"]["merges"]
    del merges[-10:]
    data["model"]["merges"] = merges
    file.write_text(json.dumps(data))


@pytest.mark.parametrize("change", ["swapped_ids", "fewer_merges"])
def test_a_draft_with_another_tokenizer_of_the_same_size_is_refused_or_exact(tmp_path, root, target, noisy,
                                                                            change, capfd):
    draft = Path(shutil.copytree(noisy, root / f"tok-{change}"))
    (_swap_two_vocab_ids if change == "swapped_ids" else _other_merges)(draft)
    cfg = write_config(tmp_path / "c", target, {"path": str(draft)})
    try:
        start(cfg)
    except SpecserveError:
        line = refused_in_one_line(cfg, capfd)
        assert str(draft) in line and str(target) in line and "tokeniz" in line, line
        return
    assert_exact(tmp_path, target, {"path": str(draft)})


def test_a_draft_whose_special_token_ids_differ_stops_where_the_target_does(tmp_path, root, target):
    """The draft's config and generation_config name other BOS/EOS ids; the target's EOS (set
    to a token its greedy output emits) ends the output at the same place with and without it."""
    want = target_only(target)
    eos = want[0][5]
    tgt = Path(shutil.copytree(target, root / "eos-target"))
    rewrite_config(tgt, eos_token_id=eos)
    (tgt / "generation_config.json").write_text(json.dumps({"eos_token_id": eos, "bos_token_id": 0}))
    draft = make_noisy_copy(tgt, root / "eos-draft", seed=7, scale=0.3)
    rewrite_config(draft, eos_token_id=7, bos_token_id=9)
    (draft / "generation_config.json").write_text(json.dumps({"eos_token_id": [7, 8], "bos_token_id": 9}))
    llms = assert_exact(tmp_path, tgt, {"path": str(draft)})
    out = llms[0].generate(PROMPTS[0], SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0))[0]
    assert out.finish_reason == "stop" and out.token_ids == want[0][:6]


# -- the draft is another model -----------------------------------------------------------------


def test_a_draft_of_another_shape_is_exact(tmp_path, root, target):
    """rope_theta, rms_norm_eps, tied embeddings, num_kv_heads and head_dim all unlike the target's."""
    draft = make_checkpoint(root / "other-shape", "llama", seed=5, rope_theta=500000.0, rms_norm_eps=1e-5,
                            tie_word_embeddings=True, num_key_value_heads=1, head_dim=32, num_hidden_layers=1)
    llms = assert_exact(tmp_path, target, {"path": str(draft)})
    args = llms[0].engine.draft.args
    assert (args.head_dim, args.num_kv_heads, args.tie_word_embeddings, args.rope_theta) == (32, 1, True, 500000.0)


def test_a_draft_of_another_architecture_is_exact(tmp_path, root, target):
    draft = make_checkpoint(root / "qwen3-draft", "qwen3", seed=6)
    assert_exact(tmp_path, target, {"path": str(draft)})


def test_a_draft_with_fewer_positions_bounds_the_context_and_stays_exact(tmp_path, root, target):
    draft = Path(shutil.copytree(target, root / "short-draft"))
    rewrite_config(draft, max_position_embeddings=64)
    llms = assert_exact(tmp_path, target, {"path": str(draft)})
    assert llms[0].engine.max_model_len <= 64
    # A request up to the bound runs to its end inside the draft's positions.
    prompt = llms[0].tokenizer.encode(PROMPTS[0])
    out = llms[0].generate(prompt, SamplingParams(max_tokens=64 - len(prompt), temperature=0.0))[0]
    assert len(prompt) + len(out.token_ids) == 64


def test_an_explicit_max_model_len_beyond_the_drafts_positions_is_not_silently_cut(tmp_path, root, target, capfd):
    """target.max_model_len = 256 with a draft of 64 positions: refused naming the draft and its
    positions, or served at 256, never quietly served at 64."""
    draft = root / "short-draft2"
    if not draft.exists():
        shutil.copytree(target, draft)
        rewrite_config(draft, max_position_embeddings=64)
    cfg = write_config(tmp_path, target, {"path": str(draft)}, target_extra={"max_model_len": 256})
    try:
        llm = start(cfg)
    except SpecserveError:
        line = refused_in_one_line(cfg, capfd)
        assert str(draft) in line and "64" in line and "max_model_len" in line, line
        return
    assert llm.engine.max_model_len == 256


@pytest.mark.parametrize("pair", [("float32", "bfloat16"), ("bfloat16", "float32")])
def test_a_draft_in_another_dtype_is_exact(tmp_path, root, target, noisy, pair):
    """[target] dtype and [draft] dtype differ (float32/bfloat16 both ways); exactness is the
    target's: compared against the target alone in its own dtype."""
    target_dtype, draft_dtype = pair
    llms = assert_exact(tmp_path, target, {"path": str(noisy), "dtype": draft_dtype}, target_dtype=target_dtype)
    assert llms[0].engine.draft.model.dtype == getattr(torch, draft_dtype)
    assert llms[0].engine.target.model.dtype == getattr(torch, target_dtype)


def test_a_bfloat16_checkpoint_as_draft_is_exact(tmp_path, root, target):
    """A draft saved in bfloat16 with dtype auto (loaded as float32 on the CPU)."""
    draft = make_checkpoint(root / "bf16-draft", "llama", dtype=torch.bfloat16, seed=8)
    assert_exact(tmp_path, target, {"path": str(draft)})


def test_the_target_as_its_own_draft_is_exact_and_accepts_everything(tmp_path, target):
    llms = assert_exact(tmp_path, target, {"path": str(target)})
    out = llms[0].generate(PROMPTS[1], SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0))[0]
    assert out.stats.mean_tokens_per_pass > 3.0


def test_a_sharded_draft_with_an_index_is_exact(tmp_path, root, noisy, target):
    from transformers import AutoModelForCausalLM

    sharded = Path(shutil.copytree(noisy, root / "sharded"))
    (sharded / "model.safetensors").unlink()
    AutoModelForCausalLM.from_pretrained(noisy).save_pretrained(sharded, max_shard_size="60KB")
    assert (sharded / "model.safetensors.index.json").is_file() and not (sharded / "model.safetensors").exists()
    assert len(list(sharded.glob("model-*.safetensors"))) > 1
    assert_exact(tmp_path, target, {"path": str(sharded)})


# -- paths --------------------------------------------------------------------------------------


def test_a_relative_draft_path_is_relative_to_the_config_file(tmp_path, root, target, noisy, monkeypatch):
    """As config.py promises: not to the working directory."""
    (tmp_path / "models").mkdir()
    shutil.copytree(noisy, tmp_path / "models" / "d")
    cfg = write_config(tmp_path / "configs", target, {"path": "../models/d"})
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    llm = start(cfg)
    assert Path(llm.config.draft.path).resolve() == (tmp_path / "models" / "d").resolve()
    assert greedy(llm) == target_only(target)


def test_a_relative_draft_path_stays_relative_to_the_config_when_the_kind_is_switched_on(tmp_path, target, noisy,
                                                                                        monkeypatch):
    """A config whose [draft] kind is "ngram" keeps a leftover relative path; `--draft-kind model`
    (or LLM(config=..., draft_kind="model")) turns it on: the path is still the config file's."""
    (tmp_path / "models").mkdir()
    shutil.copytree(noisy, tmp_path / "models" / "d")
    cfg = write_config(tmp_path / "configs", target, {"kind": "ngram", "path": "../models/d"})
    elsewhere = tmp_path / "a" / "b"
    elsewhere.mkdir(parents=True)
    monkeypatch.chdir(elsewhere)
    conf = cli._engine_config(cli_args(cfg, draft_kind="model"))
    assert Path(conf.draft.path).resolve() == (tmp_path / "models" / "d").resolve()
    llm = LLM(str(cfg), progress=False, draft_kind="model")
    assert llm.engine.draft is not None and greedy(llm) == target_only(target)


def test_a_draft_path_flag_is_relative_to_the_working_directory(tmp_path, target, noisy, monkeypatch):
    (tmp_path / "models").mkdir()
    shutil.copytree(noisy, tmp_path / "models" / "d")
    cfg = write_config(tmp_path / "configs", target, {"kind": "none"})
    monkeypatch.chdir(tmp_path)
    llm = start(cfg, draft="models/d")
    assert llm.engine.draft is not None and greedy(llm) == target_only(target)


def test_a_tilde_in_the_draft_path_is_the_home_folder(tmp_path, target, noisy, monkeypatch):
    home = tmp_path / "home"
    shutil.copytree(noisy, home / "models" / "d")
    monkeypatch.setenv("HOME", str(home))
    cfg = write_config(tmp_path / "configs", target, {"path": "~/models/d"})
    llm = start(cfg)
    assert Path(llm.config.draft.path) == home / "models" / "d"
    assert greedy(llm) == target_only(target)


@pytest.mark.parametrize("case", ["a_file", "missing", "no_weights", "no_config", "empty"])
def test_a_draft_path_that_is_no_checkpoint_is_one_line_naming_it(tmp_path, target, noisy, case, capfd):
    bad = tmp_path / "bad-draft"
    if case == "a_file":
        bad.write_text("not a model\n")
    elif case == "no_weights":
        shutil.copytree(noisy, bad)
        (bad / "model.safetensors").unlink()
    elif case == "no_config":
        shutil.copytree(noisy, bad)
        (bad / "config.json").unlink()
    elif case == "empty":
        bad.mkdir()
    cfg = write_config(tmp_path / "configs", target, {"path": str(bad)})
    line = refused_in_one_line(cfg, capfd)
    assert str(bad) in line, line


# -- [draft] kind and its keys ------------------------------------------------------------------


def test_an_adaptive_config_with_a_max_depth_below_the_default_depth_starts(tmp_path, target, noisy):
    """[spec] mode = "adaptive", max_depth = 3 and no depth (a weaker draft, a shallower cap):
    depth is not the user's, so it is no error; a later `--spec-depth` still works."""
    cfg = write_config(tmp_path, target, {"path": str(noisy)}, spec={"mode": "adaptive", "max_depth": 3})
    llm = start(cfg)
    assert llm.config.spec.max_depth == 3 and greedy(llm) == target_only(target)
    assert start(cfg, spec_mode="static", spec_depth=2).config.spec.depth == 2


@pytest.mark.parametrize("draft", [
    {"kind": "ngram", "path": "/nowhere/at/all", "dtype": "bfloat16"},
    {"kind": "none", "path": "/nowhere/at/all", "ngram_max": 3},
    {"kind": "model", "ngram_min": 2, "ngram_max": 3},   # path: filled in per test (the noisy draft)
])
def test_switching_the_kind_with_leftover_keys_starts_and_is_exact(tmp_path, target, noisy, draft):
    draft = dict(draft)
    if draft["kind"] == "model":
        draft["path"] = str(noisy)
    llms = assert_exact(tmp_path, target, draft)
    assert (llms[0].engine.draft is not None) == (draft["kind"] == "model")


@pytest.mark.parametrize("text,key,close", [
    ('[draft]\npth = "x"\n', "draft.pth", "path"),
    ('[draft]\nkinds = "ngram"\n', "draft.kinds", "kind"),
    ('[drafts]\nkind = "ngram"\n', "drafts", "draft"),
])
def test_a_typo_in_a_draft_key_is_one_line_naming_it_and_the_close_match(tmp_path, text, key, close, capfd):
    cfg = tmp_path / "typo.toml"
    cfg.write_text(text)
    line = refused_in_one_line(cfg, capfd)
    assert f"'{key}'" in line and close in line.split(key, 1)[1], line


# -- the caches ---------------------------------------------------------------------------------


def _static_engine(tmp_path, target, draft: dict):
    return start(write_config(tmp_path, target, draft)).engine


def test_the_profile_key_changes_with_the_draft(tmp_path, root, target, noisy):
    """A profile calibrated for one pair is not the key of another: another draft path, another
    draft kind, the same draft's weights replaced, or the draft in another dtype."""
    def key(draft, sub):
        return profile.profile_key(_static_engine(tmp_path / sub, target, draft), [1, 2], 4)

    base = key({"path": str(noisy)}, "a")
    other = make_checkpoint(root / "other-draft", "llama", seed=9, num_hidden_layers=3)
    assert key({"path": str(other)}, "b") != base
    assert key({"kind": "ngram"}, "c") != base
    assert key({"kind": "none"}, "d") != key({"kind": "ngram"}, "e")
    replaced = Path(shutil.copytree(noisy, tmp_path / "replaced"))
    k1 = key({"path": str(replaced)}, "f")
    shutil.copy(other / "model.safetensors", replaced / "model.safetensors")
    shutil.copy(other / "config.json", replaced / "config.json")
    assert key({"path": str(replaced)}, "g") != k1
    assert key({"path": str(noisy), "dtype": "bfloat16"}, "h") != base, \
        "the draft's dtype changes its step costs but not the profile's key"


def test_a_profile_of_the_old_pair_is_not_used_for_the_new_one(tmp_path, root, target, noisy, caplog):
    """Calibrate pair A; then start pair B (another draft) adaptive: B probes, A's profile is untouched."""
    caplog.set_level(logging.INFO, logger="specserve")
    a = start(write_config(tmp_path / "a", target, {"path": str(noisy)})).engine
    spec = a.spec
    path = profile.calibrate(a, spec.buckets(), spec.nodes_at(spec.max_depth()) + 1)
    assert path.is_file()
    caplog.clear()
    other = make_checkpoint(root / "other-draft-2", "llama", seed=10, num_hidden_layers=1)
    llm = start(write_config(tmp_path / "b", target, {"path": str(other)}, spec={"mode": "adaptive", "max_depth": 4}))
    assert "from the cached profile" not in caplog.text
    assert greedy(llm) == target_only(target)


def test_compiled_packages_are_keyed_by_the_drafts_shape(tmp_path, root, target, noisy, monkeypatch):
    """With [cpu] compile = "auto" and no builds: a draft of another shape (even only its
    rms_norm_eps) has a package of its own; one of the target's shape shares the target's."""
    from specserve.model import compiled

    monkeypatch.setenv("SPECSERVE_COMPILE_BUILDS", "0")
    eps = Path(shutil.copytree(noisy, root / "eps-draft"))
    rewrite_config(eps, rms_norm_eps=1e-3)
    engines = {}
    for name, path in (("noisy", noisy), ("eps", eps)):
        cfg = write_config(tmp_path / name, target, {"path": str(path)})
        cfg.write_text(cfg.read_text().replace('compile = "off"', 'compile = "auto"'))
        llm = start(cfg)
        assert greedy(llm) == target_only(target)
        engines[name] = llm.engine
    bs = engines["noisy"].pool.block_size
    p_target = compiled.package_path(engines["noisy"].target.model, bs)
    p_noisy = compiled.package_path(engines["noisy"].draft.model, bs)
    p_eps = compiled.package_path(engines["eps"].draft.model, bs)
    assert p_noisy == p_target and p_eps != p_noisy
