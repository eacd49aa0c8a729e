"""Chat templates, special tokens and end-of-sequence ids as real checkpoints ship them
(Llama 3, ChatML/Qwen, Mistral/Llama 2, Gemma), over HTTP and offline, compared with what
transformers renders and what vLLM stops on.

The model is a lookup table (as conftest.make_successor_checkpoint): greedy decoding after
any token outside CHAIN emits CHAIN[0], and after CHAIN[i] emits CHAIN[i + 1], so the output
of every prompt is known in advance and the stop tokens sit at chosen places in it. The
target serves as its own draft, so every drafted token is accepted and each EOS lands inside
an accepted speculative run.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from specserve.engine import LLMEngine
from specserve.errors import ModelLoadError
from specserve.model.loader import load_eos_token_ids, load_sampling_defaults
from tests.checkpoints import CORPUS, make_checkpoint
from tests.server.conftest import ServerThread, engine_config, http

SPECIALS = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>",
            "<|eom_id|>", "<|im_start|>", "<|im_end|>", "<|endoftext|>", "<s>", "</s>", "[INST]", "[/INST]",
            "<bos>", "<eos>", "<start_of_turn>", "<end_of_turn>", "<pad>"]

LLAMA3_TEMPLATE = (
    "{% set loop_messages = messages %}{% for message in loop_messages %}"
    "{% set content = '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n' + message['content'] | trim"
    " + '<|eot_id|>' %}{% if loop.index0 == 0 %}{% set content = bos_token + content %}{% endif %}{{ content }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
)
CHATML_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
MISTRAL_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "{% if message['role'] == 'user' %}{{ '[INST] ' + message['content'] + ' [/INST]' }}"
    "{% elif message['role'] == 'assistant' %}{{ message['content'] + eos_token }}"
    "{% else %}{{ raise_exception('Only user and assistant roles are supported!') }}{% endif %}{% endfor %}"
)
GEMMA_TEMPLATE = (
    "{{ bos_token }}{% if messages[0]['role'] == 'system' %}{{ raise_exception('System role not supported') }}"
    "{% endif %}{% for message in messages %}{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "{% if (message['role'] == 'assistant') %}{% set role = 'model' %}{% else %}{% set role = message['role'] %}"
    "{% endif %}{{ '<start_of_turn>' + role + '\n' + message['content'] | trim + '<end_of_turn>\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{'<start_of_turn>model\n'}}{% endif %}"
)

# kind -> (bos, eos of the tokenizer, template, BOS added by the tokenizer's post-processor?)
KINDS = {
    "llama3": ("<|begin_of_text|>", "<|eot_id|>", LLAMA3_TEMPLATE, True),
    "chatml": (None, "<|im_end|>", CHATML_TEMPLATE, False),
    "mistral": ("<s>", "</s>", MISTRAL_TEMPLATE, True),
    "gemma": ("<bos>", "<eos>", GEMMA_TEMPLATE, True),
}
USER = [{"role": "user", "content": "Tell me about the sun."}]


def _train():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=420, special_tokens=SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(CORPUS, trainer=trainer)
    return tok


def _save_tokenizer(raw, dir: Path, kind: str):
    from tokenizers import Tokenizer
    from tokenizers.processors import TemplateProcessing
    from transformers import PreTrainedTokenizerFast

    bos, eos, template, adds_bos = KINDS[kind]
    raw = Tokenizer.from_str(raw.to_str())
    if adds_bos:
        raw.post_processor = TemplateProcessing(single=f"{bos} $A", pair=f"{bos} $A {bos} $B",
                                                special_tokens=[(bos, raw.token_to_id(bos))])
    fast = PreTrainedTokenizerFast(tokenizer_object=raw, bos_token=bos, eos_token=eos, pad_token="<pad>")
    fast.chat_template = template
    fast.save_pretrained(str(dir))
    return fast


def _template_ids(tok, messages, **kwargs) -> list[int]:
    """transformers' own token ids of the rendered conversation."""
    return list(tok.apply_chat_template(messages, tokenize=True, return_dict=False, **kwargs))


def _write_json(file: Path, data) -> None:
    file.write_text(json.dumps(data, indent=2))


