"""Logprobs in OpenAI's shapes (the engine's sampling.Logprob entries turned into JSON).

Chat: `{"content": [{"token", "logprob", "bytes", "top_logprobs": [{"token", "logprob",
"bytes"}]}]}`. Completions (the legacy shape): `{"tokens", "token_logprobs", "top_logprobs":
[{token: logprob}] with the chosen token always among them, "text_offset"}`; with echo the
prompt's tokens come first, the first with null. `text_offset` counts characters of the text
(a token holding part of a character counts as its U+FFFD replacements).
"""

from __future__ import annotations

import re
from functools import lru_cache

_BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")   # SentencePiece's byte-fallback tokens


def _byte_level_alphabet() -> dict[str, int]:
    """The byte-level BPE alphabet (GPT-2's): printable bytes stand for themselves, the others
    for the code points 256, 257, ... in byte order. Maps a token's character to its byte."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[chr(b)] = b
        else:
            chars[chr(256 + extra)] = b
            extra += 1
    return chars


class TokenText:
    """A tokenizer's token ids as (text, bytes), cached."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        backend = getattr(tokenizer, "backend_tokenizer", None)
        byte_level = backend is not None and type(backend.decoder).__name__ == "ByteLevel"
        self._alphabet = _byte_level_alphabet() if byte_level else None
        self._added = set(getattr(tokenizer, "added_tokens_decoder", {}))   # their text is their content
        self.bytes = lru_cache(maxsize=1 << 16)(self._bytes)

    def _bytes(self, token_id: int) -> bytes:
        """The token's own bytes: a byte-level piece mapped back through the alphabet; a
        SentencePiece byte token (`<0xE2>`) its byte; another SentencePiece piece decoded, with
        the leading space (`▁`) decode strips from a lone token put back, as vLLM does."""
        text = self.tokenizer.decode([token_id])
        piece = self.tokenizer.convert_ids_to_tokens(token_id)
        if piece is None or token_id in self._added:
            return text.encode("utf-8")
        if self._alphabet is not None:
            if all(c in self._alphabet for c in piece):
                return bytes(self._alphabet[c] for c in piece)
        elif m := _BYTE_PIECE.fullmatch(piece):
            return bytes([int(m.group(1), 16)])
        else:
            missing = (len(piece) - len(piece.lstrip("▁"))) - (len(text) - len(text.lstrip(" ")))
            return (" " * max(missing, 0) + text).encode("utf-8")
        return text.encode("utf-8")

    def text(self, token_id: int) -> str:
        """The token as text; one that is not whole UTF-8 (part of a character) as OpenAI
        writes it, `bytes:\\xe6\\x97`, so that distinct tokens stay distinct."""
        raw = self.bytes(token_id)
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            return "bytes:" + "".join(f"\\x{b:02x}" for b in raw)


def chat(entries: list, tokens: list[int], text: TokenText) -> dict:
    def item(token_id: int, logprob: float) -> dict:
        return {"token": text.text(token_id), "logprob": logprob, "bytes": list(text.bytes(token_id))}

    return {"content": [{**item(tok, lp), "top_logprobs": [item(t, v) for t, v in top]}
                        for tok, (lp, top) in zip(tokens, entries)]}


def completion(entries: list, tokens: list[int], text: TokenText, offset: int) -> tuple[dict, int]:
    """-> (the logprobs object, the text offset after its tokens). An entry may be None (the
    first prompt token's)."""
    out: dict = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for tok, entry in zip(tokens, entries):
        piece = text.text(tok)
        out["tokens"].append(piece)
        out["text_offset"].append(offset)
        offset += len(text.bytes(tok).decode("utf-8", "replace"))
        if entry is None:
            out["token_logprobs"].append(None)
            out["top_logprobs"].append(None)
            continue
        lp, top = entry
        out["token_logprobs"].append(lp)
        out["top_logprobs"].append({**{text.text(t): v for t, v in top}, piece: lp})
    return out, offset
