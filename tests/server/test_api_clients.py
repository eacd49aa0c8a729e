"""What real OpenAI-API clients see, compared with OpenAI's API and vLLM's server: stream_options
as the official client types them, the SSE content type a `requests` client decodes by, the
parameter a context error names, chat streams of n > 1, and one keep-alive connection across
streams and errors."""

from __future__ import annotations

import asyncio
import http.client
import json

import aiohttp
import openai
import pytest

MESSAGES = [{"role": "user", "content": "Tell me about the sea."}]


def model_name(srv) -> str:
    return srv.client().models.list().data[0].id


@pytest.mark.parametrize("chat", [True, False], ids=["chat", "completions"])
def test_stream_options_accept_include_obfuscation(server, chat):
    """`stream_options.include_obfuscation` is a field of OpenAI's API, typed by the official
    client (ChatCompletionStreamOptionsParam); clients send `false` to save bandwidth. It changes
    nothing here (no obfuscation padding is sent), so, as vLLM does, it must be accepted."""
    client, model = server.client(), model_name(server)
    options = {"include_usage": True, "include_obfuscation": False}
    if chat:
        stream = client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=4, temperature=0,
                                                stream=True, stream_options=options)
    else:
        stream = client.completions.create(model=model, prompt="Once upon a time", max_tokens=4, temperature=0,
                                           stream=True, stream_options=options)
    chunks = list(stream)
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 4


def test_a_misspelt_stream_option_is_still_refused(server):
    """Accepting OpenAI's fields does not mean accepting any: a typo would silently drop the usage."""
    with pytest.raises(openai.BadRequestError, match="include_usgae"):
        server.client().chat.completions.create(model=model_name(server), messages=MESSAGES, max_tokens=2,
                                                stream=True, stream_options={"include_usgae": True})


def test_stream_options_take_null_as_not_given(server):
    """Top-level nulls mean "not given" (protocol.decode_object); typed clients that serialize
    every field write `"include_usage": null` inside stream_options too, as vLLM takes it."""
    body = {"model": model_name(server), "messages": MESSAGES, "max_tokens": 3, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": None, "continuous_usage_stats": None}}

    async def go():
        async with aiohttp.ClientSession() as s:
            async with s.post(server.url + "/chat/completions", json=body) as r:
                return r.status, await r.read()

    status, raw = asyncio.run(go())
    assert status == 200, raw
    events = [e for e in raw.split(b"\n\n") if e]
    assert events[-1] == b"data: [DONE]"
    assert all("usage" not in json.loads(e[6:]) for e in events[:-1])   # null: not asked


def test_sse_content_type_says_utf8(server):
    """OpenAI and vLLM (Starlette) answer a stream `text/event-stream; charset=utf-8`. Without
    the charset, HTTP clients that follow RFC 2616 for text/* (python-requests: r.encoding,
    iter_lines(decode_unicode=True)) decode the UTF-8 JSON as ISO-8859-1: every non-ASCII
    character of the reply comes out as mojibake. The stream is not compressed even when the
    client accepts gzip (a compressed SSE stream would be buffered)."""
    body = {"model": model_name(server), "prompt": "東京🙂", "max_tokens": 2, "temperature": 0, "echo": True,
            "stream": True}

    async def go():
        async with aiohttp.ClientSession(auto_decompress=False) as s:
            async with s.post(server.url + "/completions", json=body,
                              headers={"Accept-Encoding": "gzip, deflate"}) as r:
                return r.status, r.headers.copy(), r.content_type, r.charset, await r.read()

    status, headers, content_type, charset, raw = asyncio.run(go())
    assert status == 200 and content_type == "text/event-stream"
    assert "Content-Encoding" not in headers and headers["Cache-Control"] == "no-cache"
    assert raw.startswith(b"data: {") and "東京🙂".encode() in raw
    assert charset == "utf-8", f"Content-Type: {headers['Content-Type']!r} (a requests client decodes it as latin-1)"


@pytest.mark.parametrize("stream", [False, True])
def test_a_context_error_names_max_completion_tokens_when_that_was_sent(server, stream):
    """The chat API's budget field is max_completion_tokens (the vLLM benchmark client sends
    only it). A request whose budget overflows the context must name that field, as a bad value
    of it already does (app._parse renames the engine's max_tokens), not max_tokens, which the
    client never sent."""
    client, model = server.client(), model_name(server)
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=model, messages=MESSAGES, max_completion_tokens=1000, stream=stream)
    assert e.value.body["code"] == "context_length_exceeded"
    assert e.value.body["param"] == "max_completion_tokens", e.value.body
    with pytest.raises(openai.BadRequestError) as e:   # the legacy name is named as sent
        client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=1000, stream=stream)
    assert e.value.body["param"] == "max_tokens"