def _update_json(file: Path, **changes) -> dict:
    data = json.loads(file.read_text()) if file.is_file() else {}
    for k, v in changes.items():
        if v is None:
            data.pop(k, None)
        else:
            data[k] = v
    _write_json(file, data)
    return data


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    """(a one-layer checkpoint with hidden >= vocab, the trained raw tokenizer, CHAIN's plain text ids)."""
    raw = _train()
    vocab = raw.get_vocab_size()
    dir = make_checkpoint(tmp_path_factory.mktemp("tmpl") / "base", "llama", with_tokenizer=False, seed=0,
                          vocab_size=vocab, num_hidden_layers=1, hidden_size=512, intermediate_size=64,
                          num_attention_heads=4, num_key_value_heads=2, bos_token_id=0, eos_token_id=1,
                          pad_token_id=SPECIALS.index("<pad>"))
    # Plain tokens whose text is a run of ASCII letters: their decoded text is unambiguous.
    words = [i for i in range(len(SPECIALS), vocab)
             if (s := raw.decode([i])).isascii() and s.strip().isalpha() and len(s.strip()) >= 2]
    return dir, raw, words[:12]


def _kind_dir(base, root: Path, kind: str, chain_tokens: list, gen_eos, config_eos):
    """A checkpoint of `kind` whose greedy output is `chain_tokens` (ids, or special-token
    strings) and then CHAIN again, with generation_config eos_token_id `gen_eos` and config.json's
    `config_eos` (token strings or lists of them; None leaves the key out)."""
    src, raw, _ = base
    dir = root / kind
    shutil.copytree(src, dir)
    _save_tokenizer(raw, dir, kind)
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(dir))
    ids = lambda t: t if isinstance(t, int) else tok.convert_tokens_to_ids(t)  # noqa: E731
    as_ids = lambda v: None if v is None else ([ids(t) for t in v] if isinstance(v, list) else ids(v))  # noqa: E731
    chain = [ids(t) for t in chain_tokens]
    assert len(set(chain)) == len(chain)
    w = load_file(str(dir / "model.safetensors"))
    vocab, hidden = w["model.embed_tokens.weight"].shape
    w["model.embed_tokens.weight"] = torch.eye(vocab, hidden)
    w["model.norm.weight"] = torch.ones(hidden)
    w["model.layers.0.self_attn.o_proj.weight"].zero_()
    w["model.layers.0.mlp.down_proj.weight"].zero_()
    lm_head = torch.zeros(vocab, hidden)
    for a in range(vocab):
        if a not in chain:
            lm_head[chain[0], a] = 1.0
    for a, b in zip(chain, chain[1:] + chain[:1]):
        lm_head[b, a] = 1.0
    w["lm_head.weight"] = lm_head
    save_file(w, str(dir / "model.safetensors"), metadata={"format": "pt"})
    _update_json(dir / "config.json", eos_token_id=as_ids(config_eos), bos_token_id=ids(KINDS[kind][0] or "<pad>"))
    gen = {"bos_token_id": ids(KINDS[kind][0] or "<pad>")}
    if gen_eos is not None:
        gen["eos_token_id"] = as_ids(gen_eos)
    _write_json(dir / "generation_config.json", gen)
    return dir, tok, chain


def _serve(dir: Path, depth: int = 3):
    cfg = engine_config(dir, dir, spec_mode="static", spec_depth=depth)
    return ServerThread(LLMEngine(cfg, progress=False), cfg)


def _sse(base_url: str, path: str, body: dict) -> list[dict]:
    import urllib.request

    req = urllib.request.Request(base_url + path, data=json.dumps({**body, "stream": True}).encode(),
                                 headers={"Content-Type": "application/json"})
    events = []
    with urllib.request.urlopen(req, timeout=60) as r:
        for line in r:
            line = line.decode().strip()
            if line.startswith("data: ") and line[6:] != "[DONE]":
                events.append(json.loads(line[6:]))
    return events


def _stream_result(events: list[dict], chat: bool) -> tuple[str, str, object]:
    """(text, finish_reason, stop_reason) of a one-choice stream."""
    text, finish, stop = "", None, None
    for e in events:
        for c in e.get("choices", []):
            text += (c.get("delta", {}).get("content") or "") if chat else c.get("text", "")
            if c.get("finish_reason") is not None:
                finish, stop = c["finish_reason"], c.get("stop_reason")
    return text, finish, stop


