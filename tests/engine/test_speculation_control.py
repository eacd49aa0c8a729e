"""Speculation control while requests run (specserve/controller.py, spec.py, LLMEngine.set_speculation,
POST /admin/speculation): switches between the adaptive controller and static depths in the middle
of concurrent requests, in process and over HTTP with the engine-core process; the capacity curve
learned online under outliers; adversarial acceptance.

What must hold whatever the switches: greedy output equals target-only output token for token,
every KV block comes back, no per-request controller state outlives its request (in the active
controller or the detached one), a bad setting is a 400 naming its field and changes nothing, and
the controller keeps what it learned across switches. And the capacity curve learns only from
what a step measured: a step that ran no draft level teaches no draft-level cost, and one outlier
step (a GC pause) does not switch speculation off for good."""

from __future__ import annotations

import math
import random
import threading

import pytest
import torch

from specserve import LLM, SamplingParams
from specserve.controller import AdaptiveController, CapacityCurve, ControllerConfig, Plan
from specserve.errors import InvalidRequestError
from tests.checkpoints import make_checkpoint, make_noisy_copy
from tests.server.conftest import http

pytestmark = pytest.mark.usefixtures("one_thread")   # tests/engine/conftest.py

L = 40   # max_model_len in process: some requests run to the very end of the context


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("speculation_control")
    target = make_checkpoint(root / "target", "llama", dtype=torch.float64)
    weak = make_noisy_copy(target, root / "weak", seed=5, scale=0.05)
    return {"target": target, "weak": weak}


def make(models, draft="weak", **kw) -> LLM:
    args = dict(target=str(models["target"]), dtype="float64", device="cpu", progress=False, num_blocks=40,
                block_size=4, max_num_seqs=6, max_model_len=L)
    args["draft"] = draft if draft in ("none", "ngram") else str(models[draft])
    args.update(kw)
    return LLM(**args)


def greedy(n, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True, **kw)


# -- the curve learned online: what a step measured, and nothing else --------------------------

BUCKETS = [1, 2, 4, 8]


def _curve() -> CapacityCurve:
    """10 ms a verify pass plus 0.5 ms a row, 1 ms a draft level, 0.5 ms the rest of a step."""
    return CapacityCurve(BUCKETS, [[0.01 + 0.0005 * b * r for r in range(1, 10)] for b in BUCKETS],
                         [0.001] * len(BUCKETS), [0.0005] * len(BUCKETS))


@pytest.mark.parametrize("part, seconds", [("draft", 1.0), ("draft", math.inf), ("rest", math.nan), ("verify", 1.0)])
def test_one_outlier_step_does_not_switch_speculation_off_for_good(part, seconds):
    """A closed loop of one request whose draft is accepted 90% of the time, on a machine whose
    costs never change, except that ONE step's draft phase takes a second (a GC pause; or a
    timer that returned inf / nan). Speculation pays before and after. The draft-level cost is
    only learned from steps that run draft levels, so once an outlier has made levels look dear
    and the plan is plain decoding, nothing can ever bring it back: the controller must not let
    one step push it there for good."""
    true, ctl = _curve(), AdaptiveController(_curve(), config=ControllerConfig())
    rng = random.Random(0)
    depths = []
    for step in range(400):
        plan = ctl.plan([("a", 50, False)])
        n = plan.nodes.get("a", 0)
        accepted = 0
        while accepted < n and rng.random() < 0.9:
            accepted += 1
        draft_s, verify_s, rest_s = plan.depth * true.level_s(1), true.verify_s(1, 1 + n), true.rest_s(1)
        if step == 100:
            if part == "draft":
                draft_s = seconds
            elif part == "verify":
                verify_s = seconds
            else:
                rest_s = seconds
        ctl.observe(1, 1 + n, plan.depth, draft_s, verify_s, rest_s,
                    [("a", False, n, accepted, [])] if n else [])
        depths.append(plan.depth)
    assert min(depths[50:100]) > 0, "speculation did not pay before the outlier"
    speculating = sum(d > 0 for d in depths[-100:])
    assert speculating > 50, (f"after one outlier step at 100 ({part} = {seconds} s) only {speculating} of the "
                              f"last 100 steps speculate; draft level now {ctl.curve.level_s(1)!r} s, rest "
                              f"{ctl.curve.rest_s(1)!r} s; depths around it {depths[98:106]}")


