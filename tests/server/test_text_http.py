"""The server's text paths on a Llama-2-style checkpoint (SentencePiece BPE with byte
fallback, a `[INST]` chat template that raises on a bad conversation), whose greedy output is
known: logprob token strings and bytes, text_offset, the provenance pieces the chat page
shows, stop strings over byte-fallback characters, and the template's own errors.

The byte-level tokenizer of the other server tests spells every token in bytes of its own
alphabet; a SentencePiece one writes a space as `▁` (which `decode([token])` strips from a
token that comes first) and a character outside its vocabulary as byte tokens `<0xE2>`
(which `decode([token])` turns into U+FFFD).
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from specserve.engine import LLMEngine
from tests.checkpoints import make_checkpoint
from tests.engine.test_tokenizer_kinds import write_tokenizer
from tests.server.conftest import ServerThread, engine_config
from tests.server.test_sampling_api import post as post_json

SCRIPT = "Hello world ∑ done."
REPLY = " world ∑ done."   # after a prompt that ends with "▁Hello": its space is a real space
CHAT_REPLY = " Hello world ∑ done."   # after "[/INST]"


@pytest.fixture(scope="module")
def sp_server(tmp_path_factory):
    """A one-layer llama that is a lookup table over the llama2 tokenizer (as
    tests/server/conftest.py's make_successor_checkpoint): after a token of SCRIPT comes the
    next one, after the last comes </s>, and after `[/INST]` comes SCRIPT's first token. The
    draft is the model itself, so every step also accepts draft tokens."""
    root = tmp_path_factory.mktemp("sp_scripted")
    tok = write_tokenizer(root / "model", "llama2")
    vocab = len(tok)
    path = make_checkpoint(root / "model", "llama", with_tokenizer=False, vocab_size=vocab, hidden_size=512,
                           intermediate_size=64, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
                           bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=0)
    (path / "generation_config.json").write_text(json.dumps({"bos_token_id": tok.bos_token_id,
                                                             "eos_token_id": tok.eos_token_id}))
    ids = tok.encode(SCRIPT, add_special_tokens=False)
    assert len(set(ids)) == len(ids) and "<0xE2>" in tok.convert_ids_to_tokens(ids)
    w = load_file(str(path / "model.safetensors"))
    w["model.embed_tokens.weight"] = torch.eye(vocab, 512)
    w["model.norm.weight"] = torch.ones(512)
    w["model.layers.0.self_attn.o_proj.weight"].zero_()
    w["model.layers.0.mlp.down_proj.weight"].zero_()
    lm_head = torch.zeros(vocab, 512)
    for a, b in zip(ids, ids[1:] + [tok.eos_token_id]):
        lm_head[b, a] = 1.0
    lm_head[ids[0], tok.convert_tokens_to_ids("[/INST]")] = 1.0
    w["lm_head.weight"] = lm_head
    save_file(w, str(path / "model.safetensors"), metadata={"format": "pt"})
    cfg = engine_config(path, path, spec_mode="static", spec_depth=2)
    srv = ServerThread(LLMEngine(cfg, progress=False), cfg)
    srv.model, srv.ids, srv.tok = path.name, ids, tok
    yield srv
    srv.stop()


def post(srv, path: str, body: dict) -> tuple[int, str]:
    return post_json(srv, path, {"model": srv.model, **body})


def events(text: str) -> list[dict]:
    return [json.loads(line[6:]) for line in text.split("\n\n") if line.startswith("data: {")]


USER = [{"role": "user", "content": "hi"}]


def test_the_script_streams_and_stops_over_byte_fallback_characters(sp_server):
    """The fixture's output is what it should be, streamed or not; a stop string that spans
    the `▁` token and the three byte tokens of ∑ ends it exactly before, in either mode."""
    prompt = [sp_server.tok.bos_token_id, sp_server.ids[0]]
    for stop, text in ((None, REPLY), ("d ∑", " worl"), ("∑", " world "), ("∑ do", " world ")):
        extra = {"stop": stop} if stop else {}
        status, body = post(sp_server, "/completions", {"prompt": prompt, "max_tokens": 30, "temperature": 0, **extra})
        assert status == 200, body
        full = json.loads(body)["choices"][0]
        status, body = post(sp_server, "/completions", {"prompt": prompt, "max_tokens": 30, "temperature": 0,
                                                        "stream": True, **extra})
        chunks = [c["choices"][0] for c in events(body) if c["choices"]]
        assert full["text"] == "".join(c["text"] for c in chunks) == text, stop
        assert full["finish_reason"] == chunks[-1]["finish_reason"] == "stop" and full["stop_reason"] == stop
        assert all("\ufffd" not in c["text"] for c in chunks)
    reply = sp_server.client().chat.completions.create(model=sp_server.model, messages=USER, max_tokens=30,
                                                       temperature=0)
    assert reply.choices[0].message.content == CHAT_REPLY


def test_a_chat_template_that_raises_is_a_400_naming_messages(sp_server):
    """Llama 2's template raises on roles that do not alternate: the client gets its message as
    a 400 on `messages`, and the server goes on serving."""
    status, body = post(sp_server, "/chat/completions", {"messages": USER + USER, "max_tokens": 4})
    assert status == 400, body
    error = json.loads(body)["error"]
    assert error["param"] == "messages" and "roles must alternate" in error["message"]
    status, _ = post(sp_server, "/chat/completions", {"messages": USER, "max_tokens": 4})
    assert status == 200


# -- cases that went wrong once --------------------------------------------------------------

# The chat reply's tokens: ▁Hello ▁wo r l d ▁ <0xE2> <0x88> <0x91> ▁done . then </s>. Eleven
# tokens end it by length, before </s>, so only the tokens of its text are in play here.
CHAT_TOKENS = 11


def test_chat_logprob_bytes_spell_the_content(sp_server):
    """OpenAI's contract for `bytes` (held for the byte-level tokenizer in
    test_sampling_api.py): the tokens' bytes, joined, are the content's UTF-8. Bytes taken
    from `decode([token])` lose the `▁` of " world" and turn <0xE2> into U+FFFD: they would spell "Helloworld���done." instead of
    " Hello world ∑ done.", and the three byte tokens of ∑ all read "\\ufffd"."""
    reply = sp_server.client().chat.completions.create(model=sp_server.model, messages=USER, temperature=0,
                                                       max_tokens=CHAT_TOKENS, logprobs=True, top_logprobs=2)
    content = reply.choices[0].logprobs.content
    assert reply.choices[0].message.content == CHAT_REPLY and reply.choices[0].finish_reason == "length"
    joined = b"".join(bytes(t.bytes) for t in content)
    assert joined.decode("utf-8", "replace") == CHAT_REPLY, joined
    assert [bytes(t.bytes) for t in content[6:9]] == [b"\xe2", b"\x88", b"\x91"]


def test_completion_logprob_tokens_and_text_offsets(sp_server):
    """The tokens of " world" are " wo", "r", "l", "d" (vLLM restores the space decode strips
    from a SentencePiece token, detokenizer_utils._restore_leading_spaces), each at its
    text_offset in the text; byte tokens are written `bytes:\\xe2` (this server's rule for part
    of a character, logprobs.TokenText.text), so the three stay distinct, also as keys of
    top_logprobs (not "wo" at 0, "r" at 2 (where the text has "o"), and "\\ufffd" three
    times)."""
    prompt = [sp_server.tok.bos_token_id, sp_server.ids[0]]
    status, body = post(sp_server, "/completions", {"prompt": prompt, "max_tokens": 30, "temperature": 0,
                                                    "logprobs": 1})
    assert status == 200, body
    choice = json.loads(body)["choices"][0]
    text, lp = choice["text"], choice["logprobs"]
    assert text == REPLY
    assert lp["tokens"][:5] == [" wo", "r", "l", "d", " "], lp["tokens"]
    assert lp["tokens"][5:8] == ["bytes:\\xe2", "bytes:\\x88", "bytes:\\x91"], lp["tokens"]
    for token, offset in list(zip(lp["tokens"], lp["text_offset"]))[:5]:
        assert text[offset:offset + len(token)] == token, (token, offset, text)


def test_provenance_pieces_spell_the_streamed_text(sp_server):
    """The chat page prints the provenance pieces (static/chat.html: addPiece for each), so
    they must spell the content the same chunks carry (built from decode([token])'s bytes,
    they would read "Helloworld���done." against " Hello world ∑ done.")."""
    status, body = post(sp_server, "/chat/completions", {"messages": USER, "max_tokens": CHAT_TOKENS,
                                                         "temperature": 0, "stream": True, "provenance": True})
    assert status == 200, body
    chunks = [c["choices"][0] for c in events(body) if c["choices"]]
    content = "".join(c["delta"].get("content") or "" for c in chunks)
    pieces = "".join(text for c in chunks for text, _, _ in c.get("provenance", []))
    assert content == CHAT_REPLY
    assert pieces == content


@pytest.fixture(scope="module")
def byte_level_server(tmp_path_factory):
    """tests/server/test_streaming.py's scripted model (byte-level BPE): after any token of
    "Tokyo 東京🙂 done." comes the rest of it, then <|eos|>; the draft is the model itself."""
    from tests.server.conftest import make_successor_checkpoint

    path, ids = make_successor_checkpoint(tmp_path_factory.mktemp("bl_scripted"))
    cfg = engine_config(path, path, spec_mode="static", spec_depth=2)
    srv = ServerThread(LLMEngine(cfg, progress=False), cfg)
    srv.model, srv.ids, srv.tok = path.name, ids, srv.engine.tokenizer
    yield srv
    srv.stop()


@pytest.mark.parametrize("how", ["eos", "stop_string"])
def test_provenance_pieces_carry_no_text_the_chunk_does_not(byte_level_server, how):
    """README: "a request with provenance: true gets each chunk's text also as pieces". The
    pieces are every output token's own bytes, so the chat page also prints what the text
    leaves out: the EOS token's text ("<|eos|>" here; <|eot_id|> or <|im_end|> for Llama 3 or
    Qwen) at the end of every reply that ends by itself, and a stop string with what follows it
    in its last token. Each chunk's pieces must spell that chunk's content."""
    srv = byte_level_server
    body = {"prompt": srv.ids[:1], "max_tokens": 40, "temperature": 0, "stream": True, "provenance": True}
    if how == "stop_string":
        body["stop"] = ["京🙂"]
    status, text = post(srv, "/completions", body)
    assert status == 200, text
    chunks = [c["choices"][0] for c in events(text) if c["choices"]]
    assert chunks[-1]["finish_reason"] == "stop"
    content = "".join(c["text"] for c in chunks)
    from tests.server.conftest import SCRIPT as TOKYO

    rest = TOKYO[len(srv.tok.decode(srv.ids[:1])):]
    assert content == (rest[:rest.index("京🙂")] if how == "stop_string" else rest)
    for c in chunks:
        assert "".join(t for t, _, _ in c.get("provenance", [])) == c["text"], [
            (c["text"], c.get("provenance")) for c in chunks]