# -- Llama 3 ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def llama3(base, tmp_path_factory):
    """Llama 3.1-like: the template writes BOS, turns end in <|eot_id|>, the tokenizer's eos is
    <|eot_id|>, generation_config lists [<|end_of_text|>, <|eom_id|>, <|eot_id|>].
    Output: w0 w1 w2 <|eom_id|> w3 w4 <|eot_id|> w5 <|end_of_text|> w6 ..."""
    _, _, w = base
    chain = [w[0], w[1], w[2], "<|eom_id|>", w[3], w[4], "<|eot_id|>", w[5], "<|end_of_text|>", w[6]]
    dir, tok, ids = _kind_dir(base, tmp_path_factory.mktemp("llama3"), "llama3", chain,
                              ["<|end_of_text|>", "<|eom_id|>", "<|eot_id|>"], "<|eot_id|>")
    srv = _serve(dir)
    yield srv, tok, ids
    srv.stop()


def _chat(srv, **body):
    return http(srv.base, "/v1/chat/completions", {"messages": USER, "temperature": 0, "max_tokens": 30, **body})


def test_llama3_chat_prompt_ids_equal_apply_chat_template_with_one_bos(llama3):
    """The chat prompt's ids equal tokenizer.apply_chat_template(tokenize=True): exactly one BOS
    (the template's), though the tokenizer adds BOS when encoding; a completion of the same text
    gets one BOS too only with add_special_tokens false."""
    srv, tok, _ = llama3
    expected = _template_ids(tok, USER, add_generation_prompt=True)
    assert expected.count(tok.bos_token_id) == 1 and expected[0] == tok.bos_token_id
    assert srv.engine.tokenizer("x")["input_ids"][0] == tok.bos_token_id   # the tokenizer does add BOS
    status, body = _chat(srv, max_tokens=1)
    assert status == 200, body
    assert body["usage"]["prompt_tokens"] == len(expected)
    from specserve.server import protocol
    from specserve.server.app import _tokenize

    req = protocol.parse(json.dumps({"messages": USER}).encode(), True)
    assert _tokenize(srv.engine.tokenizer, req, True, 256) == [expected]
    text = tok.apply_chat_template(USER, tokenize=False, add_generation_prompt=True)
    status, body = http(srv.base, "/v1/completions", {"prompt": text, "max_tokens": 1, "add_special_tokens": False})
    assert body["usage"]["prompt_tokens"] == len(expected)
    status, body = http(srv.base, "/v1/completions", {"prompt": text, "max_tokens": 1})
    assert body["usage"]["prompt_tokens"] == len(expected) + 1   # asked for: the tokenizer's BOS as well


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("route", ["chat", "completions"])
def test_llama3_stops_at_each_eos_of_generation_config(llama3, stream, route):
    """Generation stops at the first id of generation_config's eos_token_id list (here
    <|eom_id|>, inside an accepted speculative run), finish_reason "stop", its text not shown;
    vLLM reports an EOS that is not the tokenizer's own eos as stop_reason (its id)."""
    srv, tok, ids = llama3
    eom = tok.convert_tokens_to_ids("<|eom_id|>")
    want = tok.decode(ids[:3])
    chat = route == "chat"
    path = "/v1/chat/completions" if chat else "/v1/completions"
    body = {"messages": USER} if chat else {"prompt": "Tell me about the sun."}
    body.update(temperature=0, max_tokens=30)
    if stream:
        text, finish, stop = _stream_result(_sse(srv.base, path, body), chat)
    else:
        status, resp = http(srv.base, path, body)
        assert status == 200, resp
        c = resp["choices"][0]
        text, finish, stop = (c["message"]["content"] if chat else c["text"]), c["finish_reason"], c["stop_reason"]
        assert resp["usage"]["completion_tokens"] == 4
    assert (text, finish) == (want, "stop")
    assert stop == eom


def test_llama3_stops_at_the_tokenizers_eos_with_stop_reason_none(llama3):
    """The tokenizer's own eos <|eot_id|> ends generation with stop_reason null, as in vLLM
    (a prompt that starts inside the output: after w3 come w4, <|eot_id|>)."""
    srv, tok, ids = llama3
    assert ids[6] == tok.convert_tokens_to_ids("<|eot_id|>") == tok.eos_token_id
    status, resp = http(srv.base, "/v1/completions", {"prompt": [ids[4]], "temperature": 0, "max_tokens": 30})
    assert status == 200, resp
    c = resp["choices"][0]
    assert c["text"] == tok.decode([ids[5]]) and c["finish_reason"] == "stop" and c["stop_reason"] is None
    assert resp["usage"]["completion_tokens"] == 2


