"""Logprobs and penalties over HTTP equal the engine's (tests/engine/test_logprobs.py and
test_penalties.py hold those to transformers'): chat with the official client's
logprobs=True, top_logprobs=3, completions with logprobs=k, echo with the prompt's logprobs,
streaming and not; presence, frequency and repetition penalties, logit_bias, min_tokens and
stop_token_ids; the draft speculating throughout."""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import pytest

from specserve.llm import LLM
from specserve.sampling import SamplingParams
from tests.server.conftest import engine_config
from tests.server.test_openai_api import model_name

PROMPT = "Once upon a time"


def post(server, path: str, body: dict) -> tuple[int, str]:
    req = urllib.request.Request(server.url + path, data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


@pytest.fixture(scope="module")
def offline(server_target, server_draft):
    return LLM(engine_config(server_target, server_draft, spec_mode="static", spec_depth=3), progress=False)


def test_chat_logprobs_with_the_official_client(server):
    client, model = server.client(), model_name(server)
    messages = [{"role": "user", "content": "Tell me a story."}]
    full = client.chat.completions.create(model=model, messages=messages, max_tokens=16, temperature=0,
                                          logprobs=True, top_logprobs=3)
    content = full.choices[0].logprobs.content
    assert len(content) == full.usage.completion_tokens
    assert b"".join(bytes(t.bytes) for t in content).decode("utf-8", "replace") == full.choices[0].message.content
    for t in content:
        assert len(t.top_logprobs) == 3
        values = [a.logprob for a in t.top_logprobs]
        assert values == sorted(values, reverse=True)
        assert t.top_logprobs[0].token == t.token and t.top_logprobs[0].logprob == t.logprob   # greedy
    stream = list(client.chat.completions.create(model=model, messages=messages, max_tokens=16, temperature=0,
                                                 logprobs=True, top_logprobs=3, stream=True))
    streamed = [t for c in stream if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.content]
    assert [(t.token, t.logprob) for t in streamed] == [(t.token, t.logprob) for t in content]
    plain = client.chat.completions.create(model=model, messages=messages, max_tokens=4, temperature=0)
    assert plain.choices[0].logprobs is None


def test_completion_logprobs_equal_the_engine(server, offline):
    client, model = server.client(), model_name(server)
    ref = offline.generate(PROMPT, SamplingParams(max_tokens=20, temperature=0.0, logprobs=2))[0]
    full = client.completions.create(model=model, prompt=PROMPT, max_tokens=20, temperature=0, logprobs=2)
    lp = full.choices[0].logprobs
    assert full.choices[0].text == ref.text
    assert len(lp.token_logprobs) == len(ref.token_ids)
    assert lp.token_logprobs == pytest.approx([e[0] for e in ref.logprobs], abs=1e-4)
    assert lp.text_offset == [len(server.engine.tokenizer.decode(ref.token_ids[:i])) for i in range(len(lp.tokens))]
    for token, top, value in zip(lp.tokens, lp.top_logprobs, lp.token_logprobs):
        assert top[token] == value and 2 <= len(top) <= 3   # the chosen token is always listed
    stream = list(client.completions.create(model=model, prompt=PROMPT, max_tokens=20, temperature=0, logprobs=2,
                                            stream=True))
    tokens = [t for c in stream if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.tokens]
    offsets = [o for c in stream if c.choices and c.choices[0].logprobs for o in c.choices[0].logprobs.text_offset]
    assert tokens == lp.tokens and offsets == lp.text_offset


@pytest.mark.parametrize("stream", [False, True])
def test_echo_returns_the_prompt_and_its_logprobs(server, offline, stream):
    ids = server.engine.tokenizer.encode(PROMPT)
    ref = offline.generate(ids, SamplingParams(max_tokens=0, prompt_logprobs=1))[0]
    body = {"prompt": PROMPT, "max_tokens": 0, "echo": True, "logprobs": 1, "stream": stream}
    status, text = post(server, "/completions", body)
    assert status == 200, text
    if stream:
        chunks = [json.loads(line[6:]) for line in text.split("\n\n") if line.startswith("data: {")]
        choice = chunks[0]["choices"][0]
        assert "".join(c["choices"][0]["text"] for c in chunks if c["choices"]) == PROMPT
    else:
        choice = json.loads(text)["choices"][0]
        assert choice["text"] == PROMPT and json.loads(text)["usage"]["completion_tokens"] == 0
    lp = choice["logprobs"]
    assert len(lp["tokens"]) == len(ids) and lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    assert lp["token_logprobs"][1:] == pytest.approx([e[0] for e in ref.prompt_logprobs[1:]], abs=1e-4)
    generated = json.loads(post(server, "/completions", {"prompt": PROMPT, "max_tokens": 5, "echo": True,
                                                         "temperature": 0})[1])["choices"][0]
    assert generated["text"].startswith(PROMPT) and len(generated["text"]) > len(PROMPT)
    assert generated["logprobs"] is None


@pytest.mark.parametrize("path,body,param", [
    ("/chat/completions", {"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, "top_logprobs"),
    ("/chat/completions", {"messages": [{"role": "user", "content": "x"}], "logprobs": True, "top_logprobs": 21},
     "top_logprobs"),
    ("/chat/completions", {"messages": [{"role": "user", "content": "x"}], "logprobs": 3}, "logprobs"),
    ("/completions", {"prompt": "x", "logprobs": 21}, "logprobs"),
    ("/completions", {"prompt": "x", "max_tokens": 0}, "max_tokens"),
])
def test_logprob_fields_out_of_range_name_themselves(server, path, body, param):
    status, text = post(server, path, body)
    assert status == 400 and json.loads(text)["error"]["param"] == param, text


def test_penalties_and_logit_bias_over_http_equal_the_engine(server, offline):
    """The sampling fields reach the engine: each output equals LLM.generate with the same
    settings (greedy, the draft speculating), and a +100 bias makes one token the only output."""
    client, model = server.client(), model_name(server)
    token = server.engine.tokenizer.encode(" the")[-1]
    for kw in (dict(presence_penalty=1.5), dict(frequency_penalty=-1.0), dict(repetition_penalty=1.5),
               dict(logit_bias={token: 100.0}), dict(min_tokens=8, stop_token_ids=[token])):
        body = {k: ({str(t): b for t, b in v.items()} if k == "logit_bias" else v) for k, v in kw.items()}
        got = client.completions.create(model=model, prompt=PROMPT, max_tokens=12, temperature=0, extra_body=body)
        ref = offline.generate(PROMPT, SamplingParams(max_tokens=12, temperature=0.0, **kw))[0]
        assert got.choices[0].text == ref.text, kw
    biased = offline.generate(PROMPT, SamplingParams(max_tokens=6, temperature=0.0, logit_bias={token: 100.0}))[0]
    assert biased.token_ids == [token] * 6


def test_the_provenance_extension_is_opt_in_and_adds_up(server):
    """With "provenance": true each chunk's pieces cover its tokens, and the accepted draft
    tokens among them are the ones the engine counted; without it no chunk mentions it."""
    messages = [{"role": "user", "content": "Tell me a story."}]
    before = server.engine.spec.totals.num_accepted_tokens
    status, text = post(server, "/chat/completions", {"messages": messages, "max_tokens": 40, "temperature": 0,
                                                      "stream": True, "provenance": True,
                                                      "stream_options": {"include_usage": True}})
    assert status == 200
    chunks = [json.loads(line[6:]) for line in text.split("\n\n") if line.startswith("data: {")]
    pieces = [p for c in chunks if c["choices"] for p in c["choices"][0]["provenance"]]
    assert sum(n for _, _, n in pieces) == chunks[-1]["usage"]["completion_tokens"] == 40
    drafted = sum(n for _, is_draft, n in pieces if is_draft)
    assert 0 < drafted == server.engine.spec.totals.num_accepted_tokens - before
    _, plain = post(server, "/chat/completions", {"messages": messages, "max_tokens": 8, "stream": True})
    assert "provenance" not in plain


def test_the_models_generation_config_sets_the_sampling_defaults(server_target, server_draft, tmp_path):
    """A model whose generation_config.json says temperature 0 (and top_k 5): a request that
    leaves temperature out is greedy, one that sends it samples, as vLLM applies the model's
    defaults."""
    import shutil

    from specserve.engine import LLMEngine
    from tests.server.conftest import ServerThread

    target = shutil.copytree(server_target, tmp_path / "target")
    file = target / "generation_config.json"
    config = json.loads(file.read_text()) if file.is_file() else {}
    file.write_text(json.dumps({**config, "temperature": 0.0, "top_k": 5}))
    cfg = engine_config(target, server_draft, spec_mode="static", spec_depth=3)
    greedy = LLM(cfg, progress=False).generate(PROMPT, SamplingParams(max_tokens=12, temperature=0.0,
                                                                     ignore_eos=True))[0].text
    srv = ServerThread(LLMEngine(cfg, progress=False), cfg)
    try:
        body = {"prompt": PROMPT, "max_tokens": 12, "ignore_eos": True}
        texts = [json.loads(post(srv, "/completions", body)[1])["choices"][0]["text"] for _ in range(2)]
        assert texts == [greedy, greedy]
        sampled = {json.loads(post(srv, "/completions", {**body, "temperature": 5.0, "top_k": -1, "seed": s})[1])
                   ["choices"][0]["text"] for s in range(4)}
        assert len(sampled) > 1
    finally:
        srv.stop()
