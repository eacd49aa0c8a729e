"""Prompt-lookup drafter: no model, no KV.

If the last n tokens appeared earlier in the sequence (prompt or output), propose what
followed their most recent earlier occurrence. Longer suffixes are tried first. Code and
chats that quote their prompt repeat themselves, which is where this pays.
"""

from __future__ import annotations

from specserve.request import Request
from specserve.scheduler import ScheduledSeq
from specserve.tree import DraftTree

from .base import TreeShape


def lookup(token_ids: list[int], ngram_min: int, ngram_max: int, num_tokens: int) -> list[int]:
    """Continuation (up to num_tokens) of the most recent earlier occurrence of the longest
    suffix of length in [ngram_min, ngram_max] that occurs earlier."""
    total = len(token_ids)
    for n in range(min(ngram_max, total - 1), ngram_min - 1, -1):
        suffix = token_ids[total - n :]
        first = suffix[0]
        # Scan backwards for an earlier start i with token_ids[i:i+n] == suffix (i + n < total).
        i = total - n - 1
        while i >= 0:
            if token_ids[i] == first and token_ids[i : i + n] == suffix:
                return token_ids[i + n : i + n + num_tokens]
            i -= 1
    return []


class NgramDrafter:
    has_kv = False
    levels_run = 0   # no forwards: a lookup costs no draft level

    def __init__(self, ngram_min: int, ngram_max: int):
        self.ngram_min = ngram_min
        self.ngram_max = ngram_max

    def propose(self, seqs: list[ScheduledSeq], shape: TreeShape, prefills: list[ScheduledSeq]) -> list[DraftTree]:
        # A chain whatever the shape: one earlier occurrence gives one continuation.
        trees = []
        for s in seqs:
            # No deeper than the request can still emit (the accepted run plus one token).
            want = max(0, min(shape.depth, s.num_spec_nodes, s.request.num_tokens_left - 1))
            tokens = lookup(s.request.token_ids, self.ngram_min, self.ngram_max, want) if want else []
            trees.append(DraftTree.chain(tokens))
        return trees

    def forget(self, request: Request) -> None:
        pass
