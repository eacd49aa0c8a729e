"""Incremental detokenization against the tokenizer kinds real Llama-family checkpoints ship.

tests/engine/test_detokenizer.py holds IncrementalDetokenizer to a byte-level BPE (Llama 3,
Qwen2). Llama 2, Mistral and TinyLlama ship a SentencePiece-style BPE instead: `▁` for a space,
a prefix space on the first word (the decoder strips it again), and byte fallback (`<0xE2>`
tokens for characters outside the vocabulary; HF's ByteFallback decoder turns a run of byte
tokens that is not valid UTF-8 into one U+FFFD per byte). Each kind is built here with the
`tokenizers` library, saved as a checkpoint's tokenizer files and loaded through
`load_tokenizer`, the loader real checkpoints go through (transformers rebuilds a
`LlamaTokenizer`'s pre-tokenizer and decoder from tokenizer_config.json, as for real ones).

Oracles: `tokenizer.decode` of prompt context + output, minus the context's text (the output
of a SentencePiece model starts with its space, as in vLLM), and vLLM v1's own detokenizer,
`tokenizers.decoders.DecodeStream` primed with the prompt ids.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
from tokenizers.decoders import DecodeStream
from transformers import PreTrainedTokenizerFast

from specserve.detokenizer import PROMPT_CONTEXT_TOKENS, IncrementalDetokenizer
from specserve.model.loader import load_tokenizer

# ∑, 😀, 🤖 and the Bengali conjunct are not in it: a SentencePiece vocabulary spells them in bytes.
CORPUS = [
    "Hello world, this is a small test of streaming text. The quick brown fox jumps over the lazy dog.",
    "你好世界，今天天气很好。我们一起去公园吧！",
    "Emoji 🎉👍 café naïve façade, done and ok.",
    "def main():\n    return 42  # two  spaces\n\n",
] * 4

SP_SPECIALS = ["<unk>", "<s>", "</s>", "[INST]", "[/INST]"]
LLAMA2_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "{% if message['role'] == 'user' %}{{ '[INST] ' + message['content'] + ' [/INST]' }}"
    "{% else %}{{ message['content'] + eos_token }}{% endif %}{% endfor %}"
)

# kind -> (tokenizer_config.json overrides). The SentencePiece kinds differ in how the prefix
# space is written: Llama 2 / TinyLlama (`legacy: false`: first word only), the legacy
# Llama 2 / Mistral tokenizer (every piece), none at all, and a generic class that keeps the
# tokenizer.json as written (normalizer Prepend + Replace, decoder Replace/ByteFallback/Fuse/Strip).
KINDS = {
    "byte_level": None,
    "llama2": {"tokenizer_class": "LlamaTokenizer", "legacy": False},
    "llama2_legacy": {"tokenizer_class": "LlamaTokenizer", "legacy": True},
    "sp_no_prefix_space": {"tokenizer_class": "LlamaTokenizer", "legacy": False, "add_prefix_space": False},
    "sp_generic": {},
}
SP_KINDS = [k for k in KINDS if k != "byte_level"]


def _sentencepiece_bpe(prefix_space: bool) -> Tokenizer:
    """A Llama-2-style BPE: <unk> <s> </s>, the 256 byte tokens <0x00>..<0xFF>, then merges
    trained on CORPUS over `▁`-joined words; byte_fallback on."""
    base = Tokenizer(models.BPE())
    base.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="always", split=True)
    base.train_from_iterator(CORPUS, trainers.BpeTrainer(vocab_size=200, show_progress=False))
    trained = json.loads(base.to_str())["model"]
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    for b in range(256):
        vocab[f"<0x{b:02X}>"] = len(vocab)
    for piece in sorted(trained["vocab"], key=trained["vocab"].get):
        vocab.setdefault(piece, len(vocab))
    merges = [tuple(m) if isinstance(m, list) else tuple(m.split(" ")) for m in trained["merges"]]
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, byte_fallback=True, unk_token="<unk>", fuse_unk=True))
    if prefix_space:
        tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    else:
        tok.normalizer = normalizers.Replace(" ", "▁")
    steps = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    tok.decoder = decoders.Sequence(steps + ([decoders.Strip(" ", 1, 0)] if prefix_space else []))
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SP_SPECIALS])
    tok.add_tokens([AddedToken("<tool>", special=False, normalized=False)])
    return tok


def _byte_level_bpe() -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(CORPUS, trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<|bos|>", "<|eos|>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False))
    tok.add_special_tokens([AddedToken("<|im_start|>", special=True, normalized=False)])
    tok.add_tokens([AddedToken("<tool>", special=False, normalized=False)])
    return tok


def write_tokenizer(dir, kind: str):
    """Save a `kind` tokenizer's files (tokenizer.json, tokenizer_config.json with a chat
    template) into dir and return it as load_tokenizer loads it."""
    dir = Path(dir)
    dir.mkdir(parents=True, exist_ok=True)
    if kind == "byte_level":
        fast = PreTrainedTokenizerFast(tokenizer_object=_byte_level_bpe(), bos_token="<|bos|>", eos_token="<|eos|>")
    else:
        prefix = KINDS[kind].get("add_prefix_space", True)
        fast = PreTrainedTokenizerFast(tokenizer_object=_sentencepiece_bpe(prefix), bos_token="<s>", eos_token="</s>",
                                       unk_token="<unk>")
    fast.chat_template = LLAMA2_TEMPLATE
    fast.save_pretrained(str(dir))
    file = dir / "tokenizer_config.json"
    config = json.loads(file.read_text())
    config.update(KINDS[kind] or {})
    config["clean_up_tokenization_spaces"] = False
    file.write_text(json.dumps(config, indent=1))
    return load_tokenizer(dir)


@pytest.fixture(scope="module")
def tokenizers_by_kind(tmp_path_factory):
    root = tmp_path_factory.mktemp("tokenizer_kinds")
    return {kind: write_tokenizer(root / kind, kind) for kind in KINDS}


def decode(tok, ids, skip=True) -> str:
    return tok.decode(ids, skip_special_tokens=skip, clean_up_tokenization_spaces=False)


def in_context(tok, context, ids, skip=True) -> str:
    """The text `ids` add after `context`: decode(context + ids) minus decode(context)."""
    before, after = decode(tok, context, skip), decode(tok, list(context) + list(ids), skip)
    assert after.startswith(before), (before, after)
    return after[len(before):]


def vllm_v1(tok, prompt, ids, skip=True) -> str:
    """What vLLM v1's FastIncrementalDetokenizer emits: a DecodeStream primed with the prompt."""
    stream = DecodeStream(ids=list(prompt), skip_special_tokens=skip)
    return "".join(stream.step(tok.backend_tokenizer, t) or "" for t in ids)


