"""A seeded random mix of requests over real HTTP against the engine core in its own process
(core.EngineCoreClient) and against two cores behind one server (core.EngineGroup), with a
small KV pool (preemption) and the noisy draft speculating at static depth 3 (float64).

About 48 requests at once mix /v1/completions and /v1/chat/completions, streaming and not,
n in 1..3, two prompts in one completion request, stop strings taken from the output (so
that they occur), stop_token_ids with and without min_tokens, logprobs / top_logprobs, echo
with the prompt's logprobs, penalties, logit_bias, seeded sampling, include_usage (and
continuous_usage_stats), and about a sixth of the streams dropped by the client mid-stream.

Checks: every greedy choice's text, finish reason, token counts and logprobs equal the
offline LLM's (target only, a large pool: greedy speculative output is the target's); every
stream that was not dropped is well-formed SSE ending in [DONE], its chunks' indices, roles
and finish reasons consistent, its usage chunk equal to the tokens; sampled choices end for
a stated reason, hold no stop string, and count their tokens as their usage says; afterwards
every core holds no block and runs nothing, /health is 200 and a new request is served; with
two cores, both served requests.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
from dataclasses import dataclass, field

import aiohttp
import pytest
import torch

from specserve.core import EngineCoreClient, EngineGroup
from specserve.llm import LLM
from specserve.sampling import SamplingParams
from specserve.server import logprobs as logprobs_json
from tests.checkpoints import CORPUS
from tests.server.conftest import ServerThread, engine_config, wait_until

SEED = int(os.environ.get("SPECSERVE_MIXED_SEED", "20240611"))   # another seed: another mix
NUM_REQUESTS = 48
NUM_BLOCKS = 24            # x 8 tokens: a few requests fill it, so running ones get preempted
MAX_LEN = 256
MAX_TOKENS = 60
SHARED = "Once upon a time there was a little cat who liked"   # a prefix some prompts share
SAMPLED_STOPS = [" the", "e", ".", "\n", "o"]
TOL = 1e-6                 # float64 on both sides: logprobs agree far closer than this


# One torch thread per engine: on a small machine shared with other work, two threads each
# spinning on two cores make every tiny op of these models take milliseconds.
THREADS = 1


@pytest.fixture(scope="module")
def cfg(server_target, server_draft):
    return engine_config(server_target, server_draft, spec_mode="static", spec_depth=3, dtype="float64",
                         num_blocks=NUM_BLOCKS, max_model_len=MAX_LEN, threads=THREADS)


@pytest.fixture(scope="module")
def reference(server_target):
    """The target alone in a pool that never preempts: what every greedy choice must equal."""
    threads = torch.get_num_threads()
    yield LLM(engine_config(server_target, "none", dtype="float64", num_blocks=512, max_model_len=MAX_LEN,
                            threads=THREADS), progress=False)
    torch.set_num_threads(threads)   # LLMEngine set it for this whole process


# -- the workload -----------------------------------------------------------------------------


@dataclass
class Case:
    k: int
    chat: bool
    body: dict
    prompts: list[list[int]]          # the token ids of each prompt, as the server makes them
    echo: list[str] | None            # completions with echo: each prompt's text
    greedy: bool
    disconnect: int | None            # a stream the client drops after this many events
    params: list[SamplingParams] = field(default_factory=list)   # greedy: the reference's, per prompt
    expected: list = field(default_factory=list)                # greedy: RequestOutput per prompt

    @property
    def n(self) -> int:
        return self.body.get("n", 1)

    @property
    def num_choices(self) -> int:
        return len(self.prompts) * self.n

    def __repr__(self) -> str:
        return f"Case({self.k}, {'chat' if self.chat else 'completions'}, {json.dumps(self.body)})"


def _piece(rng: random.Random) -> str:
    s = rng.choice(CORPUS[:9])
    start = rng.randrange(0, max(1, len(s) - 12))
    text = s[start:start + rng.randint(8, 60)]
    return text if text.strip() else "Hello there"


def _prompt_text(rng: random.Random) -> str:
    return SHARED + " " + _piece(rng) if rng.random() < 0.25 else _piece(rng)


def make_cases(rng: random.Random, tok) -> list[Case]:
    vocab = len(tok)
    cases = []
    for k in range(NUM_REQUESTS):
        chat = rng.random() < 0.4
        stream = rng.random() < 0.6
        greedy = rng.random() < 0.7
        disconnect = rng.randint(1, 20) if stream and rng.random() < 0.2 else None   # about a sixth of all streams
        n = rng.choice([1, 1, 1, 2, 3])
        body: dict = {"stream": stream, "n": n, "max_tokens": rng.randint(1, MAX_TOKENS)}
        echo = None
        if chat:
            messages = [{"role": "user", "content": _prompt_text(rng)}]
            if rng.random() < 0.3:
                messages.insert(0, {"role": "system", "content": _piece(rng)})
            body["messages"] = messages
            text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
            prompts = [tok.encode(text, add_special_tokens=False)]
        else:
            texts = [_prompt_text(rng) for _ in range(2 if rng.random() < 0.25 else 1)]
            prompts = [tok.encode(t) for t in texts]
            if rng.random() < 0.2:   # token ids instead of text
                body["prompt"] = prompts if len(prompts) == 2 else prompts[0]
                texts = [tok.decode(p) for p in prompts]
            else:
                body["prompt"] = texts if len(texts) == 2 else texts[0]
            if rng.random() < 0.2:
                echo = texts
                body["echo"] = True
                if rng.random() < 0.3:
                    body["max_tokens"] = 0   # score the prompt alone
        if greedy:
            body["temperature"] = 0
        else:
            body["temperature"] = round(rng.uniform(0.6, 1.3), 3)
            if rng.random() < 0.6:
                body["seed"] = rng.randrange(2**32)
            if rng.random() < 0.3:
                body["top_p"] = rng.choice([0.8, 0.95])
            if rng.random() < 0.3:
                body["top_k"] = rng.choice([5, 40])
        if rng.random() < 0.3:
            body["presence_penalty"] = round(rng.uniform(-1.0, 1.5), 3)
        if rng.random() < 0.2:
            body["frequency_penalty"] = round(rng.uniform(-1.0, 1.0), 3)
        if rng.random() < 0.2:
            body["repetition_penalty"] = round(rng.uniform(0.8, 1.6), 3)
        if rng.random() < 0.2:
            body["logit_bias"] = {str(rng.randrange(3, vocab)): round(rng.uniform(-5, 5), 3)
                                  for _ in range(rng.randint(1, 3))}
        if rng.random() < 0.15:
            body["ignore_eos"] = True
        if rng.random() < 0.4:
            if chat:
                body["logprobs"] = True
                if rng.random() < 0.7:
                    body["top_logprobs"] = rng.choice([0, 1, 3, 5])
            else:
                body["logprobs"] = rng.choice([0, 1, 2, 5])
        if not greedy and rng.random() < 0.2:
            body["stop"] = rng.sample(SAMPLED_STOPS, rng.randint(1, 2))
        if stream and rng.random() < 0.5:
            body["stream_options"] = {"include_usage": True, "continuous_usage_stats": rng.random() < 0.4}
        if disconnect:   # long enough to be running when the client goes
            body["max_tokens"], body["ignore_eos"] = MAX_TOKENS, True
            body.pop("echo", None)
            echo = None
        cases.append(Case(k, chat, body, prompts, echo, greedy, disconnect))
    return cases


def _params(case: Case, stop=(), stop_token_ids=(), min_tokens: int = 0) -> SamplingParams:
    """The engine's parameters of a greedy case's choices (server/app.py _parse's mapping)."""
    b = case.body
    echo = b.get("echo", False)
    if case.chat:
        logprobs, prompt_logprobs = (b.get("top_logprobs") or 0) if b.get("logprobs") else None, None
    else:
        logprobs = b.get("logprobs")
        prompt_logprobs = logprobs if echo and logprobs is not None else (0 if echo and b["max_tokens"] == 0 else None)
    return SamplingParams(
        max_tokens=b["max_tokens"], temperature=0.0, stop=list(stop), stop_token_ids=list(stop_token_ids),
        ignore_eos=b.get("ignore_eos", False), min_tokens=min(min_tokens, b["max_tokens"]), logprobs=logprobs,
        prompt_logprobs=prompt_logprobs, presence_penalty=b.get("presence_penalty", 0.0),
        frequency_penalty=b.get("frequency_penalty", 0.0), repetition_penalty=b.get("repetition_penalty", 1.0),
        logit_bias={int(t): v for t, v in b["logit_bias"].items()} if "logit_bias" in b else None)


def add_expectations(cases: list[Case], reference: LLM, rng: random.Random) -> None:
    """Greedy cases: first their output without stops, then stop strings and stop token ids
    taken from that output (so that they occur), then the reference outputs of the final bodies."""
    greedy = [c for c in cases if c.greedy]
    first = reference.generate([p for c in greedy for p in c.prompts],
                               [_params(c) for c in greedy for _ in c.prompts])
    at = 0
    for c in greedy:
        out, at = first[at], at + len(c.prompts)
        stop, stop_ids, min_tokens = [], [], 0
        if c.disconnect is None and c.body["max_tokens"] > 0:
            if out.text and rng.random() < 0.35:
                size = rng.randint(1, 4)
                start = rng.randrange(0, max(1, len(out.text) - size + 1))
                stop = [out.text[start:start + size]]
                c.body["stop"] = stop if rng.random() < 0.5 else stop[0]
            if rng.random() < 0.25:
                stop_ids = [rng.choice(out.token_ids), rng.randrange(3, len(reference.tokenizer))]
                c.body["stop_token_ids"] = stop_ids
                if rng.random() < 0.4:
                    min_tokens = rng.randint(1, c.body["max_tokens"])
                    c.body["min_tokens"] = min_tokens
        c.params = [_params(c, stop, stop_ids, min_tokens)] * len(c.prompts)
    final = reference.generate([p for c in greedy for p in c.prompts], [p for c in greedy for p in c.params])
    at = 0
    for c in greedy:
        c.expected, at = final[at:at + len(c.prompts)], at + len(c.prompts)


# -- the client -------------------------------------------------------------------------------


async def send(session: aiohttp.ClientSession, base: str, case: Case):
    """-> ("events", the stream's text) | ("body", its JSON) | ("dropped", the events read before
    the client went) | ("status", (status, text)) for anything but a 200."""
    url = base + ("/chat/completions" if case.chat else "/completions")
    async with session.post(url, json=case.body) as r:
        if r.status != 200:
            return "status", (r.status, await r.text())
        if case.disconnect is not None:
            events = []
            while len(events) < case.disconnect:
                line = await r.content.readline()
                if not line:
                    break
                if line.strip():
                    events.append(line.decode())
            r.close()   # drop the connection mid-stream
            return "dropped", events
        if not case.body.get("stream"):
            return "body", await r.json()
        raw = (await r.read()).decode()
        assert r.headers["Content-Type"].startswith("text/event-stream"), r.headers
        return "events", raw


def cores(backend) -> list[EngineCoreClient]:
    return backend.cores if isinstance(backend, EngineGroup) else [backend]


async def run_all(base: str, cases: list[Case]) -> list:
    """Every case at once; -> each one's result (or exception)."""
    timeout = aiohttp.ClientTimeout(total=180)
    async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0)) as session:
        return await asyncio.gather(*(send(session, base, c) for c in cases), return_exceptions=True)