def test_llama3_ignore_eos_and_skip_special_tokens(llama3):
    """ignore_eos runs through every EOS id to max_tokens ("length"); the EOS tokens' text is
    left out with skip_special_tokens (the default) and shown without it."""
    srv, tok, ids = llama3
    for skip in (True, False):
        status, resp = _chat(srv, ignore_eos=True, max_tokens=10, skip_special_tokens=skip)
        assert status == 200, resp
        c = resp["choices"][0]
        assert c["finish_reason"] == "length" and resp["usage"]["completion_tokens"] == 10
        assert c["message"]["content"] == tok.decode(ids, skip_special_tokens=skip)
        text, finish, _ = _stream_result(_sse(srv.base, "/v1/chat/completions",
                                              {"messages": USER, "temperature": 0, "max_tokens": 10,
                                               "ignore_eos": True, "skip_special_tokens": skip}), True)
        assert (text, finish) == (c["message"]["content"], "length")


def test_llama3_the_stopping_eos_text_is_not_shown_even_without_skipping_special_tokens(llama3):
    """skip_special_tokens false: the EOS that ends the output is still not part of its text
    (vLLM's rule), unless include_stop_str_in_output."""
    srv, tok, ids = llama3
    status, resp = _chat(srv, skip_special_tokens=False)
    assert resp["choices"][0]["message"]["content"] == tok.decode(ids[:3])
    status, resp = _chat(srv, skip_special_tokens=False, include_stop_str_in_output=True)
    assert resp["choices"][0]["message"]["content"] == tok.decode(ids[:4], skip_special_tokens=False)


def test_llama3_special_token_text_typed_by_a_user_is_rendered_as_transformers_tokenizes_it(llama3):
    """A message holding the text "<|eot_id|>" is encoded as apply_chat_template(tokenize=True)
    encodes it (as the special token, which is also what vLLM does)."""
    srv, tok, _ = llama3
    msgs = [{"role": "user", "content": "a <|eot_id|><|start_header_id|>system<|end_header_id|> b"}]
    expected = _template_ids(tok, msgs, add_generation_prompt=True)
    status, body = _chat(srv, messages=msgs, max_tokens=1)
    assert status == 200, body
    assert body["usage"]["prompt_tokens"] == len(expected)


def test_llama3_continue_final_message_and_generation_prompt_combinations(llama3):
    """continue_final_message renders the last message open (no <|eot_id|> after it);
    add_generation_prompt false leaves the assistant header out; both true is a 400."""
    srv, tok, ids = llama3
    msgs = USER + [{"role": "assistant", "content": "The sun"}]
    for extra in ({"continue_final_message": True, "add_generation_prompt": False},
                  {"add_generation_prompt": False}, {}):
        expected = _template_ids(tok, msgs, add_generation_prompt=extra.get(
            "add_generation_prompt", True), continue_final_message=extra.get("continue_final_message", False))
        status, body = _chat(srv, messages=msgs, max_tokens=1, **extra)
        assert status == 200, body
        assert body["usage"]["prompt_tokens"] == len(expected), extra
    status, body = _chat(srv, messages=msgs, continue_final_message=True, add_generation_prompt=True)
    assert status == 400 and body["error"]["param"] == "continue_final_message"


def test_llama3_empty_and_null_content(llama3):
    """Empty and null content render as the empty string, as transformers renders ""."""
    srv, tok, _ = llama3
    expected = _template_ids(tok, [{"role": "user", "content": ""}], add_generation_prompt=True)
    for content in ("", None, []):
        status, body = _chat(srv, messages=[{"role": "user", "content": content}], max_tokens=1)
        assert status == 200, body
        assert body["usage"]["prompt_tokens"] == len(expected), content


# -- ChatML: the tokenizer's eos alone marks the end of a turn --------------------------------


@pytest.fixture(scope="module")
def chatml(base, tmp_path_factory):
    """A ChatML fine-tune as such checkpoints often ship: no BOS, the tokenizer's eos is
    <|im_end|>, config.json and generation_config.json still name the base model's
    <|endoftext|>. Output: w0 w1 <|im_end|> w2 <|endoftext|> w3 ..."""
    _, _, w = base
    chain = [w[0], w[1], "<|im_end|>", w[2], "<|endoftext|>", w[3]]
    dir, tok, ids = _kind_dir(base, tmp_path_factory.mktemp("chatml"), "chatml", chain, "<|endoftext|>",
                              "<|endoftext|>")
    srv = _serve(dir, depth=4)
    yield srv, tok, ids, dir
    srv.stop()