def stream(tok, prompt, ids, chunks=None, **kw) -> tuple[list[str], str]:
    """(deltas, flushed text) of IncrementalDetokenizer fed ids in chunks (one by one by default)."""
    detok = IncrementalDetokenizer(tok, prompt, **kw)
    chunks = chunks or [1] * len(ids)
    deltas, pos = [], 0
    for size in chunks:
        if pos >= len(ids):
            break
        deltas.append(detok.append(ids[pos:pos + size])[0])
        pos += size
    return deltas, detok.flush()


def test_the_kinds_are_what_real_checkpoints_ship(tokenizers_by_kind):
    """Guards the fixtures: SentencePiece kinds write spaces as ▁ and unknown characters as
    byte tokens; the prefix space is on the first word only where it should be."""
    for kind in SP_KINDS:
        tok = tokenizers_by_kind[kind]
        pieces = tok.convert_ids_to_tokens(tok.encode("Hello ∑ world", add_special_tokens=False))
        assert "<0xE2>" in pieces and any(p.startswith("▁") for p in pieces), (kind, pieces)
        assert pieces[0].startswith("▁") == (kind != "sp_no_prefix_space"), (kind, pieces)
        assert decode(tok, tok.encode("Hello ∑ world", add_special_tokens=False)) == "Hello ∑ world"
    tok = tokenizers_by_kind["byte_level"]
    assert any("\ufffd" in tok.decode([t]) for t in tok.encode("∑ 😀", add_special_tokens=False))


