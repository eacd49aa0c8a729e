"""The server driven by the official openai client, plus the raw SSE bytes of one stream."""

from __future__ import annotations

import asyncio
import json
import urllib.error
import urllib.request

import aiohttp
import openai
import pytest

from specserve.sampling import SamplingParams
from tests.server.conftest import MAX_MODEL_LEN

MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Tell me about the sea."}]


def rendered_ids(srv, messages) -> list[int]:
    tok = srv.engine.tokenizer
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return tok.encode(text, add_special_tokens=False)


def model_name(srv) -> str:
    return srv.client().models.list().data[0].id


def test_models_lists_the_target(server, server_target):
    models = server.client().models.list().data
    assert [m.id for m in models] == [server_target.name]
    assert models[0].owned_by == "specserve"
    assert models[0].model_extra["root"] == str(server_target)


def test_a_model_is_retrieved_by_name(server, server_target):
    client = server.client()
    model = client.models.retrieve(server_target.name)
    assert model.id == server_target.name and model.owned_by == "specserve"
    with pytest.raises(openai.NotFoundError) as e:
        client.models.retrieve("org/other-model")
    assert "'org/other-model' does not exist" in str(e.value) and e.value.body["code"] == "model_not_found"


def test_the_targets_path_names_the_model_too(server, server_target, monkeypatch):
    """vLLM names a model by the path it was started with, and its benchmark client sends that:
    the target's path (absolute, or relative to the working directory) is the model too."""
    client = server.client()
    assert client.models.retrieve(str(server_target)).id == server_target.name
    monkeypatch.chdir(server_target.parent)
    out = client.completions.create(model=server_target.name + "/", prompt="Hi", max_tokens=2)
    assert out.model == server_target.name
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model=str(server_target.parent), prompt="Hi", max_tokens=2)


def test_an_echo_alone_has_logprobs_only_when_asked(server, server_target):
    client = server.client()
    for stream in (False, True):
        kw = dict(model=server_target.name, prompt="Hello there", max_tokens=0, echo=True, stream=stream)
        plain, asked = (client.completions.create(**kw), client.completions.create(**kw, logprobs=1))
        if stream:
            plain, asked = list(plain)[0], list(asked)[0]
        assert plain.choices[0].text == "Hello there" and plain.choices[0].logprobs is None
        assert asked.choices[0].logprobs.tokens and asked.choices[0].logprobs.token_logprobs[0] is None


def test_health(server):
    with urllib.request.urlopen(server.base + "/health") as r:
        assert r.status == 200


def test_chat_stream_equals_non_stream(server):
    client, model = server.client(), model_name(server)
    full = client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=40, temperature=0)
    chunks = list(client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=40, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    content = [c for c in chunks if c.choices]
    assert content[0].choices[0].delta.role == "assistant"
    assert all(c.choices[0].delta.role is None for c in content[1:])
    assert "".join(c.choices[0].delta.content for c in content) == full.choices[0].message.content
    assert [c.choices[0].finish_reason for c in content] == [None] * (len(content) - 1) + ["length"]
    assert full.choices[0].finish_reason == "length"
    prompt_tokens = len(rendered_ids(server, MESSAGES))
    for usage in (full.usage, chunks[-1].usage):
        assert (usage.prompt_tokens, usage.completion_tokens, usage.total_tokens) == (
            prompt_tokens, 40, prompt_tokens + 40)
    assert chunks[-1].choices == []
    assert len({c.id for c in chunks}) == 1


def test_chat_content_as_text_parts(server):
    client, model = server.client(), model_name(server)
    """Text parts render as their texts joined by newlines (vLLM's rendering)."""
    parts = [{"role": "user", "content": [{"type": "text", "text": "Tell me"}, {"type": "text", "text": "a story."}]}]
    plain = [{"role": "user", "content": "Tell me\na story."}]
    a = client.chat.completions.create(model=model, messages=parts, max_tokens=12, temperature=0)
    b = client.chat.completions.create(model=model, messages=plain, max_tokens=12, temperature=0)
    assert a.choices[0].message.content == b.choices[0].message.content
    assert a.usage.prompt_tokens == b.usage.prompt_tokens == len(rendered_ids(server, plain))


def test_chat_template_switches_render_as_the_template_says(server):
    """continue_final_message renders the last (assistant) message open and the reply continues
    it; chat_template_kwargs reach the template as its variables. Each reply equals the
    completion of its rendered prompt."""
    client, model, tok = server.client(), model_name(server), server.engine.tokenizer
    opened = MESSAGES + [{"role": "assistant", "content": "The sea is"}]
    cases = [({"continue_final_message": True, "add_generation_prompt": False}, opened),
             ({"chat_template_kwargs": {"brief": True}}, MESSAGES)]
    for extra, messages in cases:
        text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=not extra.get(
            "continue_final_message", False), continue_final_message=extra.get("continue_final_message", False),
            **extra.get("chat_template_kwargs", {}))
        assert text.endswith("<|assistant|>The sea is" if messages is opened else "<|assistant|>In short:")
        ids = tok.encode(text, add_special_tokens=False)
        chat = client.chat.completions.create(model=model, messages=messages, max_tokens=12, temperature=0,
                                              extra_body=extra)
        plain = client.completions.create(model=model, prompt=ids, max_tokens=12, temperature=0)
        assert chat.usage.prompt_tokens == len(ids)
        assert chat.choices[0].message.content == plain.choices[0].text


