"""Prometheus metrics of one server, all in one place (DESIGN.md §7).

Each `ServerMetrics` owns its own CollectorRegistry, so several apps (tests) can live in one
process. Latencies and token counts are observed by the HTTP handlers as outputs reach the
client; engine state (queue lengths, pool usage, the speculative counters) is read from the
engine's snapshot at scrape time by a collector, so the exported counters are exactly the
engine's, with no deltas to keep in step.

The names are a contract: the benchmark client scrapes them.
"""

from __future__ import annotations

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0,
                    20.0, 40.0, 80.0)
_E2E_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0, 320.0)


class _EngineCollector:
    """Reads the engine's snapshot (LLMEngine.snapshot) at scrape time."""

    def __init__(self, snapshot):
        self.snapshot = snapshot  # () -> dict

    def collect(self):
        snap = self.snapshot()
        G, C = GaugeMetricFamily, CounterMetricFamily
        for family, name, key, doc in (
            (G, "specserve_num_requests_running", "running", "Requests being decoded (holding KV blocks)."),
            (G, "specserve_num_requests_waiting", "waiting", "Requests queued for their first schedule."),
            (G, "specserve_kv_cache_usage_perc", "kv_usage", "Fraction of KV pool blocks held (0..1)."),
            (C, "specserve_engine_restarts", "restarts", "Times the engine was restarted after its loop or process died."),
            (C, "specserve_requests_failed", "failed", "Requests the engine failed alone (an error of theirs)."),
            (C, "specserve_num_preemptions", "preemptions",
             "Requests preempted when KV blocks ran out (their blocks dropped, their tokens recomputed later)."),
            (C, "specserve_spec_num_drafts", "num_drafts", "Speculative steps (a tree proposed and verified)."),
            (C, "specserve_spec_num_draft_tokens", "num_draft_tokens", "Draft tokens (tree nodes) proposed."),
            (C, "specserve_spec_num_accepted_tokens", "num_accepted_tokens", "Draft tokens accepted."),
            (C, "specserve_prefix_cache_queries", "prefix_cache_queries", "Prompt tokens looked up in the prefix cache."),
            (C, "specserve_prefix_cache_hits", "prefix_cache_hits", "Prompt tokens found in the prefix cache."),
            (G, "specserve_spec_mean_tokens_per_pass", "tokens_per_pass", "Tokens emitted per verifying target pass."),
            (G, "specserve_spec_depth", "depth", "Speculation depth in use (0 = plain decode)."),
        ):
            m = family(name, doc)
            m.add_metric([], snap[key])
            yield m
        for name, key, doc in (   # with several engine cores (--engines N): each one's share
            ("specserve_engine_num_requests_running", "running", "Requests being decoded, by engine core."),
            ("specserve_engine_num_requests_waiting", "waiting", "Requests queued, by engine core."),
            ("specserve_engine_prefix_cache_hits", "prefix_cache_hits", "Prefix-cache hit tokens, by engine core."),
            ("specserve_engine_requests_routed", "routed", "Requests routed to each engine core."),
        ):
            if "engines" in snap:
                g = GaugeMetricFamily(name, doc, labels=["engine"])
                for i, engine in enumerate(snap["engines"]):
                    g.add_metric([str(i)], engine[key])
                yield g
        c = CounterMetricFamily(
            "specserve_spec_accepted_per_position", "Times a draft token at depth `position` (from 1) was accepted.",
            labels=["position"],
        )
        for pos, count in enumerate(snap["accepted_per_position"]):
            c.add_metric([str(pos + 1)], count)
        yield c
        g = GaugeMetricFamily("specserve_spec_adaptive", "1 while the adaptive controller plans the steps, 0 while "
                              "a static depth does.")
        g.add_metric([], int(snap["controller"] is not None))
        yield g
        if snap["controller"] is not None:
            yield from _controller_metrics(snap["controller"])


def _controller_metrics(snap: dict):
    """The adaptive controller's decisions and what it based them on (DESIGN.md §6)."""
    c = CounterMetricFamily("specserve_controller_steps", "Engine steps planned at each depth (the depth histogram).",
                            labels=["depth"])
    for depth, count in sorted(snap["depth_histogram"].items()):
        c.add_metric([str(depth)], count)
    yield c
    g = GaugeMetricFamily("specserve_controller_acceptance_estimate",
                          "Estimated probability that the draft's token at `position` is accepted, given the ones "
                          "before it were (greedy requests).", labels=["position"])
    for pos, a in enumerate(snap["acceptance_per_position"]):
        g.add_metric([str(pos + 1)], a)
    yield g
    g = GaugeMetricFamily("specserve_controller_goodput_estimate", "Predicted tokens per second of the last plan.")
    g.add_metric([], snap["goodput_estimate"])
    yield g
    if snap["calibration"] is not None:
        g = GaugeMetricFamily("specserve_controller_draft_calibration",
                              "Accepted draft tokens over the draft's summed path probabilities (1: calibrated).")
        g.add_metric([], snap["calibration"])
        yield g
    curve = snap["curve"]
    g = GaugeMetricFamily("specserve_controller_verify_seconds",
                          "The capacity curve the controller believes: a verify pass by batch size and rows a "
                          "sequence.", labels=["batch_size", "rows"])
    for bucket, row in zip(curve["buckets"], curve["verify_s"]):
        for r, seconds in enumerate(row, 1):
            g.add_metric([str(bucket), str(r)], seconds)
    yield g
    for name, key, doc in (("specserve_controller_draft_level_seconds", "level_s", "One draft level"),
                           ("specserve_controller_step_rest_seconds", "rest_s",
                            "A step's time outside the draft and the target's pass")):
        g = GaugeMetricFamily(name, doc + ", by batch size.", labels=["batch_size"])
        for bucket, seconds in zip(curve["buckets"], curve[key]):
            g.add_metric([str(bucket)], seconds)
        yield g


class ServerMetrics:
    def __init__(self, snapshot):
        """snapshot: () -> the engine's state (LLMEngine.snapshot)."""
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
        r.register(_EngineCollector(snapshot))

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
