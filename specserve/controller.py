"""Adaptive speculation controller: how deep, and how wide, to speculate for each batch.

DESIGN.md §6. Plain Python (no torch): ints, floats and lists, so it is unit-tested on
synthetic cost models.

The quantity maximised is *goodput*, committed tokens per second of one engine step::

    goodput(d, n) = sum_i E_i(d, n) / cost(d, n)
    cost(d, n)    = t_step(B) + t_draft(B, d) + t_verify(B, B * (n + 1))    (d = 0: t_step(B) + t_verify(B, B))

``d`` is the depth (draft steps), ``n`` the node budget (tree nodes, root excluded; a chain
has ``n == d``; ``d = n = 0`` is plain decode with the draft idle). Each of the ``B``
sequences feeds its pending token plus ``n`` nodes to the verify pass, hence ``B * (n + 1)``
tokens.

**Expected accepted length.** ``a_k`` is the conditional probability that the drafter's
first choice at depth ``k`` is accepted given that the path up to depth ``k - 1`` was
(Leviathan et al. 2023 assume one constant ``alpha``; we keep one per position because it
falls with depth). For a chain of depth ``d`` the expected number of tokens committed by one
verify pass, bonus token included, is::

    E_chain(d) = 1 + sum_{k=1..d} prod_{j=1..k} a_j

**Trees.** The spine is the chain of first choices; the ``n - d`` remaining nodes are
alternates hung beside the spine (SpecInfer/EAGLE-style top-k siblings). ``b`` is the
probability that the next-ranked alternate is accepted once every higher-ranked child at
that depth has been rejected (measured, ``accepted_ranks``). With ``w_k`` alternates at
depth ``k``, the path reaches depth ``k`` with probability::

    P(reach k) = prod_{j<k} a_j * (1 - (1 - a_k) * (1 - b) ** w_k)

and ``E = 1 + sum_k P(reach k)``. The m-th alternate at depth k adds
``prod_{j<k} a_j * (1 - a_k) * b * (1 - b) ** (m - 1)``, which falls with m, so the greedy
allocation (always the largest next gain) is optimal for this model and
``E(d, n) = E_chain(d) + (sum of the n - d largest gains)``. When the drafter knows its own
path probabilities, :func:`tree_expected_accepted` gives the EAGLE-2 estimate
``1 + sum of node path probabilities`` (exact in expectation for a calibrated drafter under
lossless stochastic verification: a node is on the accepted path with its path probability).
The engine reports each verified tree's path probabilities; per (depth, nodes) the controller
keeps the mean sum of the ``nodes`` best path probabilities at depth <= ``depth``, and scales
it by measured accepted nodes / path-probability sum (drafts are not calibrated, and greedy
verification is not sampling). Once a tree shape has ``tree_min_samples`` steps of this, its
E comes from it instead of the sibling model.

**Per request.** ``a_k`` is an EMA per request and position, shrunk toward the global
per-position EMA by its number of observations (a new request uses the global one)::

    a_ik = (c_ik * ema_ik + s * g_k) / (c_ik + s)

The global EMA of a position moves once a step, toward the mean of the step's observations of
it, by ``1 - (1 - acceptance_alpha) ** n`` for ``n`` observations but at most
``acceptance_step_weight``: a batch is a sample of a few tens of requests, and with one EMA
step per sequence the estimate at 32 sequences was the last step's batch (position 1 swung
0.70-0.95 from step to step, and the plan with it between depths 1 and 3 where 3-5 were best).

**Near the end.** The drafters stop one short of a request's ``max_tokens`` (and the scheduler
at the context's end), so a request with ``c_i`` positions left gains nothing from positions
past ``c_i`` and its rows past them are not verified. The engine passes each request's cap with
the plan; ``E_i(d)`` sums positions ``k <= min(d, c_i)`` only and the verify pass is priced at
``sum_i (min(n, c_i) + 1)`` rows. Counted at the full depth, whole 64-token requests at
acceptance 0.85 per position yield 0.980 of what the model said at depth 3, 0.971 at depth 5
and 0.965 at depth 6 (a simulation), a bias toward deep plans; and where a batch's requests
near their ends together (requests started at once) a deep plan costs draft levels for nothing.

**Early stop (chains).** Within the plan's depth, each sequence's chain stops growing after
its first node whose draft path probability (the product of the draft's probabilities of
the chain's tokens) is below a threshold ``tau``. A node at path probability ``p`` is
accepted with probability about ``p`` when the draft is calibrated (the embedded one is:
``benchmarks/draft_calibration.py``), and raises the step's goodput ``G = tokens / time``
when ``p > G * dt``, ``dt`` what the node adds to the step. A chain's own share is its
verify row (the verify cost per token near the plan's rows); a draft level is one forward
for the whole batch, so it is weighed against every chain that would grow in it: the next
level runs while the growing chains' ``p_i - tau`` sum to at least ``lambda``::

    tau = G(plan) * t_row        lambda = G(plan) * t_level

At one sequence the two make ``p > G * (t_row + t_level)``. Positions a chain was allowed
but did not draft are not observed, so ``a_k`` is the acceptance where drafted; ``c_k``, the
share of chains that reached depth ``k`` and went on, gives ``reach_k = prod_{j<=k} c_j``, a
position commits ``a_k * c_{k-1}`` of the chains that reached it, and a chain plan of depth
``d`` is priced at ``B * (1 + sum_{k<d} reach_k)`` verify rows and, per batch bucket, the
draft levels measured to run (the share of steps whose level ``k`` went on to ``k + 1``;
before any: ``sum_{k<d} (1 - (1 - reach_k) ** B)``, as if the chains stopped alone). The engine applies both with ``[spec]
early_stop = "auto"``, the default, and the controller sets them only in batches of up to
``stop_max_batch`` (2) sequences: on the dev CPU early stop paid there and cost about 3.5% at
eight, where a level is shared by chains that mostly go on and the rows it saves are cheap
(benchmarks/RESULTS.md, thirty-seventh session). Larger batches are priced with every chain
reaching its depth and do not teach the continuation. Where the thresholds are its own, the
plan is the cap, ``max_depth`` (or plain decoding, where that wins): a node is drafted while
it pays, by the thresholds' own rule, so a shallower cap would only cut nodes that do; and
there is no depth to explore. With its depth chosen as for larger batches, adaptive with
early stop ran 0.98x itself without at one sequence where a static depth 8 with a hand-set
threshold of 0.3 ran 1.05x static depth 6; with the cap, 1.03x and 1.01x static depth 6.

**Cost model.** ``t_verify(B, T)`` (seconds per verify pass over ``T`` tokens) and
``t_draft(B, d)`` (seconds of ``d`` draft levels; not ``d`` times one level: the first also
catches the draft up and runs with the caches cold after the target's pass) are measured
online: batch sizes bucketed in powers of two; inside each batch bucket a verify point per
rows per sequence (``n + 1``) and a draft point per depth, each an EMA of the time and of
the exact ``T`` it saw. Queries interpolate piecewise-linearly between measured points,
made non-decreasing (isotonic: a point reading cheaper than a smaller pass is averaged
with it; more rows or more levels never cost less, and such a fall is a stale point or a
spell that would make the plans past it look cheap) but otherwise read as measured: the
verify pass is not a straight line in the rows (on the dev CPU four rows a sequence cost
less than three and five 18-23% more than four), and a row smoothed toward straight puts
the predicted top on such a dip (see ``_Row.current``), extrapolate with
the last segment's slope (never negative) beyond the largest, and interpolate in ``log2 B``
between batch buckets. :meth:`AdaptiveController.calibrate` warm-starts every power-of-two
batch bucket at start-up from a short measurement (spec.py: every chain length at every
batch size, since the cost of more rows is not linear and a curve near its flat top decides
between plans a few percent apart; every draft depth up to 8 sequences, above that depths 1,
3 and the maximum). The draft's
calibrated points only stand in until the engine runs that depth (bare forwards of dummy
sequences, without the host work of each level): the engine's levels cost 1.2x them offline
and 1.5-2.7x in a server under load, so a stand-in not yet replaced is read times the mean
ratio of those already replaced.

The shape of a batch bucket's curve (how much a pass of ``2B`` tokens costs more than one of
``B``) comes from whichever buckets were measured, but its *level* drifts as a whole: contexts
grow far beyond the calibration's, the machine gets busier. The plan in use refreshes only its
own bucket, so the buckets it does not use would keep their old level and the comparison would
be lopsided (plain decode measured at today's contexts against a verify cost from start-up:
speculation looks cheap exactly when it is not). So each row (one batch bucket) is a *shape*
times a *level*: each measured point has a reference (its place in the shape) and is read as
reference x level; the level is an EMA (``level_alpha`` 0.1, winsorised) of measured time over
the measured point's reference, moved by every step. A run of steps at one plan moves only
the level, so a slow spell is taken up by the level, which later steps bring back, and not by
the point of whichever plan ran during it (the sixth session's logs: a point that followed its
measurements read 1.2x its cost a hundred steps after a spell, and the controller leaves exactly
the plans it measured during spells, so nothing measured them again). A new point between
measured ones starts from their interpolation (the curve is smooth in the rows, and its first
measurements over a level that still lags, at a bucket's first steps under load, read 1.8x its
neighbours in the eighth session's logs); beyond them, from the mean of its first few
measurements over the level. It then follows *comparisons*: a measurement right after the row
measured another point (an exploration, a switch, the step back) moves its log by 0.1 toward
that of ``seconds x ref_other / seconds_other``: ``seconds_other`` the geometric mean of the
other point's run just before (its last steps, up to four), read on the other point's
reference. Frozen after its first few samples (until the seventh
session), a reference kept whatever mismatch the level had then, standing for a point measured
on another scale (the idle calibration, or a load since gone), and in steady state points
compare by their references: at 16 and 32 sequences 3 and 5 verify rows and 4 draft levels
read 1.5x dearer than their neighbours for good, the predicted goodput dipped at depths 2-4,
the band was depth 1 alone, and adaptive sat at depth 1-2 where 3-4 were best. Until the
forty-eighth session a comparison read ``seconds / level``, the level standing for the other
point; but every pass moves the level (the plan's own steps, passes between buckets nudging
it), so the shape tilted with whichever depth was held: s46a's adaptive steps replayed through
a fresh calibration left 4 verify rows at 16 sequences 7-11% dear beside 2, 3, 5 and 6 rows
(9-16% at 32), and the plan stayed off depth 3, the best static depth there. Paired, a
comparison sees the two points a few steps apart and nothing else. Both ways: the plan's step
back after an exploration compares the held point with the explored one, which keeps the held
point on the others' scale (read only one way, the level took in the held point's error, and
the points not compared since read 10-12% off in test_controller.py's trap). In log space,
since a ratio of two noisy times is skewed high (``1 / t`` is convex) and its plain mean would
push every compared reference up. (``paired_comparisons=False`` keeps the old reading.)

**Between buckets.** A batch of ``b / 2 < B < b`` sequences is read from the rows of both
buckets, each at the same rows per sequence (verify) or depth (draft), linear in ``B`` between
them, and at the upper bucket's level: ``level_b x ((1 - w) shape_{b/2} + w shape_b)``, a row's
shape being its prediction over its own level. Its steps are measured against that and move
``level_b`` only, never a reference or a point. At a load of ``b`` such batches are its tails,
where the plan runs deep, and until the thirty-ninth session their steps were taught to bucket
``b``'s shape: a draft step of 5-7 sequences stood for one of 8 unscaled (0.8-0.98x its cost),
and a verify step was brought to 8 by the ratio of the two buckets read at their own levels,
where bucket ``b / 2``, seldom run, still stood at the calibration's while ``b`` had moved with
the host. So the depths run in tails were priced off beside the one run at the full batch (on
synthetic costs in test_controller.py, with the host 1.3x slower than calibrated: 21% cheap for
the draft, 27% dear for the verify pass). Offline at 8 requests on the dev CPU (three start-ups
each way, four runs of 32 requests), bucket 8's priced ratio of depth 3's pass to depth 6's
ended at 0.73-0.82 (verify) and 0.52-0.73 (draft) read the old way and at 0.70-0.81 and
0.45-0.59 this way, beside 0.69 and 0.53 measured by the fixed depths (the calibration alone
spread 0.71-0.78 from one start-up to the next). Over HTTP, in the thirty-ninth session's A/B
at 4-32 requests, the old reading ran 0.963x this one, and the plan ran depth 3 (the best
static depth at 8-32) 45-92% of the time against 18-69% (benchmarks/RESULTS.md, s39a).
``between_bucket_levels=False`` keeps the old reading.

**Context.** Attention reads every cached token of a sequence for each of its rows, so a pass
also costs in proportion to the batch's context ``C`` (its tokens in the KV cache, summed) and
that share does not grow with the rows verified; at 64 sequences of a few hundred tokens on
the CPU it is most of a plain decode pass. Read as a level, that growth would scale every row
count alike and make speculation look dearer exactly when contexts are long. So the model is::

    t_verify(B, T, C) = row_B(T) + B * e_B(T / B, C / B)
    t_draft(B, d, C)  = draft_B(d) + d * B * e'_B(C / B)

with ``e_B(r, c)``, ``e'_B(c)`` (seconds per sequence that ``c`` tokens of context per sequence
add over ``C_ref`` to a verify pass of ``r`` rows per sequence and to one draft level) measured
at start-up at a few contexts (the fastest of interleaved rounds of every pass: a slow spell
over one of two separately timed passes once made the term 3x too steep), piecewise-linear
between them. ``e_B`` is kept per rows since each row attends over the whole context: on the
dev CPU at 64 sequences the slope of 3-9 rows was 1.6-2.3x that of one row, and with one slope
for all, the rows the plan was not running read 1.1-1.2x their cost beside the one it ran
(the ninth session: adaptive sat at depth 2 at 64 requests, 0.89x static depth 3). And over
more than one context, since it is not linear in the context: read off the line from 32 to
256 tokens, passes at 136 tokens (the sweep's contexts) came out 2.6% dearer at 4 rows than
at 6-9 at 16 sequences, beside 0.7% with a point at 128 (the twenty-fifth session), a tilt
toward deep plans of the size that decides between depths near the top. ``C_ref`` is the
calibration's context per sequence, and the rows and their level holding costs brought to ``C_ref`` (each
measurement has the context term taken off before it updates them). The engine passes ``C``
with every plan and every step.
``t_step(B)`` is the rest of an engine step (scheduling, bookkeeping, streaming the tokens
out), timed from the end of the step before (engine.py), so that whatever the caller does
with each step's outputs counts too: in the server, the event loop's SSE event per request per
step, which on a busy server takes the core (or the interpreter) from the engine. It is the
same for every plan, so it matters only in that deeper plans spread it over more tokens, and
at high load that decides: on the dev CPU at 64 requests (server on one core) it made static
depth 3 17% faster than plain decoding over HTTP, while the engine's own step times, which
the controller saw until the seventh session, had plain decoding ahead, and adaptive ran
depth 0.6 at 0.84x the best static depth. It is an EMA per batch bucket like the draft step.

**High load.** Once the verify pass is compute-bound, ``t_verify(B, B(n+1)) ~ (n+1) t_verify(B, B)``
while ``E < n + 1``, so every ``d > 0`` loses to plain decode and the controller falls to
``d = 0`` by itself; acceptance alone cannot tell (it stays flat while the best depth flips).

**Exploration.** A position's global estimate is shrunk toward the estimate of the position
above it by its recent data (observations, fading by ``weight_decay`` per step without one):
never observed, it takes the estimate above; seen a few times long ago, it mostly does.
Positions deeper than the steps actually verified get no fresh data: their global EMA
decays slowly toward the estimate of the position above it (position 1: toward
``prior_acceptance``), and a request's own stale positions lose weight toward the global. After ``probe_interval`` steps
without data for the position just below the current depth, one step is run one level deeper
(from ``d = 0``: depth ``probe_depth``), so the estimates cannot go stale; at most one probe
per interval, so the cost is bounded by ``1 / probe_interval`` of a step. Position 1 never
observed counts as due, so a fresh controller probes on its first plain step, at
``max_depth`` so that every position has data (the prior stays where no sequence reached), and the prior
weighs as ``_PRIOR_OBSERVATIONS`` observations in a position's first EMA steps: one probe of a
batch replaces the guess rather than nudging it.

**Sampled and greedy.** A request sampled at temperature > 0 accepts less than a greedy one
(rejection sampling keeps a draft token with probability min(1, p/q)), so after a spell of
sampled requests the global estimate is theirs, and new greedy requests were priced at it.
Where that put the plan at depth 0, nothing more was learnt (plain steps verify nothing), and
it stayed: on the embedded pair, 48 greedy requests at 16 after 48 sampled ones ran 189 of 192
steps plain, 0.90x static depth 2 (the forty-seventh session, ``benchmarks.workload_shift``).
So ``plan`` is told which requests sample, and from the first sampled request observed each
kind keeps an estimate of its own (the global one up to then becomes the greedy one, the
sampled one starts from it): a request's own estimate starts from, and is shrunk toward, its
kind's. The global estimate, over both, still drives the probes, the early-stop thresholds
and the staleness. A workload that never samples has one kind and plans as before.

**Explorations.** The plan in use refreshes only its own cost buckets; the other plans are
judged on older numbers, and the level shift of the contexts since does not move every bucket
alike. So every ``explore_interval`` steps (speculating) one step runs another depth: of the
plan's neighbours and every depth whose best plan is predicted within ``explore_margin`` of
the top, the one this batch bucket ran least recently, a neighbour's time since counted
double (with only the neighbours in reach: one level up, one down, in turn). The cost is
``1 / explore_interval`` of a step at most ``explore_margin`` below the top. Neighbours alone
(until the twenty-first session) leave a depth two levels off on whatever it last read, and
on the CPU the goodput curve over depth is not concave: in the twentieth session's sweep at
16 requests the fixed depths 3, 4, 5, 6 measured 1.00, 0.89, 0.89, 0.91 of the best (four
verify rows cheap, five dear); the plan sat at depth 5, its neighbours read as its equals,
and depth 3, predicted at 0.95 of the top from old numbers, was not measured again.
Past ``explore_batch`` sequences the gap grows: a step of a larger batch tells the bias
correction more (see "Bias": its noise sd falls as ``1/sqrt(B)`` down to the floor of the
step's own time noise), so the gap is ``explore_interval`` times the ratio of the two noise
variances, one step in 16 at 9-16 sequences and one in 25 from 17, and each depth's figure is
about as well measured per step of the plan. Every exploration is a step off the plan (often
one dearer by a tenth or more: depth 7-8 at 16 sequences) and a change of the pass's shape
into it and back; with one in 8 everywhere the plan at 16 requests on the dev CPU changed depth
on a third of its steps and ran 3% slower than with the longer gaps (thirty-eighth session).

**The centre of the band.** Near the top the goodput curve is flat (on the dev CPU at one
request, static depths 4-7 measured within 4% of each other) and the predictions carry errors
of a few percent (noisy timings, costs of depths not run lately, acceptance compounded over
deep positions), so the argmax wanders over the flat top, and a rule that takes either edge of
it lands where the curve starts to fall: the shallowest plan within a margin of the top (this
controller's rule until the sixth session) ran depth 3 at one request where depths 5-7 were
best, and depth 2 at 64 requests where 3-5 were. The band is the run of depths around the
top's whose best plans are predicted within ``band_margin`` of it, and the depth aimed at is
its *centre*: the mean of its depths weighted by how far each stands above the band's floor
(the top less the margin), rounded to the nearest depth; at that depth the plan predicted
best. Errors smaller than the margin move the centre by a fraction of a depth, whichever side
they push, and a depth that barely scrapes into the band barely counts. The band's middle
depth (the shallower of two), this controller's rule from the sixth to the ninth session,
weighed every depth in the band alike and leaned shallow wherever the curve falls slower on
the shallow side than on the deep one, which at high load it does (the ninth session's
in-server logs at 64 sequences: depth 3 predicted best, 2 within 1.3% and 4 within 5.7%, or
1, 2 and 4 within 4.5%; the middle of [2, 3] or of [1, 3] is 2, the centre 3, and the plan sat
at depth 1-2 where static depths 3-4 were best).

**Guard.** The cost model can be wrong by more than the margins between plans (on the dev
CPU its predictions for depths it has not run lately were off by 5-20%), and the one mistake
a serving engine must not make is to speculate where plain decoding is faster. So the
controller also keeps the *measured* goodput of whole steps per (batch bucket, depth), as an
EMA of measured / predicted tokens per second for each step (a bucket's steps differ in batch
size and context, so raw tokens/s would compare the batches the samples happened to land on;
the ratio keeps what the model gets wrong per depth, and times today's prediction it gives
that depth's measured goodput for the batch at hand). While speculating, every ``guard_interval`` steps it runs one plain
step, unless the plan in use has measured more than ``guard_band`` above a recent plain
figure; when the plan in use has measured below plain decoding by more than ``guard_margin``
(both within ``guard_max_age`` steps, at least ``guard_min_samples`` speculative steps and
``guard_min_plain`` plain ones: one plain step is too thin a reference, a stall of the
speculative steps or a lucky plain step would do), the bucket is held at depth 0, and its
speculative figures are dropped so that the next verdict is on fresh steps. The hold backs off:
``guard_first_hold`` steps, doubling for each trip that follows the end of the last hold within
``guard_max_age`` steps, up to ``guard_hold``. A bucket's first steps under load are slow for
whichever plan runs them (memory first touched at that size), and it is the speculative plan
that runs first: a trip on such samples held a sweep's 64-request cell at depth 0 for all
its 128-step hold, at 0.78x static depth 4 (seventh session). Where speculation truly loses,
a hold costs ``guard_min_samples`` speculative steps each, so later holds are long.
Only from ``guard_min_batch`` sequences
on: with one or two, a step's goodput says more about the request running (acceptance
differs from prompt to prompt by 2x) than about the plan, and the per-request acceptance
model is the better judge; with many the step averages over requests and its cost decides.
Across batch sizes the model still decides; within a bucket, the measurement has the last
word on speculating at all.

**Bias.** What the model gets wrong is not the same at every depth: in the fourteenth
session's step logs (adaptive servers, decode-only steps) measured over predicted tokens/s was
1.10-1.13 at depths 4-6 and 0.80 at depth 8 at one request, 1.07 at depth 3 falling to 0.71 at
depth 8 at 16 (a cost it has no term for, such as the per-token output work of a step, which
grows with the tokens a deep plan emits; deep positions' acceptance read from the positions
above; the plans it picks when a request's acceptance reads high regressing to the mean). So
each (batch bucket, depth) keeps what its whole steps measured against what was predicted for
them, in two parts: tokens as a ratio of sums (a step of nine tokens weighs as nine), and
time as the mean of each step's ratio clipped to 1.5x either way (a step slowed 8x by a spell
counts once, at 1.5x). Both are sums discounted by ``bias_half_life`` steps of their batch
bucket (what a depth gets wrong at 16 sequences is a shape of the machine, the CPU's cost of
80 rows against 64, and does not age while the server serves 64: counted in every engine
step, a round of the sweep's other loads took two thirds of a bucket's evidence), and the decision
reads every plan's prediction times its depth's factor: the ratio shrunk toward 1 as a normal
mean with prior sd ``bias_prior_sd`` and the per-step noise its steps show, pooled with
``bias_noise_sd / sqrt(B)`` worth eight steps (at one sequence a step's tokens vary by half
their mean, so a 20% bias takes ~50 steps to show and a few lucky steps move nothing; at 64
sequences a few steps do), less a dead band of ``bias_deadband`` or the posterior's sd where
that is wider (on a flat top a noise-driven 2% moves the plan, and thin evidence should move
nothing). The ratios are taken against the model's own predictions, not the corrected ones,
so the correction converges to the model's error instead of feeding on itself; the guard keeps
its own figures. Depths not run lately fade back toward 1, and the explorations keep the
neighbours of the plan measured. What it cannot tell apart: a spell that lasts while one depth
runs is read as that depth's cost (the fifteenth session's sweep, RESULTS.md).
An error every depth shares is not a reason to prefer one: on the dev CPU the acceptance model
read ~8% low at every depth of 32 sequences (the seventeenth session), so the depth in use
measured 1.05 after the dead band while its untried neighbours stayed at 1, and the plan kept
whichever depth it had first settled on (2, 4 or 6 from one run to the next, where 3 was best).
So the speculative depths' factors are read around a *centre*, the mean of the factors the
depths with figures show by themselves (one vote a depth) where that is above 1: a depth
without figures takes the centre, and a depth with figures its ratio shrunk toward the centre
instead of toward 1. Below 1 the centre stays at 1 (optimism where there is no evidence:
when the depths that ran measured below their predictions, the ones that did not keep the
benefit of the doubt, and the plan goes to try them). Plain decoding (depth 0, whose tokens
the model cannot get wrong) keeps its own figure about 1.

**Churn.** A step's goodput is not the server's: each request that ends leaves its slot
yielding nothing until the next request decodes, and that gap is counted in steps, not seconds
(the new request is admitted at a step boundary and its prompt's step yields it one token), so a
deeper plan, whose steps are longer, loses more to it. Over one slot's cycle a request of ``L``
tokens takes ``L / E`` steps and the gap ``g`` more, so the slot's rate is
``E / t * 1 / (1 + g * E / L)``, not ``E / t``. On the dev CPU at 16 requests the sweep's fixed
depths decoded 16.0, 15.8, 15.7, 15.5, 15.3, 15.1 sequences a step on average at depths 0-5,
the same ~2.2 empty slot-steps per request at every depth (the twenty-seventh session's step
logs; the client's turnaround adds to the step-bound part, ``1 - 1/E`` of a step for the
prompt's and half a step's wait for the boundary): at depth 4 against 3 that is 1.3% of
throughput, at 5 2.8%, which the step goodput does not see, where the predictions of depths 3-5
stood within 1-2% of each other. So the decision reads each depth's predicted goodput times
``1 / (1 + churn_steps * E_d / L)`` (``E_d`` the tokens a sequence of the depth's best plan),
``L`` the mean tokens a request decoded over the last finished requests (none: no term), or
what the running requests have decoded so far where that is more: they will decode at least
that, and an L learnt from a spell of short requests would otherwise hold the plan shallow
until the first long ones end (the forty-seventh session: 63 plain steps of a batch of 16
requests of 64 tokens, after 32 of 4; with the floor, 20, then depth 3). The
guard, the bias and the step log's predictions keep the step's own goodput, which is what a
step measures. Tried in the twenty-seventh session, it did not pay while the calibration priced
depth 3 5-7% dear at 8-32 requests (see ``CostModel._verify_at``); with the verify pass priced
at its rows (the thirty-second session, sweep s32f) it moved the plan at 16 and 32 requests
from depths 4-5 to depth 3 (71% and 80% of the time), +5% and +4% of throughput there.
``churn_steps`` is what the fixed depths' step logs show, not the gap's step-bound part alone.
Counted over whole sweep cells (s48c, s49h: slots times steps less the sequences that decoded,
over the requests served; ``benchmarks/step_report.py --churn``): 0.9 empty slot-steps a
request at 1 request (the engine idles through the client's turnaround, and only the prompt's
step counts), 2.0 at 2, 2.5 at 4, 3.3 at 8, 3.9 at 16, 4.4 at 32 and 64, at every depth alike
or growing with it: the new request's prompt step, the step during which it arrives, and a
tail as a load drains, which 1.5 left out. 3.0 against 1.5, in one server (s50a, 8 rounds at
4-16 requests): +0.8%, +2.0% and +3.1% at 4, 8 and 16 (+-1.2% each); 4.5 no better than 3.0
at 4 and 8. Over fresh servers (s50b + s50c, 20 rounds) the throughput ratio to the best static
depth at 4-16 requests pooled as with 1.5 (0.948-0.957), while the depths chosen, priced at the
fixed depths' rates, came closer to the best at 16 requests (0.984-0.987 against 0.970).

**Hysteresis.** The current plan is kept unless the best plan's predicted goodput beats it by
more than ``switch_margin`` (relative), or some other plan has been best for
``switch_patience`` consecutive evaluations (then the latest best is taken). A plan is
evaluated afresh when the batch changes and every ``replan_interval`` steps in between (an
evaluation is ~0.1 ms of Python, 1-2% of a one-request step on the CPU); the steps between
keep the plan, and the guard, probes and explorations still run every step.

The plan held is per batch bucket (``plan_per_bucket``): when the batch moves into another
bucket the plan goes on from the one last held there (none yet: the best, at once), and the
challenger's streak starts over. Hysteresis is against noise within one load; a new load is
not noise. With one plan for every bucket, a burst of requests after a lull kept the lull's
plan until a challenger had been best for ``switch_patience`` evaluations: in the sweep s31e
the first 10-12 steps of a cell at 8-32 requests ran depth 6-8 where the bucket's plan was 3-5
(~15% of such a cell's time).
"""

