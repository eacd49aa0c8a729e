"""Prometheus metrics of one server, all in one place (DESIGN.md §7).

Each `ServerMetrics` owns its own CollectorRegistry, so several apps (tests) can live in one
process. Latencies and token counts are observed by the HTTP handlers as outputs reach the
client; engine state (queue lengths, pool usage, the speculative counters of
`engine.spec.totals`) is read at scrape time by a collector, so the exported counters are
exactly the engine's, with no deltas to keep in step.

The names are a contract: the benchmark client scrapes them.
"""

from __future__ import annotations

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0,
                    20.0, 40.0, 80.0)
_E2E_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0, 320.0)


class _EngineCollector:
    """Reads the engine at scrape time. The engine thread mutates these ints and lists; reading
    them from the event loop is safe in CPython and at worst one step stale."""

    def __init__(self, engine):
        self.engine = engine  # LLMEngine

    def collect(self):
        engine = self.engine
        g = GaugeMetricFamily("specserve_num_requests_running", "Requests being decoded (holding KV blocks).")
        g.add_metric([], len(engine.scheduler.running))
        yield g
        g = GaugeMetricFamily("specserve_num_requests_waiting", "Requests queued for their first schedule.")
        g.add_metric([], len(engine.scheduler.waiting))
        yield g
        g = GaugeMetricFamily("specserve_kv_cache_usage_perc", "Fraction of KV pool blocks held (0..1).")
        g.add_metric([], engine.pool.usage)
        yield g

        totals = engine.spec.totals
        for name, value, doc in (
            ("specserve_spec_num_drafts", totals.num_drafts, "Speculative steps (a tree proposed and verified)."),
            ("specserve_spec_num_draft_tokens", totals.num_draft_tokens, "Draft tokens (tree nodes) proposed."),
            ("specserve_spec_num_accepted_tokens", totals.num_accepted_tokens, "Draft tokens accepted."),
        ):
            c = CounterMetricFamily(name, doc)
            c.add_metric([], value)
            yield c
        c = CounterMetricFamily(
            "specserve_spec_accepted_per_position", "Times a draft token at depth `position` (from 1) was accepted.",
            labels=["position"],
        )
        for pos, count in enumerate(list(totals.accepted_per_position)):
            c.add_metric([str(pos + 1)], count)
        yield c
        g = GaugeMetricFamily("specserve_spec_mean_tokens_per_pass", "Tokens emitted per verifying target pass.")
        g.add_metric([], totals.mean_tokens_per_pass)
        yield g
        g = GaugeMetricFamily("specserve_spec_depth", "Speculation depth in use (0 = plain decode).")
        g.add_metric([], totals.last_depth)
        yield g
        g = GaugeMetricFamily("specserve_spec_adaptive", "1 while the adaptive controller plans the steps, 0 while "
                              "a static depth does (set at start-up or by POST /admin/speculation).")
        g.add_metric([], int(getattr(engine.spec, "controller", None) is not None))
        yield g
        # The controller built at start-up, also while a static setting has it detached: its
        # figures stay what it last knew, and the series do not vanish with a switch.
        controller = getattr(engine.spec, "adaptive", None)
        if controller is not None:
            yield from _controller_metrics(controller.snapshot())


