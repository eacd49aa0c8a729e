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

Stop strings are matched in linear time and memory: one Knuth-Morris-Pratt automaton per
stop string reads the new text once, character by character; its state is the longest
prefix of the stop string that ends the text so far. The first stop string to complete
ends the output (of two completing at one character, the longer, which started earlier):
text before it is emitted, the stop string and everything after never are. Until then, as
many characters as the largest state are held back, so no part of a stop string is ever
streamed to a client (with `include_stop`, the stop string is emitted and ends the output,
and nothing is held). As in vLLM, a stop string ends the output only when it completes in
the text of a token past the first `min_tokens`; one completing earlier is text like any.

Output equals `tokenizer.decode(ids, skip_special_tokens=..., clean_up_tokenization_spaces=False)`
of the generated ids, cut before a stop string: streamed text cannot be cleaned up afterwards.
"""

from collections.abc import Sequence

# Prompt tokens decoded as context before the first generated token.
PROMPT_CONTEXT_TOKENS = 5


def _failure(s: str) -> list[int]:
    """KMP failure table: f[i] = the length of the longest proper prefix of s[:i + 1] that is
    also its suffix."""
    f = [0] * len(s)
    k = 0
    for i in range(1, len(s)):
        while k and s[i] != s[k]:
            k = f[k - 1]
        if s[i] == s[k]:
            k += 1
        f[i] = k
    return f


class IncrementalDetokenizer:
    def __init__(
        self,
        tokenizer,
        prompt_ids: Sequence[int],
        stop: Sequence[str] = (),
        skip_special_tokens: bool = True,
        min_tokens: int = 0,
        include_stop: bool = False,
    ):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.stop = list(stop)
        assert all(self.stop), "stop strings must be non-empty (SamplingParams.validate checks this)"
        self._failure = [_failure(s) for s in self.stop]   # KMP tables
        self._state = [0] * len(self.stop)                 # matched prefix length of each stop string
        self.min_tokens = min_tokens
        self.include_stop = include_stop
        self._num_tokens = 0                               # generated tokens appended so far

        self._ids = list(prompt_ids[-PROMPT_CONTEXT_TOKENS:])   # the decode window, trimmed as we go
        self._prefix_offset = 0
        self._read_offset = len(self._ids)
        # A token-id prompt may end inside a character: its last bytes are not text shown yet
        # but the start of the output's first character (at most 3 bytes follow a first byte).
        # A prompt ending in the character U+FFFD itself reads the same: that character then
        # begins the output's text too.
        for _ in range(3):
            if not self._read_offset or not self._decode(self._ids[: self._read_offset]).endswith("\ufffd"):
                break
            self._read_offset -= 1
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
        delta = self._new_text(new_text)
        # The emitted tokens become the context window of the next decode.
        del self._ids[: self._read_offset]
        self._prefix_offset, self._read_offset = 0, len(self._ids)
        self._prefix_text = None
        return delta

    def _new_text(self, new_text: str) -> str:
        """The text of ids[read_offset:] given new_text = decode(ids[prefix_offset:]). Where the
        decoder rewrote the context (ByteFallback turns a run of byte tokens holding an invalid
        byte into one U+FFFD per byte) the new tokens are decoded alone."""
        if new_text.startswith(self._prefix_text):
            return new_text[len(self._prefix_text) :]
        return self._decode(self._ids[self._read_offset :])

    def _advance(self, piece: str) -> tuple[int, str] | None:
        """Run the automata over `piece`; (index just past the match in piece, stop string) of
        the first stop string to complete, else None (always None within `min_tokens`: the
        automata still read the piece)."""
        armed = self._num_tokens > self.min_tokens
        for end, c in enumerate(piece, 1):
            hit = None
            for k, (s, fail) in enumerate(zip(self.stop, self._failure)):
                m = self._state[k]
                while m and s[m] != c:
                    m = fail[m - 1]
                if s[m] == c:
                    m += 1
                if m == len(s):
                    if hit is None or len(s) > len(hit):
                        hit = s
                    m = fail[m - 1]
                self._state[k] = m
            if hit is not None and armed:
                return end, hit
        return None

    def append(self, token_ids: Sequence[int]) -> tuple[str, int | None]:
        """Feed newly generated tokens; return (text_delta, stop_index).

        stop_index is the index in token_ids of the token during which a stop string
        completed (tokens after it are ignored; the request should end), else None.
        """
        if self.stopped:
            raise RuntimeError(f"append after stop string {self.stop_string!r} matched")
        pending = self._held
        for i, token_id in enumerate(token_ids):
            self._num_tokens += 1
            piece = self._decode_next(token_id)
            if not piece:
                continue
            hit = self._advance(piece) if self.stop else None
            pending += piece
            if hit is not None:
                end, self.stop_string = hit
                pos = len(pending) - len(piece) + end - (0 if self.include_stop else len(self.stop_string))
                self.stopped = True
                self._held = ""
                self.text += pending[:pos]
                return pending[:pos], i
        n_held = 0 if self.include_stop else min(len(pending), max(self._state, default=0))
        delta = pending[: len(pending) - n_held]
        self._held = pending[len(pending) - n_held :]
        self.text += delta
        return delta, None

    def flush(self) -> str:
        """Text still held back when the request ends without a stop string.

        That is the held suffix that might have begun a stop string, plus the text of any
        trailing incomplete UTF-8 bytes (decoded as U+FFFD, as tokenizer.decode would). That
        text is read for stop strings too (a character before the incomplete bytes may end
        one): on a match the output is cut before it and `stopped` is set.
        """
        if self.stopped:
            return ""
        tail = ""
        if len(self._ids) > self._read_offset:
            if self._prefix_text is None:
                self._prefix_text = self._decode(self._ids[self._prefix_offset : self._read_offset])
            tail = self._new_text(self._decode(self._ids[self._prefix_offset :]))
            del self._ids[: len(self._ids)]
            self._prefix_offset = self._read_offset = 0
            self._prefix_text = None
        out = self._held + tail
        if self.stop and (hit := self._advance(tail)) is not None:
            end, self.stop_string = hit
            self.stopped = True
            out = out[: len(self._held) + end - (0 if self.include_stop else len(self.stop_string))]
        self._held = ""
        self.text += out
        return out