def test_completion_matches_offline_engine(server, server_target, server_draft):
    """Non-streaming and streaming completions both equal LLM.generate on the same pair."""
    from specserve.llm import LLM
    from tests.server.conftest import engine_config

    prompt = "Once upon a time"
    client, model = server.client(), model_name(server)
    full = client.completions.create(model=model, prompt=prompt, max_tokens=30, temperature=0)
    stream = list(client.completions.create(model=model, prompt=prompt, max_tokens=30, temperature=0, stream=True))
    offline = LLM(engine_config(server_target, server_draft), progress=False).generate(
        prompt, SamplingParams(max_tokens=30, temperature=0.0))[0]
    assert full.choices[0].text == offline.text
    assert "".join(c.choices[0].text for c in stream) == offline.text
    assert stream[-1].choices[0].finish_reason == full.choices[0].finish_reason == offline.finish_reason
    assert all(c.object == "text_completion" for c in stream)
    assert full.usage.prompt_tokens == len(server.engine.tokenizer.encode(prompt))
    assert full.usage.completion_tokens == len(offline.token_ids)


def test_completion_prompt_as_token_ids_and_batch(server):
    client, model = server.client(), model_name(server)
    ids = server.engine.tokenizer.encode("The quick brown fox")
    by_text = client.completions.create(model=model, prompt="The quick brown fox", max_tokens=10, temperature=0)
    by_ids = client.completions.create(model=model, prompt=ids, max_tokens=10, temperature=0)
    assert by_ids.choices[0].text == by_text.choices[0].text
    assert by_ids.usage.prompt_tokens == len(ids)
    batch = client.completions.create(model=model, prompt=["The quick brown fox", "def f"], max_tokens=10,
                                      temperature=0)
    assert [c.index for c in batch.choices] == [0, 1]
    assert batch.choices[0].text == by_text.choices[0].text
    assert batch.usage.prompt_tokens == len(ids) + len(server.engine.tokenizer.encode("def f"))


def test_n_choices_with_seed(server):
    """n > 1: choices 0..n-1, choice i sampled with seed + i (so it equals a single request with that seed)."""
    client, model = server.client(), model_name(server)
    kw = dict(model=model, prompt="Hello! How are", max_tokens=16, temperature=5.0)
    three = client.completions.create(n=3, seed=7, extra_body={"top_k": 50, "ignore_eos": True}, **kw)
    assert [c.index for c in three.choices] == [0, 1, 2]
    singles = [client.completions.create(n=1, seed=7 + i, extra_body={"top_k": 50, "ignore_eos": True}, **kw).choices[0].text
               for i in range(3)]
    assert [c.text for c in three.choices] == singles
    assert len(set(singles)) > 1, "seeds 7, 8, 9 at temperature 5 should not all sample the same text"
    assert three.usage.completion_tokens == 3 * 16
    # The same stream: every choice's chunks, concatenated, equal its non-streaming text.
    texts = {0: "", 1: "", 2: ""}
    finished = set()
    for chunk in client.completions.create(n=3, seed=7, stream=True, extra_body={"top_k": 50, "ignore_eos": True}, **kw):
        for c in chunk.choices:
            texts[c.index] += c.text
            if c.finish_reason:
                finished.add(c.index)
    assert [texts[i] for i in range(3)] == singles and finished == {0, 1, 2}