def _controller_metrics(snap: dict):
    """The adaptive controller's decisions and what it based them on (DESIGN.md §6)."""
    c = CounterMetricFamily("specserve_controller_steps", "Engine steps planned at each depth (the depth histogram).",
                            labels=["depth"])
    for depth, count in snap["depth_histogram"].items():
        c.add_metric([str(depth)], count)
    yield c
    g = GaugeMetricFamily("specserve_controller_acceptance_estimate",
                          "Estimated probability that the draft's token at `position` is accepted, given the ones "
                          "before it were.", labels=["position"])
    for pos, a in enumerate(snap["acceptance_per_position"]):
        g.add_metric([str(pos + 1)], a)
    yield g
    g = GaugeMetricFamily("specserve_controller_kind_acceptance_estimate",
                          "The same for greedy and for sampled requests apart (present once both kinds have "
                          "been served: each request's estimate starts from its kind's).", labels=["kind", "position"])
    for kind, accs in (snap.get("kind_acceptance") or {}).items():
        for pos, a in enumerate(accs):
            g.add_metric([kind, str(pos + 1)], a)
    yield g
    g = GaugeMetricFamily("specserve_controller_reach_estimate",
                          "Estimated share of chains drafted as far as `position` (below 1 where the early "
                          "stop ends chains on the draft's doubt).", labels=["position"])
    for pos, r in enumerate(snap.get("reach_per_position", [])):
        g.add_metric([str(pos + 1)], r)
    yield g
    for name, key, doc in (
        ("specserve_controller_goodput_estimate", "goodput_estimate",
         "Predicted committed tokens per second of the plan in use."),
        ("specserve_controller_measured_goodput", "measured_goodput",
         "Committed tokens per second of recent steps (moving average)."),
        ("specserve_controller_expected_tokens_per_pass", "expected_tokens_per_pass",
         "Predicted tokens per sequence per target pass of the plan in use."),
        ("specserve_controller_num_nodes", "num_nodes", "Tree nodes per sequence of the plan in use."),
        ("specserve_controller_stop_threshold", "stop_below",
         "Draft path probability below which a chain stops growing (early stop; 0 = none) in the plan in use."),
        ("specserve_controller_level_threshold", "level_below",
         "Sum of the growing chains' path probabilities (each less the stop threshold) below which the "
         "draft's next level is not run (early stop; 0 = none) in the plan in use."),
    ):
        g = GaugeMetricFamily(name, doc)
        g.add_metric([], snap[key])
        yield g
    for name, key, doc in (
        ("specserve_controller_plan_changes", "num_plan_changes", "Times the controller switched plans."),
        ("specserve_controller_probes", "num_probes", "Steps run one level deeper to re-measure acceptance."),
        ("specserve_controller_guard_trips", "num_guard_trips",
         "Times measured goodput put a batch-size bucket back on plain decoding."),
    ):
        c = CounterMetricFamily(name, doc)
        c.add_metric([], snap[key])
        yield c
    g = GaugeMetricFamily("specserve_controller_bias_factor",
                          "What the controller's decision multiplies a depth's predicted goodput by: that "
                          "depth's measured over predicted goodput on its recent steps, shrunk toward 1, or toward "
                          "what the speculative depths share where that is above 1 (a depth without figures: that). "
                          "Per batch-size bucket.", labels=["batch_size", "depth"])
    for bucket, factors in snap.get("bias_factors", {}).items():
        for depth, f in enumerate(factors):
            g.add_metric([str(bucket), str(depth)], f)
    yield g
    costs = snap["costs"]
    for name, key, doc in (
        ("specserve_controller_draft_step_seconds", "draft_s_per_step", "Measured time of one draft step."),
        ("specserve_controller_step_overhead_seconds", "step_overhead_s",
         "Measured time of an engine step outside the draft and the target's pass."),
        ("specserve_controller_verify_level", "verify_level",
         "Verify costs now relative to when first measured (1 = unchanged)."),
    ):
        g = GaugeMetricFamily(name, doc + " Per batch-size bucket.", labels=["batch_size"])
        for bucket, value in costs.get(key, {}).items():
            g.add_metric([str(bucket)], value)
        yield g
    g = GaugeMetricFamily("specserve_controller_verify_seconds",
                          "Measured time of the target's pass per batch-size bucket and token count.",
                          labels=["batch_size", "num_tokens"])
    for bucket, row in costs.get("verify_s", {}).items():
        for _, (num_tokens, seconds) in row.items():
            g.add_metric([str(bucket), str(round(num_tokens))], seconds)
    yield g


class ServerMetrics:
    def __init__(self, engine):
        self.registry = CollectorRegistry()
        r = self.registry
        self.time_to_first_token = Histogram(
            "specserve_time_to_first_token_seconds", "From request arrival to its first token.",
            buckets=_LATENCY_BUCKETS, registry=r,
        )
        # With speculation one output carries several tokens; each of them is observed with the
        # gap since the previous output divided by their number, so the mean is time per token.
        self.inter_token_latency = Histogram(
            "specserve_inter_token_latency_seconds", "Time per output token after the first.",
            buckets=_LATENCY_BUCKETS, registry=r,
        )
        self.e2e_request_latency = Histogram(
            "specserve_e2e_request_latency_seconds", "From request arrival to its last token.",
            buckets=_E2E_BUCKETS, registry=r,
        )
        self.prompt_tokens = Counter("specserve_prompt_tokens", "Prompt tokens of admitted requests.", registry=r)
        self.generation_tokens = Counter("specserve_generation_tokens", "Tokens generated.", registry=r)
        r.register(_EngineCollector(engine))

    def observe_tokens(self, num_tokens: int, gap_s: float | None) -> None:
        """`num_tokens` new tokens of one request arrived `gap_s` after its previous ones
        (None: these include its first token, which TTFT covers)."""
        self.generation_tokens.inc(num_tokens)
        if gap_s is not None and num_tokens:
            per_token = gap_s / num_tokens
            for _ in range(num_tokens):
                self.inter_token_latency.observe(per_token)

    def render(self) -> tuple[bytes, str]:
        """(body, content type) of the Prometheus text exposition."""
        return generate_latest(self.registry), CONTENT_TYPE_LATEST
