"""Concurrent streams against the offline engine, client disconnects, multi-byte text and
stop strings across chunks, and a graceful shutdown."""

from __future__ import annotations

import asyncio
import signal
import threading
import urllib.error
import urllib.request

import aiohttp
import openai
import pytest

from specserve.engine import LLMEngine
from specserve.llm import LLM
from specserve.sampling import SamplingParams
from tests.checkpoints import CORPUS
from tests.server.conftest import (SCRIPT, ServerThread, engine_config, make_successor_checkpoint,
                                  start_server_process, wait_until)


def test_32_concurrent_streams_equal_offline_generate(server, server_target, server_draft):
    """Greedy: each stream, concatenated, equals its own LLM.generate result on the same pair."""
    prompts = [CORPUS[i % 9][: 8 + 5 * i] for i in range(32)]
    max_tokens = [6 + (7 * i) % 19 for i in range(32)]
    llm = LLM(engine_config(server_target, server_draft, spec_mode="static", spec_depth=3), progress=False)
    offline = llm.generate(prompts, [SamplingParams(max_tokens=m, temperature=0.0) for m in max_tokens])
    model = server_target.name

    async def one(client, prompt, m):
        stream = await client.completions.create(model=model, prompt=prompt, max_tokens=m, temperature=0,
                                                 stream=True, stream_options={"include_usage": True})
        text, finish, usage, num_chunks = "", None, None, 0
        async for chunk in stream:
            if chunk.choices:
                text += chunk.choices[0].text
                finish = chunk.choices[0].finish_reason or finish
                num_chunks += 1
            else:
                usage = chunk.usage
        return text, finish, usage, num_chunks

    async def all_streams():
        client = openai.AsyncOpenAI(base_url=server.url, api_key="x", max_retries=0, timeout=120)
        try:
            return await asyncio.gather(*(one(client, p, m) for p, m in zip(prompts, max_tokens)))
        finally:
            await client.close()

    drafts_before = server.engine.spec.totals.num_drafts
    results = asyncio.run(all_streams())
    for i, ((text, finish, usage, num_chunks), off) in enumerate(zip(results, offline)):
        assert text == off.text, f"stream {i}"
        assert finish == off.finish_reason, f"stream {i}"
        assert usage.completion_tokens == len(off.token_ids) and usage.prompt_tokens == len(off.prompt_token_ids)
    assert sum(r[3] for r in results) > 32  # really streamed, not one chunk each
    totals = server.engine.spec.totals
    assert totals.num_drafts > drafts_before and totals.num_accepted_tokens > 0  # speculation ran, and helped
    assert server.engine.pool.num_free_blocks == server.engine.pool.num_blocks


async def _read_some_then_disconnect(url: str, body: dict, num_events: int) -> list[bytes]:
    async with aiohttp.ClientSession() as s:
        async with s.post(url, json=body) as r:
            assert r.status == 200
            events = []
            while len(events) < num_events:
                line = await r.content.readline()
                if line.strip():
                    events.append(line)
            return events  # leaving the blocks closes the connection mid-stream


def record_finishes(srv) -> dict[str, str]:
    """request id -> finish_reason, for every request that finishes from now on (engine side)."""
    finishes: dict[str, str] = {}
    engine = srv.engine
    step = engine.step

    def recording_step():
        outputs = step()
        for out in outputs:
            if out.finished:
                finishes[out.request_id] = out.finish_reason
        return outputs

    engine.step = recording_step
    return finishes


@pytest.mark.parametrize("n", [1, 3])
def test_disconnect_mid_stream_frees_blocks(server, server_target, n):
    engine = server.engine
    free_before = engine.pool.num_free_blocks
    finishes = record_finishes(server)
    body = {"model": server_target.name, "prompt": "Once upon a time", "max_tokens": 200, "temperature": 0,
            "stream": True, "ignore_eos": True, "n": n}
    events = asyncio.run(_read_some_then_disconnect(server.url + "/completions", body, 3))
    assert all(e.startswith(b"data: {") for e in events)
    assert wait_until(lambda: not engine.requests and not engine.scheduler.running, timeout=10)
    assert wait_until(lambda: engine.pool.num_free_blocks == free_before, timeout=10)
    engine.pool.check_all_free()
    assert list(finishes.values()) == ["abort"] * n
    # the server goes on serving
    out = server.client().completions.create(model=server_target.name, prompt="Hi", max_tokens=3, temperature=0)
    assert out.usage.completion_tokens == 3


async def _disconnect_while_waiting(url, body, admitted) -> None:
    """Post, wait until the engine holds the request (so there is something to abort, also on a
    slow machine), then give up on the response."""
    async with aiohttp.ClientSession() as s:
        task = asyncio.create_task(s.post(url, json=body))
        for _ in range(500):
            if admitted():
                break
            await asyncio.sleep(0.01)
        task.cancel()
        try:
            await task
        except asyncio.CancelledError:
            pass


def test_disconnect_before_first_token_aborts(server, server_target):
    """A non-streaming client that gives up: the handler is cancelled and its request aborted."""
    engine = server.engine
    finishes = record_finishes(server)
    body = {"model": server_target.name, "prompt": "Once upon a time", "max_tokens": 240, "temperature": 0,
            "ignore_eos": True}
    asyncio.run(_disconnect_while_waiting(server.url + "/completions", body, lambda: bool(engine.requests)))
    assert wait_until(lambda: not engine.requests and engine.pool.num_free_blocks == engine.pool.num_blocks)
    assert list(finishes.values()) == ["abort"]