def test_max_tokens_defaults_to_16_for_completions_and_the_room_left_for_chat(server):
    """As OpenAI and vLLM: a completion without max_tokens gets 16 tokens, a chat the room left."""
    client, model = server.client(), model_name(server)
    ids = server.engine.tokenizer.encode("The dog sleeps")
    out = client.completions.create(model=model, prompt=ids, temperature=0, extra_body={"ignore_eos": True})
    assert out.usage.completion_tokens == 16 and out.choices[0].finish_reason == "length"
    chat = client.chat.completions.create(model=model, messages=MESSAGES, temperature=0, extra_body={"ignore_eos": True})
    assert chat.usage.completion_tokens == MAX_MODEL_LEN - chat.usage.prompt_tokens
    assert chat.choices[0].finish_reason == "length"
    # max_completion_tokens is the chat API's name for it
    chat = client.chat.completions.create(model=model, messages=MESSAGES, max_completion_tokens=5, temperature=0)
    assert chat.usage.completion_tokens == 5


def test_unknown_fields_are_ignored(server):
    client, model = server.client(), model_name(server)
    out = client.completions.create(model=model, prompt="Hi", max_tokens=3, temperature=0,
                                    extra_body={"frobnicate": {"x": 1}, "logit_bias_v2": None})
    assert out.usage.completion_tokens == 3


async def _raw_stream(url: str, body: dict) -> tuple[int, dict, bytes]:
    async with aiohttp.ClientSession() as s:
        async with s.post(url, json=body) as r:
            return r.status, dict(r.headers), await r.read()


def test_raw_sse_framing(server):
    """Byte for byte: every event is `data: <compact json>\\n\\n`, nothing else on the wire."""
    body = {"model": model_name(server), "messages": MESSAGES, "max_tokens": 12, "temperature": 0,
            "stream": True, "stream_options": {"include_usage": True}}
    status, headers, raw = asyncio.run(_raw_stream(server.url + "/chat/completions", body))
    assert status == 200 and headers["Content-Type"].startswith("text/event-stream")
    assert raw.endswith(b"data: [DONE]\n\n")
    events = raw.split(b"\n\n")
    assert events[-1] == b"" and events[-2] == b"data: [DONE]"
    chunks = []
    for ev in events[:-2]:
        assert ev.startswith(b"data: ") and b"\n" not in ev, ev
        payload = ev[len(b"data: "):]
        obj = json.loads(payload)
        # compact: exactly what json.dumps writes with no spaces after separators
        assert payload == json.dumps(obj, separators=(",", ":"), ensure_ascii=False).encode(), payload
        chunks.append(obj)
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    first, *middle, last_content, usage = chunks
    assert first["choices"][0]["delta"]["role"] == "assistant" and first["choices"][0]["finish_reason"] is None
    assert all("role" not in c["choices"][0]["delta"] and c["choices"][0]["finish_reason"] is None for c in middle)
    assert last_content["choices"][0]["finish_reason"] == "length"
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 12
    text = "".join(c["choices"][0]["delta"]["content"] for c in chunks[:-1])
    full = server.client().chat.completions.create(model=body["model"], messages=MESSAGES, max_tokens=12,
                                                   temperature=0)
    assert text == full.choices[0].message.content