# -- checks -----------------------------------------------------------------------------------


def parse_sse(raw: str) -> list[dict]:
    """The events of a complete stream: `data: <json>\\n\\n` each, the last `data: [DONE]`."""
    assert raw.endswith("\n\n"), raw[-200:]
    events = raw[:-2].split("\n\n")
    assert events[-1] == "data: [DONE]", events[-3:]
    chunks = []
    for e in events[:-1]:
        assert e.startswith("data: ") and "\n" not in e, e
        chunks.append(json.loads(e[6:]))
    return chunks


@dataclass
class Got:
    """One choice as the client sees it."""
    text: str = ""
    finish_reason: str | None = None
    logprobs: dict | None = None
    usage: list = field(default_factory=list)   # continuous_usage_stats: each chunk's


def _merge_logprobs(into: dict | None, lp: dict | None, chat: bool) -> dict | None:
    if lp is None:
        return into
    if into is None:
        return {k: list(v) for k, v in lp.items()}
    for key in (("content",) if chat else ("tokens", "token_logprobs", "top_logprobs", "text_offset")):
        into[key] += lp[key]
    return into


def choices_of_stream(case: Case, chunks: list[dict]) -> dict[int, Got]:
    got: dict[int, Got] = {}
    options = case.body.get("stream_options") or {}
    usage_chunks = [c for c in chunks if not c["choices"]]
    expected_object = "chat.completion.chunk" if case.chat else "text_completion"
    assert len({c["id"] for c in chunks}) == 1
    for c in chunks:
        assert c["object"] == expected_object and isinstance(c["created"], int), c
    if options.get("include_usage"):
        assert len(usage_chunks) == 1 and chunks[-1] is usage_chunks[0], [c["choices"] for c in chunks[-3:]]
    else:
        assert not usage_chunks and all("usage" not in c or c["usage"] is None for c in chunks)
    for c in chunks:
        if not c["choices"]:
            continue
        assert len(c["choices"]) == 1, c
        ch = c["choices"][0]
        i = ch["index"]
        assert 0 <= i < case.num_choices, c
        first = i not in got
        g = got.setdefault(i, Got())
        assert g.finish_reason is None, f"choice {i} has a chunk after its finish_reason: {c}"
        if case.chat:
            delta = ch["delta"]
            assert (delta.get("role") == "assistant") == first, f"role on choice {i}'s first chunk only: {c}"
            g.text += delta.get("content") or ""
        else:
            g.text += ch["text"]
        g.finish_reason = ch["finish_reason"]
        g.logprobs = _merge_logprobs(g.logprobs, ch["logprobs"], case.chat)
        if options.get("include_usage") and options.get("continuous_usage_stats"):
            g.usage.append(c["usage"])
    assert sorted(got) == list(range(case.num_choices)), sorted(got)
    for i, g in got.items():
        assert g.finish_reason in ("stop", "length"), (i, g.finish_reason)
    return got


