"""Streaming detokenization with stop strings, one instance per request.

Incremental decoding (the prefix/read offset scheme of HF text-generation-inference and
vLLM): `ids[prefix_offset:read_offset]` is a short window of tokens whose text was already
emitted, kept as context because a token's text can depend on its neighbours (leading
spaces of SentencePiece, bytes of a character split across byte-level BPE tokens). For
each new token only the window is decoded:

    prefix_text = decode(ids[prefix_offset:read_offset])
    new_text    = decode(ids[prefix_offset:])
    delta       = new_text[len(prefix_text):]

A delta ending in U+FFFD is an incomplete UTF-8 sequence: nothing is emitted and the
offsets stay, so the next token re-decodes the bytes together. Decoding costs O(window)
per token, never O(sequence).

Stop strings: the text not yet emitted is searched for the earliest occurrence of any stop
string; text before it is emitted, the stop string and everything after never are. Until
then, the longest suffix that could still grow into a stop string is held back, so no part
of a stop string is ever streamed to a client.

Output equals `tokenizer.decode(ids, skip_special_tokens=..., clean_up_tokenization_spaces=False)`
of the generated ids, cut before a stop string: streamed text cannot be cleaned up afterwards.
"""

from collections.abc import Sequence

# Prompt tokens decoded as context before the first generated token.
PROMPT_CONTEXT_TOKENS = 5


class IncrementalDetokenizer:
    def __init__(
        self,
        tokenizer,
        prompt_ids: Sequence[int],
        stop: Sequence[str] = (),
        skip_special_tokens: bool = True,
    ):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.stop = list(stop)
        assert all(self.stop), "stop strings must be non-empty (SamplingParams.validate checks this)"
        self._max_stop_len = max((len(s) for s in self.stop), default=0)
        # Every proper prefix of a stop string: a text suffix in here may become a stop.
        self._stop_prefixes = {s[:j] for s in self.stop for j in range(1, len(s))}

        self._ids = list(prompt_ids[-PROMPT_CONTEXT_TOKENS:])   # the decode window, trimmed as we go
        self._prefix_offset = 0
        self._read_offset = len(self._ids)
        self._prefix_text: str | None = None    # decode(ids[prefix_offset:read_offset]), cached
        self._held = ""                          # decoded, not yet emitted (may begin a stop string)

        self.text = ""                           # everything emitted so far
        self.stopped = False                     # a stop string matched; append no more
        self.stop_string: str | None = None      # which one

    def _decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(
            ids, skip_special_tokens=self.skip_special_tokens, clean_up_tokenization_spaces=False
        )

    def _decode_next(self, token_id: int) -> str:
        """Add one token; return the new complete text it makes available (maybe "")."""
        self._ids.append(token_id)
        if self._prefix_text is None:
            self._prefix_text = self._decode(self._ids[self._prefix_offset : self._read_offset])
        new_text = self._decode(self._ids[self._prefix_offset :])
        if len(new_text) <= len(self._prefix_text) or new_text.endswith("\ufffd"):
            return ""    # nothing new yet, or an incomplete character: wait for more bytes
        delta = new_text[len(self._prefix_text) :]
        # The emitted tokens become the context window of the next decode.
        del self._ids[: self._read_offset]
        self._prefix_offset, self._read_offset = 0, len(self._ids)
        self._prefix_text = None
        return delta

    def _find_stop(self, text: str, start: int) -> tuple[int, str] | None:
        """Earliest (position, stop string) in text[start:], or None."""
        best = None
        for s in self.stop:
            pos = text.find(s, start)
            if pos != -1 and (best is None or pos < best[0]):
                best = (pos, s)
        return best

    def _holdback_len(self, text: str) -> int:
        """Length of the longest suffix of text that is a proper prefix of a stop string."""
        for n in range(min(len(text), self._max_stop_len - 1), 0, -1):
            if text[-n:] in self._stop_prefixes:
                return n
        return 0

    def append(self, token_ids: Sequence[int]) -> tuple[str, int | None]:
        """Feed newly generated tokens; return (text_delta, stop_index).

        stop_index is the index in token_ids of the token during which a stop string
        completed (tokens after it are ignored; the request should end), else None.
        """
        if self.stopped:
            raise RuntimeError(f"append after stop string {self.stop_string!r} matched")
        pending = self._held
        for i, token_id in enumerate(token_ids):
            piece = self._decode_next(token_id)
            if not piece:
                continue
            # Only a match ending inside `piece` is new: earlier text was searched already.
            search_from = max(0, len(pending) - self._max_stop_len + 1)
            pending += piece
            if self.stop and (hit := self._find_stop(pending, search_from)) is not None:
                pos, self.stop_string = hit
                self.stopped = True
                self._held = ""
                self.text += pending[:pos]
                return pending[:pos], i
        n_held = self._holdback_len(pending) if self.stop else 0
        delta = pending[: len(pending) - n_held]
        self._held = pending[len(pending) - n_held :]
        self.text += delta
        return delta, None

    def flush(self) -> str:
        """Text still held back when the request ends without a stop string.

        That is the held suffix that might have begun a stop string, plus the text of any
        trailing incomplete UTF-8 bytes (decoded as U+FFFD, as tokenizer.decode would).
        """
        if self.stopped:
            return ""
        tail = ""
        if len(self._ids) > self._read_offset:
            if self._prefix_text is None:
                self._prefix_text = self._decode(self._ids[self._prefix_offset : self._read_offset])
            tail = self._decode(self._ids[self._prefix_offset :])[len(self._prefix_text) :]
            del self._ids[: len(self._ids)]
            self._prefix_offset = self._read_offset = 0
            self._prefix_text = None
        out = self._held + tail
        self._held = ""
        self.text += out
        return out
