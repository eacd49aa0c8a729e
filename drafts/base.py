"""The Drafter protocol: propose a DraftTree for each decoding sequence."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from specserve.request import Request
from specserve.scheduler import ScheduledSeq
from specserve.controller import EarlyStop
from specserve.tree import DraftTree


@dataclass
class TreeShape:
    """What to build this step: `depth` levels; `kind` chain | fixed | dynamic.
    fixed: node at depth d gets branching[d-1] children (its draft top-k);
    dynamic: each level expands the top-`topk` children of the `topk` most probable
    frontier nodes; the best `num_nodes` nodes by path probability are kept (EAGLE-2).
    Chains may be cut while drafting by `early_stop` (controller.EarlyStop)."""

    kind: str
    depth: int
    branching: tuple[int, ...] = ()
    topk: int = 4
    early_stop: EarlyStop | None = None


class Drafter(Protocol):
    has_kv: bool  # True when the drafter keeps KV in the shared pool (a model drafter)
    levels_run: int  # draft forwards that grew trees in the last propose()

    def propose(
        self, seqs: list[ScheduledSeq], shape: TreeShape, prefills: list[ScheduledSeq]
    ) -> list[DraftTree]:
        """One tree per sequence in `seqs`, at most seq.num_spec_nodes nodes each; a drafter
        with KV also catches it up on `prefills`' prompt chunks."""

    def forget(self, request: Request) -> None:
        """The request has finished."""