def choices_of_body(case: Case, body: dict) -> dict[int, Got]:
    assert body["object"] == ("chat.completion" if case.chat else "text_completion")
    got = {}
    for ch in body["choices"]:
        text = ch["message"]["content"] if case.chat else ch["text"]
        if case.chat:
            assert ch["message"]["role"] == "assistant"
        got[ch["index"]] = Got(text, ch["finish_reason"], ch["logprobs"])
    assert sorted(got) == list(range(case.num_choices)) and len(body["choices"]) == case.num_choices
    return got


def _approx_lp(got, want, where):
    if want is None:
        assert got is None, where
    else:
        assert got == pytest.approx(want, abs=TOL), where


def check_logprobs(case: Case, i: int, got: dict | None, token_text) -> int | None:
    """Greedy: equal to the reference's. Returns the number of output tokens the logprobs
    cover (None where not asked)."""
    p = i // case.n
    asked = case.body.get("logprobs") is not None and case.body["logprobs"] is not False   # 0 asks
    if not asked:   # null, as OpenAI answers (echo with max_tokens 0 included)
        assert got is None, f"{case}: choice {i} has logprobs it did not ask for: {str(got)[:200]}"
        return None
    assert got is not None, f"{case}: choice {i} has no logprobs"
    num_prompt = len(case.prompts[p]) if case.echo is not None else 0
    if case.chat:
        num_out = len(got["content"])
    else:
        num_out = len(got["tokens"]) - num_prompt
        assert len(got["token_logprobs"]) == len(got["tokens"]) == len(got["top_logprobs"]) \
               == len(got["text_offset"])
    if not case.greedy:
        return num_out
    ref = case.expected[p]
    where = f"{case} choice {i}"
    if case.chat:
        want = logprobs_json.chat(ref.logprobs, ref.token_ids, token_text)["content"]
        assert [(t["token"], t["bytes"]) for t in got["content"]] == [(t["token"], t["bytes"]) for t in want], where
        for j, (g, w) in enumerate(zip(got["content"], want)):
            _approx_lp(g["logprob"], w["logprob"], f"{where} token {j}")
            assert [t["token"] for t in g["top_logprobs"]] == [t["token"] for t in w["top_logprobs"]], \
                f"{where} token {j}: {g['top_logprobs']} != {w['top_logprobs']}"
            _approx_lp([t["logprob"] for t in g["top_logprobs"]], [t["logprob"] for t in w["top_logprobs"]],
                       f"{where} token {j}")
    else:
        entries, tokens = list(ref.logprobs), list(ref.token_ids)
        if case.echo is not None:
            entries, tokens = ref.prompt_logprobs[:len(case.prompts[p])] + entries, case.prompts[p] + tokens
        want, _ = logprobs_json.completion(entries, tokens, token_text, 0)
        assert got["tokens"] == want["tokens"], where
        assert got["text_offset"] == want["text_offset"], where
        for j, (g, w) in enumerate(zip(got["token_logprobs"], want["token_logprobs"])):
            _approx_lp(g, w, f"{where} token {j}")
        for j, (g, w) in enumerate(zip(got["top_logprobs"], want["top_logprobs"])):
            if w is None:
                assert g is None, f"{where} token {j}"
            else:
                assert set(g) == set(w), f"{where} token {j}: {g} != {w}"
                _approx_lp([g[t] for t in w], list(w.values()), f"{where} token {j}")
    return num_out