def test_one_slow_verify_pass_moves_the_curve_as_a_4x_one_would():
    """A verify pass 1000 times its estimate (a GC pause) moves the curve no further than one
    4 times its estimate: the cell it lands in is avoided afterwards, so it would stay wrong."""
    cfg = ControllerConfig()
    moved = []
    for factor in (4.0, 1000.0):
        curve = _curve()
        before = curve.verify_row(1)
        curve.observe(1, 7, factor * curve.verify_s(1, 7), 0, 0.0, None, cfg)
        moved.append([a / b for a, b in zip(curve.verify_row(1), before)])
    assert moved[0] == moved[1] and max(moved[0]) > 1.0


@pytest.mark.parametrize("path_probs", [False, True])
def test_a_draft_that_is_never_accepted_goes_idle(path_probs):
    """Requests come and go, four at a time, and no draft token is ever accepted (even though the
    draft is sure of them): after a short while no step verifies a node (plain decoding, the draft
    idle), and new requests, which start from the global rates, do not restart it."""
    ctl = AdaptiveController(_curve(), config=ControllerConfig(), path_probs=path_probs)
    true = _curve()
    left: dict[str, int] = {}
    next_id, nodes = 0, []
    for step in range(600):
        while len(left) < 4:
            left[f"r{next_id}"] = 25
            next_id += 1
        seqs = [(rid, 50, False) for rid in left]
        plan = ctl.plan(seqs)
        rows = len(seqs) + sum(plan.nodes.values())
        ctl.observe(len(seqs), rows, plan.depth, plan.depth * true.level_s(4), true.verify_s(4, rows),
                    true.rest_s(4), [(rid, False, n, 0, [0.95] * n) for rid, n in plan.nodes.items()])
        nodes.append(sum(plan.nodes.values()))
        for rid in list(left):
            left[rid] -= 1
            if not left[rid]:
                del left[rid]
                ctl.forget(rid)
    assert sum(nodes[:50]) > 0, "it never tried the draft"
    assert sum(nodes[100:]) == 0, [i for i, n in enumerate(nodes) if n][-5:]
    assert not ctl.acceptance.requests.keys() - set(left)


def test_steps_that_ran_no_draft_level_teach_no_draft_level_cost(models):
    """An adaptive engine that speculates for a few steps, then decodes plainly: the plain steps
    run no draft forward (propose is not called), so they must report 0 draft levels and leave
    the draft-level estimate alone. The drafter's `levels_run` is that of the last propose()."""
    llm = make(models, spec_mode="adaptive", spec__max_depth=4)
    ctl = llm.engine.spec.controller
    seen, planned = [], []
    observe = ctl.observe

    def spy(batch_size, rows, levels, draft_s, verify_s, rest_s, chains, timed=True, context=None):
        seen.append((levels, draft_s, timed, rows, batch_size))
        observe(batch_size, rows, levels, draft_s, verify_s, rest_s, chains, timed, context)

    def plan(seqs, context=None):   # three speculative steps, then plain decoding
        planned.append(len(planned) < 3)
        return Plan(3, {rid: min(3, cap) for rid, cap, _ in seqs if cap}) if planned[-1] else Plan()

    ctl.observe, ctl.plan = spy, plan
    llm.engine.add_request("a", [5, 6, 7], greedy(30))
    before = ctl.curve.level_s(1)
    while llm.engine.has_unfinished_requests():
        llm.engine.step()
    plain = [s for s in seen[4:] if s[3] == s[4]]   # one row a sequence: nothing was drafted
    assert plain and any(s[0] for s in seen[:4])
    assert all(levels == 0 for levels, *_ in plain), plain[:3]
    assert ctl.curve.level_s(1) >= 0.5 * before, (before, ctl.curve.level_s(1))
    llm.engine.pool.check_all_free()


# -- switching in process ------------------------------------------------------------------------


def test_adaptive_again_keeps_the_controller_and_what_it_learned(models):
    """POST {"mode": "adaptive"} to a server that is already adaptive (an operator's script that
    sets the mode it wants, whatever it was) must change nothing: not a new controller with a new
    start-up probe run between two steps, its curve, acceptance estimates and per-request history
    thrown away, and its depth histogram (a Prometheus counter) back to zero."""
    llm = make(models, spec_mode="adaptive", spec__max_depth=4)
    eng = llm.engine
    ctl = eng.spec.controller
    eng.add_request("a", [10, 11, 12, 13, 10, 11], greedy(20))
    for _ in range(4):
        eng.step()
    steps = sum(ctl.depth_histogram.values())
    assert steps > 0
    assert eng.set_speculation("adaptive") == {"mode": "adaptive"}
    assert eng.spec.controller is ctl, "a second 'adaptive' replaced the controller"
    assert sum(eng.spec.controller.depth_histogram.values()) == steps
    while eng.has_unfinished_requests():
        eng.step()
    eng.pool.check_all_free()


