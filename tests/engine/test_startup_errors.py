"""What a user gives at start-up (config files, checkpoints, the profile and compile caches, the
command line) that is wrong gets one clear error naming the file, key or value, or is handled:
never a traceback, a crash at the first request, or garbage. Complements test_config.py,
test_loader_errors.py and server/test_configs.py (not repeated here)."""

from __future__ import annotations

import json
import logging
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from specserve import config as C
from specserve import profile
from specserve.controller import CapacityCurve
from specserve.errors import ConfigError, InvalidRequestError, ModelLoadError, SpecserveError
from specserve.model.loader import load_hf_config, load_model
from specserve.sampling import SamplingParams
from tests.checkpoints import make_checkpoint, rewrite_config

QUICK = dict(device="cpu", cpu_compile="off", num_blocks=64, max_num_seqs=2)   # small, eager, few buckets


@pytest.fixture
def ckpt(tiny_llama, tmp_path) -> Path:
    """A private copy of the tiny Llama checkpoint (max_position_embeddings 512) to break."""
    return Path(shutil.copytree(tiny_llama, tmp_path / "ckpt"))


@pytest.fixture(scope="module")
def small_vocab(tiny_llama, tmp_path_factory) -> Path:
    """A checkpoint whose embedding has 300 rows, with the tiny tokenizer (403 tokens) beside it."""
    path = make_checkpoint(tmp_path_factory.mktemp("v300"), with_tokenizer=False, vocab_size=300)
    for f in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if (tiny_llama / f).is_file():
            shutil.copy(tiny_llama / f, path / f)
    return path


def _llm(**kw):
    from specserve import LLM

    return LLM(progress=False, **{**QUICK, **kw})


# -- the command line ---------------------------------------------------------------------------


