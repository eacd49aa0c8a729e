"""The engine core in its own process (specserve/core.py) behind the same app: greedy outputs
of 32 concurrent streams equal offline LLM.generate (speculation on, float64); killing the
core mid-stream ends every stream with an error event and [DONE], /health answers 503 until
a new core serves, and the restart is counted; a client that disconnects aborts its request
in the core, whose blocks come back."""

from __future__ import annotations

import json
import os
import signal
import socket
import threading
import urllib.error
import urllib.request

import pytest

from specserve.core import EngineCoreClient
from specserve.llm import LLM
from specserve.sampling import SamplingParams
from tests.server.conftest import ServerThread, concurrently, engine_config, wait_until

PROMPTS = [f"Story {i}: once upon a time" for i in range(32)]


@pytest.fixture(scope="module")
def cfg(server_target, server_draft):
    return engine_config(server_target, server_draft, spec_mode="static", spec_depth=3, dtype="float64",
                         max_model_len=512)


@pytest.fixture(scope="module")
def core_server(cfg):
    srv = ServerThread(EngineCoreClient(cfg), cfg)
    yield srv
    srv.stop()


def backend(srv) -> EngineCoreClient:
    from specserve.server.app import STATE

    return srv.app[STATE].async_engine


def stream(srv, body: dict) -> list[str]:
    """The data lines of one SSE stream."""
    req = urllib.request.Request(srv.url + "/completions", data=json.dumps({**body, "stream": True}).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        return [line[6:] for line in r.read().decode().split("\n\n") if line.startswith("data: ")]


def health(srv) -> int:
    try:
        with urllib.request.urlopen(srv.base + "/health", timeout=10) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code


def test_32_concurrent_streams_equal_offline(core_server, cfg):
    offline = LLM(cfg, progress=False).generate(PROMPTS, SamplingParams(max_tokens=24, temperature=0.0))

    def run(i: int) -> str:
        events = stream(core_server, {"prompt": PROMPTS[i], "max_tokens": 24, "temperature": 0})
        assert events[-1] == "[DONE]"
        return "".join(json.loads(e)["choices"][0]["text"] for e in events[:-1])

    assert concurrently(run, len(PROMPTS)) == [o.text for o in offline]
    snap = backend(core_server).snapshot()
    assert snap["num_accepted_tokens"] > 0 and snap["speculation"] == {"mode": "static", "depth": 3}


def test_a_disconnect_aborts_the_request_in_the_core(core_server):
    body = json.dumps({"prompt": "A long story", "max_tokens": 200, "ignore_eos": True, "stream": True,
                       "temperature": 0.8}).encode()
    with socket.create_connection(("127.0.0.1", core_server.port)) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
        received = b""
        while b"data: " not in received:
            chunk = s.recv(4096)
            assert chunk, received
            received += chunk
    # The core's own snapshot: nothing running and no block held once the abort arrived.
    core = backend(core_server)
    assert wait_until(lambda: core.snapshot()["running"] == 0 and core.snapshot()["blocks_held"] == 0, timeout=20), \
        core.snapshot()


def test_a_killed_core_ends_every_stream_and_is_restarted(core_server):
    core = backend(core_server)
    pid, restarts = core.pid, core.snapshot()["restarts"]
    results: dict[int, list[str]] = {}
    started = threading.Barrier(5)

    def run(i: int):
        req = urllib.request.Request(core_server.url + "/completions", data=json.dumps(
            {"prompt": PROMPTS[i], "max_tokens": 480, "ignore_eos": True, "temperature": 0.7,
             "stream": True}).encode(), headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=120) as r:
            first = r.readline()   # the first event: the request is running
            started.wait(30)
            results[i] = [first.decode()[6:].strip()] + [
                line[6:] for line in r.read().decode().splitlines() if line.startswith("data: ")]

    threads = [threading.Thread(target=run, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    started.wait(60)
    os.kill(pid, signal.SIGKILL)
    for t in threads:
        t.join(60)
    assert len(results) == 4
    for events in results.values():
        assert events[-1] == "[DONE]"
        error = json.loads(events[-2])["error"]
        assert error["code"] == "engine_unavailable" and "restarting" in error["message"]
    assert wait_until(lambda: health(core_server) == 200, timeout=120), "the core was not restarted"
    assert core.pid != pid and core.snapshot()["restarts"] == restarts + 1
    events = stream(core_server, {"prompt": PROMPTS[0], "max_tokens": 8, "temperature": 0})
    assert events[-1] == "[DONE]" and json.loads(events[-2])["choices"][0]["finish_reason"] == "length"
    with urllib.request.urlopen(core_server.base + "/metrics", timeout=10) as r:
        assert f"specserve_engine_restarts_total {restarts + 1}.0" in r.read().decode()


def test_text_and_stop_strings_are_made_in_the_api_server(core_server, cfg):
    """The core sends token ids only; the API server's detokenizer makes the text and cuts at
    a stop string exactly where the engine alone would have (then the core's request is
    aborted), streaming and not."""
    llm = LLM(cfg, progress=False)
    full = llm.generate(PROMPTS[5], SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True))[0]
    stop = full.text[12:16]
    ref = llm.generate(PROMPTS[5], SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True, stop=[stop]))[0]
    assert ref.finish_reason == "stop"
    events = stream(core_server, {"prompt": PROMPTS[5], "max_tokens": 40, "temperature": 0, "ignore_eos": True,
                                  "stop": [stop], "logprobs": 1})
    chunks = [json.loads(e) for e in events[:-1]]
    assert "".join(c["choices"][0]["text"] for c in chunks) == ref.text
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"
    assert sum(len(c["choices"][0]["logprobs"]["tokens"]) for c in chunks) == len(ref.token_ids)
    req = urllib.request.Request(core_server.url + "/completions", data=json.dumps(
        {"prompt": PROMPTS[5], "max_tokens": 40, "temperature": 0, "ignore_eos": True, "stop": [stop]}).encode(),
        headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as r:
        body = json.loads(r.read())
    assert body["choices"][0]["text"] == ref.text and body["usage"]["completion_tokens"] == len(ref.token_ids)
    core = backend(core_server)
    assert wait_until(lambda: core.snapshot()["running"] == 0 and core.snapshot()["blocks_held"] == 0, timeout=20)


def test_special_tokens_show_in_the_text_when_asked(core_server):
    """skip_special_tokens (vLLM's field, default true) reaches the API server's detokenizer:
    a request made to emit EOS three times gets "" by default and the EOS text three times
    with skip_special_tokens: false, streaming and not."""
    tokenizer = backend(core_server).tokenizer
    eos, eos_id = tokenizer.eos_token, tokenizer.eos_token_id
    body = {"prompt": PROMPTS[0], "max_tokens": 3, "temperature": 0, "ignore_eos": True,
            "logit_bias": {str(eos_id): 100}}
    for skip, text in ((True, ""), (False, eos * 3)):
        events = stream(core_server, {**body, "skip_special_tokens": skip})
        assert "".join(json.loads(e)["choices"][0]["text"] for e in events[:-1]) == text
        req = urllib.request.Request(core_server.url + "/completions", headers={"Content-Type": "application/json"},
                                     data=json.dumps({**body, "skip_special_tokens": skip}).encode())
        with urllib.request.urlopen(req, timeout=60) as r:
            out = json.loads(r.read())
        assert out["choices"][0]["text"] == text and out["usage"]["completion_tokens"] == 3


def test_stop_tokens_and_min_tokens_end_the_text_as_vllm_does(core_server, cfg):
    """The API server's detokenizer follows the core's stop as LLMEngine does, and both as
    vLLM: the text of the stop token id or EOS that ended a request is not output (its id is
    counted) nor is the stop string, unless include_stop_str_in_output; min_tokens holds back
    stop strings too; `stop_reason` names the stop token id or stop string (null for EOS);
    streaming and not, in the core's process and in one."""
    from specserve.engine import LLMEngine

    llm = LLM(cfg, progress=False)
    full = llm.generate(PROMPTS[7], SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True))[0]
    tok = full.token_ids[6]
    cut = full.token_ids.index(tok) + 1
    eos_id = backend(core_server).tokenizer.eos_token_id
    stop = llm.tokenizer.decode(full.token_ids[:3])[-2:]   # occurs in the first 3 tokens' text
    late = full.text[-4:-1]
    cases = [
        (dict(stop_token_ids=[tok]), full.token_ids[:cut], tok),
        (dict(logit_bias={str(eos_id): 100}, skip_special_tokens=False, max_tokens=3), [eos_id], None),
        (dict(stop=[stop], min_tokens=12), None, None),
        (dict(stop=[late]), None, late),
        (dict(stop=[late], include_stop_str_in_output=True), None, late),
        (dict(stop_token_ids=[tok], include_stop_str_in_output=True), full.token_ids[:cut], tok),
    ]
    in_process = ServerThread(LLMEngine(cfg, progress=False), cfg)
    try:
        for extra, want_ids, want_stop_reason in cases:
            body = {"prompt": PROMPTS[7], "max_tokens": 24, "temperature": 0,
                    "ignore_eos": "logit_bias" not in extra, **extra}
            params = SamplingParams(**{f: v for f, v in body.items() if f != "prompt"} | (
                {"logit_bias": {eos_id: 100}} if "logit_bias" in extra else {}))
            ref = llm.generate(PROMPTS[7], params)[0]
            include = extra.get("include_stop_str_in_output", False)
            if want_ids is not None:
                assert (ref.token_ids, ref.finish_reason) == (want_ids, "stop")
                assert ref.text == llm.tokenizer.decode(want_ids if include else want_ids[:-1], skip_special_tokens=False)
            elif "stop" in extra and not extra.get("min_tokens"):
                assert ref.text.endswith(late) == include and late not in ref.text[:-len(late)]
            elif "min_tokens" in extra:   # the stop string first completes within min_tokens: the output runs past it
                assert len(ref.token_ids) > 12 and stop in ref.text[:len(llm.tokenizer.decode(full.token_ids[:12]))]
            if want_stop_reason is not None or want_ids is not None:
                assert ref.stop_reason == want_stop_reason
            for srv in (core_server, in_process):
                events = stream(srv, body)
                chunks = [json.loads(e) for e in events[:-1]]
                assert "".join(c["choices"][0]["text"] for c in chunks) == ref.text
                last = chunks[-1]["choices"][0]
                assert (last["finish_reason"], last["stop_reason"]) == (ref.finish_reason, ref.stop_reason)
                req = urllib.request.Request(srv.url + "/completions", data=json.dumps(body).encode(),
                                             headers={"Content-Type": "application/json"})
                with urllib.request.urlopen(req, timeout=60) as r:
                    out = json.loads(r.read())
                choice = out["choices"][0]
                assert (choice["text"], choice["finish_reason"], choice["stop_reason"]) == (
                    ref.text, ref.finish_reason, ref.stop_reason)
                assert out["usage"]["completion_tokens"] == len(ref.token_ids)
    finally:
        in_process.stop()


def test_a_core_that_cannot_start_leaves_no_socket_or_process(server_target, tmp_path):
    """A core whose model cannot load exits while starting: start() says so, and neither its
    process nor the sockets opened for it stay behind (a restart loop would pile them up)."""
    import asyncio

    from specserve.engine import EngineDeadError

    good = EngineCoreClient(engine_config(server_target, None))
    broken = EngineCoreClient(engine_config(tmp_path / "gone", None), tokenizer=good.tokenizer)

    async def start() -> None:
        with pytest.raises(EngineDeadError, match="while starting"):
            await broken.start()

    asyncio.run(start())
    assert broken._push.closed and broken._pull.closed and not broken._proc.is_alive()