# -- multi-byte text and stop strings, on a model whose output is known -----------------------


@pytest.fixture(scope="module")
def scripted(tmp_path_factory):
    """A lookup-table model that greedily continues any token of SCRIPT with the rest of it."""
    path, ids = make_successor_checkpoint(tmp_path_factory.mktemp("scripted"))
    cfg = engine_config(path, path, spec_mode="static", spec_depth=2)  # draft = itself: all accepted
    srv = ServerThread(LLMEngine(cfg, progress=False), cfg)
    srv.model, srv.ids = path.name, ids
    yield srv
    srv.stop()


def stream_texts(srv, **kw) -> tuple[list[str], str | None]:
    texts, finish = [], None
    for chunk in srv.client().completions.create(model=srv.model, temperature=0, stream=True, **kw):
        texts.append(chunk.choices[0].text)
        finish = chunk.choices[0].finish_reason or finish
    return texts, finish


def test_emoji_and_cjk_stream_intact(scripted):
    tok = scripted.engine.tokenizer
    ids = scripted.ids
    # the script's tokens really split characters: some decode alone to a replacement char
    assert any("\ufffd" in tok.decode([t]) for t in ids)
    texts, finish = stream_texts(scripted, prompt=ids[:1], max_tokens=50)
    assert "".join(texts) == SCRIPT[len(tok.decode(ids[:1])):] and finish == "stop"
    assert all("\ufffd" not in t for t in texts), texts
    assert len(texts) > 3
    full = scripted.client().completions.create(model=scripted.model, prompt=ids[:1], max_tokens=50, temperature=0)
    assert full.choices[0].text == "".join(texts)
    chat = list(scripted.client().chat.completions.create(
        model=scripted.model, messages=[{"role": "user", "content": "Tokyo"}], max_tokens=40, temperature=0,
        stream=True))
    assert all("\ufffd" not in (c.choices[0].delta.content or "") for c in chat)


@pytest.mark.parametrize("stop", ["京🙂 do", "🙂", "o 東", "ne."])
def test_stop_string_across_chunks_is_never_emitted(scripted, stop):
    tok = scripted.engine.tokenizer
    start = tok.decode(scripted.ids[:1])
    continuation = SCRIPT[len(start):]
    texts, finish = stream_texts(scripted, prompt=scripted.ids[:1], max_tokens=50, stop=[stop])
    assert "".join(texts) == continuation[: continuation.index(stop)]
    assert finish == "stop"
    # the text ends exactly where the stop string begins: no part of it went out, in any chunk
    assert len([t for t in texts if t]) > 1
    assert len(tok.encode(stop)) > 1 or stop == "🙂"  # spans tokens (the emoji: 3 byte-level tokens)


# -- shutdown ---------------------------------------------------------------------------------


def test_drain_refuses_new_requests_and_finishes_streams(server_target):
    from specserve.server.app import STATE, drain

    cfg = engine_config(server_target, "none")
    srv = ServerThread(LLMEngine(cfg, progress=False), cfg)
    model = server_target.name
    try:
        client = srv.client()
        stream = client.completions.create(model=model, prompt="Once", max_tokens=120, temperature=0, stream=True,
                                           extra_body={"ignore_eos": True})
        it = iter(stream)
        first = next(it)
        drained = asyncio.run_coroutine_threadsafe(drain(srv.app, 60.0), srv.loop)
        assert wait_until(lambda: srv.app[STATE].draining)
        with pytest.raises(openai.APIStatusError) as e:
            client.completions.create(model=model, prompt="x", max_tokens=2)
        assert e.value.status_code == 503 and e.value.body["code"] == "shutting_down"
        with pytest.raises(urllib.error.HTTPError) as h:
            urllib.request.urlopen(srv.base + "/health")
        assert h.value.code == 503
        text = first.choices[0].text + "".join(c.choices[0].text for c in it)
        assert drained.result(30) == 0  # nothing left in flight
        offline = LLM(cfg, progress=False).generate("Once", SamplingParams(max_tokens=120, temperature=0.0,
                                                                            ignore_eos=True))[0]
        assert text == offline.text
    finally:
        srv.stop()
    assert not srv.app[STATE].async_engine.is_alive


def test_sigterm_finishes_streams_and_exits(server_target):
    """`specserve serve` under SIGTERM: the running stream completes, new requests get 503, exit 0."""
    proc, port, log = start_server_process(server_target)
    try:
        text = "".join(log)
        assert "target:" in text and "draft: none" in text and "pool: 64 blocks" in text
        url = f"http://127.0.0.1:{port}/v1"
        client = openai.OpenAI(base_url=url, api_key="x", max_retries=0)
        stream = iter(client.completions.create(model=server_target.name, prompt="Once", max_tokens=150,
                                                temperature=0, stream=True, extra_body={"ignore_eos": True}))
        chunks = [next(stream)]
        proc.send_signal(signal.SIGTERM)
        stderr_tail = []
        threading.Thread(target=lambda: stderr_tail.extend(proc.stderr), daemon=True).start()
        assert wait_until(lambda: any("shutting down" in l for l in stderr_tail), timeout=20), stderr_tail
        with pytest.raises(openai.APIStatusError) as e:
            client.completions.create(model=server_target.name, prompt="x", max_tokens=2)
        assert e.value.status_code == 503
        chunks += list(stream)
        assert chunks[-1].choices[0].finish_reason == "length"
        assert sum(1 for c in chunks for _ in c.choices) >= 2
        assert proc.wait(30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