from __future__ import annotations

import bisect
import math
from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Hashable, NamedTuple, Sequence


class Plan(NamedTuple):
    """A named tuple, not a frozen dataclass: plans key the dicts every evaluation builds and
    reads (tens of lookups a step), and a tuple hashes and compares in C."""

    depth: int       # draft steps; 0 = plain decode, draft idle
    num_nodes: int   # tree nodes excluding the root; == depth for a chain, 0 for plain decode


@dataclass
class StepStats:
    """What one engine step did and measured, fed to :meth:`AdaptiveController.observe`."""

    batch_size: int
    depth: int
    num_nodes: int
    draft_s: float                  # wall time of all `depth` draft steps together (0: not representative)
    verify_s: float                 # wall time of the target's verify (or plain decode) pass
    num_accepted: list[int]         # [B] tree nodes accepted per request, bonus token not counted
    request_ids: list[Hashable]     # [B]
    # [B][num_accepted_i] sibling rank of each accepted node along its path (0 = the drafter's
    # first choice at that depth). Optional; without it an accepted alternate is counted as
    # an accepted first choice (acceptance overestimated), so the engine should pass it.
    accepted_ranks: list[list[int]] | None = None
    overhead_s: float = 0.0         # the rest of the step since the previous one ended (scheduling, outputs, the caller's share)
    # Trees (not chains): [B][nodes] the draft's path probability of each verified node and its
    # depth, for the EAGLE-2 estimate of tokens per pass (see AdaptiveController.evaluate).
    path_probs: list[list[float]] | None = None
    node_depths: list[list[int]] | None = None
    # When the scheduler cut some trees below the plan (near max_tokens): [B] the depth of each
    # request's own tree (positions beyond it were not proposed, so they count neither way),
    # the verify pass's real token count, and the draft levels that ran.
    seq_depths: list[int] | None = None
    num_tokens: int | None = None
    draft_depth: int | None = None
    # Chains with early stop: [B] the depth each request's chain was really drafted to (at
    # most its seq_depths entry; shorter where the draft's path probability fell below the
    # plan's threshold). Positions past it count as not accepted. None: every chain ran to
    # its seq_depths entry (or the plan's depth).
    drafted_depths: list[int] | None = None
    # Tokens already in the KV cache of the step's decoding sequences, summed (what the
    # attention of every row reads); None: unknown, costs taken as at the reference context.
    context_tokens: int | None = None


def tree_expected_accepted(path_probs: Sequence[float]) -> float:
    """EAGLE-2 estimate of tokens per verify pass from the draft's path probability of each
    node (the product of draft probabilities from the root to the node): 1 + their sum."""
    return 1.0 + float(sum(path_probs))


def _best_per_depth(scores: dict[Plan, tuple[float, float]]) -> dict[int, tuple[float, float]]:
    """depth -> (predicted goodput, expected tokens per sequence) of its best plan."""
    best: dict[int, tuple[float, float]] = {}
    for p, (g, e) in scores.items():
        if p.depth not in best or g > best[p.depth][0]:
            best[p.depth] = (g, e)
    return best


def _bucket(x: int) -> int:
    """Smallest power of two >= x (x >= 1)."""
    b = _BUCKETS.get(x)
    if b is None:
        b = 1 << max(0, int(x) - 1).bit_length()
        if len(_BUCKETS) < 4096:
            _BUCKETS[x] = b
    return b


_BUCKETS: dict = {}   # x -> _bucket(x): asked about the same few batch sizes a dozen times a step


def _bucket_weights(buckets: list[int], batch_size: int) -> list[tuple[int, float]]:
    """How a query at batch_size reads the measured batch buckets (sorted): its own bucket
    when measured, else interpolated in log2 B between the measured buckets around it (the
    nearest one beyond either end). [(bucket, weight)], weights summing to 1."""
    b = _bucket(batch_size)
    i = bisect.bisect_left(buckets, b)
    if i < len(buckets) and buckets[i] == b:
        return [(b, 1.0)]
    if i == 0:
        return [(buckets[0], 1.0)]
    if i == len(buckets):
        return [(buckets[-1], 1.0)]
    lo, hi = buckets[i - 1], buckets[i]
    f = (math.log2(b) - math.log2(lo)) / (math.log2(hi) - math.log2(lo))
    return [(lo, 1.0 - f), (hi, f)]


class _EmaPoint:
    __slots__ = ("x", "t", "count", "ref", "ref_count", "level")

    def __init__(self, x: float, t: float):
        self.x, self.t, self.count = float(x), float(t), 1
        self.ref, self.ref_count, self.level = float(t), 1, 1.0   # used by _Row only

    def update(self, x: float, t: float, alpha: float) -> None:
        # The first few samples are averaged plainly, so one outlier at start-up does not stick.
        w = max(alpha, 1.0 / (self.count + 1))
        if self.count >= 3:
            # Winsorised: one stall (a GC pause, a busy core under a 2-thread torch) counts as at
            # most twice the estimate, so it moves it by alpha at most; a lasting change still
            # doubles the estimate within ~7 steps and keeps following.
            t = min(max(t, 0.5 * self.t), 2.0 * self.t)
        self.x += w * (x - self.x)
        self.t += w * (t - self.t)
        self.count += 1


def _interp_points(points: list[_EmaPoint], x: float, xs: list[float] | None = None) -> float:
    """Piecewise-linear through points sorted by x; linear extrapolation with the end
    segments' slopes (never negative); one point: half fixed, half proportional to x.
    xs: the points' x, when the caller has them."""
    return _interp_xt([p.x for p in points] if xs is None else xs, [p.t for p in points], x)


