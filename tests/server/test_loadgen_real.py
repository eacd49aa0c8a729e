"""The benchmark client against a real specserve server (with speculation): its figures must
agree with what the server itself counted."""

from __future__ import annotations

import urllib.request

from prometheus_client.parser import text_string_to_metric_families

from benchmarks import loadgen


def _counter(base: str, name: str) -> float:
    text = urllib.request.urlopen(base + "/metrics", timeout=10).read().decode()
    return sum(s.value for f in text_string_to_metric_families(text) for s in f.samples if s.name == name)


def test_loadgen_figures_are_consistent_with_the_server(server):
    model = server.client().models.list().data[0].id
    generated_before = _counter(server.base, "specserve_generation_tokens_total")
    drafts_before = _counter(server.base, "specserve_spec_num_drafts_total")
    res = loadgen.main([
        "--base-url", server.base, "--model", model, "--num-prompts", "12", "--max-concurrency", "4",
        "--max-tokens", "16", "--min-words", "4", "--max-words", "24", "--save-requests", "--no-progress",
        "--goodput", "ttft:60000", "tpot:60000",
    ])
    m = res["metrics"]
    assert m["num_completed"] == 12 and m["num_failed"] == 0 and not res["errors"]

    # Token counts: the usage chunk of every stream, the server's own counter, and the chunks.
    reqs = res["requests"]
    assert all(r["usage_reported"] for r in reqs)
    assert m["total_output_tokens"] == sum(r["num_output_tokens"] for r in reqs)
    generated = _counter(server.base, "specserve_generation_tokens_total") - generated_before
    assert generated == m["total_output_tokens"]
    assert m["usage_mismatches"] == 0  # never more content chunks than tokens
    for r in reqs:
        assert 1 <= r["num_chunks"] <= r["num_output_tokens"] <= 16
        assert 0 < r["ttft"] <= r["e2e"]
        assert len(r["itl"]) == r["num_chunks"] - 1

    # Percentiles ordered; every request met the (generous) goodput targets.
    for key in ("ttft_s", "tpot_s", "itl_s", "e2e_s"):
        s = m[key]
        assert 0 <= s["median"] <= s["p90"] <= s["p99"], (key, s)
    assert m["ttft_s"]["p99"] <= m["e2e_s"]["p99"]
    assert abs(m["goodput_requests_per_s"] - m["request_throughput"]) < 1e-9

    # Acceptance, from /metrics before and after: the server speculates (static depth 3).
    acc = res["acceptance"]
    assert acc["num_drafts"] == _counter(server.base, "specserve_spec_num_drafts_total") - drafts_before > 0
    assert 0 <= acc["num_accepted_tokens"] <= acc["num_draft_tokens"] <= 3 * acc["num_drafts"]
    assert abs(acc["mean_acceptance_length"] - (1 + acc["num_accepted_tokens"] / acc["num_drafts"])) < 1e-9