# Pieces encoded one by one and joined at whole characters, so every sequence is valid UTF-8
# (where it is not, HF's ByteFallback decoder has no single right answer: see below).
PIECES = ["Hello", " world", "你好", " ∑", "∑", " 😀", "🤖", " café", "e\u0301", "\n\n", "  x", " ক্ষ", ",", " 42",
          "<tool>", " ok"]
PROMPTS = ["Say:", "[INST] hi [/INST]", "x 😀", "问", "<s>"]


@pytest.mark.parametrize("kind", KINDS)
def test_random_streams_equal_decode_in_context_and_vllm(tokenizers_by_kind, kind):
    """Random outputs of whole characters, special and added tokens between them, fed in
    random chunks with and without skip_special_tokens: the streamed text equals both
    oracles, and no delta holds a U+FFFD."""
    tok = tokenizers_by_kind[kind]
    specials = [tok.bos_token_id, tok.eos_token_id, tok.convert_tokens_to_ids("<tool>")]
    if kind != "byte_level":
        specials.append(tok.convert_tokens_to_ids("[/INST]"))
    rng = random.Random(kind)
    for trial in range(60):
        ids = []
        for _ in range(rng.randint(1, 6)):
            ids += tok.encode(rng.choice(PIECES), add_special_tokens=False)
            if rng.random() < 0.25:
                ids.append(rng.choice(specials))
        prompt = tok.encode(rng.choice(PROMPTS), add_special_tokens=rng.random() < 0.5) or [tok.bos_token_id]
        skip = rng.random() < 0.5
        chunks = [rng.randint(1, 5) for _ in ids]
        deltas, tail = stream(tok, prompt, ids, chunks, skip_special_tokens=skip)
        where = (trial, tok.convert_ids_to_tokens(prompt), tok.convert_ids_to_tokens(ids), skip)
        assert tail == "" and all("\ufffd" not in d for d in deltas), where
        out = "".join(deltas)
        assert out == in_context(tok, prompt[-PROMPT_CONTEXT_TOKENS:], ids, skip), where
        assert out == vllm_v1(tok, prompt, ids, skip), where


def test_sentencepiece_output_starts_with_its_space_after_the_prompt(tokenizers_by_kind):
    """A Llama 2 reply after `[/INST]` is " Hello": the prefix space of the first output token
    is a real space in context, as vLLM streams it, not stripped as decode(output) would."""
    tok = tokenizers_by_kind["llama2"]
    prompt = tok.encode("[INST] hi [/INST]")
    ids = tok.encode("Hello world", add_special_tokens=False)
    assert decode(tok, ids) == "Hello world"
    deltas, tail = stream(tok, prompt, ids)
    assert deltas[0] == " Hello" and "".join(deltas) + tail == " Hello world" == vllm_v1(tok, prompt, ids)


# -- cases that went wrong once --------------------------------------------------------------


TEXT = "a ∑ b ∑∑ c 😀 d"


def _char_boundary_after(tok, ids, cut) -> int:
    """The first position >= cut where ids[:position] ends with a whole character."""
    j = cut
    while j < len(ids) and decode(tok, ids[:j]).endswith("\ufffd"):
        j += 1
    return j