def test_chat_stream_of_n_choices_gives_each_its_role_and_finish(server):
    """n = 2 in chat (the existing tests stream n > 1 only as completions): chunks of the two
    choices interleave, each choice's first chunk alone carries the role, its last alone the
    finish_reason, every chunk has the stream's one id and created, and each choice's text
    equals the non-streamed choice of the same seed."""
    client, model = server.client(), model_name(server)
    kw = dict(model=model, messages=MESSAGES, max_tokens=12, temperature=1.0, seed=11, n=2)
    full = client.chat.completions.create(**kw)
    chunks = list(client.chat.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
    *content, usage = chunks
    assert usage.choices == [] and usage.usage.completion_tokens == full.usage.completion_tokens
    assert len({c.id for c in chunks}) == 1 and len({c.created for c in chunks}) == 1
    assert all(len(c.choices) == 1 for c in content)
    for i in range(2):
        mine = [c.choices[0] for c in content if c.choices[0].index == i]
        assert [m.delta.role for m in mine] == ["assistant"] + [None] * (len(mine) - 1)
        assert [m.finish_reason for m in mine] == [None] * (len(mine) - 1) + [full.choices[i].finish_reason]
        assert "".join(m.delta.content for m in mine) == full.choices[i].message.content
    assert [c.index for c in full.choices] == [0, 1]


def test_one_keep_alive_connection_serves_streams_errors_and_json(server):
    """A client's pooled connection stays open across a stream, a JSON answer, a 400, a 404
    and another stream (curl, requests and the benchmark clients reuse it)."""
    model = model_name(server)
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
    calls = [
        ("/v1/chat/completions", {"model": model, "messages": MESSAGES, "max_tokens": 3, "stream": True}, 200),
        ("/v1/completions", {"model": model, "prompt": "Hi", "max_tokens": 2}, 200),
        ("/v1/completions", {"model": model, "prompt": "Hi", "best_of": 3}, 400),
        ("/v1/completions", {"model": "nope", "prompt": "Hi"}, 404),
        ("/v1/completions", {"model": model, "prompt": "Hi", "max_tokens": 2, "stream": True}, 200),
    ]
    try:
        conn.connect()
        local = conn.sock.getsockname()
        for path, body, want in calls:
            conn.request("POST", path, body=json.dumps(body),
                         headers={"Content-Type": "application/json", "Accept-Encoding": "gzip"})
            r = conn.getresponse()
            data = r.read()
            assert r.status == want, data
            assert not r.will_close and conn.sock is not None and conn.sock.getsockname() == local, path
            assert data.endswith(b"data: [DONE]\n\n") if body.get("stream") else json.loads(data)
    finally:
        conn.close()


def test_x_request_id_names_the_response_and_two_alike_both_run(server):
    """As vLLM: a client's X-Request-Id becomes the response's id (cmpl-<id>); two requests that
    send the same one at once both run (the engine's own ids stay unique)."""
    import concurrent.futures

    client = server.client()

    def one(_):
        return client.completions.create(model=model_name(server), prompt="Hi", max_tokens=3, temperature=0,
                                         extra_headers={"X-Request-Id": "bench-7"})

    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        outs = list(pool.map(one, range(2)))
    assert [o.id for o in outs] == ["cmpl-bench-7"] * 2 and outs[0].choices[0].text == outs[1].choices[0].text
    assert client.completions.create(model=model_name(server), prompt="Hi", max_tokens=1).id != "cmpl-bench-7"