def check_case(case: Case, kind: str, result, token_text) -> None:
    assert kind in ("events", "body"), f"{case}: {kind} {str(result)[:500]}"
    if kind == "events":
        chunks = parse_sse(result)
        got = choices_of_stream(case, chunks)
        usage = chunks[-1]["usage"] if (case.body.get("stream_options") or {}).get("include_usage") else None
    else:
        got = choices_of_body(case, result)
        usage = result["usage"]
    counts = []
    for i, g in sorted(got.items()):
        p = i // case.n
        where = f"{case} choice {i}"
        echo = case.echo[p] if case.echo is not None else ""
        assert g.text.startswith(echo), where
        out_text = g.text[len(echo):]
        num = check_logprobs(case, i, g.logprobs, token_text)
        if case.greedy:
            ref = case.expected[p]
            assert (out_text, g.finish_reason) == (ref.text, ref.finish_reason), where
            num = len(ref.token_ids)
        else:
            for s in case.body.get("stop", []):
                assert s not in out_text, f"{where}: stop string {s!r} in {out_text!r}"
            if num is not None:
                max_tokens = case.body["max_tokens"]
                # "stop" may come with the last token allowed (EOS there); "length" only with it
                assert num <= max_tokens and (g.finish_reason == "stop" or num == max_tokens), \
                    f"{where}: {num} tokens of {max_tokens}, finish_reason {g.finish_reason}"
        if g.usage:   # continuous usage: this choice's so far, chunk by chunk
            completions = [u["completion_tokens"] for u in g.usage]
            assert completions == sorted(completions), where
            assert all(u["prompt_tokens"] == len(case.prompts[p]) and
                       u["total_tokens"] == u["prompt_tokens"] + u["completion_tokens"] for u in g.usage), where
            if num is not None:
                assert completions[-1] == num, f"{where}: {g.usage[-1]} vs {num} tokens"
            num = completions[-1]
        counts.append(num)
    if usage is not None:
        prompt_tokens = sum(len(p) for p in case.prompts)
        assert usage["prompt_tokens"] == prompt_tokens, f"{case}: {usage}"
        assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"], f"{case}: {usage}"
        if None not in counts:
            assert usage["completion_tokens"] == sum(counts), f"{case}: {usage} vs {counts}"
        else:
            max_tokens = case.body["max_tokens"]   # 0: an echo alone
            assert min(1, max_tokens) <= usage["completion_tokens"] <= case.num_choices * max_tokens, f"{case}: {usage}"