@pytest.mark.parametrize("kind", KINDS)
def test_a_token_id_prompt_that_ends_inside_a_character_loses_no_later_output(tokenizers_by_kind, kind):
    """A token-id prompt may end inside a character (a client continuing an output that
    max_tokens cut there sends exactly that). The output's first tokens complete the
    character; everything generated after it must still come out.

    The trap: the prompt context's text ends in U+FFFD, one per byte with HF's ByteFallback: the
    completed character is shorter than that, so `len(new_text) <= len(prefix_text)` swallows
    the next tokens, and then the delta is cut at the wrong length. With the SentencePiece
    kinds whole words would vanish: a prompt ending `<0xF0> <0x9F> <0x98>` (most of 😀) then the
    output `<0x80> ▁d` would stream nothing at all instead of " d"; `... <0xE2> <0x88>` then
    `<0x91> <0xE2> <0x88> <0x91> ▁ c ...` would lose the second ∑, all of it generated."""
    tok = tokenizers_by_kind[kind]
    bos = [tok.bos_token_id]
    ids = tok.encode(TEXT, add_special_tokens=False)
    cuts = [c for c in range(1, len(ids)) if decode(tok, ids[:c]).endswith("\ufffd")]
    assert len(cuts) >= 4
    failures = []
    for cut in cuts:
        prompt, output = bos + ids[:cut], ids[cut:]
        boundary = _char_boundary_after(tok, ids, cut)
        after = in_context(tok, bos + ids[:boundary], ids[boundary:])   # text of the tokens after that character
        deltas, tail = stream(tok, prompt, output)
        text = "".join(deltas) + tail
        if not text.endswith(after):
            failures.append((tok.convert_ids_to_tokens(prompt[-3:]), tok.convert_ids_to_tokens(output), text, after))
    assert not failures, "\n".join(f"prompt ...{p} output {o}: streamed {t!r}, lost the end of {a!r}"
                                   for p, o, t, a in failures)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("case", ["cut_by_max_tokens", "stray_byte_then_text"])
def test_incomplete_bytes_after_a_byte_fallback_character(tokenizers_by_kind, kind, case):
    """Output "a ∑" and then the first bytes of another ∑ (max_tokens cut it), or a stray lead
    byte followed by " b". A byte-level tokenizer gives one U+FFFD for them, as UTF-8's
    decoder does; with byte fallback the incomplete bytes join the run of the ∑ before them,
    HF's ByteFallback decoder rewrites that whole run (the ∑ included) as one U+FFFD per byte,
    and a detokenizer that slices that string at the length of "∑" gives "a ∑����" for
    two trailing bytes and "a ∑��� b" for one stray byte. At most one U+FFFD per incomplete byte,
    and the text before them stays."""
    tok = tokenizers_by_kind[kind]
    prompt = tok.encode("[INST] hi [/INST]" if kind != "byte_level" else "Q:", add_special_tokens=True)
    whole = tok.encode("a ∑ b", add_special_tokens=False)
    rest = whole[len(tok.encode("a ∑", add_special_tokens=False)):]    # " b" in context: "▁b", or "▁" "b"
    whole, partial = whole[:len(whole) - len(rest)], whole[-len(rest) - 3:-len(rest)]
    assert all(decode(tok, [t]) == "\ufffd" for t in partial), tok.convert_ids_to_tokens(partial)   # ∑'s 3 bytes
    context = prompt[-PROMPT_CONTEXT_TOKENS:]
    before = in_context(tok, context, whole)
    if case == "cut_by_max_tokens":
        stray, after, ids = 2, "", whole + partial[:2]
    else:
        stray, ids = 1, whole + partial[:1] + rest
        after = in_context(tok, context + whole, rest)
    deltas, tail = stream(tok, prompt, ids)
    text = "".join(deltas) + tail
    assert text.startswith(before), text
    middle = text[len(before):len(text) - len(after)] if text.endswith(after) else None
    assert middle is not None and middle and set(middle) == {"\ufffd"} and len(middle) <= stray, (
        f"{tok.convert_ids_to_tokens(ids)} streamed {text!r}: expected {before!r} + at most {stray} U+FFFD + {after!r}")