def _interp_xt(xs: list[float], ts: list[float], x: float) -> float:
    """_interp_points over the points' x and t as two lists (a row's plan reads it a dozen
    times a step)."""
    n = len(xs)
    if n == 1:
        px, pt = xs[0], ts[0]
        return pt * (0.5 + 0.5 * x / px) if px > 0 else pt
    i = bisect.bisect_left(xs, x)
    if 0 < i < n:
        xl, xh, tl, th = xs[i - 1], xs[i], ts[i - 1], ts[i]
        slope = (th - tl) / (xh - xl) if xh > xl else 0.0
    else:   # extrapolating: never cheaper with more tokens
        j = 1 if i == 0 else n - 1
        xl, xh, tl, th = xs[j - 1], xs[j], ts[j - 1], ts[j]
        slope = max(0.0, (th - tl) / (xh - xl) if xh > xl else 0.0)
    t = tl + slope * (x - xl)
    floor = 0.1 * ts[0]
    return floor if floor > t else t


class _ContextCurves:
    """What the context adds to a pass at one batch bucket, per rows per sequence: seconds per
    sequence over the reference context, piecewise-linear in the context per sequence between
    the contexts measured (on the end segments beyond them) and in the rows between the rows
    measured (flat beyond them). One slope per rows is the two-context case."""

    __slots__ = ("rows", "contexts", "excess")

    def __init__(self, contexts: list[float], excess: dict[float, list[float]]):
        self.contexts = contexts                          # sorted; the first is the reference
        self.rows = sorted(excess)
        self.excess = [excess[r] for r in self.rows]      # [rows][context]: seconds per sequence

    def at_context(self, context: float) -> list[float]:
        """Seconds per sequence at `context` tokens per sequence, per rows (as self.rows)."""
        xs = self.contexts
        j = min(max(bisect.bisect_right(xs, context), 1), len(xs) - 1)
        f = (context - xs[j - 1]) / (xs[j] - xs[j - 1])
        return [e[j - 1] + f * (e[j] - e[j - 1]) for e in self.excess]

    def at(self, context: float, rows: float) -> float:
        """over_rows(at_context(context), rows), reading only the rows it needs."""
        xs = self.contexts
        j = min(max(bisect.bisect_right(xs, context), 1), len(xs) - 1)
        f = (context - xs[j - 1]) / (xs[j] - xs[j - 1])
        rs, excess = self.rows, self.excess
        if rows <= rs[0] or rows >= rs[-1]:
            e = excess[0] if rows <= rs[0] else excess[-1]
            return e[j - 1] + f * (e[j] - e[j - 1])
        i = bisect.bisect_left(rs, rows)
        lo, hi = excess[i - 1], excess[i]
        v0, v1 = lo[j - 1] + f * (lo[j] - lo[j - 1]), hi[j - 1] + f * (hi[j] - hi[j - 1])
        return v0 + (v1 - v0) * (rows - rs[i - 1]) / (rs[i] - rs[i - 1])

    def over_rows(self, values: list[float], rows: float) -> float:
        """at_context's values read at `rows` rows per sequence."""
        rs = self.rows
        if rows <= rs[0]:
            return values[0]
        if rows >= rs[-1]:
            return values[-1]
        i = bisect.bisect_left(rs, rows)
        return values[i - 1] + (values[i] - values[i - 1]) * (rows - rs[i - 1]) / (rs[i] - rs[i - 1])

    def mean_slope(self) -> dict[float, float]:
        """Per rows, seconds per token of context from the reference to the last context
        measured (the one slope of the two-context case)."""
        span = self.contexts[-1] - self.contexts[0]
        return {r: e[-1] / span for r, e in zip(self.rows, self.excess)}


def _pooled(ts: list[float]) -> list[float]:
    """_pool_adjacent_violators over the points' t alone, as a new list (the same list when
    they never fall, the usual case)."""
    prev = None
    for t in ts:
        if prev is not None and prev > t:
            break
        prev = t
    else:
        return ts
    blocks: list[list[float]] = []
    for t in ts:
        blocks.append([t, 1])
        while len(blocks) > 1 and blocks[-2][0] / blocks[-2][1] > blocks[-1][0] / blocks[-1][1]:
            total, n = blocks.pop()
            blocks[-1][0] += total
            blocks[-1][1] += n
    out: list[float] = []
    for total, n in blocks:
        out.extend([total / n] * n)
    return out


def _pool_adjacent_violators(points: list[_EmaPoint]) -> None:
    """Make the points' t non-decreasing in x, in place, by averaging each run that falls
    (isotonic regression, weights equal). A pass over more rows or more draft levels does more
    work; where a point reads cheaper than the one before it, one of them is stale or caught a
    slow spell, and the fall would make the plan past it look cheaper than it is (at 64
    sequences the sixth session's logs had 8 rows read 8% cheaper than 7, and the controller
    ran depth 6-8 where 3 was best)."""
    for p, t in zip(points, _pooled([p.t for p in points])):
        p.t = t


# How far one comparison with a neighbouring point (a measurement right after the row measured
# another point) moves a point's reference (AdaptiveController(cross_alpha=...)): explorations
# come one step in 8, so each counts, but one taken just as a slow spell ends is off by the
# spell. 0.03 and 0.3 read within 1.2% of this in a server A/B (benchmarks/RESULTS.md, s24a).
_CROSS_ALPHA = 0.1


class _Row:
    """t_verify (or draft time by depth) of one batch bucket: a point per rows per sequence
    (per depth), and the row's level.

    A measured point is read as ``ref * level``: its reference (the shape) at today's level.
    The level is an EMA of measured / reference over every step; a reference is the mean of
    its point's first few measurements over the level, then moves only on steps that follow a
    measurement of another point (a comparison of the two at one moment). A stand-in (a
    calibration that does not run the way the engine does) is read as its value moved with
    the level since, times ``standin_ratio``, until the first real measurement replaces it.
    Each point also keeps an EMA ``t`` of its measurements and ``x`` of its token counts; ``t``
    is what a stand-in reads, and a measured point's ``t`` is no longer read."""

    RUN_MEAN = 4     # a comparison's other side: the mean of up to this many of its last steps
    RUN_FRESH = 16   # of the row's last measurements and nudges

    __slots__ = ("points", "level", "key", "_xt", "standin_ratio", "_standins_replaced", "_last_key",
                 "_run", "_tick")

    def __init__(self, key: Callable[[int], int] = None):
        self.points: dict[int, _EmaPoint] = {}
        self.level = 1.0
        self.key = key or _bucket   # x -> the point it updates (token counts: power-of-two buckets)
        # The points as current() reads them, as their x and t, until the next observe.
        self._xt: tuple[list[float], list[float]] | None = None
        # Stand-ins not yet replaced are read times the mean ratio the replaced ones showed
        # (first real measurement over its stand-in). The calibration's bare draft forwards
        # miss the host work of each level and, in a server, the event loop's share of the
        # interpreter: offline the engine's levels cost ~1.2x the stand-ins, under HTTP load
        # 1.5-2.7x, every depth alike. Read as they stand, the depths the engine has not run
        # yet look cheap, and that is where the plan goes (sixth session, 8 requests over
        # HTTP: depth 8's stand-in read 6.9 ms beside 14.8 ms measured for depth 7).
        self.standin_ratio = 1.0
        self._standins_replaced = 0
        self._last_key: int | None = None   # the point the last online measurement updated
        # The run of measurements of that point since the row last measured another: (tick,
        # log seconds) of its last RUN_MEAN, the other side of a comparison (see observe);
        # the tick counts the row's measurements and nudges, so a stale run is seen as one.
        self._run: deque[tuple[int, float]] = deque(maxlen=self.RUN_MEAN)
        self._tick = 0

    def current(self) -> list[_EmaPoint]:
        """The points at today's level, sorted by token count (copies)."""
        return [_EmaPoint(x, t) for x, t in zip(*self.curve())]

    def curve(self) -> tuple[list[float], list[float]]:
        """current()'s x and t as two lists (do not modify), kept until the next observe."""
        if self._xt is not None:
            return self._xt
        xs, ts = [], []
        level, standin_ratio = self.level, self.standin_ratio
        points = self.points
        for k in sorted(points):
            p = points[k]
            xs.append(p.x)
            if p.ref_count == 0:   # a stand-in: as calibrated, moved with the level since
                ts.append(p.t * level / p.level * standin_ratio)
            else:                  # measured: its place in the row's shape, at today's level
                ts.append(p.ref * level)
        # Not smoothed toward a straight row: the verify pass zig-zags over rows (in the
        # server at 16 sequences 32.9, 31.4, 37.1, 41.5 ms at 3, 4, 5, 6 rows, the nineteenth
        # session's step logs), and read halfway to its neighbours' line each point lost its
        # edge: the predicted top sat on the dip at depth 4 where depth 3 was best, 2-3% of
        # goodput in an A/B over 16 sweep rounds. A lone point measured high by noise at
        # start-up is a dip in the predicted curve until the engine's own steps there replace
        # it: soon next to the plan (explorations, one step in ``explore_interval``), only
        # when the plan comes near for a point further off (the worst run of
        # test_noisy_costs_do_not_hold_the_plan_away_from_the_best_depth).
        self._xt = (xs, _pooled(ts))
        return self._xt

    def predict(self, num_tokens: float) -> float:
        return _interp_xt(*self.curve(), num_tokens)

    def nudge_level(self, ratio: float, level_alpha: float) -> None:
        """A measurement `ratio` times what the row predicted, that tells its level and nothing
        of its shape (a pass between two buckets, see "Between buckets" in the module
        docstring): the level moves as any measurement moves it, winsorised alike; no point,
        reference or comparison changes."""
        if level_alpha > 0:
            self.level *= 1.0 + level_alpha * (min(max(ratio, 0.5), 2.0) - 1.0)
            self._xt = None
            self._tick += 1

    def observe(self, num_tokens: int, seconds: float, alpha: float, level_alpha: float,
                is_reference: bool = False, provisional: bool = False, key: int | None = None,
                cross_alpha: float = _CROSS_ALPHA, paired: bool = True) -> None:
        """is_reference: a careful measurement (calibration) that fixes the point's reference.
        provisional: a stand-in (a calibration that does not run the way the engine's steps
        do) used until the first real measurement, which then replaces it outright, value
        and reference, without moving the level."""
        self._xt = None
        tb = self.key(num_tokens) if key is None else key
        p = self.points.get(tb)
        if provisional:
            if p is None or p.ref_count == 0:
                p = self.points[tb] = _EmaPoint(num_tokens, seconds)
                p.ref, p.ref_count, p.level = seconds / self.level, 0, self.level
            return
        if p is not None and p.ref_count == 0:   # the first real measurement of a stand-in
            self._learn_standin_ratio(seconds, p.t * self.level / p.level)
            p.x, p.t, p.count = float(num_tokens), float(seconds), 1
            p.ref, p.ref_count, p.level = seconds / self.level, 1, self.level
            self._run.clear()
            return
        if p is None and not is_reference:
            # A depth the engine runs for the first time between stand-ins (the calibration
            # measured depths 1, 3 and 8; the engine first runs 4): compared with the stand-ins
            # around it, it teaches their ratio as a replaced stand-in does. Read unscaled
            # beside a measurement, they made depths 1-3 look half as dear as 4 at 64 sequences
            # (eighth session), and the plan fell to depth 1-2.
            standins = self._standins()
            if len(standins) >= 2 and standins[0].x <= num_tokens <= standins[-1].x:
                self._learn_standin_ratio(seconds, _interp_points(standins, num_tokens))
        # A measurement right after the row measured another point compares this point with
        # that one at one moment: this one's cost over the other's, times the other's
        # reference, is what its reference should be (see below; unpaired, the level stands
        # for the other's cost). The run of steps at one plan only moves the level.
        switched = level_alpha > 0 and self._last_key is not None and self._last_key != tb
        cross = seconds / self.level
        if level_alpha > 0:
            self._tick += 1
        if paired and switched:
            # Paired: over the other point's run just before (the geometric mean of its last
            # few steps, on that point's reference), not over the level; none over a run gone
            # stale. Both ways: the plan's step back after an exploration compares the plan's
            # point with the explored one, which keeps the held point's reference on the
            # others' scale (otherwise the level takes in its error, and every point not
            # compared since reads off by it).
            other = self.points.get(self._last_key)
            run = [x for t, x in self._run if t >= self._tick - self.RUN_FRESH]
            cross = (seconds * other.ref / math.exp(sum(run) / len(run))
                     if other is not None and other.ref_count > 0 and run else None)
            switched = cross is not None
        if level_alpha > 0:
            if self._last_key != tb:
                self._run.clear()
            self._last_key = tb
            if seconds > 0:
                self._run.append((self._tick, math.log(seconds)))
        # The measured points (stand-ins are not part of the shape), read only for a new point:
        # a point here that is not new is measured (stand-ins returned above), so the row has one.
        reference = self._reference() if p is None else None
        if level_alpha > 0 and (p is not None or reference):
            # Measured against the row's reference shape at today's level; one stall moves
            # the level by level_alpha of 2x at most.
            predicted = self.level * (p.ref if p is not None else _interp_points(reference, num_tokens))
            if predicted > 0:
                ratio = min(max(seconds / predicted, 0.5), 2.0)
                self.level *= 1.0 + level_alpha * (ratio - 1.0)
        if p is None:
            p = self.points[tb] = _EmaPoint(num_tokens, seconds)
            if (level_alpha > 0 and not is_reference and len(reference) >= 2
                    and reference[0].x <= num_tokens <= reference[-1].x):
                # A new point between measured ones takes its place in the shape from them:
                # the curve is smooth in the rows, and its first measurements over the level
                # would take in whatever the level lags behind (a bucket's first steps under
                # load, on the idle calibration's scale: at 64 sequences 3 rows, measured
                # first, read 1.8x the calibrated 2 and 4 around it, and the plan fell to
                # depth 1). The measurement moves the level; comparisons refine the place.
                p.ref, p.ref_count = _interp_points(reference, num_tokens), 4
            else:
                p.ref = seconds / self.level
                p.ref_count = 4 if is_reference else 1
        else:
            if is_reference:
                p.ref, p.ref_count = seconds / self.level, 4
            elif p.ref_count < 4:   # the reference is the mean of the first few, not one noisy sample
                p.ref_count += 1
                p.ref += (seconds / self.level - p.ref) / p.ref_count
            elif switched:
                # Then it follows such comparisons (winsorised like the points). Frozen after
                # the first few, a reference kept whatever mismatch the level had when the point
                # was first measured (the level then stood for another point measured on another
                # scale: the idle calibration, or a load since gone), and in steady state points
                # compare by their references: at 32 sequences (seventh session) 3 rows read
                # 1.5x dearer than 4 for good, depth 2 became a dip, and adaptive sat at depth 1.
                target = min(max(cross, 0.5 * p.ref), 2.0 * p.ref)
                if paired:
                    # In log space: a ratio of two noisy times is skewed high (1 / t is convex),
                    # so its plain mean would push every compared reference up.
                    p.ref *= (target / p.ref) ** cross_alpha
                else:
                    p.ref += cross_alpha * (target - p.ref)
            p.update(num_tokens, seconds, alpha)
        p.level = self.level

    def _reference(self) -> list[_EmaPoint]:
        return [_EmaPoint(p.x, p.ref) for _, p in sorted(self.points.items()) if p.ref_count > 0]

    def _standins(self) -> list[_EmaPoint]:
        """The stand-ins as calibrated, moved with the level since (not yet scaled)."""
        return [_EmaPoint(p.x, p.t * self.level / p.level) for _, p in sorted(self.points.items())
                if p.ref_count == 0]

    def _learn_standin_ratio(self, seconds: float, standin: float) -> None:
        """One real measurement against the stand-in value at the same place: the running mean
        of such ratios is what stand-ins not yet replaced are read times."""
        if standin > 0:
            self._standins_replaced += 1
            ratio = min(max(seconds / standin, 0.25), 4.0)
            self.standin_ratio += (ratio - self.standin_ratio) / self._standins_replaced


def _between(lo: _Row, hi: _Row, w: float, xs_lo: Sequence[float], xs_hi: Sequence[float]) -> list[float]:
    """A pass between two buckets' batch sizes, `w` of the way from the lower to the upper:
    the two rows' shapes (at xs_lo and xs_hi) interpolated, at the upper row's level (see
    "Between buckets" in the module docstring)."""
    (px_lo, ts_lo), (px_hi, ts_hi) = lo.curve(), hi.curve()
    level_lo, level_hi = lo.level, hi.level
    v = 1.0 - w
    return [level_hi * (v * (_interp_xt(px_lo, ts_lo, x) / level_lo) + w * (_interp_xt(px_hi, ts_hi, y) / level_hi))
            for x, y in zip(xs_lo, xs_hi)]