def test_chatml_prompt_has_no_bos(chatml):
    srv, tok, *_ = chatml
    expected = _template_ids(tok, USER, add_generation_prompt=True)
    status, body = _chat(srv, max_tokens=1)
    assert body["usage"]["prompt_tokens"] == len(expected)


@pytest.mark.parametrize("stream", [False, True])
def test_chatml_stops_at_the_tokenizers_eos_too(chatml, stream):
    """The tokenizer's eos_token (<|im_end|>) ends generation even when generation_config and
    config.json name another id, as vLLM stops at tokenizer.eos_token_id plus generation_config's
    ids: the reply ends with its turn, finish_reason "stop", stop_reason null."""
    srv, tok, ids, dir = chatml
    assert tok.convert_tokens_to_ids("<|im_end|>") not in load_eos_token_ids(dir)   # the files' ids alone
    body = {"messages": USER, "temperature": 0, "max_tokens": 30}
    if stream:
        text, finish, stop = _stream_result(_sse(srv.base, "/v1/chat/completions", body), True)
    else:
        status, resp = http(srv.base, "/v1/chat/completions", body)
        assert status == 200, resp
        c = resp["choices"][0]
        text, finish, stop = c["message"]["content"], c["finish_reason"], c["stop_reason"]
    assert (text, finish, stop) == (tok.decode(ids[:2]), "stop", None)


def test_chatml_offline_generate_stops_at_the_tokenizers_eos(chatml):
    """LLM.generate with the engine alone (no server) stops at the tokenizer's eos as well."""
    from specserve.sampling import SamplingParams

    srv, tok, ids, _ = chatml
    prompt = _template_ids(tok, USER, add_generation_prompt=True)
    # The server's engine runs on its own thread: a second engine on the same files.
    offline = LLMEngine(srv.engine.config, progress=False)
    offline.add_request("x", prompt, SamplingParams(temperature=0.0, max_tokens=30))
    while offline.has_unfinished_requests():
        outs = offline.step()
    out = [o for o in outs if o.request_id == "x"][-1]
    assert out.token_ids == ids[:3] and out.finish_reason == "stop" and out.text == tok.decode(ids[:2])


# -- Mistral / Llama 2 and Gemma: templates that refuse conversations -------------------------


@pytest.fixture(scope="module")
def refusing(base, tmp_path_factory):
    """Mistral-like and Gemma-like checkpoints (templates raising on roles)."""
    _, _, w = base
    root = tmp_path_factory.mktemp("refusing")
    mistral, mtok, mids = _kind_dir(base, root, "mistral", [w[0], w[1], "</s>", w[2]], "</s>", "</s>")
    gemma, gtok, gids = _kind_dir(base, root, "gemma", [w[0], "<end_of_turn>", w[1], "<eos>", w[2]],
                                  ["<eos>", "<end_of_turn>"], "<eos>")
    m, g = _serve(mistral), _serve(gemma)
    yield {"mistral": (m, mtok, mids), "gemma": (g, gtok, gids)}
    m.stop()
    g.stop()


@pytest.mark.parametrize("kind,messages", [
    ("mistral", [{"role": "assistant", "content": "hi"}, {"role": "user", "content": "x"}]),
    ("mistral", [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]),
    ("gemma", [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "x"}]),
])
@pytest.mark.parametrize("stream", [False, True])
def test_a_template_that_raises_is_a_400_naming_its_message(refusing, kind, messages, stream):
    import urllib.error
    import urllib.request

    srv, _, _ = refusing[kind]
    req = urllib.request.Request(srv.base + "/v1/chat/completions", data=json.dumps(
        {"messages": messages, "max_tokens": 4, "stream": stream}).encode(), headers={"Content-Type": "application/json"})
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(req, timeout=30)
    assert e.value.code == 400
    err = json.loads(e.value.read())["error"]
    assert err["param"] == "messages"
    assert ("alternate" in err["message"]) or ("System role not supported" in err["message"])


@pytest.mark.parametrize("kind", ["mistral", "gemma"])
def test_mistral_and_gemma_prompts_and_stops(refusing, kind):
    """One BOS (the template's) and generation stopping at the first EOS id (Gemma:
    <end_of_turn> from generation_config's list; Mistral: </s>)."""
    srv, tok, ids = refusing[kind]
    expected = _template_ids(tok, USER, add_generation_prompt=True)
    assert expected.count(tok.bos_token_id) == 1
    status, body = _chat(srv)
    assert status == 200, body
    assert body["usage"]["prompt_tokens"] == len(expected)
    c = body["choices"][0]
    n = 2 if kind == "gemma" else 3
    assert c["finish_reason"] == "stop" and c["message"]["content"] == tok.decode(ids[:n - 1])
    assert body["usage"]["completion_tokens"] == n


