"""Several engine cores behind one API server (`--engines 2`, core.EngineGroup): requests that
share a long prefix land on one core, whose prefix-cache hits rise; a mixed load uses both;
outputs equal offline greedy; metrics are given per core and in total."""

from __future__ import annotations

import json
import urllib.request

import pytest

from specserve.core import EngineGroup
from specserve.llm import LLM
from specserve.sampling import SamplingParams
from tests.server.conftest import ServerThread, concurrently, engine_config, wait_until


@pytest.fixture(scope="module")
def cfg(server_target, server_draft):
    return engine_config(server_target, server_draft, spec_mode="static", spec_depth=3, dtype="float64")


@pytest.fixture(scope="module")
def group_server(cfg):
    srv = ServerThread(EngineGroup(cfg, 2), cfg)
    yield srv
    srv.stop()


def group(srv) -> EngineGroup:
    from specserve.server.app import STATE

    return srv.app[STATE].async_engine


def complete(srv, prompt, max_tokens: int = 12) -> str:
    req = urllib.request.Request(srv.url + "/completions", data=json.dumps(
        {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0}).encode(),
        headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        return json.loads(r.read())["choices"][0]["text"]


def test_a_shared_prefix_lands_on_one_core_and_hits_its_cache(group_server):
    g = group(group_server)
    prefix = list(range(20, 84))   # 64 tokens: 8 blocks of 8
    before = [dict(s) for s in g.snapshot()["engines"]]
    for k in range(6):
        complete(group_server, prefix + [100 + k, 101 + k])
    after = g.snapshot()["engines"]
    routed = [a["routed"] - b["routed"] for a, b in zip(after, before)]
    assert sorted(routed) == [0, 6], routed
    core = routed.index(6)
    # Every request after the first finds the 64-token prefix in that core's cache (the core's
    # snapshot arrives within a tenth of a second of its step).
    assert wait_until(lambda: g.snapshot()["engines"][core]["prefix_cache_hits"]
                      - before[core]["prefix_cache_hits"] >= 5 * 64, timeout=5), g.snapshot()["engines"]


def test_a_mixed_load_uses_both_cores_and_outputs_equal_offline(group_server, cfg):
    prompts = [f"Prompt number {i} about something else" for i in range(12)]
    before = [s["routed"] for s in group(group_server).snapshot()["engines"]]
    texts = concurrently(lambda i: complete(group_server, prompts[i]), len(prompts))
    after = [s["routed"] for s in group(group_server).snapshot()["engines"]]
    assert all(a - b > 0 for a, b in zip(after, before)), (before, after)
    offline = LLM(cfg, progress=False).generate(prompts, SamplingParams(max_tokens=12, temperature=0.0))
    assert texts == [o.text for o in offline]


def test_each_core_has_its_own_waiting_queue(group_server, monkeypatch):
    """scheduler.max_waiting_requests bounds each core's queue (each core enforces it): with one
    request waiting on core 0 and none on core 1, a new request is still admitted."""
    from specserve.server.app import STATE

    g = group(group_server)
    monkeypatch.setattr(group_server.app[STATE].cfg.scheduler, "max_waiting_requests", 1)
    monkeypatch.setattr(g.cores[0], "num_waiting", lambda: 1)
    assert complete(group_server, "Still room on core one", max_tokens=2)


def test_metrics_per_core_and_in_total(group_server):
    with urllib.request.urlopen(group_server.base + "/metrics", timeout=10) as r:
        text = r.read().decode()
    per_core = [float(line.split()[-1]) for line in text.splitlines()
                if line.startswith("specserve_engine_requests_routed{")]
    assert len(per_core) == 2 and sum(per_core) > 0
    snap = group(group_server).snapshot()
    assert snap["num_drafts"] == sum(s["num_drafts"] for s in snap["engines"]) > 0
    assert "specserve_spec_num_drafts_total" in text and "specserve_prefix_cache_hits_total" in text


def test_engines_that_share_a_gpu_split_its_memory(cfg, monkeypatch, caplog):
    """Three engines on two GPUs: engines 0 and 2 share GPU 0, so each engine sizes its pool
    from half of cache.memory_fraction; said in a warning."""
    import msgspec
    import torch

    from specserve import core

    made = []
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(core, "EngineCoreClient", lambda c, tokenizer=None, **placement: made.append((c, placement)))
    on_cuda = msgspec.structs.replace(cfg, device="cuda")
    EngineGroup(on_cuda, 3)
    assert [p["env"]["CUDA_VISIBLE_DEVICES"] for _, p in made] == ["0", "1", "0"]
    assert {c.cache.memory_fraction for c, _ in made} == {cfg.cache.memory_fraction / 2}
    assert "3 engines on 2 GPUs: up to 2 share a GPU" in caplog.text


def test_routing_spreads_ties_and_forgets_a_restarted_cores_prefixes(cfg, monkeypatch):
    """EngineGroup.route on stand-in cores: with nothing in flight, requests in turn go to the
    core given fewer so far; a prompt whose prefix a core served goes back to it, until that
    core restarts (its cache is empty then)."""
    from types import SimpleNamespace

    from specserve import core

    monkeypatch.setattr(core, "EngineCoreClient",
                        lambda c, tokenizer=None, **placement: SimpleNamespace(is_alive=True, restarts=0))
    g = EngineGroup(cfg, 2)

    def send(prompt):
        i = g.route(prompt)
        g.routed[i] += 1
        return i

    assert [send([k]) for k in range(4)] == [0, 1, 0, 1]
    prefix = list(range(40, 40 + 4 * cfg.cache.block_size))
    owner = send(prefix + [1])
    assert [send(prefix + [k]) for k in range(2, 5)] == [owner] * 3
    g.routed[owner] = 0   # the owner is also the least loaded: only ownership decides below
    g.routed[1 - owner] = 1
    g.cores[1 - owner].restarts += 1   # a restart of the other core changes nothing
    assert send(prefix + [5]) == owner
    g.routed[owner] = 10
    assert send(prefix + [6]) == owner   # the owner, though the other was given fewer
    g.cores[owner].restarts += 1
    assert send(prefix + [7]) == 1 - owner   # forgotten: the least loaded, which owns it from now
    assert send(prefix + [8]) == 1 - owner
