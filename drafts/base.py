"""The Drafter protocol: propose a DraftTree for each decoding sequence."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from specserve.request import Request
from specserve.scheduler import ScheduledSeq
from specserve.tree import DraftTree


@dataclass
class TreeShape:
    """What to build this step: `depth` levels; `kind` chain | fixed | dynamic.
    fixed: node at depth d gets branching[d-1] children (its draft top-k);
    dynamic: each level expands the top-`topk` children of the `topk` most probable
    frontier nodes; the best `num_nodes` nodes by path probability are kept (EAGLE-2).
    A chain may stop short of `depth` for a sequence whose path probability fell below
    `stop_below` (its last node, the one that fell below, is kept), and every chain of the
    batch stops when the next level would not pay for itself (`level_below`)."""

    kind: str
    depth: int
    branching: tuple[int, ...] = ()
    topk: int = 4
    # Chains: a sequence stops growing once its path probability (the product of the draft's
    # probabilities of its nodes) is below this; 0 = always to `depth`.
    stop_below: float = 0.0
    # Chains: the next draft level runs only while the chains still growing have path
    # probabilities over stop_below that sum to at least this (a level is one forward for the
    # whole batch: worth it when the tokens it may add, about the sum of those probabilities,
    # beat what it costs in the step's goodput); 0 = no such rule.
    level_below: float = 0.0


class Drafter(Protocol):
    has_kv: bool  # True when the drafter keeps KV in the shared pool (a model drafter)

    def prefill(self, prefills: list[ScheduledSeq]) -> None:
        """Keep the drafter's KV in step with the target's prompt prefill (chunks)."""

    def propose(
        self, seqs: list[ScheduledSeq], shape: TreeShape, prefills: list[ScheduledSeq]
    ) -> list[DraftTree]:
        """One tree per sequence in `seqs`, at most seq.num_spec_nodes nodes each."""

    def forget(self, request: Request) -> None:
        """The request has finished."""