# -- where the template comes from ------------------------------------------------------------


def _engine_tokenizer_dir(base, root: Path, how: str) -> Path:
    _, _, w = base
    dir, tok, _ = _kind_dir(base, root, "chatml", [w[0], "<|im_end|>", w[1]], "<|im_end|>", "<|im_end|>")
    cfg_file = dir / "tokenizer_config.json"
    data = json.loads(cfg_file.read_text())
    data.pop("chat_template", None)
    (dir / "chat_template.jinja").unlink(missing_ok=True)
    (dir / "chat_template.json").unlink(missing_ok=True)
    if how == "list":
        data["chat_template"] = [{"name": "default", "template": CHATML_TEMPLATE},
                                 {"name": "tool_use", "template": "TOOLS"}]
    elif how == "jinja":
        (dir / "chat_template.jinja").write_text(CHATML_TEMPLATE)
    _write_json(cfg_file, data)
    return dir


@pytest.mark.parametrize("how", ["list", "jinja"])
def test_templates_as_a_named_list_or_a_jinja_file(base, tmp_path, how):
    """tokenizer_config's chat_template as a list of named templates (the "default" one is used)
    or a separate chat_template.jinja: rendered as transformers renders them."""
    from transformers import AutoTokenizer

    dir = _engine_tokenizer_dir(base, tmp_path, how)
    tok = AutoTokenizer.from_pretrained(str(dir))
    expected = _template_ids(tok, USER, add_generation_prompt=True)
    assert tok.decode(expected).endswith("<|im_start|>assistant\n")
    srv = _serve(dir)
    try:
        status, body = _chat(srv, max_tokens=1)
        assert status == 200, body
        assert body["usage"]["prompt_tokens"] == len(expected)
    finally:
        srv.stop()


def test_no_chat_template_is_a_clear_400_and_completions_still_work(base, tmp_path):
    dir = _engine_tokenizer_dir(base, tmp_path, "none")
    srv = _serve(dir)
    try:
        for stream in (False, True):
            status, body = _chat(srv, max_tokens=1, stream=stream)
            assert status == 400 and "no chat template" in body["error"]["message"], body
        status, body = http(srv.base, "/v1/completions", {"prompt": "hi", "max_tokens": 2})
        assert status == 200, body
    finally:
        srv.stop()


# -- generation_config.json: sampling defaults, malformed or missing --------------------------


def test_sampling_defaults_and_eos_from_generation_config(base, tmp_path):
    _, _, w = base
    dir, tok, _ = _kind_dir(base, tmp_path, "llama3", [w[0], "<|eot_id|>"], ["<|end_of_text|>", "<|eot_id|>"],
                            "<|end_of_text|>")
    _update_json(dir / "generation_config.json", do_sample=True, temperature=0.6, top_p=0.9, top_k=20,
                 repetition_penalty=1.05)
    assert load_sampling_defaults(dir) == {"temperature": 0.6, "top_p": 0.9, "top_k": 20, "repetition_penalty": 1.05}
    assert load_eos_token_ids(dir) == [tok.convert_tokens_to_ids(t) for t in ("<|end_of_text|>", "<|eot_id|>")]
    # no generation_config.json: config.json's eos, no sampling defaults
    (dir / "generation_config.json").unlink()
    assert load_sampling_defaults(dir) == {}
    assert load_eos_token_ids(dir) == [tok.convert_tokens_to_ids("<|end_of_text|>")]
    # malformed: an error naming the file, not a silent default
    (dir / "generation_config.json").write_text("{not json")
    with pytest.raises(ModelLoadError, match="generation_config.json"):
        load_sampling_defaults(dir)
    with pytest.raises(ModelLoadError, match="generation_config.json"):
        load_eos_token_ids(dir)
    _write_json(dir / "generation_config.json", {"temperature": -1})
    with pytest.raises(ModelLoadError, match="generation_config.json"):
        load_sampling_defaults(dir)
    _write_json(dir / "generation_config.json", {"eos_token_id": "2"})
    with pytest.raises(ModelLoadError, match="eos_token_id"):
        load_eos_token_ids(dir)
