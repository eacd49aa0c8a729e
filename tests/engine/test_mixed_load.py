"""A seeded randomized stress test of the engine: a mix of requests arriving over time on a
deliberately small KV pool (so that requests are preempted), with a model drafter speculating
(static chains, the adaptive controller, and a fixed tree), all driven through LLMEngine.step().

Checked for every mix:
  1. every greedy request's tokens (and text, finish reason, logprobs, prompt logprobs) equal
     target-only greedy generation (draft "none", a roomy pool) of the same prompt and params:
     stop strings, stop_token_ids, min_tokens (with EOS pushed up by a logit bias), presence /
     frequency / repetition penalties, logit_bias, duplicates of one request (n-like), logprobs
     and prompt logprobs (echo included); a request aborted mid-way has a prefix of it;
  2. once everything has finished or been aborted, every block is free and nothing is unfinished;
  3. seeded sampled requests give the same tokens when the whole run is repeated on a fresh
     engine. sampling.py and docs/INTERNALS.md promise that a seeded request draws only from its
     own generator (n + 1 uniforms per verified tree of n nodes, spec.py), so with the same
     trees a repeat is identical. With a static depth the trees depend only on the (repeated)
     schedule; the adaptive controller picks depths from measured step times, so its mix
     checks points 1 and 2 only.

Everything runs in float64 on the CPU, as the other exactness tests do (no near-tie flips).
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import msgspec
import pytest

from specserve import LLM, SamplingParams

TOL = 1e-8          # logprobs: float64 on both sides (verify rows against decode rows)
BLOCK_SIZE = 4
EOS = 1             # tests/checkpoints.py: <|bos|> 0, <|eos|> 1, <|pad|> 2
LOW_ID = 3          # prompts draw ids from [LOW_ID, vocab)

MIXES = {
    # name: (mix seed, number of requests, engine settings)
    "chain-static": (1234, 40, dict(spec_mode="static", spec_depth=3, spec_tree="chain",
                                    num_blocks=14, enable_prefix_caching=True)),
    "chain-adaptive": (777, 36, dict(spec_mode="adaptive", spec__max_depth=4, spec_tree="chain",
                                     num_blocks=14, enable_prefix_caching=False)),
    "fixed-static": (4242, 36, dict(spec_mode="static", spec_depth=3, spec_tree="fixed",
                                    spec__branching=[2, 2, 1], num_blocks=16, enable_prefix_caching=True)),
}


@dataclass
class Planned:
    rid: str
    prompt: list[int]
    params: SamplingParams
    arrival: int                 # the step before which it is added
    abort_after: int | None      # aborted this many steps after its arrival (None: never)
    kind: str


def common_args(models) -> dict:
    return dict(target=str(models["target"]), dtype="float64", device="cpu", progress=False,
                block_size=BLOCK_SIZE, max_num_batched_tokens=32, max_num_seqs=8)


@pytest.fixture(scope="module")
def target_only(models):
    """The reference: the target alone, a pool with room for everything, no prefix cache."""
    return LLM(draft="none", num_blocks=256, enable_prefix_caching=False, **common_args(models))


def spec_llm(models, settings: dict) -> LLM:
    return LLM(draft=str(models["weak"]), **common_args(models), **settings)


# -- the mix ----------------------------------------------------------------------------------


def _ascii_stop(rng: random.Random, text: str) -> str | None:
    """A 1- or 2-character ASCII stop string taken from the later part of text."""
    at = [i for i, c in enumerate(text) if c.isascii() and c.isalnum() and i >= len(text) // 4]
    if not at:
        return None
    i = rng.choice(at)
    n = 2 if i + 1 < len(text) and text[i + 1].isascii() and text[i + 1].isalnum() and rng.random() < 0.5 else 1
    return text[i:i + n]


def build_mix(rng: random.Random, num: int, vocab: int, probe_llm: LLM) -> list[Planned]:
    """num requests: prompts (some sharing prefixes), params of every kind, arrivals, aborts."""
    bases = [[rng.randrange(LOW_ID, vocab) for _ in range(rng.randint(5, 10))] for _ in range(3)]

    def prompt() -> list[int]:
        if rng.random() < 0.35:
            return rng.choice(bases) + [rng.randrange(LOW_ID, vocab) for _ in range(rng.randint(1, 5))]
        return [rng.randrange(LOW_ID, vocab) for _ in range(rng.randint(2, 18))]

    kinds = ["plain", "stop_str", "stop_ids", "min_tokens", "min_eos", "penalties", "bias", "echo",
             "sampled", "sampled", "sampled_pen"]
    # Every kind at least once, in a random order, then kinds at random.
    chosen = sorted(set(kinds))
    rng.shuffle(chosen)
    covering = len(chosen)   # these are never aborted: every kind runs to its end at least once
    chosen += [rng.choice(kinds) for _ in range(num - len(chosen))]
    aborted = set(rng.sample(range(covering, num), 3))
    drafts = [(prompt(), kind, rng.randint(4, 24)) for kind in chosen]   # (prompt, kind, max_tokens)
    # Stop strings and stop ids are picked from the target's own output, so that they occur.
    probe_at = [i for i, (_, kind, _) in enumerate(drafts) if kind in ("stop_str", "stop_ids", "min_tokens")]
    probes = probe_llm.generate([drafts[i][0] for i in probe_at],
                                [SamplingParams(max_tokens=drafts[i][2], temperature=0.0, ignore_eos=True)
                                 for i in probe_at])
    probe = dict(zip(probe_at, probes))

    planned, arrival = [], 0
    for i, (p, kind, max_tokens) in enumerate(drafts):
        kw: dict = dict(max_tokens=max_tokens, temperature=0.0, ignore_eos=rng.random() < 0.7)
        if kind == "stop_str":
            stop = _ascii_stop(rng, probe[i].text)
            kw.update(stop=[stop] if stop else ["\x00never"], ignore_eos=True)
        elif kind in ("stop_ids", "min_tokens"):
            out = probe[i].token_ids
            j = rng.randrange(0, len(out))
            kw.update(stop_token_ids=[out[j]] + ([rng.randrange(LOW_ID, vocab)] if rng.random() < 0.5 else []))
            if kind == "min_tokens":
                kw["min_tokens"] = min(max_tokens, j + rng.randint(1, 4))
        elif kind == "min_eos":   # EOS pushed up, held back by min_tokens
            kw.update(ignore_eos=False, logit_bias={EOS: rng.uniform(3.0, 8.0)},
                      min_tokens=rng.randint(1, max_tokens - 1))
        elif kind == "penalties":
            kw.update(presence_penalty=rng.choice([0.0, rng.uniform(-1.0, 2.0)]),
                      frequency_penalty=rng.choice([0.0, rng.uniform(-1.5, 1.5)]),
                      repetition_penalty=rng.choice([1.0, rng.uniform(0.8, 1.6)]))
        elif kind == "bias":
            kw.update(logit_bias={rng.randrange(LOW_ID, vocab): rng.uniform(-5.0, 6.0) for _ in range(3)})
        elif kind == "echo":
            kw.update(prompt_logprobs=rng.randint(0, 3), max_tokens=rng.choice([0, max_tokens]))
        elif kind.startswith("sampled"):
            kw.update(temperature=rng.uniform(0.6, 1.2), seed=rng.randrange(2**32), top_k=rng.choice([0, 0, 20]),
                      top_p=rng.choice([1.0, 1.0, 0.9]))
            if kind == "sampled_pen":
                kw.update(frequency_penalty=rng.uniform(-1.0, 1.0), logit_bias={rng.randrange(LOW_ID, vocab): 3.0})
        if rng.random() < 0.3:
            kw["logprobs"] = rng.randint(0, 4)
        if rng.random() < 0.15 and kind != "echo":
            kw["prompt_logprobs"] = rng.randint(0, 2)
        params = SamplingParams(**kw)
        arrival += rng.choice([0, 0, 1, 1, 2, 3])
        abort_after = rng.randint(1, 6) if i in aborted else None
        planned.append(Planned(f"q{i}", p, params, arrival, abort_after, kind))
        if rng.random() < 0.2:   # n-like: the same prompt and params again, at once
            for k in range(rng.randint(1, 2)):
                planned.append(Planned(f"q{i}-{k}", list(p), params, arrival, None, kind))
    return planned


def run_mix(llm: LLM, planned: list[Planned]) -> dict:
    """Add each request at its step, abort the chosen ones, step until done. Returns
    request id -> final output."""
    eng = llm.engine
    finals: dict = {}

    def collect(outputs) -> None:
        for out in outputs:
            if out.finished:
                assert out.request_id not in finals, f"{out.request_id} finished twice"
                finals[out.request_id] = out

    pending = sorted(planned, key=lambda r: r.arrival)
    aborts: dict[int, list[str]] = {}
    step = 0
    while pending or eng.has_unfinished_requests() or aborts:
        while pending and pending[0].arrival <= step:
            r = pending.pop(0)
            eng.add_request(r.rid, r.prompt, r.params)
            if r.abort_after is not None:
                aborts.setdefault(step + r.abort_after, []).append(r.rid)
        for rid in aborts.pop(step, []):
            eng.abort_request(rid)
        if not eng.has_unfinished_requests() and pending:   # idle until the next arrival
            eng.idle()
            step = pending[0].arrival
            continue
        collect(eng.step())
        step += 1
        if not pending and not eng.has_unfinished_requests():
            aborts.clear()   # aborts due after everything ended are moot
        assert step < 5000, "the mix does not finish"
    collect(eng.step())   # a step with nothing to run reports the aborts since the last one
    return finals


# -- checks -------------------------------------------------------------------------------------
# Each check appends what is wrong to `problems` rather than stopping at the first, so that one
# failing run reports every request it got wrong.


def _compare_logprobs(got, want, what: str, problems: list[str]) -> None:
    if got is None or len(got) != len(want):
        problems.append(f"{what}: {None if got is None else len(got)} entries, the reference has {len(want)}")
        return
    for j, (g, w) in enumerate(zip(got, want)):
        if w is None or g is None:
            if g is not w:
                problems.append(f"{what}[{j}]: {g!r}, the reference has {w!r}")
            continue
        (glp, gtop), (wlp, wtop) = g, w
        if abs(glp - wlp) >= TOL:
            problems.append(f"{what}[{j}]: logprob {glp}, the reference has {wlp}")
        elif ([t for t, _ in gtop] != [t for t, _ in wtop]
              or any(abs(a - b) >= TOL for (_, a), (_, b) in zip(gtop, wtop))):
            problems.append(f"{what}[{j}]: top logprobs {gtop}, the reference has {wtop}")


def describe(r: Planned) -> str:
    default = SamplingParams()
    fields = {k: v for k, v in msgspec.structs.asdict(r.params).items() if v != getattr(default, k)}
    return f"{r.rid} ({r.kind}, arrives at step {r.arrival}, prompt {r.prompt}, {fields})"


def check_greedy(planned: list[Planned], finals: dict, reference: dict, problems: list[str]) -> None:
    for r in planned:
        out, ref = finals.get(r.rid), reference.get(r.rid)
        if out is None or ref is None:   # sampled, or no final output (reported already)
            continue
        where = f"{describe(r)}, preempted {out.stats.num_preemptions}x"
        if out.finish_reason == "abort":
            if r.abort_after is None:
                problems.append(f"{where}: aborted, but nobody aborted it")
            elif out.token_ids != ref.token_ids[:len(out.token_ids)]:
                problems.append(f"{where}: aborted with {out.token_ids}, not a prefix of the reference {ref.token_ids}")
            continue
        if out.error is not None:
            problems.append(f"{where}: failed: {out.error}")
            continue
        if out.token_ids != ref.token_ids or out.finish_reason != ref.finish_reason:
            problems.append(f"{where}: tokens {out.token_ids} ({out.finish_reason}), "
                            f"the target alone: {ref.token_ids} ({ref.finish_reason})")
            continue
        if out.text != ref.text:
            problems.append(f"{where}: text {out.text!r}, the target alone: {ref.text!r}")
        if r.params.logprobs is not None:
            _compare_logprobs(out.logprobs, ref.logprobs, f"{where}: logprobs", problems)
        if r.params.prompt_logprobs is not None:
            _compare_logprobs(out.prompt_logprobs, ref.prompt_logprobs, f"{where}: prompt_logprobs", problems)


def check_sampled(planned: list[Planned], finals: dict, problems: list[str]) -> None:
    for r in planned:
        out = finals.get(r.rid)
        if r.params.is_greedy or out is None or out.finish_reason == "abort":
            continue
        where = f"{describe(r)}, preempted {out.stats.num_preemptions}x"
        n = len(out.token_ids)
        if out.error is not None:
            problems.append(f"{where}: failed: {out.error}")
        elif r.params.ignore_eos and (n != r.params.max_tokens or out.finish_reason != "length"):
            problems.append(f"{where}: {n} tokens ({out.finish_reason}) with ignore_eos")
        elif not 1 <= n <= r.params.max_tokens:
            problems.append(f"{where}: {n} tokens")
        if r.params.logprobs is not None and len(out.logprobs or []) != n:
            problems.append(f"{where}: {len(out.logprobs or [])} logprobs for {n} tokens")
        if r.params.prompt_logprobs is not None and len(out.prompt_logprobs or []) != len(r.prompt):
            problems.append(f"{where}: {len(out.prompt_logprobs or [])} prompt logprobs, "
                            f"for a prompt of {len(r.prompt)}")


@pytest.mark.parametrize("mix", list(MIXES))
def test_mixed_load(models, target_only, mix):
    seed, num, settings = MIXES[mix]
    rng = random.Random(seed)
    vocab = len(target_only.tokenizer)
    planned = build_mix(rng, num, vocab, target_only)

    # The reference: every greedy request in the target-only engine, none aborted.
    greedy = [r for r in planned if r.params.is_greedy]
    reference = dict(zip([r.rid for r in greedy],
                         target_only.generate([r.prompt for r in greedy], [r.params for r in greedy])))

    llm = spec_llm(models, settings)
    eng = llm.engine
    finals = run_mix(llm, planned)

    problems: list[str] = []
    # 2. nothing left behind
    if eng.has_unfinished_requests():
        problems.append("the engine has unfinished requests after the mix")
    for check in (eng.pool.check_all_free, eng.pool.check_consistency):
        try:
            check()
        except AssertionError as e:
            problems.append(f"pool.{check.__name__}: {e}")
    if set(finals) != {r.rid for r in planned}:
        problems.append(f"no final output for {sorted({r.rid for r in planned} - set(finals))}")

    # 1. greedy requests are the target's; sampled ones are whole
    check_greedy(planned, finals, reference, problems)
    check_sampled(planned, finals, problems)

    # 3. seeded sampled requests repeat exactly on a fresh engine (static depths only)
    if settings["spec_mode"] == "static":
        again = run_mix(spec_llm(models, settings), planned)
        for r in planned:
            if r.params.is_greedy or r.rid not in finals or r.rid not in again:
                continue
            if (again[r.rid].token_ids, again[r.rid].finish_reason) != (
                    finals[r.rid].token_ids, finals[r.rid].finish_reason):
                problems.append(f"{describe(r)}: seeded output {finals[r.rid].token_ids}, "
                                f"then {again[r.rid].token_ids} when the run was repeated")
    assert not problems, f"{len(problems)} problem(s) in mix {mix}:\n" + "\n".join(problems)

    # The run did what it is meant to: preemption, speculation, prefix-cache hits, aborts mid-way,
    # stop strings that matched, greedy requests preempted and finished.
    assert eng.scheduler.num_preemptions > 0, "the pool never ran out: no preemption"
    totals = eng.spec.totals
    assert totals.num_drafts > 0 and totals.num_accepted_tokens > 0, "no speculation happened"
    assert any(finals[r.rid].finish_reason == "abort" for r in planned if r.abort_after is not None)
    if settings["enable_prefix_caching"]:
        assert eng.pool.prefix_cache_hit_tokens > 0, "no prefix-cache hit"
    assert any(finals[r.rid].stats.num_preemptions and finals[r.rid].finish_reason != "abort" for r in greedy)
    assert any(finals[r.rid].finish_reason == "stop" for r in planned if r.kind == "stop_str")
