"""One speculative step: plan -> propose -> verify input -> ONE target forward -> accept -> commit.

Plain decoding is this step with no nodes. Every decoding sequence verifies its pending
token (position T - 1, T = tokens so far) and its tree's nodes in BFS order: node k at RoPE
position T - 1 + depth(k) and the scratch slot of position T + k, seeing the committed
prefix, the pending token, its ancestors and itself. Prompt chunks ride in the same forward
with their causal rows.

Acceptance is the tree-verification kernel (kernels/tree_accept.py, DESIGN.md §5) over
every decoding sequence at once, a sequence without nodes included (the kernel then samples
its one token): greedy follows the target's argmax; sampled requests use multi-round
speculative sampling (Leviathan et al. 2023; Miao et al. 2023, SpecInfer), so the output
follows the target's distribution. Accepted nodes off the chain are compacted to positions
T..T+a-1 (target KV; the draft re-reads accepted branch tokens in its next catch-up).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

import torch

from specserve.config import EngineConfig
from specserve.controller import AdaptiveController, ControllerConfig, Plan
from specserve.drafts.base import TreeShape
from specserve.errors import InvalidRequestError
from specserve.kernels import ops
from specserve.kernels.reference import greedy_walk
from specserve.request import Request
from specserve.runner import ForwardInput, slots_for
from specserve.sampling import SamplingTensors, mask_tokens, penalize, target_probs, token_logprobs
from specserve.scheduler import ScheduledSeq, SchedulerOutput
from specserve.tree import DraftTree, fixed_tree_size

logger = logging.getLogger("specserve")

_NO_TREE = DraftTree()


@dataclass
class SpecTotals:
    """Engine-wide speculative counters (exported as metrics)."""

    num_drafts: int = 0            # trees verified
    num_draft_tokens: int = 0      # their nodes
    num_accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)
    num_emitted_tokens: int = 0    # tokens of verify passes that checked a tree (accepted + bonus)
    last_depth: int = 0

    @property
    def mean_tokens_per_pass(self) -> float:
        return self.num_emitted_tokens / self.num_drafts if self.num_drafts else 1.0


@dataclass
class _Verified:
    seq: ScheduledSeq
    tree: DraftTree
    first_row: int         # its first logit row (the pending token's)


class Speculator:
    """Plans each step (the adaptive controller, or a static depth) and runs it."""

    def __init__(self, config: EngineConfig, engine, drafter):
        self.config = config
        self.engine = engine
        self.drafter = drafter            # None: [draft] kind = "none"
        self.tree_kind = config.spec.tree if drafter is not None and drafter.has_kv else "chain"
        self.static_depth = config.spec.depth
        self.controller: AdaptiveController | None = None   # None while a static depth plans
        self.totals = SpecTotals()
        self._observed: tuple | None = None   # this step's measurements, for end_step()
        self._detached: AdaptiveController | None = None   # the controller while a static depth plans
        self._finished: list[str] = []    # requests to forget once the step that ended them is learned
        self.failed: dict[str, str] = {}  # request id -> why its part of this step raised (it fails alone)
        if drafter is not None and config.spec.mode == "adaptive":
            self.controller = self.make_controller()

    # -- the setting ---------------------------------------------------------------------

    def max_depth(self) -> int:
        spec = self.config.spec
        return min(spec.max_depth, len(spec.branching)) if self.tree_kind == "fixed" else spec.max_depth

    def nodes_at(self, depth: int) -> int:
        spec = self.config.spec
        if self.tree_kind == "fixed":
            return fixed_tree_size(spec.branching, depth)
        if self.tree_kind == "dynamic":
            return min(spec.num_nodes, depth * spec.topk)
        return depth

    def buckets(self) -> list[int]:
        """The controller's batch buckets: powers of two up to the largest batch a step can
        decode (max_num_seqs, or the token budget), and that."""
        sched = self.config.scheduler
        largest = min(sched.max_num_seqs, sched.max_num_batched_tokens)
        buckets = [1 << i for i in range(largest.bit_length()) if 1 << i <= largest]
        return buckets if buckets[-1] == largest else buckets + [largest]

    def make_controller(self) -> AdaptiveController:
        from specserve import profile

        max_depth = self.max_depth()
        curve = profile.initial_curve(self.engine, self.buckets(), self.nodes_at(max_depth) + 1)
        trees = None if self.tree_kind == "chain" else [self.nodes_at(d) for d in range(max_depth + 1)]
        return AdaptiveController(curve, trees, ControllerConfig(max_depth=max_depth),
                                  path_probs=self.drafter.has_kv)

    def setting(self) -> dict:
        if self.drafter is None:
            return {"mode": "off"}
        if self.controller is not None:
            return {"mode": "adaptive"}
        return {"mode": "static", "depth": self.static_depth}

    def costs_changed(self) -> None:
        """The forwards' costs changed (a compiled forward was taken up): the controller probes
        afresh, and one kept while a static depth plans is dropped (a switch to adaptive probes)."""
        self._detached = None
        if self.controller is not None:
            self.controller = self.make_controller()

    def set_setting(self, mode: str, depth: int | None = None) -> dict:
        """Switch between the adaptive controller and a static depth between two steps. Any
        depth is exact (verification keeps only what the target agrees with), so requests in
        flight carry on. A static setting keeps the controller's state for a later switch back."""
        if self.drafter is None:
            raise InvalidRequestError("this server has no draft ([draft] kind = 'none'): there is no "
                                      "speculation to switch", param="mode")
        if mode == "adaptive":
            if depth is not None:
                raise InvalidRequestError("'depth' is only for mode 'static'", param="depth")
            self.controller = self.controller or self._detached or self.make_controller()
            self._detached = None
        elif mode == "static":
            limit = self.max_depth()
            if not isinstance(depth, int) or isinstance(depth, bool) or not 0 <= depth <= limit:
                raise InvalidRequestError(f"mode 'static' needs an integer 'depth' in 0..{limit}, got {depth!r}",
                                          param="depth")
            self._detached = self.controller or self._detached
            self.controller = None
            self.static_depth = depth
        else:
            raise InvalidRequestError(f"unknown speculation mode {mode!r}: 'adaptive' or 'static'", param="mode")
        return self.setting()

    # -- the plan ------------------------------------------------------------------------

    def plan(self, running: list[Request]) -> Plan:
        if self.drafter is None:
            return Plan()
        # Nodes a request can still use: the drafters stop one short of max_tokens (the step's
        # bonus token is the last), the scheduler at the context's end.
        room = self.engine.max_model_len
        decoding = [r for r in running if r.num_computed_tokens >= r.num_tokens - 1]   # not mid-prompt
        caps = [(r, max(0, min(r.num_tokens_left - 1, room - r.num_tokens))) for r in decoding]
        if self.controller is not None:
            context = sum(r.num_computed_tokens for r in decoding) / max(len(decoding), 1)
            plan = self.controller.plan([(r.request_id, cap, not r.params.is_greedy) for r, cap in caps], context)
        else:
            d = min(self.static_depth, self.max_depth())
            plan = Plan(depth=d, nodes={r.request_id: self.nodes_at(min(d, cap)) for r, cap in caps if d and cap})
        self.totals.last_depth = plan.depth
        return plan

    def shape(self, plan: Plan) -> TreeShape:
        spec = self.config.spec
        return TreeShape(kind=self.tree_kind, depth=plan.depth, branching=tuple(spec.branching), topk=spec.topk,
                         early_stop=plan.early_stop)

    # -- the step ------------------------------------------------------------------------

    def step(self, batch: SchedulerOutput, plan: Plan) -> dict[str, list[int]]:
        """Run one step; returns each decoding sequence's new tokens."""
        if batch.is_empty:
            self._observed = None
            return {}
        engine, block_size = self.engine, self.engine.pool.block_size
        decoding = [s.request.num_computed_tokens for s in batch.seqs if not s.is_prefill]
        context = sum(decoding) / max(len(decoding), 1)   # cached tokens a decoding sequence, before the step
        t0 = time.perf_counter()
        # Propose: a tree per sequence given nodes. The draft's first forward also catches it up
        # on what it has not seen: this step's prompt chunks, the last step's accepted tokens.
        spec_seqs = [s for s in batch.seqs if s.num_spec_nodes]
        prefills = [s for s in batch.seqs if s.is_prefill]
        trees: dict[str, DraftTree] = {}
        backlog = levels = 0   # levels: draft forwards that grew trees this step (none unless propose ran)
        if self.drafter is not None and (spec_seqs or (prefills and self.drafter.has_kv)):
            backlog = max((s.request.num_tokens - s.request.num_draft_computed_tokens for s in spec_seqs), default=0)
            proposed = self.drafter.propose(spec_seqs, self.shape(plan), prefills)
            trees = {s.request.request_id: t for s, t in zip(spec_seqs, proposed) if t.num_nodes}
            levels = self.drafter.levels_run
        t1 = time.perf_counter()

        # The verify input: each sequence's new tokens (a prompt chunk, or the pending token),
        # then its tree's nodes; logits for the pending token and every node.
        inp = ForwardInput()
        verified: list[_Verified] = []
        scored: list[tuple[Request, int, int]] = []   # prompt logprobs: (request, first logit row, rows)
        for s in batch.seqs:
            req, start, m = s.request, s.request.num_computed_tokens, s.num_new_tokens
            tree = trees.get(req.request_id, _NO_TREE)
            try:
                rows = (req.token_ids[start:start + m] + tree.tokens,
                        list(range(start, start + m)) + [start + m - 1 + d for d in tree.depths],
                        slots_for(req.block_table, block_size, start, m + tree.num_nodes))
            except Exception as e:
                self.failed[req.request_id] = f"building this request's rows failed: {e!r}"
                continue
            # Prompt logprobs: the row of position p scores prompt token p + 1, and `first` is the
            # position of the next token owed. A request preempted by recompute computes its
            # prompt again from 0, and is scored from where its list stops.
            first = len(req.prompt_logprobs) - 1 if req.prompt_logprobs is not None else -1
            num_scored = max(0, min(start + m, req.num_prompt_tokens - 1) - first) if first >= start else 0
            if num_scored:
                scored.append((req, len(inp.logit_rows), num_scored))
            if s.is_decode:
                verified.append(_Verified(s, tree, len(inp.logit_rows) + num_scored))
            inp.add(*rows, req.block_table, start + m + tree.num_nodes,
                    logit_rows=list(range(first - start, first - start + num_scored))
                    + (list(range(m - 1, m + tree.num_nodes)) if s.is_decode else []),
                    mask=None if tree.is_chain else tree.verify_mask())   # trees: m == 1

        # One target forward, then acceptance and the commit of KV and tokens.
        logits = engine.target.forward(inp)
        if scored:
            self._prompt_logprobs(logits, scored)
        new_tokens = self._accept(logits, verified) if verified else {}
        t2 = time.perf_counter()
        self._observed = (batch, verified, new_tokens, t1 - t0, t2 - t1, backlog <= plan.depth + 1, context,
                          levels)
        return new_tokens

    def _accept(self, logits: torch.Tensor, verified: list[_Verified]) -> dict[str, list[int]]:
        """The sampler: tree_accept over every decoding sequence. Its inputs are built first:
        each sequence's logit rows, the target's distribution (after min_tokens, temperature,
        top-k, top-p), the trees, the draft's distributions and the uniforms. A batch of greedy
        requests needs only the argmax: its trees are walked on the host (greedy_walk), on any
        device."""
        dev = logits.device
        num_seqs = len(verified)
        max_nodes = max(v.tree.num_nodes for v in verified)
        requests = [v.seq.request for v in verified]
        if len(logits) != sum(1 + v.tree.num_nodes for v in verified):   # prompt rows scored too
            index = torch.tensor([v.first_row + j for v in verified for j in range(1 + v.tree.num_nodes)], device=dev)
            logits, first = logits[index], 0
            for v in verified:
                v.first_row, first = first, first + 1 + v.tree.num_nodes
        masked, banned = [], []   # min_tokens: a row j nodes deep comes depth(j) tokens after the last
        for v in verified:
            req = v.seq.request
            if req.params.min_tokens:
                for j, depth in enumerate([0] + v.tree.depths):
                    if req.num_output_tokens + depth < req.params.min_tokens:
                        masked.append(v.first_row + j)
                        banned.append(sorted(req.stop_token_ids | (set() if req.params.ignore_eos
                                                                   else req.eos_token_ids)))
        mask_tokens(logits, masked, banned)
        self._penalize(logits, verified)
        argmax = logits.argmax(dim=-1)
        if all(r.params.is_greedy for r in requests):
            # Greedy rows read only the target's argmax: each tree is walked on host lists
            # (tree_accept's greedy rule), with none of the tensors below.
            rows = argmax.tolist()
            walks = [greedy_walk(v.tree.tokens, v.tree.parents, rows[v.first_row:v.first_row + 1 + v.tree.num_nodes])
                     for v in verified]
            accepted = [path for path, _ in walks]
            new_tokens = self._commit(verified, accepted, [len(path) for path in accepted], [b for _, b in walks])
            self._logprobs(logits, verified, accepted, new_tokens)
            return new_tokens
        # Row j of sequence i in a [B, N + 1] layout; a shorter tree's padding repeats its last row.
        index = None
        if max_nodes or len(logits) != num_seqs:
            index = torch.tensor([v.first_row + min(j, v.tree.num_nodes) for v in verified
                                  for j in range(max_nodes + 1)], device=dev)
        target_argmax = (argmax if index is None else argmax[index]).view(num_seqs, max_nodes + 1)
        tensors = SamplingTensors.from_params([r.params for r in requests], dev)
        vocab = 1 if tensors.all_greedy else logits.shape[1]   # greedy reads only the argmax
        if tensors.all_greedy:
            probs = torch.zeros(num_seqs, max_nodes + 1, 1, device=dev)
        else:
            per_row = lambda t: t.repeat_interleave(max_nodes + 1)  # noqa: E731
            probs = target_probs(logits if index is None else logits[index], per_row(tensors.temperature),
                                 per_row(tensors.top_k), per_row(tensors.top_p), tensors.any_restricted)
            probs = probs.float().view(num_seqs, max_nodes + 1, vocab)

        width = max(max_nodes, 1)   # the kernel wants a node column even when no tree has one
        tokens = torch.zeros(num_seqs, width, dtype=torch.long)
        parents = torch.full((num_seqs, width), -1, dtype=torch.int32)
        is_sampled = torch.zeros(num_seqs, width, dtype=torch.bool)
        draft_probs = torch.zeros(num_seqs, width, vocab, device=dev)
        num_nodes = torch.tensor([v.tree.num_nodes for v in verified], dtype=torch.int32)
        is_greedy = torch.tensor([r.params.is_greedy for r in requests], dtype=torch.bool)
        uniforms = torch.zeros(num_seqs, width + 1)
        for i, v in enumerate(verified):
            tree, n, gen = v.tree, v.tree.num_nodes, v.seq.request.generator
            try:
                if n:
                    tokens[i, :n] = torch.tensor(tree.tokens)
                    parents[i, :n] = torch.tensor(tree.parents, dtype=torch.int32)
                    is_sampled[i, :n] = torch.tensor(tree.is_sampled)
                    if tree.draft_probs is not None and vocab > 1:
                        k = min(vocab, tree.draft_probs.shape[1])   # the draft's vocabulary may be padded otherwise
                        draft_probs[i, :n, :k] = tree.draft_probs[:, :k].float()
                if not requests[i].params.is_greedy:
                    # Exactly n + 1 draws (each node, then the bonus at column `width`): a seeded
                    # request's stream does not depend on the other trees of the batch.
                    u = torch.rand(n + 1, generator=gen, device=gen.device).cpu() if gen is not None else torch.rand(n + 1)
                    uniforms[i, :n] = u[:n]
                    uniforms[i, width] = u[n]
            except Exception as e:   # this request's part: it fails alone, its row verifies nothing
                self.failed[requests[i].request_id] = f"preparing this request's acceptance failed: {e!r}"
                num_nodes[i], is_greedy[i] = 0, True
        if width > max_nodes:   # no trees: a padding row beside each root row
            target_argmax = torch.cat([target_argmax, target_argmax], dim=1)
            probs = torch.cat([probs, probs], dim=1)
        accepted, num_accepted, bonus = self._tree_accept(probs, target_argmax, draft_probs, tokens, parents,
                                                          is_sampled, num_nodes, is_greedy, uniforms)
        new_tokens = self._commit(verified, accepted, num_accepted, bonus)
        self._logprobs(logits, verified, accepted, new_tokens)
        return new_tokens

    def _logprobs(self, logits, verified: list[_Verified], accepted, new_tokens: dict[str, list[int]]) -> None:
        """Logprobs of the tokens each sequence emits, where its request asks for them: its
        k-th token came from the pending token's row (k = 0) or from the row of its k-th
        accepted node, rows the verify pass computed already."""
        rows, tokens, temps, ks, owners = [], [], [], [], []
        for i, v in enumerate(verified):
            req = v.seq.request
            toks = new_tokens.get(req.request_id)
            if req.logprobs is None or toks is None:
                continue
            path = accepted[i][:len(toks) - 1]
            rows += [v.first_row] + [v.first_row + 1 + node for node in path]
            tokens += toks
            temps += [req.params.temperature] * len(toks)
            ks += [req.params.logprobs] * len(toks)
            owners += [req] * len(toks)
        if rows:
            for req, entry in zip(owners, token_logprobs(logits[rows], temps, tokens, ks)):
                req.logprobs.append(entry)

    @staticmethod
    def _prompt_logprobs(logits, scored: list[tuple[Request, int, int]]) -> None:
        rows, tokens, temps, ks = [], [], [], []
        for req, first, n in scored:
            start = len(req.prompt_logprobs)   # the first prompt token not yet scored
            rows += range(first, first + n)
            tokens += req.token_ids[start:start + n]
            temps += [req.params.temperature] * n
            ks += [req.params.prompt_logprobs] * n
        entries = iter(token_logprobs(logits[rows], temps, tokens, ks))
        for req, _, n in scored:
            req.prompt_logprobs += [next(entries) for _ in range(n)]

    @staticmethod
    def _penalize(logits: torch.Tensor, verified: list[_Verified]) -> None:
        """Penalties and logit biases, row by row: a node's row follows the output so far and
        its own path (its ancestors and itself), so the target's distribution at every node is
        the one plain decoding would have used after that path."""
        for v in verified:
            req, tree = v.seq.request, v.tree
            if not req.params.has_penalties:
                continue
            paths: list[list[int]] = [[]]   # the pending token's row, then each node's (BFS: parents first)
            for k in range(tree.num_nodes):
                parent = tree.parents[k]
                paths.append(paths[parent + 1] + [tree.tokens[k]])
            penalize(logits, list(range(v.first_row, v.first_row + len(paths))), req.params, req.output_token_ids,
                     req.prompt_token_ids, paths)

    @staticmethod
    def _tree_accept(probs, target_argmax, draft_probs, tokens, parents, is_sampled, num_nodes, is_greedy,
                     uniforms) -> tuple[list[list[int]], list[int], list[int]]:
        dev = probs.device
        if not ops.on_triton(probs):   # the torch reference (CPU): nothing to copy or wait for
            accepted, num_accepted, bonus = ops.tree_accept(
                probs, target_argmax, draft_probs, tokens, parents, is_sampled, num_nodes, is_greedy, uniforms)
            return accepted.tolist(), num_accepted.tolist(), bonus.tolist()
        # On a GPU every host-device copy waits for the device: the five integer inputs travel
        # as one int64 buffer, the three outputs come back as one.
        B, N = tokens.shape
        packed = torch.cat([tokens.flatten(), parents.flatten().long(), is_sampled.flatten().long(),
                            num_nodes.long(), is_greedy.long()]).to(dev)
        t_d, p_d, s_d, n_d, g_d = packed.split_with_sizes([B * N] * 3 + [B] * 2)
        accepted, num_accepted, bonus = ops.tree_accept(
            probs, target_argmax, draft_probs, t_d.view(B, N), p_d.view(B, N).int(), s_d.view(B, N).bool(),
            n_d.int(), g_d.bool(), uniforms.to(dev))
        width = accepted.shape[1]
        back = torch.cat([accepted.flatten().long(), num_accepted.long(), bonus.long()]).tolist()
        return [back[i * width:(i + 1) * width] for i in range(B)], back[B * width:B * width + B], back[B * width + B:]

    def _commit(self, verified: list[_Verified], accepted, num_accepted, bonus) -> dict[str, list[int]]:
        """Accepted nodes' KV to their final positions; the tokens each sequence emits."""
        engine = self.engine
        block_size = engine.pool.block_size
        out: dict[str, list[int]] = {}
        src, dst = [], []
        for i, v in enumerate(verified):
            req, tree, a = v.seq.request, v.tree, num_accepted[i]
            if req.request_id in self.failed:
                continue
            base = req.num_tokens   # node k's scratch slot: position base + k
            path = accepted[i][:a]
            for depth, node in enumerate(path):
                if node != depth:   # off the chain: its KV moves to position base + depth
                    src += slots_for(req.block_table, block_size, base + node, 1)
                    dst += slots_for(req.block_table, block_size, base + depth, 1)
            out[req.request_id] = [tree.tokens[k] for k in path] + [bonus[i]]
            req.num_step_drafted = a
            if tree.num_nodes:
                if self.drafter.has_kv:
                    # Only a chain's nodes sit at their final positions in the draft's KV.
                    fed = tree.num_nodes - 1 if self.tree_kind == "chain" else 0
                    req.num_draft_computed_tokens = base + min(a, fed)
                self._count(req, tree.num_nodes, a)
        if src:
            dev = engine.target.cache_tensors[0].device
            ops.copy_slots(engine.target.cache_tensors, torch.tensor(src, dtype=torch.long, device=dev),
                           torch.tensor(dst, dtype=torch.long, device=dev))
        return out

    def _count(self, req: Request, num_nodes: int, num_accepted: int) -> None:
        stats, totals = req.stats, self.totals
        for s in (stats, totals):
            s.num_drafts += 1
            s.num_draft_tokens += num_nodes
            s.num_accepted_tokens += num_accepted
            while len(s.accepted_per_position) < num_accepted:
                s.accepted_per_position.append(0)
            for pos in range(num_accepted):
                s.accepted_per_position[pos] += 1
        totals.num_emitted_tokens += num_accepted + 1

    # -- learning ------------------------------------------------------------------------

    def end_step(self, step_s: float) -> None:
        """The step is over (outputs built): the controller learns what it measured. step_s:
        the step's whole cost, from the end of the step before (LLMEngine.step)."""
        observed, self._observed = self._observed, None
        if observed is not None and self.controller is not None:
            self._learn(self.controller, observed, step_s)
        for request_id in self._finished:
            for c in (self.controller, self._detached):
                if c is not None:
                    c.forget(request_id)
        self._finished.clear()

    def _learn(self, controller: AdaptiveController, observed: tuple, step_s: float) -> None:
        batch, verified, new_tokens, draft_s, verify_s, typical, context, levels = observed
        decoding = [v for v in verified if v.seq.num_new_tokens == 1]
        chains = [(v.seq.request.request_id, not v.seq.request.params.is_greedy,
                   v.tree.num_nodes if self.tree_kind == "chain" else v.tree.max_depth,
                   len(new_tokens[v.seq.request.request_id]) - 1, v.tree.path_probs)
                  for v in verified if v.tree.num_nodes and v.seq.request.request_id in new_tokens]
        timed = len(decoding) == len(batch.seqs) and typical
        controller.observe(len(decoding), sum(1 + v.tree.num_nodes for v in decoding), levels, draft_s,
                           verify_s, step_s - draft_s - verify_s, chains, timed=timed, context=context)

    def recover(self, keep_failed: bool = False) -> None:
        """A step failed part-way (or the engine was reset): nothing of it is learned."""
        self._observed = None
        if not keep_failed:
            self.failed.clear()

    def forget(self, request: Request) -> None:
        """The request finished or was aborted: its draft state goes now, its acceptance
        history after the step's end (the step that finished it still reports it)."""
        if self.drafter is not None:
            self.drafter.forget(request)
        self._finished.append(request.request_id)


def make_speculator(config: EngineConfig, engine) -> Speculator:
    kind = config.draft.kind
    drafter = None
    if kind == "ngram":
        from specserve.drafts.ngram import NgramDrafter

        drafter = NgramDrafter(config.draft.ngram_min, config.draft.ngram_max)
    elif kind == "model":
        from specserve.drafts.model import ModelDrafter

        drafter = ModelDrafter(engine.draft, target_vocab_size=engine.target_args.vocab_size)
    return Speculator(config, engine, drafter)