def check_dropped(case: Case, events: list[str]) -> None:
    assert events, f"{case}: no event before the drop"
    for e in events:
        assert e.startswith("data: ") and e.endswith("\n"), e
        if e.strip() != "data: [DONE]":
            json.loads(e[6:])


# -- the tests --------------------------------------------------------------------------------


def idle(core: EngineCoreClient) -> bool:
    s = core.snapshot()
    return s["running"] == 0 and s["waiting"] == 0 and s["blocks_held"] == 0


async def _get(url: str) -> tuple[int, str]:
    async with aiohttp.ClientSession() as s:
        async with s.get(url) as r:
            return r.status, await r.text()


@pytest.mark.parametrize("engines", [1, 2])
def test_a_random_mix_over_http(cfg, reference, engines):
    from specserve.server.app import STATE

    rng = random.Random(SEED + engines)
    tok = reference.tokenizer
    cases = make_cases(rng, tok)
    add_expectations(cases, reference, rng)
    token_text = logprobs_json.TokenText(tok)
    srv = ServerThread(EngineCoreClient(cfg) if engines == 1 else EngineGroup(cfg, engines), cfg)
    try:
        backend = srv.app[STATE].async_engine
        results = asyncio.run(run_all(srv.url, cases))
        failures = []   # every case is checked, and every failure reported at once
        for case, result in zip(cases, results):
            try:
                if isinstance(result, BaseException):
                    raise AssertionError(f"{case}: {result!r}") from result
                kind, value = result
                if case.disconnect is not None:
                    assert kind == "dropped", f"{case}: {kind} {str(value)[:300]}"
                    check_dropped(case, value)
                else:
                    check_case(case, kind, value, token_text)
            except AssertionError as e:
                message = str(e).split("\n")[0][:600]
                failures.append(message if repr(case) in message else f"{case!r}: {message}")
        for i, core in enumerate(cores(backend)):
            if not wait_until(lambda: idle(core), timeout=20):
                failures.append(f"core {i} is not idle after every request ended: {core.snapshot()}")
        status, _ = asyncio.run(_get(srv.base + "/health"))
        if status != 200:
            failures.append(f"/health answers {status}")
        # The server goes on serving: one more greedy request equals the reference.
        prompt = "The quick brown fox"
        want = reference.generate(prompt, SamplingParams(max_tokens=12, temperature=0.0))[0]
        case = Case(-1, False, {"prompt": prompt, "max_tokens": 12, "temperature": 0}, [tok.encode(prompt)],
                    None, True, None, expected=[want])

        async def last():
            async with aiohttp.ClientSession() as s:
                return await send(s, srv.url, case)

        try:
            check_case(case, *asyncio.run(last()), token_text)
        except AssertionError as e:
            failures.append(f"the request after the mix: {e}")
        if engines > 1:
            routed = [s["routed"] for s in backend.snapshot()["engines"]]
            if not (all(r > 0 for r in routed) and sum(routed) == sum(c.num_choices for c in cases) + 1):
                failures.append(f"requests routed per core: {routed}")
        snap = backend.snapshot()
        if not (snap["num_accepted_tokens"] > 0 and snap["failed"] == 0 and snap["restarts"] == 0):
            failures.append(f"snapshot: {snap}")
        preempted = [core.snapshot()["preemptions"] for core in cores(backend)]
        if min(preempted) == 0:   # the pools ran out: running requests were preempted
            failures.append(f"preemptions per core: {preempted}")
        metrics = asyncio.run(_get(srv.base + "/metrics"))[1]
        if f"specserve_num_preemptions_total {float(sum(preempted))}" not in metrics:
            failures.append(f"/metrics does not count the {sum(preempted)} preemptions")
        assert not failures, f"{len(failures)} failures:\n" + "\n".join(failures)
    finally:
        srv.stop()
