"""A small language model as drafter. Its KV lives in the shared pool under the target's block ids.

Each propose() starts with one "catch-up" forward over every token the draft has not seen
(prompt chunks being prefilled, the target's bonus token, tokens accepted from a branch),
whose last row gives the first level of the tree. Each further level is one more forward:
- chain: feed the newest node only; its KV lands at its final position, so after
  verification the draft keeps the KV of the accepted nodes it has fed (no copy, no redo).
  With early stop (TreeShape.early_stop, controller.py) a chain ends before its first node
  whose path probability (the product of the draft's probabilities of its nodes) does not
  pay for its verify row, and no level runs that would not pay for itself. A sampled node
  is kept only when its own draw passes that bar, so a kept one was drawn from q restricted
  to the tokens that pass, renormalised: that is the q it is verified against, and sampled
  verification stays lossless (Leviathan et al.'s rule holds for any proposal law, as long
  as it is the law the token was drawn from);
- trees: feed every expanded node so far with the ancestor mask (rows are rewritten each
  level, which keeps slot use inside the reserved scratch). After verification the draft's
  tree KV is dropped and the accepted tokens are caught up in the next step's first forward.
"""

from __future__ import annotations

import torch

from specserve.request import Request
from specserve.runner import ForwardInput, ModelRunner, slots_for
from specserve.sampling import SamplingTensors, sample, target_probs
from specserve.scheduler import ScheduledSeq
from specserve.tree import DraftTree, ancestor_mask

from .base import TreeShape


class _Growing:
    """One sequence's tree while it grows."""

    def __init__(self, seq: ScheduledSeq, shape: TreeShape):
        self.seq = seq
        self.req = seq.request
        self.tree = DraftTree()
        self.frontier: list[int] = []  # nodes to expand at the next level
        self.fed: list[int] = []  # nodes fed so far (trees), in feeding order
        self.budget = seq.num_spec_nodes
        # A step emits the accepted run plus one token: with `left` to go, nodes deeper than
        # left - 1 could only be thrown away after verification.
        self.max_depth = min(shape.depth, self.budget, self.req.num_tokens_left - 1)
        self.q_rows: list[torch.Tensor | None] = []

    def drop_last(self) -> None:
        """A chain's newest node is not worth its verify row: the chain ends before it."""
        t = self.tree
        for column in (t.tokens, t.parents, t.is_sampled, t.path_probs, self.q_rows):
            column.pop()
        self.frontier = []

    def add(self, token: int, parent: int, prob: float, sampled: bool, q: torch.Tensor | None) -> int:
        t = self.tree
        t.tokens.append(token)
        t.parents.append(parent)
        t.is_sampled.append(sampled)
        t.path_probs.append(prob * (t.path_probs[parent] if parent >= 0 else 1.0))
        self.q_rows.append(q)
        return t.num_nodes - 1


def _passing(g: _Growing, bar: float) -> torch.Tensor:
    """The law of g's newest (sampled) node given that it is kept: its q on the tokens whose
    path probability exceeds `bar` (the products as keep() compares them), renormalised."""
    t = g.tree
    parent = t.parents[-1]
    path = t.path_probs[parent] if parent >= 0 else 1.0
    q = g.q_rows[-1]
    kept = q * (q.double() * path > bar)
    total = kept.sum()
    return kept / total if total > 0 else q   # total 0: the node is dropped next