PROMPTS = [[5, 6, 7], [10, 11, 12, 13, 10, 11, 12, 13, 10, 11], [200 + i for i in range(L - 3)],
           [50 + i for i in range(L - 10)], [7] * 9, [30, 31, 30, 31, 30], [99]]
PARAMS = [greedy(20, logprobs=2), greedy(14, repetition_penalty=1.3, presence_penalty=0.5), greedy(3),
          greedy(10, logprobs=1, frequency_penalty=0.4), greedy(1), greedy(2), greedy(25, logit_bias={17: 3.0})]


@pytest.fixture(scope="module")
def refs(models):
    return make(models, "none").generate(PROMPTS, PARAMS)


@pytest.mark.parametrize("draft, tree", [("weak", "chain"), ("weak", "fixed"), ("weak", "dynamic"),
                                         ("ngram", "chain")])
def test_a_switch_before_every_step_keeps_output_exact_and_leaves_no_state(models, refs, draft, tree):
    """Greedy requests (penalties, biases, logprobs; one up to the context's last position; max_tokens
    1 and 2) and seeded sampled ones join at random steps while the setting changes at random before
    steps: adaptive (also when already adaptive), static 0, 1, the deepest allowed, any. A request
    id is reused after its request finished and right after an abort. Greedy output and logprobs
    equal target-only; every block comes back; neither the active nor the detached controller
    keeps history of a request that is gone. The depth edges are checked on the way: 0 and the
    deepest are taken, one more is refused naming 'depth', and the setting stays as it was."""
    llm = make(models, draft, spec_mode="static", spec_depth=3, spec_tree=tree, spec__branching=[3, 2, 1],
               spec__num_nodes=6, spec__topk=3, spec__max_depth=5)
    eng = llm.engine
    limit = eng.spec.max_depth()
    assert limit == (3 if tree == "fixed" else 5)
    assert eng.set_speculation("static", limit) == {"mode": "static", "depth": limit}
    with pytest.raises(InvalidRequestError) as e:
        eng.set_speculation("static", limit + 1)
    assert e.value.param == "depth" and eng.speculation() == {"mode": "static", "depth": limit}
    rng = random.Random(7)
    pending, finals, extra = list(range(len(PROMPTS))), {}, 0
    reused = False
    for step in range(400):
        if not (pending or eng.has_unfinished_requests()):
            break
        if pending and rng.random() < 0.5:
            i = pending.pop(0)
            eng.add_request(f"r{i}", PROMPTS[i], PARAMS[i])
        if rng.random() < 0.2:
            eng.add_request(f"s{extra}", [3, 4, 5], SamplingParams(max_tokens=rng.randint(1, 6), temperature=0.8,
                                                                   seed=extra))
            extra += 1
        if not reused and "r2" in finals and "r0" in eng.requests:
            eng.abort_request("r0")   # abort, and the id again at once, with another prompt
            eng.add_request("r0", PROMPTS[0], PARAMS[0])
            eng.add_request("r2", PROMPTS[2], PARAMS[2])   # a finished request's id
            reused = True
        r = rng.random()
        if r < 0.3:
            eng.set_speculation("adaptive")
        elif r < 0.6:
            eng.set_speculation("static", rng.choice([0, 1, limit, rng.randint(0, limit)]))
        for out in eng.step():
            if out.finished:
                finals[out.request_id] = out
    assert not eng.has_unfinished_requests() and reused
    for i, ref in enumerate(refs):
        out = finals[f"r{i}"]
        assert out.token_ids == ref.token_ids, (i, out.token_ids, ref.token_ids)
        assert out.finish_reason == ref.finish_reason == "length"
        if ref.logprobs is not None:
            assert len(out.logprobs) == len(ref.logprobs)
            assert all(abs(a[0] - b[0]) < 1e-9 for a, b in zip(out.logprobs, ref.logprobs)), i
    assert eng.spec.totals.num_drafts > 0
    eng.pool.check_all_free()
    eng.pool.check_consistency()
    for ctl in (eng.spec.controller, eng.spec._detached):
        if ctl is not None:
            assert not ctl.acceptance.requests and not ctl.acceptance.taught, list(ctl.acceptance.requests)


# -- over HTTP, with the engine-core process ---------------------------------------------------------


HTTP_PROMPTS = [[10, 11, 12, 13, 10, 11, 12, 13, 10, 11], [5, 6, 7], [30, 31, 30, 31, 30], [200 + i for i in range(20)],
                [7] * 9, [120, 121, 122, 120, 121]]
HTTP_TOKENS = 48