def test_continuous_usage_stats_put_each_choices_usage_so_far_in_every_chunk(server):
    body = {"model": model_name(server), "prompt": ["Hi", "Once upon a time"], "max_tokens": 6, "temperature": 0,
            "stream": True, "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    status, _, raw = asyncio.run(_raw_stream(server.url + "/completions", body))
    assert status == 200, raw
    chunks = [json.loads(e[len(b"data: "):]) for e in raw.split(b"\n\n")[:-2]]
    *content, final = chunks
    tokens = {0: 0, 1: 0}
    for c in content:
        i, u = c["choices"][0]["index"], c["usage"]
        assert u["completion_tokens"] >= tokens[i] and u["total_tokens"] == u["prompt_tokens"] + u["completion_tokens"]
        tokens[i] = u["completion_tokens"]
        if c["choices"][0]["finish_reason"]:
            assert u["completion_tokens"] == 6
    prompts = {c["choices"][0]["index"]: c["usage"]["prompt_tokens"] for c in content}
    assert final["choices"] == [] and final["usage"] == {
        "prompt_tokens": sum(prompts.values()), "completion_tokens": 12, "total_tokens": sum(prompts.values()) + 12}
    assert prompts[0] < prompts[1]


def test_stream_without_usage_has_no_usage_chunk(server):
    body = {"model": model_name(server), "prompt": "Hi", "max_tokens": 4, "temperature": 0, "stream": True}
    status, _, raw = asyncio.run(_raw_stream(server.url + "/completions", body))
    events = [e for e in raw.split(b"\n\n") if e]
    assert status == 200 and events[-1] == b"data: [DONE]"
    objs = [json.loads(e[6:]) for e in events[:-1]]
    assert all(o["choices"] and "usage" not in o for o in objs)
    assert objs[-1]["choices"][0]["finish_reason"] == "length"


def _scrape(srv) -> dict[str, float]:
    with urllib.request.urlopen(srv.base + "/metrics") as r:
        text = r.read().decode()
    values = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            values[name] = float(value)
    return values


def test_metrics_move_after_a_request(server):
    names = ["specserve_time_to_first_token_seconds_count", "specserve_inter_token_latency_seconds_count",
             "specserve_e2e_request_latency_seconds_count", "specserve_num_requests_running",
             "specserve_num_requests_waiting", "specserve_kv_cache_usage_perc", "specserve_prompt_tokens_total",
             "specserve_generation_tokens_total", "specserve_spec_num_drafts_total",
             "specserve_spec_num_draft_tokens_total", "specserve_spec_num_accepted_tokens_total",
             "specserve_spec_mean_tokens_per_pass", "specserve_spec_depth"]
    before = _scrape(server)
    assert set(names) <= set(before), set(names) - set(before)
    out = server.client().completions.create(model=model_name(server), prompt="The quick brown", max_tokens=20,
                                             temperature=0)
    after = _scrape(server)
    assert after["specserve_prompt_tokens_total"] - before["specserve_prompt_tokens_total"] == out.usage.prompt_tokens
    assert after["specserve_generation_tokens_total"] - before["specserve_generation_tokens_total"] == 20
    for name in ("specserve_time_to_first_token_seconds_count", "specserve_e2e_request_latency_seconds_count"):
        assert after[name] == before[name] + 1
    # every token after the first output's is observed once; the first output holds 1 token
    # plus what the first verify pass accepted (at most the depth, 3)
    itl = after["specserve_inter_token_latency_seconds_count"] - before["specserve_inter_token_latency_seconds_count"]
    assert 20 - 4 <= itl <= 19
    totals = server.engine.spec.totals
    assert after["specserve_spec_num_drafts_total"] == totals.num_drafts > before["specserve_spec_num_drafts_total"]
    assert after["specserve_spec_num_draft_tokens_total"] == totals.num_draft_tokens
    assert after["specserve_spec_num_accepted_tokens_total"] == totals.num_accepted_tokens
    assert after["specserve_spec_depth"] == 3  # static depth 3
    per_position = [after.get(f'specserve_spec_accepted_per_position_total{{position="{k}"}}', 0.0)
                    for k in range(1, 4)]
    assert sum(per_position) == totals.num_accepted_tokens
    assert after["specserve_num_requests_running"] == 0 and after["specserve_kv_cache_usage_perc"] == 0



def test_add_special_tokens_defaults_by_route_and_can_be_set(server_target):
    """A text prompt is encoded with the tokenizer's special tokens on /v1/completions and
    without them in chat (the template writes them), unless add_special_tokens says otherwise."""
    from tokenizers.processors import TemplateProcessing
    from transformers import AutoTokenizer

    from specserve.server import protocol
    from specserve.server.app import _tokenize
    from tests.checkpoints import BOS

    tok = AutoTokenizer.from_pretrained(str(server_target))    # made to add BOS, as Llama's does
    bos = tok.convert_tokens_to_ids(BOS)
    tok.backend_tokenizer.post_processor = TemplateProcessing(single=f"{BOS} $A", special_tokens=[(BOS, bos)])

    def ids(chat: bool, **extra) -> list[int]:
        body = {"messages": [{"role": "user", "content": "hi"}]} if chat else {"prompt": "hi"}
        return _tokenize(tok, protocol.parse(json.dumps({**body, **extra}).encode(), chat), chat, MAX_MODEL_LEN)[0]

    assert ids(False)[0] == bos and ids(False, add_special_tokens=False)[0] != bos
    assert ids(False)[1:] == ids(False, add_special_tokens=False)
    assert ids(True).count(bos) == 1 and ids(True, add_special_tokens=True)[:2] == [bos, bos]


def test_an_api_key_guards_the_api_routes_and_only_those(server_target):
    from specserve.engine import LLMEngine
    from tests.server.conftest import ServerThread, engine_config

    cfg = engine_config(server_target, "none", api_key="s3cret")
    srv = ServerThread(LLMEngine(cfg, progress=False), cfg)
    try:
        for key in (None, "wrong"):
            req = urllib.request.Request(srv.url + "/models", headers={"Authorization": f"Bearer {key}"} if key else {})
            with pytest.raises(urllib.error.HTTPError) as e:
                urllib.request.urlopen(req)
            body = json.loads(e.value.read())
            assert e.value.code == 401 and e.value.headers["WWW-Authenticate"] == "Bearer"
            assert body["error"]["code"] == "invalid_api_key"
            assert ("needs an API key" if key is None else "not this server's") in body["error"]["message"]
        with pytest.raises(openai.AuthenticationError):
            srv.client().completions.create(model=server_target.name, prompt="Hi", max_tokens=2)
        client = openai.OpenAI(base_url=srv.url, api_key="s3cret", max_retries=0)
        assert client.completions.create(model=server_target.name, prompt="Hi", max_tokens=2).usage.completion_tokens == 2
        for path in ("/health", "/metrics", "/", "/stats"):   # open: probes, scrapers, the page
            with urllib.request.urlopen(srv.base + path) as r:
                assert r.status == 200
        srv.engine.pool.check_all_free()
    finally:
        srv.stop()


def test_cors_answers_allowed_origins_only(server_target, server):
    from specserve.engine import LLMEngine
    from tests.server.conftest import ServerThread, engine_config

    def call(srv, method, path, headers, body=None):
        req = urllib.request.Request(srv.base + path, method=method, headers=headers,
                                     data=json.dumps(body).encode() if body else None)
        try:
            with urllib.request.urlopen(req) as r:
                return r.status, r.headers, r.read()
        except urllib.error.HTTPError as e:
            return e.code, e.headers, e.read()

    preflight = {"Origin": "http://app.example", "Access-Control-Request-Method": "POST",
                 "Access-Control-Request-Headers": "authorization, content-type"}
    status, headers, _ = call(server, "OPTIONS", "/v1/completions", preflight)   # none allowed by default
    assert status == 405 and "Access-Control-Allow-Origin" not in headers
    cfg = engine_config(server_target, "none", api_key="s3cret", allowed_origins=["http://app.example"])
    srv = ServerThread(LLMEngine(cfg, progress=False), cfg)
    try:
        status, headers, _ = call(srv, "OPTIONS", "/v1/completions", preflight)   # no key needed for it
        assert status == 204 and headers["Access-Control-Allow-Origin"] == "http://app.example"
        assert headers["Access-Control-Allow-Headers"] == "authorization, content-type"
        assert "POST" in headers["Access-Control-Allow-Methods"]
        status, headers, _ = call(srv, "OPTIONS", "/v1/completions", {**preflight, "Origin": "http://evil.example"})
        assert status == 403 and "Access-Control-Allow-Origin" not in headers
        body = {"prompt": "Hi", "max_tokens": 3, "stream": True}
        key = {"Authorization": "Bearer s3cret", "Content-Type": "application/json"}
        status, headers, raw = call(srv, "POST", "/v1/completions", {**key, "Origin": "http://app.example"}, body)
        assert status == 200 and headers["Access-Control-Allow-Origin"] == "http://app.example"
        assert raw.endswith(b"data: [DONE]\n\n")
        status, headers, _ = call(srv, "POST", "/v1/completions", {"Origin": "http://app.example"}, body)
        assert status == 401 and headers["Access-Control-Allow-Origin"] == "http://app.example"  # readable
        status, headers, _ = call(srv, "POST", "/v1/completions", {**key, "Origin": "http://evil.example"}, body)
        assert status == 200 and "Access-Control-Allow-Origin" not in headers
    finally:
        srv.stop()
