"""The command line and the offline `LLM` API as a newcomer uses them: every flag reaches the
engine config (over the config file), bad values and conflicting flags are refused in one line
naming the flag (exit 2, before any model loads), `generate` writes only text to stdout and
repeats a seeded run, `calibrate` writes the profile a server start reads, SIGINT exits 130
without leftovers, and `LLM.generate` takes the prompt forms vLLM's does. Complements
test_startup_errors.py, test_config.py and test_draft_swap.py (not repeated here)."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import threading
import time
import types
from pathlib import Path

import pytest

from specserve import cli
from specserve import config as C
from specserve.errors import ConfigError
from tests.checkpoints import make_float32_pair

PROMPT = "héllo 東京 🙂"


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return make_float32_pair(tmp_path_factory.mktemp("cli_pair"))


@pytest.fixture(scope="module")
def cfg_file(pair, tmp_path_factory) -> Path:
    """A small, eager, one-thread setup of the tiny pair: each engine starts in well under a second."""
    target, draft = pair
    path = tmp_path_factory.mktemp("cli_cfg") / "tiny.toml"
    path.write_text(f"""device = "cpu"
[target]
path = "{target}"
[draft]
path = "{draft}"
[spec]
max_depth = 2
[cache]
num_blocks = 64
[scheduler]
max_num_seqs = 1
[cpu]
threads = 1
linear = "torch"
compile = "off"
heap_malloc = false
""")
    return path


def run_cli(argv, capsys) -> tuple[int, str, str]:
    """cli.main in this process: (exit code, stdout, stderr)."""
    try:
        rc = cli.main([str(a) for a in argv])
    except SystemExit as e:   # argparse's own refusals and --help
        rc = e.code
    out, err = capsys.readouterr()
    return rc, out, err


def refused(rc, err, *names):
    """Exit 2, no traceback, and the last line of stderr names every one of `names`."""
    assert rc == 2, (rc, err)
    assert "Traceback" not in err and "SPECSERVE_DEBUG" not in err, err
    last = err.strip().splitlines()[-1]
    for name in names:
        assert name in last, (name, last)
    return last


@pytest.fixture
def no_loading(monkeypatch):
    """Fail the test if anything loads a model or starts a server."""
    import specserve.llm
    import specserve.server.app

    def boom(*a, **k):
        raise AssertionError("a model was loaded or a server started")

    monkeypatch.setattr(specserve.llm, "LLM", boom)
    monkeypatch.setattr(specserve.server.app, "serve", boom)
    fake_ray = types.ModuleType("specserve.server.ray_serve")
    fake_ray.serve_on_ray = boom
    monkeypatch.setitem(sys.modules, "specserve.server.ray_serve", fake_ray)


# -- flags and the config file ------------------------------------------------------------------


@pytest.mark.parametrize("command", ["serve", "generate", "calibrate"])
def test_every_subcommand_has_help_and_no_subcommand_is_usage_exit_2(command, capsys):
    rc, out, _ = run_cli([command, "--help"], capsys)
    assert rc == 0 and "--config" in out and "--spec-depth" in out and "--cpu-compile" in out
    rc, out, err = run_cli([], capsys)
    assert rc == 2 and "serve" in out + err and "Traceback" not in err


def test_serve_flags_override_the_config_file(cfg_file, monkeypatch, capsys):
    import specserve.server.app

    seen = []
    monkeypatch.setattr(specserve.server.app, "serve", seen.append)
    monkeypatch.setenv("SPECSERVE_API_KEY", "k1")
    rc, _, err = run_cli(["serve", "--config", cfg_file, "--spec-mode", "static", "--spec-depth", 5,
                          "--num-blocks", 32, "--max-num-seqs", 3, "--dtype", "float64",
                          "--cpu-threads", 2, "--cpu-compile", "auto", "--host", "127.0.0.2", "--port", 0,
                          "--admin-api", "--engine-thread", "--served-model-name", "m", "--shutdown-timeout", 2.5,
                          "--draft-kind", "ngram", "--spec-tree", "chain"], capsys)
    assert rc == 0, err
    cfg = seen[0]
    assert (cfg.spec.mode, cfg.spec.depth, cfg.spec.max_depth, cfg.spec.tree) == ("static", 5, 5, "chain")
    assert (cfg.cache.num_blocks, cfg.scheduler.max_num_seqs) == (32, 3)
    assert (cfg.target.dtype, cfg.draft.dtype, cfg.draft.kind) == ("float64", "float64", "ngram")
    assert (cfg.cpu.threads, cfg.cpu.compile, cfg.cpu.linear) == (2, "auto", "torch")   # linear: the file's
    s = cfg.server
    assert (s.host, s.port, s.admin_api, s.engine_process, s.served_model_name, s.shutdown_timeout_s, s.api_key) \
        == ("127.0.0.2", 0, True, False, "m", 2.5, "k1")
    rc, _, _ = run_cli(["serve", "--config", cfg_file], capsys)   # no flags: the file's values as they are
    cfg = seen[1]
    assert rc == 0 and (cfg.spec.mode, cfg.spec.max_depth, cfg.cache.num_blocks, cfg.server.engine_process) \
        == ("adaptive", 2, 64, True)


@pytest.mark.parametrize("argv,flag", [
    (["serve", "--spec-depth", "-1"], "--spec-depth"),
    (["serve", "--num-blocks", "0"], "--num-blocks"),
    (["serve", "--max-num-seqs", "0"], "--max-num-seqs"),
    (["serve", "--cpu-threads", "-3"], "--cpu-threads"),
    (["serve", "--engines", "0"], "--engines"),
    (["serve", "--engines", "65"], "--engines"),
    (["serve", "--port", "70000"], "--port"),
    (["serve", "--port", "-1"], "--port"),
    (["serve", "--shutdown-timeout", "-1"], "--shutdown-timeout"),
    (["serve", "--engines", "2", "--engine-thread"], "--engine-thread"),
    (["calibrate", "--num-blocks", "0"], "--num-blocks"),
    (["generate", "--max-num-seqs", "-2"], "--max-num-seqs"),
])
def test_a_bad_flag_value_is_one_line_naming_the_flag(argv, flag, no_loading, capsys):
    refused(*run_cli(argv, capsys)[::2], flag)


@pytest.mark.parametrize("argv,flags", [
    (["serve", "--ray", "--engines", "2"], ["--ray", "--engines"]),
    (["serve", "--ray", "--engine-thread"], ["--ray", "--engine-thread"]),
    (["serve", "--ray", "--replicas", "0"], ["--replicas"]),
    (["serve", "--ray", "--replicas", "3", "--max-replicas", "2"], ["--max-replicas", "--replicas"]),
    (["serve", "--replicas", "2"], ["--replicas", "--ray"]),
    (["serve", "--max-replicas", "4"], ["--max-replicas", "--ray"]),
])
def test_ray_flags_that_conflict_or_do_nothing_are_refused_before_ray_starts(argv, flags, no_loading, capsys):
    refused(*run_cli(argv, capsys)[::2], *flags)


@pytest.mark.parametrize("flag,value", [
    ("--max-tokens", "0"), ("--max-tokens", "-5"), ("--temperature", "-1"), ("--temperature", "nan"),
    ("--top-p", "0"), ("--top-p", "1.5"), ("--top-k", "-2"),
])
def test_generate_refuses_a_bad_sampling_flag_naming_it_before_loading_the_models(flag, value, no_loading, capsys):
    refused(*run_cli(["generate", "--prompt", "x", flag, value], capsys)[::2], flag)


def test_serve_on_an_invalid_host_is_one_line_before_loading(cfg_file, capsys):
    rc, _, err = run_cli(["serve", "--config", cfg_file, "--host", "no-such-host.invalid", "--port", 0], capsys)
    line = refused(rc, err, "cannot listen on no-such-host.invalid")
    assert "pool:" not in err and line.startswith("specserve: error:")


# -- generate -----------------------------------------------------------------------------------


def test_generate_prints_only_the_text_on_stdout_and_a_seed_repeats_under_static_speculation(cfg_file, capsys):
    base = ["generate", "--config", cfg_file, "--spec-mode", "static", "--spec-depth", 2, "--prompt", PROMPT,
            "--max-tokens", 12]
    rc, out, err = run_cli(base, capsys)
    assert rc == 0, err
    assert out.startswith(PROMPT) and out.endswith("\n")   # the prompt, its continuation, nothing else
    assert "tokens per target pass" not in out and "tokens/s" not in out and "loading" not in out
    assert "tokens/s" in err
    greedy_other_seed = run_cli(base + ["--seed", 99], capsys)[1]
    assert greedy_other_seed == out   # greedy: the seed changes nothing

    sampled = base + ["--temperature", 1.0, "--seed", 7]
    first, again = run_cli(sampled, capsys)[1], run_cli(sampled, capsys)[1]
    other = run_cli(base + ["--temperature", 1.0, "--seed", 8], capsys)[1]
    assert first == again and first != other and first != out


def test_generate_max_tokens_one_beyond_the_context_and_an_empty_prompt(cfg_file, capsys):
    base = ["generate", "--config", cfg_file, "--spec-mode", "static"]
    rc, out, err = run_cli(base + ["--prompt", "ab", "--max-tokens", 1], capsys)
    assert rc == 0 and "(1 tokens, length" in out + err
    rc, _, err = run_cli(base + ["--prompt", "ab", "--max-tokens", 600], capsys)
    refused(rc, err, "maximum context length is 512")
    rc, _, err = run_cli(base + ["--prompt", ""], capsys)
    refused(rc, err, "prompt is empty")


def _env(tmp_path) -> dict:
    return dict(os.environ, SPECSERVE_CACHE_DIR=str(tmp_path / "cache"), SPECSERVE_COMPILE_BUILDS="0",
                TMPDIR=str(tmp_path), PYTHONUNBUFFERED="1")


def _read_stderr(proc, lines: list) -> threading.Thread:
    thread = threading.Thread(target=lambda: lines.extend(proc.stderr), daemon=True)
    thread.start()
    return thread


def test_sigint_during_generation_exits_130_quietly(cfg_file, tmp_path):
    proc = subprocess.Popen([sys.executable, "-m", "specserve.cli", "generate", "--config", str(cfg_file),
                             "--spec-mode", "static", "--max-tokens", "480", "--temperature", "1", "--seed", "1",
                             "--prompt", "a"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=_env(tmp_path))
    err: list[str] = []
    reader = _read_stderr(proc, err)
    deadline = time.monotonic() + 60
    while not any("pool:" in line for line in err) and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.02)
    time.sleep(0.2)   # generating now
    proc.send_signal(signal.SIGINT)
    out = proc.stdout.read()
    proc.wait(timeout=30)
    reader.join(5)
    assert proc.returncode == 130, "".join(err)
    assert "Traceback" not in "".join(err) and "KeyboardInterrupt" not in "".join(err)
    assert out == ""


def _descendants(pid: int) -> list[int]:
    kids = []
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                if int(Path(f"/proc/{d}/stat").read_text().rsplit(")", 1)[1].split()[1]) == pid:
                    kids.append(int(d))
            except (OSError, ValueError, IndexError):
                pass
    return kids + [k for kid in kids for k in _descendants(kid)]


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_sigint_before_the_engine_core_is_ready_leaves_no_process_and_no_socket_file(cfg_file, tmp_path):
    proc = subprocess.Popen([sys.executable, "-m", "specserve.cli", "serve", "--config", str(cfg_file),
                             "--port", "0"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=_env(tmp_path))
    err: list[str] = []
    reader = _read_stderr(proc, err)
    kids: list[int] = []
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and proc.poll() is None:
        kids = _descendants(proc.pid)
        if any("multiprocessing" in Path(f"/proc/{k}/cmdline").read_text(errors="replace") for k in kids
               if _alive(k)) and list(tmp_path.glob("specserve-*")):
            break
        time.sleep(0.02)
    assert list(tmp_path.glob("specserve-*")), "the engine core's sockets were not made"
    proc.send_signal(signal.SIGINT)
    proc.wait(timeout=30)
    reader.join(5)
    text = "".join(err)
    try:
        assert "engine core ready" not in text   # interrupted while starting
        assert proc.returncode == 130 and "Traceback" not in text, text
        time.sleep(0.5)
        assert not [k for k in kids if _alive(k)], "engine-core children outlived the server"
        assert not list(tmp_path.glob("specserve-*")), "ipc socket files were left behind"
    finally:
        for k in kids:
            if _alive(k):
                os.kill(k, signal.SIGKILL)


# -- calibrate ----------------------------------------------------------------------------------


def test_calibrate_writes_the_profile_a_server_start_reads(cfg_file, tmp_path, monkeypatch, capsys, caplog):
    from specserve.engine import LLMEngine

    monkeypatch.setenv("SPECSERVE_CACHE_DIR", str(tmp_path / "cache"))
    rc, out, err = run_cli(["calibrate", "--config", cfg_file], capsys)
    assert rc == 0, err
    written = list((tmp_path / "cache" / "profiles").glob("*.json"))
    assert len(written) == 1 and str(written[0]) in out
    with caplog.at_level(logging.INFO, logger="specserve"):
        LLMEngine(C.load(cfg_file), progress=False)   # what the engine core of `serve --config` builds
    assert f"step costs from the cached profile {written[0]}" in caplog.text


def test_calibrate_into_a_cache_dir_it_cannot_write_is_one_line_exit_2(cfg_file, tmp_path, monkeypatch, capsys):
    import specserve.engine

    blocker = tmp_path / "a-file"
    blocker.write_text("")
    monkeypatch.setenv("SPECSERVE_CACHE_DIR", str(blocker / "cache"))
    real, built = specserve.engine.LLMEngine, []
    monkeypatch.setattr(specserve.engine, "LLMEngine", lambda *a, **k: built.append(1) or real(*a, **k))
    rc, _, err = run_cli(["calibrate", "--config", cfg_file], capsys)
    refused(rc, err, str(blocker / "cache"))
    assert not built   # refused before loading and measuring, which take minutes on a real pair


# -- the offline LLM API ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def llm(cfg_file):
    from specserve import LLM

    return LLM(str(cfg_file), progress=False, spec_mode="static", spec_depth=2, spec__topk=2, num_blocks=48)


def test_llm_keywords_reach_the_config(llm):
    cfg = llm.config
    assert (cfg.spec.mode, cfg.spec.depth, cfg.spec.topk, cfg.cache.num_blocks, cfg.cpu.linear) \
        == ("static", 2, 2, 48, "torch")


@pytest.mark.parametrize("typo,close", [("spec_dept", "spec_depth"), ("num_block", "num_blocks"),
                                        ("max_num_seq", "max_num_seqs")])
def test_an_unknown_llm_keyword_is_named_with_its_close_match(typo, close):
    from specserve import LLM

    with pytest.raises(ConfigError) as e:
        LLM(progress=False, **{typo: 3})
    assert f"'{typo}'" in str(e.value) and f"did you mean '{close}'" in str(e.value), str(e.value)


def test_llm_generate_takes_a_string_token_ids_and_lists_of_them_as_vllm_does(llm):
    from specserve import SamplingParams

    sp = SamplingParams(max_tokens=4, temperature=0.0)
    ids = llm.tokenizer.encode("ab")
    one = llm.generate("ab", sp)
    assert len(one) == 1 and one[0].token_ids == llm.generate(["ab"], sp)[0].token_ids
    assert [o.token_ids for o in llm.generate([ids], sp)] == [llm.generate(ids, sp)[0].token_ids]
    assert llm.generate([], sp) == []
    with pytest.raises(ValueError, match="2 prompts but 1 SamplingParams"):
        llm.generate(["a", "b"], [sp])
    # vLLM's TextPrompt / TokensPrompt dicts, alone or in a list
    assert llm.generate({"prompt": "ab"}, sp)[0].token_ids == one[0].token_ids
    got = llm.generate([{"prompt_token_ids": ids}, {"prompt": "ab"}], sp)
    assert [o.token_ids for o in got] == [llm.generate(ids, sp)[0].token_ids, one[0].token_ids]