def stream_ids(base: str, prompt: list[int], **kw):
    from tests.server.conftest import SseStream

    return SseStream(base, {"prompt": prompt, "max_tokens": HTTP_TOKENS, "temperature": 0, "ignore_eos": True}, **kw)


@pytest.fixture(scope="module")
def http_refs(models):
    llm = make(models, "none", max_model_len=256, num_blocks=128)
    return [o.text for o in llm.generate(HTTP_PROMPTS, greedy(HTTP_TOKENS))]


@pytest.fixture(scope="module")
def core(models):
    """An API server on an engine-core process (EngineCoreClient) with the prompt-lookup drafter,
    adaptive, /admin/speculation on."""
    from specserve.core import EngineCoreClient
    from tests.server.conftest import ServerThread, engine_config

    cfg = engine_config(models["target"], "ngram", dtype="float64", spec_mode="adaptive", max_depth=4, threads=1,
                        admin_api=True, cpu__linear="torch", cpu__compile="off")
    srv = ServerThread(EngineCoreClient(cfg), cfg)
    yield srv
    srv.stop()


def _backend(srv):
    from specserve.server.app import STATE

    return srv.app[STATE].async_engine


@pytest.fixture
def live_core(core):
    from tests.server.conftest import wait_until

    assert wait_until(lambda: _backend(core).is_alive, timeout=60)
    return core


BAD_SETTINGS = [({"mode": "static", "depth": "3"}, "depth"), ({"mode": "static", "depth": 2.5}, "depth"),
                ({"mode": "static", "depth": True}, "depth"), ({"mode": None}, "mode"), ({"mode": 7}, "mode"),
                ({"mode": "static", "depth": 10 ** 30}, "depth")]


def test_a_setting_of_the_wrong_type_is_a_400_and_the_core_serves_on(live_core, http_refs):
    """Over the engine-core process, a depth that is a string, a float, a bool or too big for
    msgpack, or a mode that is not a string, is the same 400 naming the field as in one process;
    the core does not die of it (taking every stream in flight with it), and no reply is left
    waiting."""
    base, backend = live_core.base, _backend(live_core)
    restarts = backend.restarts
    stream = stream_ids(base, HTTP_PROMPTS[0])
    answers = [(body, http(base, "/admin/speculation", body)) for body, _ in BAD_SETTINGS]
    stream.join(120)
    wrong = [(body, status, reply) for (body, (status, reply)), (_, param) in zip(answers, BAD_SETTINGS)
             if status != 400 or reply["error"]["param"] != param]
    assert not wrong, wrong
    assert backend.restarts == restarts, "a bad setting killed the engine core"
    assert stream.outcome() == "length" and stream.text == http_refs[0]
    assert not backend._calls
    assert http(base, "/admin/speculation") == (200, {"mode": "adaptive"})


def test_switches_under_concurrent_streams_keep_them_exact_and_free_every_block(live_core, http_refs):
    """Six greedy streams and two that the client leaves after its first chunk, on the core
    process, while the setting changes after every chunk any of them receives: adaptive (again
    and again), static 0, 1, the deepest, 3. Every answer is 200, every finished stream is target-only
    text, the core does not restart, and once all is over no request runs and no block is held."""
    from tests.server.conftest import wait_until

    base, backend = live_core.base, _backend(live_core)
    restarts = backend.restarts
    settings = [{"mode": "static", "depth": 4}, {"mode": "adaptive"}, {"mode": "static", "depth": 0},
                {"mode": "adaptive"}, {"mode": "static", "depth": 1}, {"mode": "static", "depth": 3}]
    answers, lock = [], threading.Lock()

    def switch():
        with lock:
            body = settings[len(answers) % len(settings)]
            answers.append((body, http(base, "/admin/speculation", body)))

    streams = [stream_ids(base, p, on_chunk=switch) for p in HTTP_PROMPTS]
    streams += [stream_ids(base, p, close_after=1) for p in HTTP_PROMPTS[:2]]
    for s in streams:
        s.join(120)
    assert len(answers) >= len(settings) and all(status == 200 and reply == body for body, (status, reply) in answers), \
        [a for a in answers if a[1][0] != 200][:3]
    for i, s in enumerate(streams[:len(HTTP_PROMPTS)]):
        assert s.outcome() == "length", i
        assert s.text == http_refs[i], i
    assert backend.restarts == restarts
    assert wait_until(lambda: backend.snapshot().get("num_drafts", 0) > 0, timeout=5), "nothing was drafted"
    assert wait_until(lambda: (lambda s: s.get("running") == 0 and s.get("waiting") == 0
                               and s.get("blocks_held") == 0)(backend.snapshot()), timeout=20), backend.snapshot()
    assert http(base, "/admin/speculation") == (200, answers[-1][0])
