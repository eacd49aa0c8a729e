"""The adaptive controller: how many draft nodes each sequence of a batch verifies.

DESIGN.md §6; the derivation, with references, is in docs/controller.md. Plain Python on
floats and lists, so it is unit-tested on synthetic costs and replayed deterministically
(benchmarks/replay.py).

A step of B decoding sequences, sequence i verifying L_i nodes, commits on average

    E = sum_i (1 + sum_{j <= L_i} p_ij)           p_ij: node j and every node before it accepted

tokens and costs

    T = t_rest(B) + D t_level(B) + t_verify(B, R)  D = max_i L_i draft levels, R = B + sum_i nodes(L_i) rows

so its goodput is G = E / T. The plan maximises G; at the optimum a node is kept exactly
while p_ij > G * dt_row, its marginal row cost priced in goodput (the marginal rule), and a
draft level runs while the nodes it adds pay for it. One rule, so per-request lengths come
out at every batch size, and where rows are dear every chain stops at 0: plain decoding.

Acceptance p_ij is the product of per-position conditional rates, per request (decayed counts
shrunk toward a global estimate per request kind). When the draft's path probabilities prove
calibrated (accepted nodes / summed path probabilities within `calibration_band`), chains are
cut while drafting by the same rule on the draft's own numbers (`EarlyStop`).

Costs come from a `CapacityCurve`: seeded by a probe or a cached profile (profile.py) and
learned online from the steps the engine serves.
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field


@dataclass
class EarlyStop:
    """Chains of a calibrated draft, cut while they are drafted. A node at path probability q
    is worth min(1, R q) tokens (R: accepted over predicted, measured); it is kept while that
    beats G times its row, and the next level runs while the growing chains' next nodes, worth
    R q a each (a: the mean acceptance rate), beat G times the level and their rows. A row is
    priced at the verify curve's slope at the rows kept so far, but never at its first segment
    (one row a sequence to two): that step also carries what any speculative step pays
    (acceptance, other shapes), which the plan has already committed to."""

    goodput: float
    ratio: float
    rate: float
    level_s: float
    verify_s: list[float]      # this batch's verify pass at 1 .. rows per sequence
    batch_size: int
    rows: int = 0              # rows kept so far: the batch's pending tokens, then kept nodes

    def _row(self, rows: int, n: int = 1) -> float:
        """What n more rows cost after `rows`."""
        v, B = self.verify_s, self.batch_size
        lo = max(rows / B, 2.0 if len(v) > 2 else 1.0)
        return _at(v, lo + n / B) - _at(v, lo)

    def bar(self) -> float:
        """The path probability the next node must exceed to be kept: min(1, R q) > G row."""
        cost = self.goodput * self._row(self.rows)
        return math.inf if cost >= 1.0 else cost / self.ratio

    def keep(self, q: float) -> bool:
        if q > self.bar():
            self.rows += 1
            return True
        return False

    def next_level(self, qs: Sequence[float]) -> bool:
        gain = sum(min(1.0, self.ratio * q * self.rate) for q in qs)
        return gain > self.goodput * (self.level_s + self._row(self.rows, len(qs)))


@dataclass
class Plan:
    depth: int = 0                                     # draft levels at most (0: plain decoding)
    nodes: dict[Hashable, int] = field(default_factory=dict)  # request id -> nodes to verify (absent: 0)
    early_stop: EarlyStop | None = None   # chains of a calibrated draft: cut while drafting
    goodput: float = 0.0                  # predicted tokens per second (adaptive only)


@dataclass
class ControllerConfig:
    max_depth: int = 8
    cost_alpha: float = 0.1          # weight of a step in the curve's level (how fast the machine is now)
    shape_alpha: float = 0.05        # weight of a step in the curve's shape (how rows add cost)
    initial_acceptance: float = 0.7  # global rate per position before any observation
    global_alpha: float = 0.02       # weight of one observation in the global acceptance rates
    teach_global: int = 3            # observations per request and position that teach the global rates
    request_decay: float = 0.95      # a request's acceptance counts decay by this a step
    prior_weight: float = 4.0        # pseudo-observations of the global rate in a request's estimate
    calibration_alpha: float = 0.01  # weight of one verified chain in the calibration sums
    calibration_band: float = 1.25   # the draft is calibrated while accepted / predicted is in 1/b..b
    margin: float = 0.02             # speculation must beat plain decoding (a node its row) by this


def _interp(xs: Sequence[float], x: float) -> tuple[int, float]:
    """(i, w): x lies between xs[i] and xs[i + 1] at weight w toward xs[i + 1] (clamped)."""
    if x <= xs[0] or len(xs) == 1:
        return 0, 0.0
    for i in range(len(xs) - 1):
        if x <= xs[i + 1]:
            return i, (x - xs[i]) / (xs[i + 1] - xs[i])
    return len(xs) - 2, 1.0


class CapacityCurve:
    """Seconds of a step's parts by batch size B: the target's verify pass of r rows per
    sequence (r = 1 .. max_rows), one draft level, and the rest of the step (scheduling,
    acceptance, outputs, the server's share of the process).

    verify(b, r, ctx) = level[b] * (shape[b][r] + (ctx - context) * context_s[b](r)): the shape
    is what rows cost at the probe's `context` tokens a sequence, the context term what every
    further cached token adds (attention reads all of them, for every row: measured at 1 and
    at max_rows rows, linear between); the level follows how fast the machine is now and moves
    fast, the shape moves slowly. All are kept per batch bucket (powers of two), interpolated
    linearly in B and in r, and the shape is kept non-decreasing in r."""

    def __init__(self, buckets: list[int], verify: list[list[float]], level: list[float],
                 rest: list[float] | None = None, context: float = 0.0,
                 context_s: list[list[float]] | None = None):
        assert len(verify) == len(buckets) == len(level) and buckets == sorted(buckets)
        self.buckets = list(buckets)
        self.max_rows = len(verify[0])
        self.level = [1.0] * len(buckets)
        self.shape = [_monotone(list(row)) for row in verify]
        self.draft = list(level)
        self.rest = list(rest) if rest is not None else [0.0] * len(buckets)
        self.num_rest = [0 if rest is None else 1] * len(buckets)   # rest: a running mean until 1/alpha steps
        self.context = context
        self.context_s = [list(x) for x in context_s] if context_s else [[0.0, 0.0] for _ in buckets]

    def _corners(self, batch_size: int) -> list[tuple[int, float]]:
        i, w = _interp(self.buckets, batch_size)
        return [(i, 1.0 - w), (i + 1, w)] if w > 0.0 else [(i, 1.0)]

    def _base(self, b: int, r: float, ctx: float | None) -> float:
        """Bucket b's verify pass at r rows a sequence and ctx cached tokens, at level 1."""
        shape = self.shape[b]
        j, wr = _interp(range(1, self.max_rows + 1), min(r, self.max_rows))
        s = shape[j] if wr == 0.0 else (1 - wr) * shape[j] + wr * shape[j + 1]
        if r > self.max_rows:   # beyond the table: the last segment's slope
            s += (r - self.max_rows) * max(0.0, shape[-1] - shape[-2] if len(shape) > 1 else 0.0)
        if ctx is not None:
            one, full = self.context_s[b]
            w = (min(r, self.max_rows) - 1) / max(self.max_rows - 1, 1)
            s = max(0.5 * s, s + (ctx - self.context) * ((1 - w) * one + w * full))
        return s

    def verify_s(self, batch_size: int, rows: float, context: float | None = None) -> float:
        """Seconds of a verify pass of `rows` rows in all over `batch_size` sequences that hold
        `context` cached tokens each on average (None: the probe's)."""
        r = rows / batch_size
        return sum(wb * self.level[b] * self._base(b, r, context) for b, wb in self._corners(batch_size))

    def verify_row(self, batch_size: int, context: float | None = None) -> list[float]:
        """verify_s at r = 1 .. max_rows rows per sequence."""
        return [self.verify_s(batch_size, batch_size * r, context) for r in range(1, self.max_rows + 1)]

    def level_s(self, batch_size: int) -> float:
        return sum(w * self.draft[b] for b, w in self._corners(batch_size))

    def rest_s(self, batch_size: int) -> float:
        return sum(w * self.rest[b] for b, w in self._corners(batch_size))

    def observe(self, batch_size: int, rows: int, verify_s: float, levels: int, draft_s: float,
                rest_s: float | None, cfg: ControllerConfig, context: float | None = None) -> None:
        """One step's measured seconds (draft_s over `levels` levels; rest_s None: not measured)."""
        corners = self._corners(batch_size)
        ratio = verify_s / max(self.verify_s(batch_size, rows, context), 1e-12)
        if 0.0 < ratio < math.inf:
            ratio = min(max(ratio, 1.0 / _OUTLIER), _OUTLIER)   # a GC pause moves the curve as a 4x step would
            r = min(rows / batch_size, self.max_rows)
            j, wr = _interp(range(1, self.max_rows + 1), r)
            for b, wb in corners:
                self.level[b] *= ratio ** (cfg.cost_alpha * wb)
                shape = self.shape[b]
                for k, wk in ((j, 1.0 - wr), (j + 1, wr)):
                    if wk > 0.0:
                        shape[k] *= ratio ** (cfg.shape_alpha * wb * wk)
                _monotone(shape)
        if levels > 0 and 0.0 <= draft_s < math.inf:
            for b, wb in corners:
                # One step counts for at most _OUTLIER times the estimate: a GC pause must not make
                # levels look so dear that plain decoding, which measures none, never ends.
                per_level = draft_s / levels
                if self.draft[b] > 0.0:
                    per_level = min(per_level, _OUTLIER * self.draft[b])
                self.draft[b] += cfg.cost_alpha * wb * (per_level - self.draft[b])
        if rest_s is not None and math.isfinite(rest_s):
            for b, wb in corners:
                self.num_rest[b] += 1
                self.rest[b] += max(cfg.cost_alpha, 1.0 / self.num_rest[b]) * wb * (rest_s - self.rest[b])

    def to_dict(self) -> dict:
        return {"buckets": self.buckets,
                "verify_s": [[lv * s for s in row] for lv, row in zip(self.level, self.shape)],
                "level_s": self.draft, "rest_s": self.rest, "context": self.context,
                "context_s": [[lv * s for s in x] for lv, x in zip(self.level, self.context_s)]}


_OUTLIER = 4.0   # a step counts for at most this many times (or this fraction of) the estimate


def _monotone(xs: list[float]) -> list[float]:
    """In place, non-decreasing by pooling adjacent violators (each run that falls is averaged)."""
    blocks: list[list[float]] = []   # [sum, count]
    for x in xs:
        blocks.append([x, 1])
        while len(blocks) > 1 and blocks[-2][0] / blocks[-2][1] > blocks[-1][0] / blocks[-1][1]:
            s, n = blocks.pop()
            blocks[-1][0] += s
            blocks[-1][1] += n
    i = 0
    for s, n in blocks:
        for _ in range(n):
            xs[i] = s / n
            i += 1
    return xs


class Acceptance:
    """Conditional acceptance rates a_k = P(node k accepted | node k - 1 was), per position.

    A request's own rates are counts that decay by `request_decay` a step, shrunk toward its
    kind's (greedy or sampled) global rates: a request not verified for a while drifts back to
    the global rates, and is tried again where those say it pays. The global rates are what a
    *new* request is expected to do, so each request teaches them only its first few
    (`teach_global`) observations per position: later ones come from requests the plan kept
    speculating because they did well, and would bias the rates up."""

    def __init__(self, cfg: ControllerConfig):
        self.cfg = cfg
        self.glob = {kind: [cfg.initial_acceptance] * cfg.max_depth for kind in (False, True)}
        self.seen = {kind: [0] * cfg.max_depth for kind in (False, True)}   # observations taught so far
        self.requests: dict[Hashable, tuple[list[float], list[float], list[int]]] = {}  # hits, trials, [step]
        self.taught: dict[Hashable, list[int]] = {}   # id -> observations it taught, by position

    def _global(self, sampled: bool) -> list[float]:
        """The global rates; a position never observed takes the rate of the one before it (a
        fixed prior there would keep plans from ever reaching it, or push them past it)."""
        g, seen = self.glob[sampled], self.seen[sampled]
        out = list(g)
        for k in range(1, len(out)):
            if not seen[k]:
                out[k] = out[k - 1]
        return out

    def rates(self, request_id: Hashable, sampled: bool, step: int) -> list[float]:
        g = self._global(sampled)
        own = self.requests.get(request_id)
        if own is None:
            return g
        hits, trials, (last,) = own
        f, w = self.cfg.request_decay ** (step - last), self.cfg.prior_weight
        return [(f * h + w * a) / (f * n + w) for h, n, a in zip(hits, trials, g)]

    def observe(self, request_id: Hashable, sampled: bool, num_nodes: int, num_accepted: int, step: int) -> None:
        """A verified chain (or a tree's depth) of `num_nodes`: positions 1..num_accepted hit,
        the next one missed, those after it unobserved."""
        cfg = self.cfg
        g, seen = self.glob[sampled], self.seen[sampled]
        own = self.requests.setdefault(request_id, ([0.0] * cfg.max_depth, [0.0] * cfg.max_depth, [step]))
        hits, trials, last = own
        taught = self.taught.setdefault(request_id, [0] * cfg.max_depth)
        f = cfg.request_decay ** (step - last[0])
        last[0] = step
        prior = self._global(sampled)
        for k in range(min(num_nodes, num_accepted + 1, cfg.max_depth)):
            hit = float(k < num_accepted)
            if taught[k] < cfg.teach_global:
                taught[k] += 1
                if not seen[k]:
                    g[k] = prior[k]
                seen[k] += 1
                g[k] += max(cfg.global_alpha, 1.0 / (seen[k] + cfg.prior_weight)) * (hit - g[k])
            hits[k] = f * hits[k] + hit
            trials[k] = f * trials[k] + 1.0

    def forget(self, request_id: Hashable) -> None:
        self.requests.pop(request_id, None)
        self.taught.pop(request_id, None)


def _at(row: list[float], r: float) -> float:
    """A verify row (seconds at 1 .. len(row) rows per sequence) at r rows per sequence,
    linear between its points and along its last segment beyond them."""
    n = len(row)
    if n == 1 or r <= 1.0:
        return row[0]
    i = min(int(r), n - 1)            # r lies on the segment from i to i + 1 rows
    return row[i - 1] + (r - i) * (row[i] - row[i - 1])


class AdaptiveController:
    """Plans every step from the capacity curve and the acceptance estimates, and learns both
    from what the step measured (`observe`)."""

    def __init__(self, curve: CapacityCurve, nodes_per_depth: Sequence[int] | None = None,
                 config: ControllerConfig | None = None, path_probs: bool = False):
        self.cfg = cfg = config or ControllerConfig()
        self.curve = curve
        # Tree nodes at each depth 0..max_depth; None: chains (one node a depth, lengths per request).
        self.is_chain = nodes_per_depth is None
        self.nodes_at = list(nodes_per_depth) if nodes_per_depth is not None else list(range(cfg.max_depth + 1))
        assert len(self.nodes_at) == cfg.max_depth + 1 and self.nodes_at[-1] + 1 <= curve.max_rows
        self.acceptance = Acceptance(cfg)
        self.uses_path_probs = path_probs and self.is_chain   # the drafter reports path probabilities
        self.calib = [0.0, 0.0, 0.0]   # decayed sums over verified chain nodes: accepted, path probability, nodes
        self.num_steps = 0
        self.depth_histogram: dict[int, int] = {}
        self.last_plan = Plan()

    # -- planning -----------------------------------------------------------------------

    @property
    def calibration(self) -> float | None:
        """Accepted nodes over the draft's summed path probabilities; None until enough were seen."""
        accepted, predicted, seen = self.calib
        if not self.uses_path_probs or seen < 0.5 / self.cfg.calibration_alpha or predicted <= 0.0:
            return None
        return accepted / predicted

    def plan(self, seqs: Sequence[tuple[Hashable, int, bool]], context: float | None = None) -> Plan:
        """seqs: (request id, most nodes it can still use, sampled?) of every decoding sequence;
        context: their cached tokens, on average."""
        self.num_steps += 1
        B = len(seqs)
        if B == 0:
            return Plan()
        cfg, curve = self.cfg, self.curve
        rest, level = curve.rest_s(B), curve.level_s(B)
        verify = curve.verify_row(B, context)        # seconds at r = 1 .. max_rows rows a sequence
        cum = []                                     # per sequence: p_i1 .. p_i,cap
        for rid, cap, sampled in seqs:
            p, ps = 1.0, []
            for a in self.acceptance.rates(rid, sampled, self.num_steps)[:max(0, min(cap, cfg.max_depth))]:
                p *= a
                ps.append(p)
            cum.append(ps)
        best = (B / (rest + verify[0]), 0, 1.0)      # (goodput, depth, smallest p kept): plain decoding
        if self.is_chain:
            best = max(best, self._best_chains(B, cum, rest, level, verify))
        else:
            for d in range(1, cfg.max_depth + 1):
                tokens = B + sum(sum(ps[:d]) for ps in cum)
                best = max(best, (tokens / (rest + d * level + verify[self.nodes_at[d]]), d, 0.0))
        if best[1] and best[0] < (1 + cfg.margin) * B / (rest + verify[0]):
            best = (B / (rest + verify[0]), 0, 1.0)   # too close to call: plain decoding
        goodput, depth, p_min = best
        nodes = {}
        for (rid, _, _), ps in zip(seqs, cum):
            n = sum(1 for p in ps[:depth] if p >= p_min)
            if n:
                nodes[rid] = self.nodes_at[n]
        plan = Plan(depth=max((n for n in nodes.values()), default=0) if self.is_chain else depth * bool(nodes),
                    nodes=nodes, goodput=goodput)
        ratio = self.calibration
        if plan.depth and ratio is not None and 1 / cfg.calibration_band <= ratio <= cfg.calibration_band:
            # The drafter cuts each chain the plan speculates on by the rule on its own path
            # probabilities, up to the request's cap.
            plan.nodes = {rid: len(ps) for (rid, _, _), ps in zip(seqs, cum) if rid in nodes}
            plan.depth = max(plan.nodes.values())
            rates = self.acceptance.glob[False]
            plan.early_stop = EarlyStop(goodput * (1 + cfg.margin), ratio, sum(rates) / len(rates), level, verify,
                                        B, rows=B)
        self.last_plan = plan
        self.depth_histogram[plan.depth] = self.depth_histogram.get(plan.depth, 0) + 1
        return plan

    def _best_chains(self, B: int, cum: list[list[float]], rest: float, level: float,
                     verify: list[float]) -> tuple[float, int, float]:
        """The best plan "node (i, j) iff j <= D and p_ij >= p_min". For each D nodes are added
        in falling p, so each prefix is the best set of its size (p_ij falls in j: every prefix
        is a set of chains); G is read between ties only, since a threshold keeps all of a tie.
        A walk stops once a node is worth less than the cheapest row ahead costs (p < G dt):
        every later node is worth less and costs at least as much."""
        nodes = sorted(((p, j) for ps in cum for j, p in enumerate(ps, 1)), reverse=True)
        top = len(verify) - 1
        slopes = [(verify[r] - verify[r - 1]) / B for r in range(1, top + 1)] or [0.0]
        cheapest = [min(slopes[r:]) for r in range(len(slopes))]   # a row's least cost from r + 1 rows on
        best = (0.0, 0, 1.0)
        n = len(nodes)
        for depth in range(1, max(map(len, cum)) + 1):
            fixed = rest + depth * level
            tokens, rows = float(B), B
            for k in range(n):
                p, j = nodes[k]
                if j > depth:
                    continue
                tokens += p
                rows += 1
                if k + 1 < n and nodes[k + 1][0] == p:
                    continue
                i = min(rows // B, top)               # rows / B lies on the segment i .. i + 1
                g = tokens / (fixed + verify[i - 1] + (rows / B - i) * slopes[i - 1] * B)
                if g > best[0]:
                    best = (g, depth, p)
                elif p < g * cheapest[i - 1]:
                    break
        return best

    # -- learning -----------------------------------------------------------------------

    def observe(self, batch_size: int, rows: int, levels: int, draft_s: float, verify_s: float,
                rest_s: float | None, chains: Sequence[tuple[Hashable, bool, int, int, Sequence[float]]],
                timed: bool = True, context: float | None = None) -> None:
        """A step's outcome. chains: (request id, sampled?, nodes, accepted, path probabilities)
        per verified sequence (trees: nodes = the tree's depth). timed=False: the seconds do not
        describe a decode step (it also prefilled); only acceptance is learned."""
        if timed and batch_size > 0:
            self.curve.observe(batch_size, rows, verify_s, levels, draft_s, rest_s, self.cfg, context)
        keep = 1.0 - self.cfg.calibration_alpha
        for rid, sampled, num_nodes, num_accepted, qs in chains:
            self.acceptance.observe(rid, sampled, num_nodes, num_accepted, self.num_steps)
            if self.uses_path_probs and qs:
                c = self.calib
                c[0] = keep * c[0] + num_accepted
                c[1] = keep * c[1] + sum(qs)
                c[2] = keep * c[2] + len(qs)

    def forget(self, request_id: Hashable) -> None:
        self.acceptance.forget(request_id)

    def snapshot(self) -> dict:
        return {
            "depth_histogram": dict(self.depth_histogram),
            "acceptance_per_position": list(self.acceptance.glob[False]),
            "goodput_estimate": self.last_plan.goodput,
            "calibration": self.calibration,
            "curve": self.curve.to_dict(),
        }