def test_serve_on_a_port_in_use_is_one_line_before_loading_anything(tmp_path):
    """As a user runs it: the console script, a port someone else listens on."""
    exe = shutil.which("specserve")
    cmd = [exe] if exe else [sys.executable, "-m", "specserve.cli"]
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen(1)
        port = busy.getsockname()[1]
        proc = subprocess.run(cmd + ["serve", "--host", "127.0.0.1", "--port", str(port)],
                              capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert proc.returncode != 0
    assert "Traceback" not in proc.stderr
    assert f"cannot listen on 127.0.0.1:{port}" in proc.stderr and "in use" in proc.stderr
    assert "pool:" not in proc.stderr and "engine core" not in proc.stderr   # nothing was loaded first


def test_serve_with_a_corrupt_checkpoint_says_which_file_without_a_traceback(ckpt, capfd):
    """`specserve serve` runs the engine in a process of its own by default: a checkpoint that
    fails there must reach the user as the loader's own one-line message (naming the file), not
    as the child's traceback plus 'the engine core exited with code 1'."""
    from specserve import cli

    data = (ckpt / "model.safetensors").read_bytes()
    (ckpt / "model.safetensors").write_bytes(data[: len(data) // 2])
    rc = cli.main(["serve", "--target", str(ckpt), "--device", "cpu", "--cpu-compile", "off",
                   "--host", "127.0.0.1", "--port", "0"])
    err = capfd.readouterr().err
    assert rc != 0
    assert "Traceback" not in err, err[-3000:]
    assert "model.safetensors" in err and "corrupt or truncated" in err, err[-3000:]


# -- config files -------------------------------------------------------------------------------


def test_a_config_file_that_is_not_utf8_names_the_file(tmp_path):
    p = tmp_path / "latin1.toml"
    p.write_bytes('[server]\nserved_model_name = "caf\xe9"\n'.encode("latin-1"))
    with pytest.raises(ConfigError) as e:
        C.load(p)
    assert str(p) in str(e.value) and "UTF-8" in str(e.value).upper()


def test_a_max_model_len_beyond_the_checkpoint_is_refused_not_silently_cut(ckpt):
    """vLLM refuses a max_model_len above max_position_embeddings (positions past it were never
    trained); a silent cap turns the user's 4096 into 512 without a word."""
    with pytest.raises(SpecserveError) as e:
        _llm(target=str(ckpt), max_model_len=4096)
    msg = str(e.value)
    assert "max_model_len" in msg and "4096" in msg and "512" in msg


def test_a_pool_smaller_than_the_context_is_said_at_start(ckpt, caplog):
    """64 blocks of 4 hold 256 tokens of a 512-token context: requests past them are refused, and
    the start-up log says so (and what to raise) before the first one is."""
    with caplog.at_level(logging.WARNING, logger="specserve"):
        _llm(target=str(ckpt), block_size=4)
    assert "the KV pool holds 256 tokens, fewer than the context (max_model_len 512)" in caplog.text


def test_a_tree_wider_than_the_vocabulary_is_refused_or_capped(ckpt, caplog):
    """spec.topk = 1000 on a 403-token model passes the config check; then every step raises
    (top-k out of range) and is run again sequence by sequence, a traceback in the log each time."""
    try:
        llm = _llm(target=str(ckpt), draft=str(ckpt), spec_mode="static", spec_depth=2, spec_tree="dynamic",
                   spec__topk=1000)
    except ConfigError as e:
        assert "topk" in str(e) and "1000" in str(e)
        return
    with caplog.at_level(logging.ERROR, logger="specserve"):
        outs = llm.generate(["The quick brown", "def f"], SamplingParams(max_tokens=6, temperature=0.0))
    assert all(o.error is None and len(o.token_ids) == 6 for o in outs)
    assert "engine step failed" not in caplog.text


@pytest.mark.parametrize("case", ["short_context", "fixed_tree_past_the_context"])
def test_the_startup_probe_stays_inside_the_models_context(ckpt, case):
    """The adaptive controller's start-up probe times dummy sequences at positions 32 + rows,
    whatever the model's context: a checkpoint with a short context (24 positions), or a fixed
    tree of more nodes (584) than positions (512), crashed start-up with an IndexError."""
    kw = dict(target=str(ckpt), draft=str(ckpt))
    if case == "short_context":
        rewrite_config(ckpt, max_position_embeddings=24)
    else:
        kw.update(spec_tree="fixed", spec__branching=[8, 8, 8])
    try:
        llm = _llm(**kw)
    except ConfigError as e:   # refusing the tree (naming it) is fine; a short model must start
        assert case != "short_context" and "branching" in str(e), e
        return
    out = llm.generate("The quick", SamplingParams(max_tokens=4, temperature=0.0))[0]
    assert out.error is None and len(out.token_ids) == 4


# -- checkpoints --------------------------------------------------------------------------------


def test_an_activation_we_do_not_implement_is_refused(ckpt):
    """Our MLP is SwiGLU (silu) whatever config.json says: a gelu checkpoint loaded and served
    garbage. vLLM's Llama refuses it ("Unsupported activation")."""
    rewrite_config(ckpt, hidden_act="gelu")
    with pytest.raises(ModelLoadError) as e:
        load_model(ckpt, progress=False)
    msg = str(e.value)
    assert "hidden_act" in msg and "gelu" in msg and "config.json" in msg


def test_architectures_as_a_string_is_not_spelled_out_letter_by_letter(ckpt):
    rewrite_config(ckpt, architectures="LlamaForCausalLM")
    try:
        load_hf_config(ckpt)   # taking it as ["LlamaForCausalLM"] is fine
    except ModelLoadError as e:
        assert "L, l, a" not in str(e) and "architectures" in str(e), e


def test_a_tokenizer_larger_than_the_embedding_is_a_clear_error(small_vocab):
    """Text whose ids pass the embedding's 300 rows failed inside the step with
    IndexError('index out of range in self'): refuse the pair at start-up or the request."""
    text = "Speculative decoding 東京 🙂"
    try:
        llm = _llm(target=str(small_vocab))
    except ModelLoadError as e:
        assert "300" in str(e) and "tokenizer" in str(e)
        return
    assert max(llm.tokenizer.encode(text)) >= 300
    with pytest.raises(InvalidRequestError) as e:
        llm.engine.add_request(None, text, SamplingParams(max_tokens=2))
    assert "300" in str(e.value)


def test_a_draft_with_a_smaller_vocabulary_is_refused(ckpt, small_vocab):
    with pytest.raises(ModelLoadError) as e:
        _llm(target=str(ckpt), draft=str(small_vocab))
    msg = str(e.value)
    assert str(small_vocab) in msg and "vocab_size 300" in msg and "tokenizer" in msg


def test_a_draft_with_another_tokenizer_is_refused(ckpt):
    draft = C.ASSETS_DIR / "tiny-draft"   # vocab 4096 >= 403: only the tokenizer differs
    with pytest.raises(ModelLoadError) as e:
        _llm(target=str(ckpt), draft=str(draft))
    msg = str(e.value)
    assert str(draft) in msg and "tokeniz" in msg and str(ckpt) in msg


# -- the caches ---------------------------------------------------------------------------------


def _curve() -> dict:
    return {"buckets": [1, 2], "verify_s": [[1e-3, 2e-3, 3e-3], [2e-3, 3e-3, 4e-3]], "level_s": [1e-4, 2e-4],
            "rest_s": [0.0, 0.0], "context": 32, "context_s": [[0.0, 0.0], [0.0, 0.0]]}


@pytest.mark.parametrize("damage", ["not_json", "stale_key", "short_level", "ragged_rows", "nan_level",
                                    "negative_level"])
def test_a_damaged_profile_is_ignored_not_fatal(tmp_path, monkeypatch, damage):
    """A stale or unreadable profile is ignored (README). Past the first three: a profile whose key
    matches but whose table is damaged was taken, and then the first plan raised IndexError
    (ragged rows) in every step: the engine died with every request, at every restart."""
    monkeypatch.setenv("SPECSERVE_CACHE_DIR", str(tmp_path))
    key = {"format": profile.FORMAT, "target": "t", "buckets": [1, 2], "max_rows": 3}
    path = profile._path(key)
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps({"key": key, "curve": _curve()}))
    assert profile.load(key) is not None   # the undamaged file is read
    curve = _curve()
    if damage == "not_json":
        path.write_text(json.dumps({"key": key, "curve": curve})[:-20])
        assert profile.load(key) is None
        return
    if damage == "stale_key":   # another version wrote it (a hash collision of the name, in effect)
        path.write_text(json.dumps({"key": {**key, "format": profile.FORMAT + 1}, "curve": curve}))
        assert profile.load(key) is None
        return
    if damage == "ragged_rows":
        curve["verify_s"][1] = [2e-3]
    elif damage == "nan_level":
        curve["level_s"][0] = float("nan")
    elif damage == "negative_level":
        curve["level_s"][1] = -1.0
    else:
        curve["level_s"] = [1e-4]
    path.write_text(json.dumps({"key": key, "curve": curve}))
    assert profile.load(key) is None


def test_two_writers_of_one_profile_both_succeed(tmp_path, monkeypatch):
    """Two `specserve calibrate` of one setup share the temporary file name: the one that
    renames second finds its file gone (FileNotFoundError) after minutes of calibration."""
    monkeypatch.setenv("SPECSERVE_CACHE_DIR", str(tmp_path))
    key = {"format": profile.FORMAT, "target": "t", "buckets": [1, 2], "max_rows": 3}
    c = _curve()
    curve = CapacityCurve(c["buckets"], c["verify_s"], c["level_s"], c["rest_s"], c["context"], c["context_s"])
    real, state = Path.replace, {"other_done": False}

    def replace(self, target):
        if not state["other_done"]:   # the other writer writes and renames in between
            state["other_done"] = True
            profile.save(key, curve)
        return real(self, target)

    monkeypatch.setattr(Path, "replace", replace)
    profile.save(key, curve)
    assert state["other_done"] and profile.load(key) is not None


def test_an_unwritable_compile_cache_leaves_the_engine_eager(ckpt, tmp_path, monkeypatch):
    """Read-only home directories are common in containers: with compiled forwards on (the CPU
    default) and builds allowed, the cache directory that cannot be made crashed start-up."""
    from specserve.model import compiled

    blocker = tmp_path / "cache"
    blocker.write_text("a file where the cache directory should be")
    monkeypatch.setenv("SPECSERVE_CACHE_DIR", str(blocker))
    monkeypatch.delenv("SPECSERVE_COMPILE_BUILDS", raising=False)
    started = []
    monkeypatch.setattr(compiled.subprocess, "Popen", lambda *a, **k: started.append(a))   # never a real build
    monkeypatch.setattr(compiled, "supported", lambda model: True)
    llm = _llm(target=str(ckpt), cpu_compile="auto")
    assert llm.engine.target.compiled is None and not started
    out = llm.generate("The quick", SamplingParams(max_tokens=3, temperature=0.0))[0]
    assert out.error is None and len(out.token_ids) == 3