class CostModel:
    """Measured step costs: t_draft(B) per draft step and t_verify(B, num_tokens) per pass."""

    def __init__(self, alpha: float = 0.03, level_alpha: float = 0.1, cross_alpha: float = _CROSS_ALPHA,
                 verify_by_rows: bool = True, context_rows_monotone: bool = False,
                 between_bucket_levels: bool = True, paired_comparisons: bool = True):
        self.alpha = alpha
        # A comparison reads the point over the other point's run just before (False: over
        # the row's level; see _Row.observe).
        self.paired_comparisons = paired_comparisons
        self.level_alpha = level_alpha
        self.cross_alpha = cross_alpha   # how far one comparison moves a point's reference
        # A verify pass at a batch size between two measured buckets: read at its rows per
        # sequence in both and interpolated in the batch size (see _verify_at), not as a token
        # count on its own bucket's row.
        self.verify_by_rows = verify_by_rows
        # Between two buckets, a pass (verify, and draft levels alike) is read as the upper
        # bucket's level times the two buckets' shapes interpolated, and its measurements
        # move that level only (False: each bucket read at its own level, and a measurement
        # brought to the upper bucket and taught to its shape, as until the thirty-ninth
        # session; draft levels read as the upper bucket's). See "Between buckets".
        self.between_bucket_levels = between_bucket_levels
        self._draft: dict[int, _EmaPoint] = {}                    # batch bucket -> (B, t) of one draft level
        self._draft_rows: dict[int, _Row] = {}                    # batch bucket -> total draft time by depth
        self._overhead: dict[int, _EmaPoint] = {}                 # batch bucket -> (B, t)
        self._verify: dict[int, _Row] = {}                          # batch bucket -> its verify costs
        # The context term (see the module docstring): batch bucket -> what the context adds
        # to a verify pass (per rows per sequence) and to one draft level, measured at
        # start-up; the rows hold costs as at `reference_context` tokens per sequence.
        # A verify pass's is kept per rows per sequence (each row attends over the whole
        # context: on the dev CPU at 64 sequences, 168 more tokens each added 16 ms to a
        # one-row pass and 26-38 ms to passes of 3-9 rows), and as a curve over the context,
        # not a slope: see set_context_curves.
        # Per rows as measured (monotone in the context only), and the same pooled to never
        # read cheaper for more rows (`context_rows_monotone`, before the thirty-second session):
        # see set_context_curves.
        self._ctx_verify_measured: dict[int, _ContextCurves] = {}
        self._ctx_verify_pooled: dict[int, _ContextCurves] = {}
        self.context_rows_monotone = context_rows_monotone
        self._ctx_draft: dict[int, _ContextCurves] = {}
        self.reference_context = 0

    @property
    def _ctx_verify(self) -> dict[int, _ContextCurves]:
        return self._ctx_verify_pooled if self.context_rows_monotone else self._ctx_verify_measured

    def set_context_slopes(self, batch_size: int, verify_s_per_token: float | dict[int, float],
                           draft_s_per_token: float, reference_context: int) -> None:
        """verify_s_per_token: one slope for every pass, or {rows per sequence: slope} (read
        piecewise-linearly between the rows given, flat beyond them, and made non-decreasing
        in the rows: one more row per sequence never reads the context for less)."""
        b = _bucket(batch_size)
        slopes = verify_s_per_token if isinstance(verify_s_per_token, dict) else {1: verify_s_per_token}
        points = [_EmaPoint(rows, max(0.0, float(s))) for rows, s in sorted(slopes.items())]
        _pool_adjacent_violators(points)
        ref = int(reference_context)
        self._ctx_verify_measured[b] = self._ctx_verify_pooled[b] = _ContextCurves(
            [ref, ref + 1], {p.x: [0.0, p.t] for p in points})
        self._ctx_draft[b] = _ContextCurves([ref, ref + 1], {1: [0.0, max(0.0, float(draft_s_per_token))]})
        self.reference_context = ref

    def set_context_curves(self, batch_size: int, verify_s: dict[int, dict[int, float]],
                           draft_s: dict[int, float] | None, reference_context: int) -> None:
        """What the context adds, measured at more than one longer context: ``verify_s[rows]
        [context]`` the seconds a pass of `rows` rows per sequence at `context` tokens per
        sequence took over the same pass at `reference_context` (at this batch size), every rows
        at the same contexts; ``draft_s[context]`` the same of one draft level. Read as
        piecewise-linear in the context (on the end segments beyond the contexts measured),
        made non-decreasing in the context. Across rows the figures stand as measured: what the
        context adds is not monotone in the rows (on the dev CPU at 8 and 16 sequences and 256
        tokens, per sequence 0.42, 0.37, 0.37, 0.48 ms at 2, 3, 4, 5 rows, timed in the
        thirty-second session; the attention's tiles), and pooled to never read cheaper for more
        rows (``context_rows_monotone``, as until then) 3 and 4 rows took 2's figure: depth 3
        priced 3% over its pass at 140 tokens, the depth static runs found best at 8-32
        requests. One slope from the reference to a
        long context does not do: the cost is not linear in the context (on the dev CPU at 16
        sequences, a pass at 136 tokens read off the line through 32 and 256 tokens came out
        3% over at 3-4 rows and 5-6% under at 6-9: deep plans priced cheap beside shallow
        ones), and the plan compares depths at the contexts it serves."""
        b = _bucket(batch_size)
        ref = int(reference_context)

        def curves(table: dict[int, dict[int, float]], pool_rows: bool = False) -> _ContextCurves:
            contexts = sorted({int(c) for per in table.values() for c in per if c > ref})
            if not contexts or any(set(per) != set(contexts) for per in table.values()):
                raise ValueError("every rows needs a figure at the same contexts, each past the reference "
                                 f"({ref}), got {table!r}")
            excess: dict[float, list[float]] = {}
            for rows, per in table.items():
                seq = [0.0]
                for c in contexts:   # never cheaper at a longer context
                    seq.append(max(seq[-1], float(per[c]) / b))
                excess[rows] = seq
            if pool_rows:   # nor with more rows at one context
                for j in range(1, len(contexts) + 1):
                    points = [_EmaPoint(r, excess[r][j]) for r in sorted(excess)]
                    _pool_adjacent_violators(points)
                    for p in points:
                        excess[p.x][j] = p.t
            for seq in excess.values():
                for j in range(1, len(seq)):
                    seq[j] = max(seq[j], seq[j - 1])
            return _ContextCurves([ref] + contexts, excess)

        self._ctx_verify_measured[b] = curves(verify_s)
        self._ctx_verify_pooled[b] = curves(verify_s, pool_rows=True)
        if draft_s:
            self._ctx_draft[b] = curves({1: draft_s})
        self.reference_context = ref

    def _excess_context(self, table: dict[int, _ContextCurves], batch_size: int, context_tokens: int | None,
                        rows: float = 1.0) -> float:
        """Seconds the context adds over the reference context (negative below it) to a pass
        of `rows` rows per sequence."""
        if context_tokens is None or not table:
            return 0.0
        B = max(1, batch_size)
        per_seq = context_tokens / B
        total = 0
        for b, w in _bucket_weights(sorted(table), B):
            total += w * table[b].at(per_seq, rows)
        return B * total

    def _strip_context(self, table: dict[int, _ContextCurves], batch_size: int, context_tokens: int | None,
                       seconds: float, levels: int = 1, rows: float = 1.0) -> float:
        """A measurement brought to the reference context (never below a tenth of itself)."""
        adjusted = seconds - levels * self._excess_context(table, batch_size, context_tokens, rows)
        return max(adjusted, 0.1 * seconds)

    @property
    def has_draft(self) -> bool:
        return bool(self._draft)

    @property
    def has_verify(self) -> bool:
        return bool(self._verify)

    def observe_draft(self, batch_size: int, seconds_per_step: float) -> None:
        b = _bucket(batch_size)
        if b in self._draft:
            self._draft[b].update(batch_size, seconds_per_step, self.alpha)
        else:
            self._draft[b] = _EmaPoint(batch_size, seconds_per_step)

    def observe_draft_total(self, batch_size: int, depth: int, seconds: float, track_level: bool = True,
                            context_tokens: int | None = None) -> None:
        """All `depth` draft levels of one step took `seconds` (`track_level=False`: calibration)."""
        seconds = self._strip_context(self._ctx_draft, batch_size, context_tokens, seconds, depth)
        row = self._draft_rows.get(_bucket(batch_size))
        if row is None:
            row = self._draft_rows[_bucket(batch_size)] = _Row(key=int)   # a point per depth
        elif track_level and self._draft_between_buckets(batch_size):
            predicted = self._draft_at(batch_size, [depth])[0]
            if predicted > 0:
                row.nudge_level(seconds / predicted, self.level_alpha)
            return
        # A calibration's draft levels run on caught-up dummy sequences; the engine's first
        # level also catches the draft up on the accepted run (more rows the more was
        # accepted, so it grows with depth) with the caches cold: the measured levels then
        # cost up to 2-3x the calibrated ones at the same depth, and as references those
        # would push the row's level up for every depth. So they only stand in until the
        # engine has run that depth.
        row.observe(depth, seconds, self.alpha, self.level_alpha if track_level else 0.0,
                    provisional=not track_level, cross_alpha=self.cross_alpha,
                    paired=self.paired_comparisons)

    def t_draft_total(self, batch_size: int, depth: int, context_tokens: int | None = None) -> float:
        """Seconds of `depth` draft levels. Measured totals by depth where the engine has run
        (piecewise-linear in depth like the verify rows: the first level costs more than the
        others, as it also catches the draft up and runs with the caches cold after the target's
        pass); batch buckets without any fall back on depth x the start-up per-level time."""
        return self.t_draft_total_many(batch_size, [depth], context_tokens)[0]

    def observe_overhead(self, batch_size: int, seconds: float) -> None:
        b = _bucket(batch_size)
        if b in self._overhead:
            self._overhead[b].update(batch_size, seconds, self.alpha)
        else:
            self._overhead[b] = _EmaPoint(batch_size, seconds)

    def observe_verify(self, batch_size: int, num_tokens: int, seconds: float, track_level: bool = True,
                       context_tokens: int | None = None) -> None:
        """`track_level=False` (calibration): set this bucket only, do not move the row's level."""
        rows = max(1, round(num_tokens / max(1, batch_size)))
        seconds = self._strip_context(self._ctx_verify, batch_size, context_tokens, seconds, rows=rows)
        row = self._verify.get(_bucket(batch_size))
        if row is None:
            row = self._verify[_bucket(batch_size)] = _Row()
        elif track_level and self._between_buckets(batch_size) and self.between_bucket_levels:
            predicted = self._verify_at(batch_size, [num_tokens / batch_size])[0]
            if predicted > 0:
                row.nudge_level(seconds / predicted, self.level_alpha)
            return
        elif track_level and self._between_buckets(batch_size):
            # Brought to the bucket's own batch size by the model's ratio between the two (see
            # _verify_at), so the row's points stay where the calibration put them.
            b, r = _bucket(batch_size), num_tokens / batch_size
            at_b, at_batch = row.predict(b * r), self._verify_at(batch_size, [r])[0]
            if at_b > 0 and at_batch > 0:
                seconds *= at_b / at_batch
                num_tokens = round(b * r)
        # A point per verified rows per sequence (depth + 1 for a chain), not per power-of-two
        # token bucket: at 16 sequences depths 2 and 3 (48 and 64 tokens) would share a point,
        # and on the CPU their costs differ by odd/even row effects a bucket's mean blurs.
        row.observe(num_tokens, seconds, self.alpha, self.level_alpha if track_level else 0.0,
                    is_reference=not track_level, key=rows, cross_alpha=self.cross_alpha,
                    paired=self.paired_comparisons)

    def t_draft(self, batch_size: int) -> float:
        if not self._draft:
            return 0.0
        points = [self._draft[b] for b in sorted(self._draft)]
        return _interp_points(points, batch_size)

    def t_overhead(self, batch_size: int) -> float:
        if not self._overhead:
            return 0.0
        return _interp_points([self._overhead[b] for b in sorted(self._overhead)], batch_size)

    def t_verify_many(self, batch_size: int, token_counts: Sequence[int],
                      context_tokens: int | None = None) -> list[float]:
        """t_verify for several token counts at one batch size (what a plan reads every step:
        the batch buckets and the context term are looked up once)."""
        if not self._verify:
            return [0.0] * len(token_counts)
        B = max(1, batch_size)
        if self._between_buckets(B):
            bases = self._verify_at(B, [n / B for n in token_counts])
        else:
            curves = []
            for b, w in _bucket_weights(sorted(self._verify), batch_size):
                curves.append((*self._verify[b].curve(), w))
            bases = []
            for n in token_counts:   # (each row's predict(), summed over the buckets)
                base = 0
                for xs, ts, w in curves:
                    base += w * _interp_xt(xs, ts, n)
                bases.append(base)
        # The context term: its batch buckets and contexts looked up once, read per rows.
        terms = ([(curves, w, curves.at_context(context_tokens / B))
                  for b, w in _bucket_weights(sorted(self._ctx_verify), B) for curves in (self._ctx_verify[b],)]
                 if context_tokens is not None and self._ctx_verify else [])
        out = []
        for n, base in zip(token_counts, bases):
            rows = n / B
            excess = 0
            for curves, w, values in terms:
                excess += w * curves.over_rows(values, rows)
            t, floor = base + B * excess, 0.1 * base
            out.append(t if t > floor else floor)
        return out

    def _between_buckets(self, batch_size: int) -> bool:
        """Whether a verify pass at `batch_size` is read between two measured buckets (the
        one it falls in and the one below), which only _verify_at does."""
        b = _bucket(batch_size)
        return (self.verify_by_rows and batch_size != b and b in self._verify
                and b // 2 in self._verify)

    def _verify_at(self, batch_size: int, rows: Sequence[float]) -> list[float]:
        """The verify pass of `batch_size` sequences of each of `rows` rows (context as the
        rows hold it), between the measured buckets b / 2 < batch_size < b: each bucket's
        row read at the same rows per sequence, linear in the batch size between them.

        A pass's cost is not a function of its token count alone: it steps where the rows per
        sequence do (the attention's tiles; on the dev CPU 4 rows to 5 cost 1.20x at 8-32
        sequences, 3 to 4 and 5 to 6 1.12-1.17x). Read as a token count on its own bucket's
        row, 13 sequences of 5 rows (65 tokens) sat beside 16 sequences of 4 (64): right after
        the start-up calibration, depth 3 at 13 sequences and 140 tokens of context was priced
        4% over its timed pass and depth 4 3% under, 7% between the two depths the plan chose
        from at 16 requests. Read at the rows in buckets 8 and 16, linear between them, the two
        priced within 1% of each other's timed ratio (the thirty-second session; with the
        context curves as measured, see set_context_curves). At bucket b's level (see
        "Between buckets" in the module docstring).
        """
        b = _bucket(batch_size)
        lo, hi = self._verify[b // 2], self._verify[b]
        w = (batch_size - b // 2) / (b - b // 2)
        if self.between_bucket_levels:
            return _between(lo, hi, w, [b // 2 * r for r in rows], [b * r for r in rows])
        return [(1.0 - w) * lo.predict(b // 2 * r) + w * hi.predict(b * r) for r in rows]

    def _draft_between_buckets(self, batch_size: int) -> bool:
        """Whether draft levels at `batch_size` are read between two measured buckets (the one
        it falls in and the one below), as _draft_at reads them."""
        b = _bucket(batch_size)
        return (self.between_bucket_levels and batch_size != b and b in self._draft_rows
                and b // 2 in self._draft_rows)

    def _draft_at(self, batch_size: int, depths: Sequence[float]) -> list[float]:
        """`depths` draft levels at `batch_size`, between the measured buckets b / 2 <
        batch_size < b, as _verify_at reads a verify pass (on the dev CPU a draft level of 5-7
        sequences costs 0.8-0.98x one of 8, which bucket 8's row alone would price it at)."""
        b = _bucket(batch_size)
        w = (batch_size - b // 2) / (b - b // 2)
        return _between(self._draft_rows[b // 2], self._draft_rows[b], w, depths, depths)

    def t_draft_total_many(self, batch_size: int, depths: Sequence[int],
                           context_tokens: int | None = None) -> list[float]:
        """t_draft_total for several depths at one batch size."""
        buckets = sorted(set(self._draft_rows) | set(self._draft))
        if not buckets:
            return [0.0] * len(depths)
        excess = self._excess_context(self._ctx_draft, batch_size, context_tokens)
        if self._draft_between_buckets(batch_size):
            bases = self._draft_at(batch_size, [max(d, 1) for d in depths])
            return [0.0 if d <= 0 else max(0.1 * base, base + d * excess) for d, base in zip(depths, bases)]
        reads = []   # per bucket: (its row's x and t, or None: its per-level time), weight
        for b, w in _bucket_weights(buckets, batch_size):
            row = self._draft_rows.get(b)
            if row is None:
                reads.append((None, self._draft[b].t, w))
            else:
                reads.append((*row.curve(), w))
        out = []
        for d in depths:
            if d <= 0:
                out.append(0.0)
                continue
            base = 0.0
            for xs, ts, w in reads:   # (each row's predict())
                base += w * (_interp_xt(xs, ts, d) if xs is not None else d * ts)
            t, floor = base + d * excess, 0.1 * base
            out.append(t if t > floor else floor)
        return out

    def t_verify(self, batch_size: int, num_tokens: int, context_tokens: int | None = None) -> float:
        return self.t_verify_many(batch_size, [num_tokens], context_tokens)[0]

    def snapshot(self) -> dict:
        return {
            "draft_s_per_step": {b: p.t for b, p in sorted(self._draft.items())},
            # What plans read (the rows' current(): shape x level, stand-ins scaled, non-decreasing).
            "draft_total_s": {b: {d: (q.x, q.t) for d, q in zip(sorted(row.points), row.current())}
                              for b, row in sorted(self._draft_rows.items())},
            "step_overhead_s": {b: p.t for b, p in sorted(self._overhead.items())},
            "verify_s": {b: {tb: (q.x, q.t) for tb, q in zip(sorted(row.points), row.current())}
                         for b, row in sorted(self._verify.items())},
            "verify_level": {b: row.level for b, row in sorted(self._verify.items())},
            # Per batch bucket: {rows per sequence: seconds per context token} of a verify pass,
            # and the seconds per context token of one draft level (from the reference context
            # to the longest measured); and what the context adds per sequence at each context
            # measured, {rows: {context: seconds}} and {context: seconds}.
            "verify_s_per_context_token": {b: {int(r): v for r, v in c.mean_slope().items()}
                                           for b, c in sorted(self._ctx_verify.items())},
            "draft_s_per_context_token": {b: c.mean_slope()[1] for b, c in sorted(self._ctx_draft.items())},
            "verify_context_s": {b: {int(r): dict(zip(c.contexts, e)) for r, e in zip(c.rows, c.excess)}
                                 for b, c in sorted(self._ctx_verify.items())},
            "draft_context_s": {b: dict(zip(c.contexts, c.excess[0])) for b, c in sorted(self._ctx_draft.items())},
            "reference_context": self.reference_context,
        }


class _Measured:
    """EMA of measured goodput of whole steps at one (batch bucket, depth), as a ratio to
    what the model predicted for each of those steps (raw tokens/s when it had no figure)."""

    __slots__ = ("goodput", "count", "step", "is_ratio")

    def __init__(self, goodput: float, step: int, is_ratio: bool = False):
        self.goodput, self.count, self.step, self.is_ratio = goodput, 1, step, is_ratio

    def update(self, goodput: float, step: int, alpha: float) -> None:
        w = max(alpha, 1.0 / (self.count + 1))   # the first few averaged plainly
        self.goodput += w * (goodput - self.goodput)
        self.count += 1
        self.step = step


class _Bias:
    """Measured against predicted, over the whole steps of one (batch bucket, depth), in two
    parts: tokens (the acceptance model's error, and the regression to the mean of the plans
    picked when a request's acceptance read high) as a ratio of sums, so that a step of one
    token and one of nine weigh as the tokens they are; and time (the cost model's error at
    that depth) as the mean of each step's ratio clipped to ``TIME_CLIP``, so that a slow spell
    (a step at 8x) counts as one step at 1.5x and not as eight. Sums forget by ``decay`` an
    engine step (whichever plan ran it), so a depth not run lately keeps a fading figure;
    ``sum_r``/``sum_r2`` hold each step's combined ratio for the noise."""

    TIME_CLIP = (1 / 1.5, 1.5)
    __slots__ = ("tokens", "tokens_pred", "time_r", "weight", "sum_r", "sum_r2", "step")

    def __init__(self, step: int):
        self.tokens = self.tokens_pred = self.time_r = self.weight = self.sum_r = self.sum_r2 = 0.0
        self.step = step

    def add(self, tokens: float, tokens_pred: float, seconds: float, seconds_pred: float,
            step: int, decay: float) -> None:
        if step > self.step:
            f = (1.0 - decay) ** (step - self.step)
            self.tokens *= f
            self.tokens_pred *= f
            self.time_r *= f
            self.weight *= f
            self.sum_r *= f
            self.sum_r2 *= f
            self.step = step
        lo, hi = self.TIME_CLIP
        t = min(hi, max(lo, seconds / seconds_pred))
        self.tokens += tokens
        self.tokens_pred += tokens_pred
        self.time_r += t
        self.weight += 1.0
        r = tokens / tokens_pred / t
        self.sum_r += r
        self.sum_r2 += r * r

    def evidence(self, step: int, decay: float, prior_sd: float, noise_sd: float,
                 deadband: float, lo: float, hi: float) -> tuple[float, float, float, float] | None:
        """What ``shifted`` reads, whatever the centre: (ratio, weight, variance, band), or None
        without figures (the factor is then the centre)."""
        # Read without aging in place (the metrics scrape reads it from another thread): the
        # ratios and the mean do not change with the discount, the weight and the spread do.
        f = (1.0 - decay) ** (step - self.step) if step > self.step else 1.0
        n = self.weight * f
        if self.tokens_pred <= 0.0 or self.time_r <= 0.0 or n <= 0.0:
            return None
        mean = self.sum_r / self.weight
        spread = self.sum_r2 - self.weight * mean * mean
        var = ((spread if spread > 0.0 else 0.0) * f + 8.0 * noise_sd ** 2) / (n + 8.0)
        ratio = (self.tokens / self.tokens_pred) / (self.time_r / self.weight)
        ratio = ratio if ratio > lo else lo
        ratio = ratio if ratio < hi else hi
        # What is left inside the dead band is noise as often as not, and on a flat top a
        # few percent either way moves the plan: only the excess over the band, or over the
        # posterior's sd where that is wider (thin evidence), corrects.
        band = math.sqrt(1.0 / (1.0 / prior_sd ** 2 + n / var))
        return ratio, n, var, (band if band > deadband else deadband)

    @staticmethod
    def shifted(evidence: tuple[float, float, float, float] | None, centre: float, prior_sd: float) -> float:
        """The correction of the depth's predicted goodput from its ``evidence``: measured over
        predicted tokens per second shrunk toward ``centre`` (1, or the correction the other
        depths share: see ``bias_factors``) as a normal mean with prior sd ``prior_sd`` about it
        and per-step noise estimated from the steps, pooled with ``noise_sd`` (what the batch
        size leads to expect) worth eight steps: weight n / (n + noise² / prior_sd²). At one
        sequence a 20% bias takes ~50 steps to show, and three lucky steps in a row move
        nothing; at 64, a few steps do."""
        if evidence is None:
            return centre
        ratio, n, var, band = evidence
        shift = (ratio - centre) * n / (n + var / prior_sd ** 2)
        excess = abs(shift) - band
        return centre + math.copysign(excess if excess > 0.0 else 0.0, shift)


@dataclass
class _RequestAcceptance:
    ema: list[float] = field(default_factory=list)    # [max_depth] per-position EMA
    count: list[int] = field(default_factory=list)    # [max_depth] observations
    tokens: int = 0                                   # emitted by its decode steps so far


# What the prior acceptance is worth, in observations: a position's first few average with it.
_PRIOR_OBSERVATIONS = 4
# Finished requests before their mean length prices the churn (see "Churn").
_CHURN_MIN_FINISHED = 4


class AdaptiveController:
    """Chooses Plan(depth, num_nodes) per batch; see the module docstring for the maths."""

    def __init__(
        self,
        mode: str = "adaptive",
        max_depth: int = 8,
        static_depth: int = 4,
        static_num_nodes: int | None = None,
        max_num_nodes: int | None = None,
        prior_acceptance: float = 0.6,
        prior_sibling_acceptance: float = 0.25,
        acceptance_alpha: float = 0.05,
        acceptance_step_weight: float = 0.1,
        request_alpha: float = 0.1,
        request_shrinkage: float = 4.0,
        cost_alpha: float = 0.03,
        cross_alpha: float = _CROSS_ALPHA,
        stale_decay: float = 0.005,
        position_shrinkage: float = 4.0,
        weight_decay: float = 0.01,
        request_stale_decay: float = 0.02,
        switch_margin: float = 0.03,
        switch_patience: int = 5,
        replan_interval: int = 4,
        probe_interval: int = 200,
        probe_depth: int = 2,
        explore_interval: int = 8,
        explore_margin: float = 0.15,
        explore_batch: int | None = 8,
        tree_min_samples: int = 8,
        band_margin: float = 0.05,
        tree_max_profiled: int = 8,
        draft_cost_guess: float = 0.2,
        guard_margin: float = 0.03,
        guard_min_samples: int = 6,
        guard_max_age: int = 128,
        guard_hold: int = 128,
        guard_first_hold: int = 32,
        guard_min_plain: int = 3,
        guard_interval: int = 32,
        guard_band: float = 1.15,
        guard_alpha: float = 0.2,
        guard_min_batch: int = 8,
        bias_half_life: float = 256.0,
        bias_prior_sd: float = 0.1,
        bias_noise_sd: float = 0.5,
        bias_deadband: float = 0.02,
        bias_limits: tuple[float, float] = (0.6, 1.5),
        stop_scale: float = 0.0,
        stop_max_batch: int = 2,
        plan_per_bucket: bool = True,
        verify_by_rows: bool = True,
        context_rows_monotone: bool = False,
        between_bucket_levels: bool = True,
        paired_comparisons: bool = True,
        churn_steps: float = 3.0,
        churn_alpha: float = 0.05,
    ):
        if mode not in ("adaptive", "static"):
            raise ValueError(f"controller mode must be 'adaptive' or 'static', got {mode!r}")
        if not 0 <= max_depth <= 64:
            raise ValueError(f"max_depth must be in 0..64, got {max_depth}")
        if max_num_nodes is None:
            max_num_nodes = max_depth
        if max_num_nodes < max_depth:
            raise ValueError(f"max_num_nodes ({max_num_nodes}) must be >= max_depth ({max_depth})")
        if mode == "adaptive":   # the static plan is unused; keep it within range
            static_depth = min(static_depth, max_depth)
            static_num_nodes = None if static_num_nodes is None else max(
                static_depth, min(static_num_nodes, max_num_nodes))
        if static_num_nodes is None:
            static_num_nodes = static_depth
        if not 0 <= static_depth <= max_depth:
            raise ValueError(f"static_depth must be in 0..{max_depth}, got {static_depth}")
        if not static_depth <= static_num_nodes <= max(max_num_nodes, static_depth) or (
            static_depth == 0 and static_num_nodes != 0
        ):
            raise ValueError(
                f"static_num_nodes must be in {static_depth}..{max_num_nodes} "
                f"(0 when static_depth is 0), got {static_num_nodes}"
            )
        for name, v in (("prior_acceptance", prior_acceptance),
                        ("prior_sibling_acceptance", prior_sibling_acceptance)):
            if not 0.0 <= v <= 1.0:
                raise ValueError(f"{name} must be in [0, 1], got {v}")
        self.mode = mode
        self.max_depth = max_depth
        self.max_num_nodes = max_num_nodes
        self.static_plan = Plan(static_depth, static_num_nodes)
        self.prior_acceptance = prior_acceptance
        self.acceptance_alpha = acceptance_alpha
        self.acceptance_step_weight = acceptance_step_weight
        self.request_alpha = request_alpha
        self.request_shrinkage = request_shrinkage
        self.stale_decay = stale_decay
        self.position_shrinkage = position_shrinkage
        self.weight_decay = weight_decay
        self.request_stale_decay = request_stale_decay
        self.switch_margin = switch_margin
        self.switch_patience = switch_patience
        self.plan_per_bucket = plan_per_bucket
        self._held: dict[int, Plan] = {}   # batch bucket -> the plan last held there (see "Hysteresis")
        self._held_bucket: int | None = None
        self.replan_interval = max(1, replan_interval)
        self.probe_interval = probe_interval
        self.explore_interval = explore_interval
        self.explore_margin = explore_margin
        self.explore_batch = explore_batch
        self.tree_min_samples = tree_min_samples
        self.band_margin = band_margin
        self.tree_max_profiled = tree_max_profiled
        self.draft_cost_guess = draft_cost_guess
        self.guard_margin = guard_margin
        self.guard_min_samples = guard_min_samples
        self.guard_max_age = guard_max_age
        self.guard_hold = guard_hold
        self.guard_first_hold = max(1, min(guard_first_hold, guard_hold))
        self.guard_min_plain = guard_min_plain
        self.guard_interval = guard_interval
        self.guard_band = guard_band
        self.guard_alpha = guard_alpha
        self.guard_min_batch = guard_min_batch
        if (bias_half_life < 0 or bias_prior_sd <= 0 or bias_noise_sd <= 0
                or not 0 < bias_limits[0] <= 1 <= bias_limits[1]):
            raise ValueError(
                f"bias_half_life must be >= 0 (0: off), bias_prior_sd and bias_noise_sd > 0, and "
                f"bias_limits (lo, hi) with 0 < lo <= 1 <= hi, got {bias_half_life}, "
                f"{bias_prior_sd}, {bias_noise_sd}, {bias_limits}")
        self.bias_decay = 1.0 - 0.5 ** (1.0 / bias_half_life) if bias_half_life > 0 else None
        self.bias_prior_sd = bias_prior_sd
        self.bias_noise_sd = bias_noise_sd
        self.bias_deadband = bias_deadband
        self.bias_limits = bias_limits
        self.probe_depth = max(1, min(probe_depth, max_depth)) if max_depth else 0
        if stop_scale < 0:
            raise ValueError(f"stop_scale must be >= 0 (0: no early stop), got {stop_scale}")
        self.stop_scale = stop_scale
        self.stop_max_batch = stop_max_batch
        if churn_steps < 0 or not 0 < churn_alpha <= 1:
            raise ValueError(f"churn_steps must be >= 0 (0: off) and churn_alpha in (0, 1], "
                             f"got {churn_steps}, {churn_alpha}")
        self.churn_steps = churn_steps
        self.churn_alpha = churn_alpha
        # Tokens a request decoded, over the finished ones (see "Churn"): mean and count.
        self.request_tokens = 0.0
        self._num_finished = 0

        if not 0.0 <= cross_alpha <= 1.0:
            raise ValueError(f"cross_alpha must be in [0, 1], got {cross_alpha}")
        self.costs = CostModel(cost_alpha, cross_alpha=cross_alpha, verify_by_rows=verify_by_rows,
                               context_rows_monotone=context_rows_monotone,
                               between_bucket_levels=between_bucket_levels,
                               paired_comparisons=paired_comparisons)
        # Global per-position acceptance a_k (index k-1) and sibling acceptance b.
        self.acceptance = [prior_acceptance] * max_depth
        # Early stop (chains): continuation c_k = P(a chain allowed past depth k that reached it
        # goes on to k + 1); c_0 = 1. reach()[k] = c_0 ... c_k is the share of sequences that
        # draft position k + 1, which prices a plan's verify rows and draft levels.
        self.continuation = [1.0] * max_depth
        # And per batch bucket, the draft levels: lc_k = P(level k + 1 runs | level k ran and the
        # plan allowed more), measured once the early stop has run there (before: levels are
        # priced as if the chains stopped independently). The level rule (stop_thresholds)
        # ends a level for the whole batch, so levels stop together more often than that.
        self._level_continuation: dict[int, list[float]] = {}
        self._last_context: int | None = None
        self.sibling_acceptance = prior_sibling_acceptance
        self._requests: dict[Hashable, _RequestAcceptance] = {}
        self._steps_since_seen = [0] * max_depth   # steps since position k got data
        # Position 1 never measured: the first plain step probes. On the prior alone a fresh
        # server hit by 64 requests at once planned depth 0 and ran ~25 plain steps before its
        # step costs, not any acceptance figure, pushed it to speculate (eighth session).
        if max_depth and probe_interval > 0:
            self._steps_since_seen[0] = probe_interval
        # Each depth's node budgets, and the chain plans (what every evaluation reads).
        self._all_budgets = [self._node_budgets(d) for d in range(max_depth + 1)]
        self._chain_plans = [Plan(d, d) for d in range(max_depth + 1)]
        self._num_seen = [0] * max_depth           # observations of position k, ever
        # Sampled and greedy requests apart (see "Sampled and greedy"): the sampled requests of
        # the batches planned, and, once both kinds have been seen, each kind's acceptance.
        self._sampled_ids: set[Hashable] = set()
        self._kind_acc: dict[bool, list[float]] | None = None
        self._kind_num_seen: dict[bool, list[int]] = {}
        self._weight = [0.0] * max_depth           # observations of position k, fading when stale

        # Decision state and exported metrics.
        self.current = self.static_plan if mode == "static" else Plan(0, 0)
        self._challenger_streak = 0
        self.num_steps = 0
        self.num_plan_changes = 0
        self.num_probes = 0
        self.num_explorations = 0
        # EAGLE-2 estimate for trees: (depth, nodes) -> EMA over steps of the mean over requests of
        # the sum of the `nodes` largest path probabilities among nodes at depth <= `depth`; and
        # EMAs of accepted nodes and of the path-probability sums of the trees verified, whose
        # ratio calibrates the estimate (a draft is rarely calibrated; greedy verification
        # accepts a node more or less often than its draft probability says).
        self._tree_profile: dict[tuple[int, int], _EmaPoint] = {}
        self._tree_accepted = 0.0
        self._tree_predicted = 0.0
        self._explore_countdown = explore_interval
        # (batch bucket, depth) -> the bucket's step clock when that depth last ran there
        self._last_run: dict[tuple[int, int], int] = {}
        # The guard (see the module docstring): measured goodput per (batch bucket, depth), the
        # buckets held at depth 0 until a step count, and the countdown to the next depth-0 step.
        self._measured: dict[tuple[int, int], _Measured] = {}
        # Each depth's predicted goodput corrected by what its steps measured (see "Bias" in
        # the module docstring): (batch bucket, depth) -> discounted sums.
        self._bias: dict[tuple[int, int], _Bias] = {}
        # Their clock: steps served per batch bucket (see "Bias": a bucket's figures fade with
        # its own steps, not with the steps of other loads).
        self._bucket_steps: dict[int, int] = {}
        self._factors: list[float] = [1.0] * (max_depth + 1)   # those the last evaluation read
        self._guard_hold_until: dict[int, int] = {}
        self._guard_holds_in_row: dict[int, int] = {}   # bucket -> trips in a row (the backoff)
        self._guard_countdown = guard_interval
        self.num_guard_trips = 0
        self.depth_histogram: dict[int, int] = {}
        self.goodput_estimate = 0.0          # predicted tokens/s of the last plan
        self.expected_tokens_per_pass = 1.0  # predicted tokens per sequence per verify pass
        self.stop_below = 0.0                # the last plan's early-stop path probability (chains)
        self.level_below = 0.0               # and the sum over the growing chains a level needs
        self._thresholds_for: Plan | None = None
        self.measured_goodput = 0.0          # EMA of observed tokens/s
        self.last_plan = self.current
        self._priced: tuple[list, list, float] = ([], [], 0.0)   # what it priced (fresh_costs)
        self._scores: dict[Plan, tuple[float, float]] | None = None   # the last evaluation,
        self._scores_key: tuple | None = None                          # the batch it was for,
        self._since_evaluated = 0                                      # and plans since
        # the plan handed out, its predicted goodput and expected tokens per sequence
        self._planned: tuple[Plan, float, float] | None = None

    # ---------------------------------------------------------------- start-up
    def calibrate(
        self,
        measure_verify: Callable[[int, int], float],
        measure_draft: Callable[[int], float] | None = None,
        batch_sizes: Sequence[int] = (1, 2, 4, 8, 16, 32, 64),
        nodes_per_seq: Sequence[int] = (0, 1, 3, 7),
        measure_draft_total: Callable[[int, int], float] | None = None,
        draft_depths: Sequence[int] = (1, 3, 8),
        measure_context: Callable[[int], tuple[float, float]] | None = None,
        reference_context: int = 0,
        measure_context_curves: Callable[[int], tuple[dict[int, dict[int, float]], dict[int, float]]] | None = None,
    ) -> None:
        """Warm-start the cost tables: ``measure_verify(batch_size, num_tokens) -> seconds`` of
        one verify pass, ``measure_draft(batch_size) -> seconds`` of one draft step, and
        ``measure_draft_total(batch_size, depth) -> seconds`` of the `depth` levels of a step
        as the engine runs them (right after a target pass).
        ``measure_context(batch_size) -> (verify, draft)``: seconds per token of context (summed
        over the batch) of a one-row-per-sequence verify pass and of one draft level; the
        other measurements are then taken at ``reference_context`` tokens per sequence.
        ``measure_context_curves(batch_size) -> (verify, draft)``, in its place: what longer
        contexts add, measured at more than one (CostModel.set_context_curves):
        ``verify[rows][context]`` and ``draft[context]`` seconds over the same pass at
        ``reference_context``."""
        for b in batch_sizes:
            if measure_context_curves is not None:
                self.costs.set_context_curves(b, *measure_context_curves(b), reference_context)
            elif measure_context is not None:
                self.costs.set_context_slopes(b, *measure_context(b), reference_context)
            for n in nodes_per_seq:
                if n > self.max_num_nodes:
                    continue
                num_tokens = b * (n + 1)
                self.costs.observe_verify(b, num_tokens, float(measure_verify(b, num_tokens)), track_level=False)
            if measure_draft is not None:
                self.costs.observe_draft(b, float(measure_draft(b)))
            if measure_draft_total is not None:
                for d in sorted({min(d, self.max_depth) for d in draft_depths if d > 0}):
                    self.costs.observe_draft_total(b, d, float(measure_draft_total(b, d)), track_level=False)

    def forget(self, request_id: Hashable, num_tokens: int | None = None) -> None:
        """The request finished: drop its acceptance history; the tokens it decoded count
        toward the mean request's (see "Churn"). num_tokens: what it decoded after its
        prompt's step, from the engine; None: what the steps reported to this controller
        showed, which leaves out the plain steps (they report no requests), so a spell at
        depth 0 would read every request as a few tokens long."""
        r = self._requests.pop(request_id, None)
        self._sampled_ids.discard(request_id)
        tokens = num_tokens if num_tokens is not None else (r.tokens if r is not None else 0)
        if tokens > 0:
            self._num_finished += 1
            w = max(self.churn_alpha, 1.0 / self._num_finished)
            self.request_tokens += w * (tokens - self.request_tokens)

    def churn_factors(self, scores: dict[Plan, tuple[float, float]], running_tokens: float = 0.0) -> list[float]:
        """Per depth 0..max_depth, what a slot's rate keeps of the step's goodput at that depth's
        best plan: 1 / (1 + churn_steps * E / L) (1.0 before _CHURN_MIN_FINISHED requests ended,
        or with churn_steps 0), L the mean request length or, where more, running_tokens (what
        the running requests decoded so far, on average). See "Churn" in the module docstring."""
        out = [1.0] * (self.max_depth + 1)
        if self.churn_steps <= 0 or self._num_finished < _CHURN_MIN_FINISHED or self.request_tokens <= 0:
            return out
        length = self.request_tokens if self.request_tokens >= running_tokens else running_tokens
        for d, (_, e) in _best_per_depth(scores).items():
            out[d] = 1.0 / (1.0 + self.churn_steps * e / length)
        return out

    # ---------------------------------------------------------------- estimates
    def global_acceptance(self) -> list[float]:
        """[max_depth] global a_k, each position's EMA shrunk toward the estimate of the
        position above by how much recent data it has: ``(w_k ema_k + s g_{k-1}) / (w_k + s)``.
        A position never observed (w = 0) takes the estimate above it (acceptance falls slowly
        with depth), and one seen a few times long ago leans on it, so that a low guess from
        thin or old data does not hold the depth down until a probe happens to reach it."""
        g = list(self.acceptance)
        s = self.position_shrinkage
        for k in range(1, len(g)):
            w = self._weight[k]
            if s > 0:   # position_shrinkage = 0: every position stands on its own EMA
                g[k] = (w * g[k] + s * g[k - 1]) / (w + s)
        return g

    def kind_acceptance(self, request_id: Hashable, global_acc: list[float]) -> list[float]:
        """What a request's acceptance is shrunk toward: its kind's (sampled or greedy) once
        both kinds have been seen, else the global estimate."""
        kinds = self._kind_acc
        if kinds is None:
            return global_acc
        return kinds[request_id in self._sampled_ids]

    def request_acceptance(self, request_id: Hashable, global_acc: list[float] | None = None) -> list[float]:
        """[max_depth] a_k for one request: its EMA shrunk toward its kind's estimate (the
        global one while only one kind has been seen)."""
        g = self.global_acceptance() if global_acc is None else global_acc
        g = self.kind_acceptance(request_id, g)
        r = self._requests.get(request_id)
        if r is None:
            return g
        s = self.request_shrinkage
        return [(c * e + s * gk) / (c + s) for e, c, gk in zip(r.ema, r.count, g)]

    def _alternate_gains(self, miss: list[float], depth: int, budget: int) -> list[float]:
        """The `budget` largest marginal gains of alternates at depths 1..depth, descending.
        miss[k-1] = sum_i prod_{j<k} a_ij (1 - a_ik)."""
        b = self.sibling_acceptance
        if budget <= 0 or b <= 0.0:
            return []
        gains = []
        for k in range(depth):
            g = miss[k] * b
            for _ in range(budget):
                if g <= 1e-12:
                    break
                gains.append(g)
                g *= 1.0 - b
        gains.sort(reverse=True)
        return gains[:budget]

    def _alternate_counts(self, depth: int, num_nodes: int, accs: list[float]) -> list[int]:
        """Greedy allocation of num_nodes - depth alternates over depths (mean request)."""
        counts = [0] * depth
        b = self.sibling_acceptance
        if b <= 0.0:
            return counts
        prefix, miss = 1.0, []
        for k in range(depth):
            miss.append(prefix * (1.0 - accs[k]))
            prefix *= accs[k]
        for _ in range(num_nodes - depth):
            k = max(range(depth), key=lambda k: miss[k] * (1.0 - b) ** counts[k])
            counts[k] += 1
        return counts

    def _node_budgets(self, depth: int) -> list[int]:
        if depth == 0 or self.max_num_nodes == self.max_depth:
            return [depth]   # chains only: trees are enabled by max_num_nodes > max_depth
        hi = self.max_num_nodes
        cands = set(range(depth, min(hi, 16) + 1))
        cands.update(n for n in range(16, hi + 1, 8) if n >= depth)
        cands.add(hi)
        return sorted(n for n in cands if depth <= n <= hi)

    def evaluate(self, batch_size: int, request_ids: Sequence[Hashable],
                 context_tokens: int | None = None,
                 depth_caps: Sequence[int] | None = None) -> dict[Plan, tuple[float, float]]:
        """Every candidate plan -> (predicted goodput tokens/s, expected tokens per sequence).
        context_tokens: the batch's tokens in the KV cache, summed (None: the reference).
        depth_caps: per request (as request_ids), the deepest it can be drafted this step (its
        max_tokens less one, or the context's end): a tree is cut there, so positions beyond
        commit nothing for it and its rows beyond are not verified (None: no cap)."""
        B = max(1, batch_size)
        ids = list(request_ids) or [None] * B
        K = self.max_depth
        g = self.global_acceptance()
        caps = ([max(0, int(c)) for c in depth_caps] if depth_caps is not None and len(depth_caps) == len(ids)
                else [K] * len(ids))
        # chain[k] = sum_i E_chain_i(k); miss per depth (trees only), summed over requests. A
        # request cut at depth c gains nothing from positions past c (module docstring: "Near
        # the end"). Request by request, each a_ik computed as request_acceptance does: this
        # runs every engine step, and per request and position it is most of the controller's
        # time (the sums over requests are taken in the same order as one loop per position).
        trees = self.max_num_nodes > K
        # Where chains stop early, position k + 1 commits only where it was drafted: its
        # acceptance (measured where drafted) times the continuation to it.
        cont = self.continuation if self._stops_early(B) and not trees else None
        gained = [0.0] * K
        miss = [0.0] * K
        s = self.request_shrinkage
        requests = self._requests
        kinds, sampled_ids = self._kind_acc, self._sampled_ids
        plain_chain = cont is None and not trees
        # A request without its own figures (just admitted) reads its kind's estimate as it
        # stands: those prefix products are the same for every such request, taken once.
        base_prefixes: dict[int, list[float]] = {}
        for rid, cap in zip(ids, caps):
            r = requests.get(rid)
            base = g if kinds is None else kinds[rid in sampled_ids]   # kind_acceptance, inline
            m = cap if cap < K else K
            if plain_chain:   # (the usual case, a plain chain: the same sums)
                prefix = 1.0
                if r is None:
                    prefixes = base_prefixes.get(id(base))
                    if prefixes is None:
                        prefixes = base_prefixes[id(base)] = []
                        for a in base:
                            prefix *= a
                            prefixes.append(prefix)
                    for k in range(m):
                        gained[k] += prefixes[k]
                else:
                    # request_acceptance, inline: its EMA shrunk toward the base, position by
                    # position, only as deep as the request can go.
                    count, ema = r.count, r.ema
                    for k in range(m):
                        c = count[k]
                        prefix *= (c * ema[k] + s * base[k]) / (c + s)
                        gained[k] += prefix
                continue
            accs = base if r is None else [(c * e + s * gk) / (c + s) for c, e, gk in zip(r.count, r.ema, base)]
            prefix = 1.0
            for k in range(m):
                a = accs[k]
                if cont is not None:
                    a *= cont[k]
                if trees:
                    miss[k] += prefix * (1.0 - a)
                prefix *= a
                gained[k] += prefix
        chain = [float(len(ids))]
        for k in range(K):
            chain.append(chain[-1] + gained[k])
        scale = B / len(ids)   # request_ids may be shorter than the batch (prefills)
        ctx = context_tokens
        out: dict[Plan, tuple[float, float]] = {}
        if not self.costs.has_verify:
            # No measurement yet: cannot compare, report the plain-decode estimate only.
            out[Plan(0, 0)] = (0.0, 1.0)
            return out
        # Every cost this step reads, in two lookups (a plan is made every engine step).
        all_budgets = self._all_budgets
        # Rows verified: each sequence's pending token and its nodes; a request capped below
        # the plan's depth has its tree cut there (a chain's nodes to its cap).
        short = [c for c in caps if c < self.max_depth]   # usually none, or the few near their end
        # A chain's position k is drafted and verified only where the early stop has not cut
        # it: reach[k-1] of the sequences (1 everywhere without early stop).
        reach = self.reach() if self._stops_early(B) else [1.0] * K
        cum_reach = [0.0]
        for r in reach:
            cum_reach.append(cum_reach[-1] + r)

        def rows(d: int, n: int) -> float:
            if n == d:   # a chain
                cut = sum(cum_reach[d] - cum_reach[c] for c in short if c < d)
                return max(float(B), B * (1.0 + cum_reach[d]) - scale * cut)
            cut = sum(n - c for c in short if c < d and c < n)
            return max(B, round(B * (n + 1) - scale * cut))
        if trees or short:
            plan_rows = {(d, n): rows(d, n) for d, budgets in enumerate(all_budgets) for n in budgets}
        else:   # chains, none capped (as rows() reads them)
            fB = float(B)
            plan_rows = {}
            for d in range(K + 1):
                x = B * (1.0 + cum_reach[d])
                plan_rows[d, d] = x if x > fB else fB
        token_counts = sorted(set(plan_rows.values()))
        verify = dict(zip(token_counts, self.costs.t_verify_many(B, token_counts, ctx)))
        t_verify0 = verify[B]
        # Before the first draft measurement, guess a draft step at a fraction of a decode
        # pass; the first speculative step replaces the guess with a measurement.
        # Draft levels: level k + 1 runs while any sequence still drafts position k + 1.
        levels = [0.0]
        measured_levels = self._level_continuation.get(_bucket(B))
        level_reach = 1.0
        for k, r in enumerate(reach):
            if measured_levels is None:
                levels.append(levels[-1] + 1.0 - (1.0 - r) ** B)
            else:   # a level runs at least where that share of chains goes on
                level_reach *= measured_levels[k]
                levels.append(levels[-1] + max(level_reach, r))
        if self.max_num_nodes > self.max_depth:   # trees: every level runs
            levels = [float(d) for d in range(self.max_depth + 1)]
        if self.costs.has_draft:
            drafts = self.costs.t_draft_total_many(B, levels, ctx)
        else:
            drafts = [x * self.draft_cost_guess * t_verify0 for x in levels]
        t_step = self.costs.t_overhead(B)
        # Each depth's best plan: (goodput, draft seconds, verify seconds), for the step log.
        parts: dict[int, tuple[float, float, float]] = {}
        if not trees:   # one plan a depth, its nodes its depth
            for d, plan in enumerate(self._chain_plans):
                total = chain[d] * scale
                v = verify[plan_rows[d, d]]
                cost = t_step + drafts[d] + v
                if cost > 0:
                    out[plan] = (total / cost, total / B)
                    parts[d] = (total / cost, drafts[d], v)
                else:
                    out[plan] = (0.0, total / B)
        for d in range(self.max_depth + 1) if trees else ():
            budgets = all_budgets[d]
            gains = self._alternate_gains(miss, d, budgets[-1] - d) if d else []
            cum = [0.0]
            for g in gains:
                cum.append(cum[-1] + g)
            for n in budgets:
                extra = cum[min(n - d, len(cum) - 1)]
                total = (chain[d] + extra) * scale
                from_paths = self.tree_estimate(d, n) if n > d else None
                if from_paths is not None:
                    total = from_paths * B
                cost = t_step + drafts[d] + verify[plan_rows[d, n]]
                out[Plan(d, n)] = (total / cost if cost > 0 else 0.0, total / B)
                if cost > 0 and (d not in parts or total / cost > parts[d][0]):
                    parts[d] = (total / cost, drafts[d], verify[plan_rows[d, n]])
        self._priced = ([parts[d][1] if d in parts else None for d in range(self.max_depth + 1)],
                        [parts[d][2] if d in parts else None for d in range(self.max_depth + 1)], t_step)
        return out

    def _own_stops(self, batch_size: int) -> bool:
        """Whether this batch's chains stop on the controller's own thresholds."""
        return (self.stop_scale > 0 and batch_size <= self.stop_max_batch
                and self.max_num_nodes == self.max_depth)

    def _stops_early(self, batch_size: int) -> bool:
        """Whether this batch's chains may stop early, so that reach() prices its plans and its
        steps teach the continuation: its own threshold at up to stop_max_batch sequences, or
        a configured one (stop_scale 0: the controller sets none, [spec] early_stop may)."""
        return self.stop_scale == 0 or batch_size <= self.stop_max_batch

    def reach(self) -> list[float]:
        """[max_depth] the share of sequences whose chain drafts position k + 1 (early stop;
        all 1 without it): the product of the continuations up to k."""
        out, r = [], 1.0
        for c in self.continuation:
            r *= c
            out.append(r)
        return out

    def tree_estimate(self, depth: int, num_nodes: int) -> float | None:
        """Expected tokens per sequence per pass of a tree plan from the draft's path
        probabilities (EAGLE-2: 1 + the sum of the node path probabilities, scaled by the
        measured ratio of accepted nodes to that sum), or None without enough trees of that
        shape measured."""
        p = self._tree_profile.get((depth, num_nodes))
        if p is None or p.count < self.tree_min_samples or self._tree_predicted <= 0:
            return None
        return 1.0 + (self._tree_accepted / self._tree_predicted) * p.t

    def _observe_tree_paths(self, stats: StepStats) -> None:
        ga = self.acceptance_alpha
        accepted = predicted = 0.0
        sums: dict[tuple[int, int], float] = {}
        rows = list(zip(stats.path_probs, stats.node_depths or [], stats.num_accepted))
        for probs, depths, n_acc in rows[: self.tree_max_profiled]:   # bounded work per step
            accepted += n_acc
            predicted += sum(probs)
            for d in range(1, stats.depth + 1):
                top = sorted((p for p, k in zip(probs, depths) if k <= d), reverse=True)
                total = 0.0
                for n, p in enumerate(top, start=1):
                    total += p
                    if n >= d:
                        sums[(d, n)] = sums.get((d, n), 0.0) + total
        m = min(len(rows), self.tree_max_profiled)
        if not m:
            return
        for key, total in sums.items():
            point = self._tree_profile.get(key)
            if point is None:
                self._tree_profile[key] = _EmaPoint(key[1], total / m)
            else:
                point.update(key[1], total / m, ga)
        self._tree_accepted += ga * (accepted / m - self._tree_accepted)
        self._tree_predicted += ga * (predicted / m - self._tree_predicted)

    # ---------------------------------------------------------------- decisions
    def plan(self, batch_size: int, request_ids: Sequence[Hashable] = (),
             context_tokens: int | None = None, depth_caps: Sequence[int] | None = None,
             decoded_tokens: int | None = None, sampled: Sequence[bool] | None = None) -> Plan:
        """decoded_tokens: what the batch's requests have decoded so far, summed (a floor
        under the mean request length the churn is priced at; see "Churn"). sampled: per
        request, whether it samples (temperature > 0); None: all greedy."""
        if sampled is not None:
            for rid, is_sampled in zip(request_ids, sampled):
                if is_sampled:
                    self._sampled_ids.add(rid)
        if self.mode == "static" or self.max_depth == 0:
            chosen = self.static_plan if self.mode == "static" else Plan(0, 0)
            if self.costs.has_verify:
                scores = self.evaluate(batch_size, request_ids, context_tokens, depth_caps)
                self.goodput_estimate, self.expected_tokens_per_pass = scores.get(chosen, (0.0, 1.0))
            return self._record(chosen)

        # Re-evaluated when the batch changes and every replan_interval steps in between: a
        # plan takes ~0.1 ms of Python, 1-2% of a one-request step on the CPU, and the
        # estimates it reads move by an EMA step per engine step. Four times as long where the
        # chains stop on their own (the plan then only says whether to speculate, and what
        # goodput the thresholds weigh a node against).
        K = self.max_depth
        batch_key = (batch_size, tuple(request_ids),
                     None if depth_caps is None else tuple([c if c < K else K for c in depth_caps]))
        self._since_evaluated += 1
        fresh = (self._scores is None or batch_key != self._scores_key
                 or self._since_evaluated >= self.replan_interval * (4 if self._own_stops(batch_size) else 1))
        self._last_context = context_tokens
        if fresh:
            scores = self.evaluate(batch_size, request_ids, context_tokens, depth_caps)
            self._scores, self._scores_key, self._since_evaluated = scores, batch_key, 0
            churn = self.churn_factors(scores, 0.0 if decoded_tokens is None else decoded_tokens / batch_size)
            self._factors = [f * c for f, c in zip(self.bias_factors(batch_size), churn)]
            if self.plan_per_bucket:
                self._enter_bucket(_bucket(batch_size))
            cur = self._decide(self._corrected(scores, self._factors))
        else:
            scores = self._scores
            cur = self.current
        cur = self._guard(batch_size, cur, scores)
        if cur.depth > 0 and self._own_stops(batch_size):
            # The chains' own stops decide how deep each goes: a node is drafted while it pays
            # (stop_thresholds), so a shallower cap would only cut off nodes that do.
            cur = Plan(self.max_depth, self.max_depth)
        self.current = cur
        if self.plan_per_bucket:
            self._held[_bucket(batch_size)] = cur

        chosen = cur
        probe_pos = cur.depth  # 0-based index of the first position this plan leaves unverified
        if cur.depth > 0 and self._wants_plain_sample(batch_size, scores):
            chosen = Plan(0, 0)   # one plain step: the guard's reference stays current
        elif (probe_pos < self.max_depth and self.probe_interval > 0
                and self._steps_since_seen[probe_pos] >= self.probe_interval):
            if self._num_seen[0] == 0:
                # The first probe of a fresh controller runs every position: one probe of two
                # left positions 3 and deeper on the prior (0.6), and a fresh engine hit by 32
                # requests at once planned plain decoding for its whole first load (192 steps,
                # no probe due) where depths 3-4 measured 1.1x it (the eighteenth session).
                depth = self.max_depth
            else:
                depth = self.probe_depth if cur.depth == 0 else cur.depth + 1
            chosen = Plan(depth, max(depth, cur.num_nodes))
            self.num_probes += 1
            for k in range(depth):
                self._steps_since_seen[k] = 0   # do not probe again before it reports
        elif cur.depth > 0 and self.explore_interval > 0 and not self._own_stops(batch_size):
            # (Where the chains stop on their own, no depth is being chosen: nothing to explore.)
            self._explore_countdown -= 1
            if self._explore_countdown <= 0:
                self._explore_countdown = self._explore_interval_at(batch_size)
                # Not past what any request of the batch can still draft: its trees would be
                # cut back to the plan in use, and the step would measure that plan.
                deepest = self.max_depth if not depth_caps else max(depth_caps)
                d = self._exploration(batch_size, cur, scores, min(self.max_depth, deepest))
                if d is not None:
                    chosen = Plan(d, min(self.max_num_nodes, max(d, cur.num_nodes + d - cur.depth)))
                    self.num_explorations += 1
        self.goodput_estimate, self.expected_tokens_per_pass = scores.get(chosen, scores[cur])
        self._planned = (chosen, self.goodput_estimate, self.expected_tokens_per_pass)
        if fresh or chosen != self._thresholds_for:   # (they read the costs: ~50 us)
            self.stop_below, self.level_below = self.stop_thresholds(batch_size, chosen, scores)
            self._thresholds_for = chosen
        return self._record(chosen)

    def _step_noise_sd(self, batch_size: int) -> float:
        """The spread of one step's measured over predicted goodput at this batch size, as the
        bias correction reads it: a step's tokens are a sum over its sequences, so their spread
        falls as 1/sqrt(B), down to what the step's time alone varies by."""
        return max(0.1, self.bias_noise_sd / math.sqrt(_bucket(batch_size)))

    def _explore_interval_at(self, batch_size: int) -> int:
        """Steps between explorations at this batch size: ``explore_interval`` up to
        ``explore_batch`` sequences; past it, as much longer as a step there tells more (its
        noise variance is that much smaller), so that each depth is measured as well per step
        of the plan. See "Explorations" in the module docstring."""
        if self.explore_batch is None or batch_size <= self.explore_batch:
            return self.explore_interval
        ratio = (self._step_noise_sd(self.explore_batch) / self._step_noise_sd(batch_size)) ** 2
        return max(self.explore_interval, round(self.explore_interval * ratio))

    def _exploration(self, batch_size: int, cur: Plan, scores: dict[Plan, tuple[float, float]],
                     deepest: int) -> int | None:
        """The depth an exploration step runs: of the plan's neighbours and every depth whose
        best plan is predicted within ``explore_margin`` of the top (as the decision reads
        them, bias corrected), the one this batch bucket ran least recently (never: first;
        ties: the nearer, then the shallower), a neighbour's time since counted double. With
        only the neighbours in reach that is one level up, one down, in turn."""
        b = _bucket(batch_size)
        best_at = {d: g * self._factors[d] for d, (g, _) in _best_per_depth(scores).items()}
        floor = max(best_at.values(), default=0.0) * (1.0 - self.explore_margin)
        in_margin = {d for d, g in best_at.items() if self.explore_margin > 0 and g >= floor}
        candidates = [d for d in range(1, deepest + 1)
                      if d != cur.depth and (abs(d - cur.depth) == 1 or d in in_margin)]
        if not candidates:
            return None
        clock = self._bucket_steps.get(b, 0)

        def due(d: int) -> tuple:
            last = self._last_run.get((b, d))
            if last is None:
                return (1, 0, -abs(d - cur.depth), -d)
            # A neighbour's age counts double: the plan moves to its neighbours first.
            return (0, (clock - last) * (2 if abs(d - cur.depth) == 1 else 1), -abs(d - cur.depth), -d)
        return max(candidates, key=due)

    def stop_thresholds(self, batch_size: int, plan: Plan,
                        scores: dict[Plan, tuple[float, float]]) -> tuple[float, float]:
        """The early stop's thresholds for this step's chains: (per chain, per level).

        One more node on one sequence's chain, at draft path probability p, is accepted with
        about probability p (the embedded draft is calibrated: benchmarks/RESULTS.md). It
        raises the step's goodput G = tokens / time when p > G x dt, dt what that one node
        adds to the step. Its own share is a verify row (the verify pass's cost per token near
        the plan's rows): a chain stops below G x t_row. A draft level is one forward for the
        whole batch: the next one runs while the growing chains' p - G x t_row sum to at
        least G x t_level. At one sequence the two make p > G (t_row + t_level); in a batch
        the level is shared, as the chains that would go on share it. Trees and plain
        steps: 0, 0."""
        d = plan.depth
        B = max(1, batch_size)
        if (d == 0 or plan.num_nodes != d or self.stop_scale == 0 or B > self.stop_max_batch
                or not self.costs.has_verify):
            return 0.0, 0.0
        g = self.stop_scale * scores.get(plan, (0.0, 0.0))[0]
        lo = min(d, self.max_depth - 1)
        ctx = self._last_context
        # The secant over two depths: one row's cost read at a single point of the verify row
        # jumps with the CPU's odd and even row counts.
        n0, n1 = B * max(1, lo), B * (lo + 2)
        v = self.costs.t_verify_many(B, [n0, n1], ctx)
        row = max(0.0, v[1] - v[0]) / (n1 - n0)
        level = 0.0
        if self.costs.has_draft:
            # A level's cost over the plan's levels past the first (which also catches the
            # draft up): the threshold weighs each of them, and at the cap (a plan of
            # max_depth) a secant at the last level reads a curve flattened there.
            hi = max(2, d)
            dr = self.costs.t_draft_total_many(B, [1, hi], ctx)
            level = max(0.0, dr[1] - dr[0]) / (hi - 1)
        return min(1.0, max(0.0, g * row)), max(0.0, g * level)

    def fresh_curve(self) -> list[float] | None:
        """When the last plan came from a fresh evaluation: the predicted goodput of each depth
        0..max_depth (its best node budget; None where the batch's caps left a depth out),
        for the step log; None when the plan reused an earlier evaluation."""
        if self.mode != "adaptive" or self._scores is None or self._since_evaluated != 0:
            return None
        best = _best_per_depth(self._scores)
        return [best[d][0] if d in best else None for d in range(self.max_depth + 1)]

    def fresh_tokens(self) -> list[float | None] | None:
        """With fresh_curve: the expected tokens per sequence of each depth's best plan (with
        the curve, the predicted step time: batch x tokens / goodput; the step report sets
        both against what the fixed depths measured)."""
        if self.mode != "adaptive" or self._scores is None or self._since_evaluated != 0:
            return None
        best = _best_per_depth(self._scores)
        return [best[d][1] if d in best else None for d in range(self.max_depth + 1)]

    def fresh_costs(self) -> tuple[list[float | None], list[float | None], float] | None:
        """With fresh_curve: the seconds that evaluation priced each depth's best plan at, as
        (draft levels per depth, verify pass per depth, the rest of a step): beside what the
        fixed depths measured (step_report --curves), which part of the cost model is wrong."""
        if self.mode != "adaptive" or self._scores is None or self._since_evaluated != 0:
            return None
        return self._priced

    def fresh_bias(self) -> list[float] | None:
        """With fresh_curve: the bias factor of each depth that decision read (see "Bias")."""
        if self.mode != "adaptive" or self._scores is None or self._since_evaluated != 0:
            return None
        return self._factors

    def bias_factors(self, batch_size: int) -> list[float]:
        """Per depth 0..max_depth, the factor its predicted goodput is corrected by at this
        batch size (1.0: no figure, or the correction is off)."""
        if self.bias_decay is None:
            return [1.0] * (self.max_depth + 1)
        b = _bucket(batch_size)
        lo, hi = self.bias_limits
        noise_sd = self._step_noise_sd(batch_size)
        args = (self._bucket_steps.get(b, 0), self.bias_decay, self.bias_prior_sd, noise_sd,
                self.bias_deadband, lo, hi)
        biases = [self._bias.get((b, d)) for d in range(self.max_depth + 1)]
        # What the speculative depths measured share (each depth's own factor, one vote a
        # depth) stands for the depths without figures, and each depth's own figure is read
        # as a deviation from it: an error common to every depth (the acceptance model a few
        # percent low everywhere) otherwise raises only the depths that ran, and the plan in
        # use keeps an edge over neighbours that would beat it (see "Bias").
        # Only upward: where the depths that ran measured below their predictions, the
        # others keep the benefit of the doubt (1), so the plan still goes to try them.
        prior_sd = self.bias_prior_sd
        evidence = [None if bias is None else bias.evidence(*args) for bias in biases]
        own = [None if bias is None else _Bias.shifted(e, 1.0, prior_sd) for bias, e in zip(biases, evidence)]
        measured = [f for f in own[1:] if f is not None]
        centre = max(1.0, sum(measured) / len(measured)) if measured else 1.0
        out = [1.0 if own[0] is None else own[0]]
        for bias, f, e in zip(biases[1:], own[1:], evidence[1:]):
            if bias is None:
                out.append(centre)
            else:   # read around 1, as it was computed, unless the centre is above it
                out.append(f if centre == 1.0 else _Bias.shifted(e, centre, prior_sd))
        return out

    @staticmethod
    def _corrected(scores: dict[Plan, tuple[float, float]], factors: list[float]
                   ) -> dict[Plan, tuple[float, float]]:
        """The scores the decision reads: each plan's predicted goodput times its depth's
        bias factor. (The guard and the step log keep the model's own figures, and the
        measured ratios are taken against them, so the correction does not feed on itself.)"""
        if all(f == 1.0 for f in factors):
            return scores
        return {p: (g * factors[p.depth], e) for p, (g, e) in scores.items()}

    def _enter_bucket(self, bucket: int) -> None:
        """The batch is in `bucket` now: if it was in another, the plan held is the one last
        held in this one (none: the best of the coming decision, at once), and a challenger's
        streak from the other bucket does not carry over (see "Hysteresis")."""
        if bucket == self._held_bucket:
            return
        first, self._held_bucket = self._held_bucket is None, bucket
        if not first:   # (a controller's first plan goes on from the one it was built with)
            self._challenger_streak = 0
            self.current = self._held.get(bucket)

    def _decide(self, scores: dict[Plan, tuple[float, float]]) -> Plan:
        """The plan to run from a fresh evaluation: the centre of the band, with hysteresis."""
        top = max(g for g, _ in scores.values())
        best = self._centre_of_band(scores, top)
        cur = self.current if self.current in scores else best
        if best == cur:
            self._challenger_streak = 0
            return cur
        if scores[best][0] > scores[cur][0] * (1.0 + self.switch_margin):
            return self._switch(best)
        # Any challenger counts: near a flat top the centre of the band changes from one
        # evaluation to the next, and a streak of one challenger would never end.
        self._challenger_streak += 1
        if self._challenger_streak >= self.switch_patience:
            return self._switch(best)
        return cur

    def _centre_of_band(self, scores: dict[Plan, tuple[float, float]], top: float) -> Plan:
        """The plan aimed at: the centre of the band (the run of depths around the top's whose
        best plans are predicted within band_margin of it), its depths weighted by their height
        above the band's floor; at that depth the plan predicted best. See "The centre of the
        band" in the module docstring."""
        floor = top * (1.0 - self.band_margin)
        best_at: dict[int, float] = {}   # depth -> its best plan's predicted goodput
        for p, (g, _) in scores.items():
            best_at[p.depth] = max(g, best_at.get(p.depth, 0.0))
        # The band is the run of depths around the top's whose best plans stay within the
        # margin: a far depth that pokes into it past a dip is a bump of the estimates (a
        # stale cost), not part of a flat top.
        lo = hi = max(best_at, key=best_at.get)
        while lo - 1 in best_at and best_at[lo - 1] >= floor:
            lo -= 1
        while hi + 1 in best_at and best_at[hi + 1] >= floor:
            hi += 1
        heights = {d: best_at[d] - floor for d in range(lo, hi + 1)}
        total = sum(heights.values())
        centre = sum(d * h for d, h in heights.items()) / total if total > 0 else (lo + hi) / 2
        depth = min(heights, key=lambda d: (abs(d - centre), -best_at[d]))
        band = [p for p, (g, _) in scores.items() if p.depth == depth and g >= floor]
        return max(band, key=lambda p: (scores[p][0], -p.num_nodes))

    def _measured_goodput(self, m: _Measured, plan: Plan, scores) -> float:
        """A plan's goodput as measured, brought to the batch at hand: its measured/predicted
        ratio times today's prediction (raw measured tokens/s when it has no ratio)."""
        if m.is_ratio:
            return m.goodput * scores.get(plan, (0.0, 1.0))[0]
        return m.goodput

    def _guard(self, batch_size: int, cur: Plan, scores) -> Plan:
        """Measured goodput overrules the model on speculating at all: a batch bucket whose
        speculative plan has measured below plain decoding (both measured recently) is held
        at depth 0 (guard_first_hold steps, doubling for trips in a row, up to guard_hold)."""
        b = _bucket(batch_size)
        if batch_size < self.guard_min_batch:
            return cur
        if self.num_steps < self._guard_hold_until.get(b, -1):
            return cur if cur.depth == 0 else self._switch(Plan(0, 0))
        if cur.depth == 0:
            return cur
        m, m0 = self._fresh_measured(b, cur.depth), self._fresh_measured(b, 0)
        if (m is not None and m0 is not None and m.count >= self.guard_min_samples
                and m0.count >= self.guard_min_plain
                and self._measured_goodput(m, cur, scores)
                < self._measured_goodput(m0, Plan(0, 0), scores) * (1.0 - self.guard_margin)):
            self.num_guard_trips += 1
            in_row = (self._guard_holds_in_row.get(b, 0) + 1
                      if self.num_steps - self._guard_hold_until.get(b, -self.guard_max_age - 1)
                      <= self.guard_max_age else 1)
            self._guard_holds_in_row[b] = in_row
            hold = min(self.guard_hold, self.guard_first_hold << min(in_row - 1, 30))
            self._guard_hold_until[b] = self.num_steps + hold
            for key in [k for k in self._measured if k[0] == b and k[1] > 0]:
                del self._measured[key]   # the verdict after the hold is on fresh steps
            return self._switch(Plan(0, 0))
        return cur

    def _wants_plain_sample(self, batch_size: int, scores) -> bool:
        """Every guard_interval speculative steps, one plain step, unless the plan in use has
        measured clearly (guard_band) above a recent plain step in this bucket."""
        if self.guard_interval <= 0 or batch_size < self.guard_min_batch:
            return False
        self._guard_countdown -= 1
        if self._guard_countdown > 0:
            return False
        self._guard_countdown = self.guard_interval
        b = _bucket(batch_size)
        # A plain figure up to 4x the guard's age limit still shows a clear win as clear.
        m = self._fresh_measured(b, self.current.depth)
        m0 = self._fresh_measured(b, 0, 4 * self.guard_max_age)
        return m0 is None or m is None or (
            self._measured_goodput(m, self.current, scores)
            < self._measured_goodput(m0, Plan(0, 0), scores) * self.guard_band)

    def _fresh_measured(self, bucket: int, depth: int, max_age: int | None = None) -> _Measured | None:
        m = self._measured.get((bucket, depth))
        age = self.guard_max_age if max_age is None else max_age
        return m if m is not None and self.num_steps - m.step <= age else None

    def _switch(self, plan: Plan) -> Plan:
        self.num_plan_changes += 1
        self._challenger_streak = 0
        return plan

    def _record(self, plan: Plan) -> Plan:
        self.depth_histogram[plan.depth] = self.depth_histogram.get(plan.depth, 0) + 1
        self.last_plan = plan
        return plan

    # ---------------------------------------------------------------- feedback
    def observe(self, stats: StepStats) -> None:
        B = stats.batch_size
        if B <= 0:
            return
        self.num_steps += 1
        bucket = _bucket(B)
        clock = self._bucket_steps[bucket] = self._bucket_steps.get(bucket, 0) + 1
        self._last_run[(bucket, stats.depth)] = clock
        draft_depth = stats.depth if stats.draft_depth is None else stats.draft_depth
        ctx = stats.context_tokens
        if draft_depth > 0 and stats.draft_s > 0:
            self.costs.observe_draft(B, stats.draft_s / draft_depth)
            self.costs.observe_draft_total(B, draft_depth, stats.draft_s, context_tokens=ctx)
        if stats.verify_s > 0:
            num_tokens = B * (stats.num_nodes + 1) if stats.num_tokens is None else stats.num_tokens
            self.costs.observe_verify(B, num_tokens, stats.verify_s, context_tokens=ctx)
            if stats.overhead_s > 0:
                self.costs.observe_overhead(B, stats.overhead_s)
        total_s = stats.draft_s + stats.verify_s + stats.overhead_s
        if total_s > 0:
            tokens = sum(stats.num_accepted) + len(stats.num_accepted)
            rate = tokens / total_s
            self.measured_goodput = rate if self.num_steps == 1 else (
                self.measured_goodput + 0.1 * (rate - self.measured_goodput))
        # The guard's figures: whole steps with every part timed (no prefill, no catch-up),
        # booked under the plan. Steps where some trees were cut near max_tokens count too:
        # at high load nearly every step has such a sequence, and what it emits (its accepted
        # run + 1, a plain row 1) and costs is what the plan really yields there.
        whole = stats.verify_s > 0 and (stats.depth == 0 or stats.draft_s > 0)
        planned, self._planned = self._planned, None
        if whole:
            rate = (B + (sum(stats.num_accepted) if stats.depth else 0)) / total_s
            # Measured over predicted for the step that ran: the batch size and the contexts of
            # a bucket's steps differ (requests finish, contexts grow), and raw tokens/s of a
            # plain sample taken at 32 sequences against speculative steps at 20 would compare
            # the batches, not the plans. The ratio keeps what the model gets wrong per depth.
            is_ratio = (planned is not None and planned[1] > 0
                        and planned[0].depth == stats.depth and planned[0].num_nodes == stats.num_nodes)
            if is_ratio:
                if self.bias_decay is not None and planned[2] > 0:
                    key = (bucket, stats.depth)
                    bias = self._bias.get(key)
                    if bias is None:
                        bias = self._bias[key] = _Bias(clock)
                    tokens_pred = planned[2] * B
                    bias.add(rate * total_s, tokens_pred, total_s, tokens_pred / planned[1],
                             clock, self.bias_decay)
                rate /= planned[1]
            key = (bucket, stats.depth)
            m = self._measured.get(key)
            if m is None or m.is_ratio != is_ratio or self.num_steps - m.step > self.guard_max_age:
                self._measured[key] = _Measured(rate, self.num_steps, is_ratio)
            else:
                m.update(rate, self.num_steps, self.guard_alpha)

        d = min(stats.depth, self.max_depth)
        is_tree = stats.num_nodes > stats.depth
        # Without early stop every chain runs to its allowed depth: nothing to learn there.
        if (d > 1 and not is_tree and self._stops_early(B)
                and (stats.drafted_depths is not None or min(self.continuation) < 1.0)):
            self._observe_continuation(stats, d)
            self._observe_levels(stats, d, bucket)
        if is_tree and stats.path_probs:
            self._observe_tree_paths(stats)
        alt_counts = self._alternate_counts(d, stats.num_nodes, self.acceptance) if is_tree else []
        ga, ra = self.acceptance_alpha, self.request_alpha
        carried = self.global_acceptance()
        K = self.max_depth
        hits, seen = [0.0] * K, [0] * K   # this step's observations per position
        requests = self._requests
        keep = 1.0 - self.request_stale_decay
        seq_depths, drafted_depths = stats.seq_depths, stats.drafted_depths
        with_ranks = bool(is_tree and stats.accepted_ranks)
        # Each kind's observations apart, from the first sampled request on (until then the
        # global estimate is the greedy one, and nothing else is done).
        sampled_ids = self._sampled_ids
        kinds = self._kind_acc
        if kinds is None and sampled_ids and any(rid in sampled_ids for rid in stats.request_ids):
            kinds = self._start_kinds(carried)
        kind_hits = {False: [0.0] * K, True: [0.0] * K} if kinds is not None else None
        kind_seen = {False: [0] * K, True: [0] * K} if kinds is not None else None
        for i, (rid, n_acc) in enumerate(zip(stats.request_ids, stats.num_accepted)):
            ranks = stats.accepted_ranks[i] if with_ranks else None
            r = requests.get(rid)
            if r is None:
                r = requests[rid] = _RequestAcceptance(list(self.kind_acceptance(rid, carried)), [0] * K)
            r.tokens += n_acc + 1
            d_i = min(d, seq_depths[i]) if seq_depths else d
            drafted = d_i if drafted_depths is None else min(d_i, drafted_depths[i])
            observed = min(n_acc + 1, d_i, drafted)
            ema, count = r.ema, r.count
            kh = ks = None
            if kinds is not None:
                kind = rid in sampled_ids
                kh, ks = kind_hits[kind], kind_seen[kind]
            # A position the early stop left undrafted is not observed: what a chain accepts
            # where it was drafted is the draft's, and how often it is drafted there is the
            # continuation's (evaluate multiplies the two). Counted as not accepted, it held
            # deep positions at a fraction of their acceptance after a spell of one or two
            # sequences, and larger batches, whose chains are not stopped, read them so.
            for k in range(observed):   # position k+1
                if ranks is not None and k < n_acc and ranks[k] > 0:
                    spine = 0.0   # an alternate won at this depth: the first choice was rejected
                    if alt_counts and alt_counts[k] > 0:
                        self.sibling_acceptance += ga * (1.0 - self.sibling_acceptance)
                else:
                    spine = 1.0 if k < n_acc else 0.0
                    # Stopped here although alternates existed: they all failed. (Without
                    # ranks an alternate's success counts as the spine's.)
                    if spine == 0.0 and alt_counts and alt_counts[k] > 0:
                        self.sibling_acceptance += ga * (0.0 - self.sibling_acceptance)
                hits[k] += spine
                seen[k] += 1
                if kh is not None:
                    kh[k] += spine
                    ks[k] += 1
                ema[k] += ra * (spine - ema[k])
                count[k] += 1
                if spine == 0.0:
                    break
            # A request's positions without fresh data lose weight, back toward the global.
            for k in range(observed, K):
                count[k] *= keep
        self._update_global_acceptance(hits, seen, carried)
        if kinds is not None:
            for kind in (False, True):
                self._move_estimate(kinds[kind], self._kind_num_seen[kind], kind_hits[kind], kind_seen[kind])
        # Positions the step verified have fresh data; the others drift toward the position
        # above (position 1: toward the prior), so a stale low estimate recovers slowly and
        # the plan reaches that depth again to re-measure it.
        since, weight, acc = self._steps_since_seen, self._weight, self.acceptance
        fade, stale = 1.0 - self.weight_decay, self.stale_decay
        for k in range(min(d, K)):
            since[k] = 0
        for k in range(max(d, 0), K):
            since[k] += 1
            weight[k] *= fade
            target = self.prior_acceptance if k == 0 else acc[k - 1]
            acc[k] += stale * (target - acc[k])

    def _start_kinds(self, carried: list[float]) -> dict[bool, list[float]]:
        """The first sampled request observed: the global estimate so far becomes the greedy
        one (every request before was greedy), and the sampled one starts from it, its first
        observations averaging with it as with the prior (see "Sampled and greedy")."""
        self._kind_acc = {False: list(carried), True: list(carried)}
        self._kind_num_seen = {False: list(self._num_seen), True: [0] * self.max_depth}
        return self._kind_acc

    def _update_global_acceptance(self, hits: list[float], seen: list[int], carried: list[float]) -> None:
        """One step's observations of each position (``seen[k]`` sequences reached position
        k + 1, ``hits[k]`` of them had it accepted) move its global EMA once, toward their
        mean. Whatever the order of the batch: one EMA step per sequence in batch order gave
        the batch's last sequences (its youngest requests) ~5x the weight of its first at 32
        sequences. The weight is what ``seen[k]`` EMA steps of ``acceptance_alpha`` would give,
        capped at ``acceptance_step_weight`` a step: at 32 sequences those steps make 0.81, so
        the estimate was the last step's batch (position 1 swung 0.70-0.95 from one step to
        the next on the dev CPU, the plan with it between depths 1 and 3 where 3-5 were
        best), while one step's batch is a sample of a few tens of requests. A position's
        first observations average plainly with the prior (worth ``_PRIOR_OBSERVATIONS``),
        so the first probe replaces the guess rather than nudging it."""
        self._move_estimate(self.acceptance, self._num_seen, hits, seen, carried)
        for k, n in enumerate(seen):
            self._weight[k] += n

    def _move_estimate(self, acc: list[float], counts: list[int], hits: list[float], seen: list[int],
                       carried: list[float] | None = None) -> None:
        """In place: one step's observations move each position of `acc` once (see
        _update_global_acceptance; each kind's estimate moves the same way). counts: the
        observations of each position so far; carried: where a position's first data starts
        from (None: from acc as it is)."""
        ga, cap = self.acceptance_alpha, self.acceptance_step_weight
        for k, n in enumerate(seen):
            if n == 0:
                continue
            before = counts[k]
            if before == 0 and carried is not None:   # first data: start from the carried estimate
                acc[k] = carried[k]
            plain = n / (before + n + _PRIOR_OBSERVATIONS - 1)   # a running mean over prior + data
            w = max(plain, min(1.0 - (1.0 - ga) ** n, cap))
            acc[k] += w * (hits[k] / n - acc[k])
            counts[k] += n

    def _observe_continuation(self, stats: StepStats, d: int) -> None:
        """Each chain's continuations this step: from position k to k + 1 for k below its
        allowed depth, 1 while it went on, 0 where the early stop ended it."""
        ga = self.acceptance_alpha
        c = self.continuation
        for i in range(len(stats.num_accepted)):
            allowed = min(d, stats.seq_depths[i]) if stats.seq_depths else d
            drafted = allowed if stats.drafted_depths is None else min(allowed, stats.drafted_depths[i])
            for k in range(1, allowed):
                went_on = 1.0 if k < drafted else 0.0
                c[k] += ga * (went_on - c[k])
                if not went_on:
                    break

    def _observe_levels(self, stats: StepStats, d: int, bucket: int) -> None:
        """The draft levels this step ran against those its chains were allowed: from level k
        to k + 1 for k below the deepest allowed, 1 while the batch went on, 0 where it ended."""
        c = self._level_continuation.get(bucket)
        if c is None:
            c = self._level_continuation[bucket] = [1.0] * self.max_depth
        allowed = max((min(d, x) for x in stats.seq_depths), default=0) if stats.seq_depths else d
        ran = allowed if stats.draft_depth is None else min(allowed, stats.draft_depth)
        ga = self.acceptance_alpha
        for k in range(1, allowed):
            went_on = 1.0 if k < ran else 0.0
            c[k] += ga * (went_on - c[k])
            if not went_on:
                break

    # ---------------------------------------------------------------- metrics
    def snapshot(self) -> dict:
        """Plain values for the metrics module (DESIGN.md §6: depth histogram, acceptance per
        position, goodput estimate)."""
        return {
            "mode": self.mode,
            "depth": self.last_plan.depth,
            "num_nodes": self.last_plan.num_nodes,
            "depth_histogram": dict(sorted(self.depth_histogram.items())),
            "acceptance_per_position": list(self.acceptance),
            # greedy and sampled requests apart, once both have been seen (else None)
            "kind_acceptance": None if self._kind_acc is None else {
                "greedy": list(self._kind_acc[False]), "sampled": list(self._kind_acc[True])},
            "sibling_acceptance": self.sibling_acceptance,
            "goodput_estimate": self.goodput_estimate,
            "expected_tokens_per_pass": self.expected_tokens_per_pass,
            "stop_below": self.stop_below,
            "level_below": self.level_below,
            "reach_per_position": self.reach(),
            "measured_goodput": self.measured_goodput,
            "num_steps": self.num_steps,
            "num_plan_changes": self.num_plan_changes,
            "num_probes": self.num_probes,
            "num_explorations": self.num_explorations,
            "num_guard_trips": self.num_guard_trips,
            "request_tokens": self.request_tokens,
            "num_tracked_requests": len(self._requests),
            # batch bucket -> each depth's bias factor (1.0 where it has no figure)
            "bias_factors": {b: self.bias_factors(b)
                             for b in sorted({key[0] for key in list(self._bias)})},
            "costs": self.costs.snapshot(),
        }