class ModelDrafter:
    has_kv = True
    levels_run = 0   # draft forwards that grew trees in the last propose()

    def __init__(self, runner: ModelRunner, target_vocab_size: int | None = None):
        self.runner = runner
        self.block_size = runner.block_size
        # A draft whose embedding is padded wider than the target's must not propose ids the
        # target cannot embed.
        self.vocab_limit = target_vocab_size

    def _catch_up(self, inp: ForwardInput, req: Request, end: int, want_logits: bool) -> None:
        start = req.num_draft_computed_tokens
        n = end - start
        tokens = req.token_ids[start:end]
        vocab = self.runner.args.vocab_size
        if any(t >= vocab for t in tokens):
            # An id from the target's padded vocabulary that the draft cannot embed: the draft
            # reads it as token 0. Only the draft's guesses suffer; the output is the target's.
            tokens = [t if t < vocab else 0 for t in tokens]
        inp.add(
            tokens,
            list(range(start, end)),
            slots_for(req.block_table, self.block_size, start, n),
            req.block_table,
            end,
            logit_rows=[n - 1] if want_logits else [],
        )

    def _add_prefills(self, inp: ForwardInput, prefills: list[ScheduledSeq]) -> list[tuple[Request, int]]:
        """Rows that keep the draft's KV level with the target's prompt chunks of this step."""
        ends = []
        for s in prefills:
            end = s.request.num_computed_tokens + s.num_new_tokens
            if end > s.request.num_draft_computed_tokens:
                self._catch_up(inp, s.request, end, want_logits=False)
                ends.append((s.request, end))
        return ends

    @torch.inference_mode()
    def propose(self, seqs: list[ScheduledSeq], shape: TreeShape, prefills: list[ScheduledSeq]) -> list[DraftTree]:
        self.levels_run = 0
        grows = [_Growing(s, shape) for s in seqs]
        active = [g for g in grows if g.max_depth > 0]
        # Level 1: one forward that catches the draft up on everything, prompts included.
        inp = ForwardInput()
        ends = self._add_prefills(inp, prefills)
        for g in active:
            self._catch_up(inp, g.req, g.req.num_tokens, want_logits=True)
            ends.append((g.req, g.req.num_tokens))
        logits = self.runner.forward(inp) if inp.num_rows else None
        for req, end in ends:
            req.num_draft_computed_tokens = end
        parents = [[-1] for _ in active]
        stop = shape.early_stop if shape.kind == "chain" else None
        for depth in range(1, shape.depth + 1):
            if logits is None or not active:
                break
            self.levels_run = depth
            self._expand(active, parents, logits, shape, depth)
            if stop is not None:
                for g in active:
                    if g.q_rows[-1] is not None:
                        g.q_rows[-1] = _passing(g, stop.bar())
                    if not stop.keep(g.tree.path_probs[-1]):
                        g.drop_last()
            active = [g for g in active if g.frontier and depth < g.max_depth]
            if not active or (stop is not None and not stop.next_level([g.tree.path_probs[-1] for g in active])):
                break
            inp = ForwardInput()
            parents = []
            for g in active:
                parents.append(self._feed(inp, g, shape))
            logits = self.runner.forward(inp)
        return [self._finish(g, shape) for g in grows]

    def _expand(self, active, parents, logits, shape: TreeShape, depth: int) -> None:
        """Children of each active sequence's frontier nodes. `parents[i]` lists the nodes whose
        logits rows (in order) belong to sequence i; logits: [sum of those, V]."""
        if self.vocab_limit is not None and logits.shape[1] > self.vocab_limit:
            logits = logits[:, : self.vocab_limit]
        width = 1 if shape.kind == "chain" else (
            shape.branching[depth - 1] if shape.kind == "fixed" else shape.topk)
        if all(g.req.params.is_greedy for g in active):
            # Greedy requests: the draft's own softmax ranks children (no top-k/top-p to apply),
            # and a chain needs only the argmax, so no per-row sampling tensors are built.
            q = None if shape.kind == "chain" else torch.softmax(logits.float(), dim=-1)
        else:
            params = [g.req.params for g, plist in zip(active, parents) for _ in plist]
            tensors = SamplingTensors.from_params(params, logits.device)
            q = target_probs(logits, tensors.temperature, tensors.top_k, tensors.top_p,
                             tensors.any_restricted)  # [R, V]
        if shape.kind == "chain" and q is None:
            # The argmax and its probability (the controller's early stop and its calibration
            # check read the path probabilities), off one softmax: one fused kernel.
            top, chosen = torch.softmax(logits.float(), dim=-1).max(dim=-1)
            top_p_vals, chosen = top.tolist(), chosen.tolist()
        elif shape.kind == "chain":
            gens = [g.req.generator for g, plist in zip(active, parents) for _ in plist]
            chosen = sample(logits, tensors.temperature, tensors.top_k, tensors.top_p, gens, probs=q).tolist()
            top_p_vals = q.gather(1, torch.tensor(chosen, device=q.device)[:, None]).squeeze(1).tolist()
        else:
            top_vals, top_ids = q.topk(width, dim=-1)
            top_vals, top_ids = top_vals.tolist(), top_ids.tolist()
        row = 0
        for g, plist in zip(active, parents):
            new_nodes = []
            for parent in plist:
                if shape.kind == "chain":
                    sampled = not g.req.params.is_greedy
                    node = g.add(chosen[row], parent, top_p_vals[row], sampled, q[row] if sampled else None)
                    new_nodes.append(node)
                else:
                    for tok, prob in zip(top_ids[row], top_vals[row]):
                        if prob > 0.0:
                            new_nodes.append(g.add(tok, parent, prob, False, None))
                row += 1
            if shape.kind == "dynamic":
                new_nodes.sort(key=lambda k: -g.tree.path_probs[k])
                new_nodes = new_nodes[: shape.topk]
            # Only nodes whose KV fits the reserved scratch can be fed to grow another level.
            room = g.budget - (len(g.fed) if shape.kind != "chain" else g.tree.num_nodes - 1)
            g.frontier = new_nodes[: max(0, room)]

    def _feed(self, inp: ForwardInput, g: _Growing, shape: TreeShape) -> list[int]:
        """Add the rows that give logits for g's frontier; returns the frontier (row order)."""
        req, base = g.req, g.req.num_tokens
        tree = g.tree
        if shape.kind == "chain":
            node = g.frontier[0]  # == tree.num_nodes - 1: node k sits at position base + k
            inp.add(
                [tree.tokens[node]],
                [base + node],
                slots_for(req.block_table, self.block_size, base + node, 1),
                req.block_table,
                base + node + 1,
                logit_rows=[0],
            )
            return [node]
        g.fed.extend(g.frontier)
        rows = g.fed
        depths = tree.depths
        index = {node: r for r, node in enumerate(rows)}
        mask = ancestor_mask([index[tree.parents[k]] if tree.parents[k] >= 0 else -1 for k in rows])
        inp.add(
            [tree.tokens[k] for k in rows],
            [base - 1 + depths[k] for k in rows],
            slots_for(req.block_table, self.block_size, base, len(rows)),
            req.block_table,
            base + len(rows),
            logit_rows=[index[k] for k in g.frontier],
            mask=mask,
        )
        return list(g.frontier)

    def _finish(self, g: _Growing, shape: TreeShape) -> DraftTree:
        tree = g.tree
        if any(q is not None for q in g.q_rows):
            vocab = next(q for q in g.q_rows if q is not None).shape[0]
            tree.draft_probs = torch.stack(
                [q if q is not None else torch.zeros(vocab, device=self.runner.device) for q in g.q_rows]
            )
        if shape.kind != "chain" and tree.num_nodes > g.budget:
            # Best nodes by path probability; a parent is at least as probable as its child,
            # and ties go to the shallower node, so the kept set is closed under parents.
            depths = tree.depths
            order = sorted(range(tree.num_nodes), key=lambda k: (-tree.path_probs[k], depths[k], k))
            tree = tree.select(order[: g.budget])
        elif shape.kind != "chain":
            tree = tree.select(list(range(tree.num_nodes)))  # BFS order
        return tree

    def forget(self, request: Request) -> None:
        pass
