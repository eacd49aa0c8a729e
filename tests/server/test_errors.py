"""Every bad request gets its status and a JSON error body naming the field, and the server
keeps serving: a good request after each bad one succeeds."""

from __future__ import annotations

import json
import threading
import urllib.error
import urllib.request

import pytest

from specserve.engine import LLMEngine
from tests.server.conftest import ServerThread, engine_config, wait_until


def post(srv, path: str, body, raw: bool = False) -> tuple[int, dict, dict]:
    data = body if raw else json.dumps(body).encode()
    req = urllib.request.Request(srv.url + path, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, dict(r.headers), json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, dict(e.headers), json.loads(e.read())


def assert_error(status, body, want_status, param=None, contains=()):
    assert status == want_status, body
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["param"] == param, err
    for s in contains:
        assert s in err["message"], err["message"]


@pytest.fixture(scope="module")
def srv(server_target):
    cfg = engine_config(server_target, "ngram", max_waiting_requests=1, max_num_seqs=1)
    s = ServerThread(LLMEngine(cfg, progress=False), cfg)
    s.model = server_target.name
    yield s
    s.stop()


def good(srv):
    status, _, body = post(srv, "/completions", {"model": srv.model, "prompt": "The dog", "max_tokens": 4,
                                                 "temperature": 0})
    assert status == 200 and body["usage"]["completion_tokens"] == 4, body


CHAT = [{"role": "user", "content": "hi"}]

CASES = [
    # (path, body, status, param, message fragments)
    ("/completions", {"prompt": "x", "temperature": -1}, 400, "temperature", ["temperature", "[0, 100]"]),
    ("/completions", {"prompt": "x", "temperature": "hot"}, 400, "temperature", ["'hot'"]),
    ("/completions", {"prompt": "x", "top_p": 0}, 400, "top_p", ["(0, 1]"]),
    ("/completions", {"prompt": "x", "top_k": -2}, 400, "top_k", ["top_k"]),
    ("/completions", {"prompt": "x", "max_tokens": 0}, 400, "max_tokens", ["[1, 1048576]", "got 0"]),
    ("/chat/completions", {"messages": CHAT, "max_completion_tokens": "5"}, 400, "max_completion_tokens",
     ["max_completion_tokens"]),
    ("/completions", {"prompt": "x", "n": 0}, 400, "n", ["[1, 64]"]),
    ("/completions", {"prompt": "x", "seed": 1.5}, 400, "seed", ["seed"]),
    ("/completions", {"prompt": "x", "stop": [""]}, 400, "stop", ["non-empty"]),
    ("/completions", {"prompt": "x", "stream": "yes"}, 400, "stream", ["true or false"]),
    ("/completions", {"prompt": "x", "ignore_eos": 1}, 400, "ignore_eos", ["true or false"]),
    ("/completions", {"prompt": {"a": 1}}, 400, "prompt", ["prompt must be"]),
    ("/completions", {"prompt": [1, 2, 100000]}, 400, "prompt", ["[0, 400)"]),
    ("/completions", {"prompt": ""}, 400, "prompt", ["empty"]),
    ("/chat/completions", {"messages": []}, 400, "messages", ["non-empty"]),
    ("/chat/completions", {"messages": [{"role": "user", "content": 5}]}, 400, "messages[0].content", ["got 5"]),
    ("/completions", {"prompt": "x", "top_k": 2**70}, 400, "top_k", ["top_k"]),
    ("/completions", {"prompt": "x", "stop_token_ids": [2**65]}, 400, "stop_token_ids", ["token ids"]),
    ("/completions", {"prompt": "x", "presence_penalty": 2.5}, 400, "presence_penalty", ["[-2, 2]", "got 2.5"]),
    ("/completions", {"prompt": "x", "repetition_penalty": 0}, 400, "repetition_penalty", ["(0, 10]"]),
    ("/completions", {"prompt": "x", "logit_bias": {"7": 101}}, 400, "logit_bias", ["[-100, 100]"]),
    ("/completions", {"prompt": "x", "logit_bias": {"the": 1}}, 400, "logit_bias", ["not a token id"]),
    ("/completions", {"prompt": "x", "logit_bias": {"100000": 1}}, 400, "logit_bias", ["outside the vocabulary"]),
    ("/chat/completions", {"messages": CHAT, "response_format": {"type": "json_object"}}, 400, "response_format",
     ["not implemented"]),
    ("/completions", {"prompt": "x", "suffix": "y"}, 400, "suffix", ["not implemented"]),
    ("/chat/completions", {"messages": CHAT, "tools": [{"type": "function"}]}, 400, "tools", ["not implemented"]),
    ("/completions", {"prompt": ["a", "b", "c"], "n": 30}, 400, "n", ["at most 64"]),
    ("/chat/completions", {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
     400, "messages[0].content", ["text part"]),
    ("/chat/completions", {"messages": CHAT, "continue_final_message": True}, 400, "continue_final_message",
     ["add_generation_prompt: false"]),
    ("/chat/completions", {"messages": CHAT, "chat_template_kwargs": {"tokenize": True}}, 400,
     "chat_template_kwargs", ["'tokenize'"]),
    ("/chat/completions", {"messages": CHAT, "chat_template_kwargs": [1]}, 400, "chat_template_kwargs",
     ["variables for the chat template"]),
    ("/chat/completions", {"messages": CHAT, "chat_template": "{{ 1 }}"}, 400, "chat_template",
     ["not implemented"]),
    ("/completions", {"prompt": "x", "model": "gpt-9"}, 404, "model", ["gpt-9", "does not exist"]),
    # context: 256 tokens
    ("/completions", {"prompt": list(range(3, 303))}, 400, "prompt", ["maximum context length is 256"]),
    ("/completions", {"prompt": "x", "max_tokens": 1000}, 400, "max_tokens", ["maximum context length is 256"]),
    ("/chat/completions", {"messages": [{"role": "user", "content": "word " * 300}]}, 400, "messages",
     ["maximum context length is 256"]),
]


@pytest.mark.parametrize("path,body,status,param,contains", CASES, ids=[f"{c[3]}-{i}" for i, c in enumerate(CASES)])
def test_bad_request_then_good(srv, path, body, status, param, contains):
    body = {"model": srv.model, **body} if "model" not in body else body
    got_status, _, got = post(srv, path, body)
    assert_error(got_status, got, status, param, contains)
    good(srv)


@pytest.mark.parametrize("raw", [b"{not json", b"[1, 2]", b"\xff\xfe", b'{"prompt": "\\ud800"}',
                                 b"[" * 100000 + b"]" * 100000])
def test_invalid_json_body(srv, raw):
    status, _, body = post(srv, "/completions", raw, raw=True)
    assert status == 400 and body["error"]["type"] == "invalid_request_error", body
    good(srv)


def test_unknown_route_is_a_json_404(srv):
    status, _, body = post(srv, "/embeddings", {"input": "x"})
    assert status == 404 and "error" in body


def test_a_wrong_method_is_a_json_405_that_says_the_allowed_one(srv):
    import urllib.error
    import urllib.request

    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(srv.url + "/completions", timeout=30)   # a GET
    assert e.value.code == 405 and e.value.headers["Allow"] == "POST"
    assert json.loads(e.value.read())["error"]["code"] == "405"


def test_queue_full_is_429_with_retry_after(srv):
    """max_num_seqs = 1, max_waiting_requests = 1: one running, one waiting, the third is refused."""
    import openai

    client = openai.OpenAI(base_url=srv.url, api_key="x", max_retries=0)
    first = client.completions.create(model=srv.model, prompt="a", max_tokens=200, temperature=0, stream=True,
                                      extra_body={"ignore_eos": True})
    next(iter(first))  # the first request is running
    results = {}

    def second():
        results["second"] = client.completions.create(model=srv.model, prompt="b", max_tokens=8, temperature=0)

    t = threading.Thread(target=second)
    t.start()
    assert wait_until(lambda: len(srv.engine.scheduler.waiting) == 1)
    status, headers, body = post(srv, "/completions", {"model": srv.model, "prompt": "c", "max_tokens": 4})
    assert_error(status, body, 429, None, ["waiting"])
    assert body["error"]["type"] == "rate_limit_error" and headers["Retry-After"] == "1"
    first.close()  # the running request is aborted; the waiting one runs
    t.join(60)
    assert results["second"].usage.completion_tokens == 8
    good(srv)


@pytest.mark.parametrize("field,value", [
    ("tools", [{"type": "function", "function": {"name": "f"}}]), ("tool_choice", "auto"),
    ("response_format", {"type": "json_object"}), ("modalities", ["text", "audio"]), ("min_p", 0.1),
    ("bad_words", ["x"]), ("use_beam_search", True), ("guided_json", {"type": "object"}), ("echo", True),
    ("prompt_logprobs", 1), ("spaces_between_special_tokens", False),
    ("return_tokens_as_token_ids", True), ("length_penalty", 0.5),
])
def test_fields_that_would_change_the_output_are_refused_by_name(srv, field, value):
    status, _, body = post(srv, "/chat/completions", {"model": srv.model, "messages": CHAT, field: value})
    assert_error(status, body, 400, field, ["not implemented"])


@pytest.mark.parametrize("field,value", [("tools", []), ("tool_choice", "none"), ("response_format", {"type": "text"}),
                                         ("min_p", 0), ("user", "me"), ("metadata", {"a": "b"}), ("store", False),
                                         ("parallel_tool_calls", True), ("echo", False),
                                         ("skip_special_tokens", False), ("add_special_tokens", True),
                                         ("prediction", {"type": "content", "content": "hi"})])
def test_neutral_and_unknown_fields_are_accepted(srv, field, value):
    status, _, body = post(srv, "/chat/completions", {"model": srv.model, "messages": CHAT, field: value,
                                                      "max_tokens": 2})
    assert status == 200, body
