"""The compiled CPU forward (model/compiled.py) against the eager one: the same logits (float32
rounding), the same keys and values in the pool, for every layout a step makes (a decode row, a
chain, a tree, sequences of different row counts, a prompt chunk); through the engine, greedy
speculative output equal to target-only output on it for chains and trees, sampled output
following the target's distribution, every block back after aborts; and how the engine takes a
package up. One package is built per test session (about a minute and a half on two cores), in the
session's cache directory where the engine looks, for a two-layer Qwen3-shaped target (per-head
q/k norms, the LM head tied to the embedding); the draft is the target with noise added (it
agrees often, not always), so it has the target's shape and shares the package."""

from __future__ import annotations

import random
import shutil

import pytest
import torch

from specserve import LLM, SamplingParams
from specserve.model import compiled
from specserve.model.loader import load_model
from specserve.runner import ForwardInput, ModelRunner, slots_for
from tests.checkpoints import make_checkpoint, make_noisy_copy

BLOCK = 4


def build(ckpt) -> object:
    model, _ = load_model(ckpt, dtype="float32", progress=False)
    path = compiled.package_path(model, BLOCK)
    if not path.is_file():
        compiled.build(ckpt, "float32", BLOCK, path)
    return path


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("compiled")
    target = make_checkpoint(root / "target", arch="qwen3", num_hidden_layers=2, tie_word_embeddings=True)
    return target, make_noisy_copy(target, root / "draft", seed=5, scale=0.1)


@pytest.fixture(scope="module")
def package(pair):
    return pair[0], build(pair[0])


def runners(ckpt, path):
    """An eager runner and a compiled one (the package at `path`; None: none yet) over pools of
    the same (random) contents."""
    out = []
    for use in (False, True):
        model, args = load_model(ckpt, dtype="float32", progress=False)
        r = ModelRunner(model, args, num_blocks=96, block_size=BLOCK, device=torch.device("cpu"))
        torch.manual_seed(0)
        for k, v in r.kv_caches:
            k.normal_()
            v.normal_()
        if use and path is not None:
            r.use_compiled(compiled.load(path, model))
        out.append(r)
    return out


def layout(kind: str, rng: random.Random) -> ForwardInput:
    """Sequences on disjoint blocks: (context, new rows, tree mask or None) per sequence."""
    seqs = {
        "decode": [(9, 1, None)],
        "short chain": [(13, 4, None)],
        "short tree": [(10, 3, [[1, 0, 0], [1, 1, 0], [1, 0, 1]])],
        "padded few": [(5, 2, None), (9, 1, None)],
        "chain": [(13, 6, None)],
        "batch": [(5, 1, None), (17, 1, None), (0, 1, None)],
        "mixed": [(7, 4, None), (3, 1, None), (20, 2, None)],
        "prompt": [(0, 11, None)],
        "tree": [(10, 5, [[1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [1, 0, 1, 0, 0], [1, 1, 0, 1, 0], [1, 0, 1, 0, 1]]),
                 (6, 3, None)],
        "small tree": [(10, 4, [[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 1, 0, 1]]), (21, 2, None)],
        "two rows": [(13, 2, None), (4, 1, None), (9, 2, [[1, 0], [1, 1]])],
        "wide": [(3 * b, 1 + b % 2, [[1, 0], [1, 1]] if b == 3 else None) for b in range(9)],
        "long chain": [(13, 17, None)],
        "long tree": [(10, 5, [[1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [1, 0, 1, 0, 0], [1, 1, 0, 1, 0], [1, 0, 1, 0, 1]]),
                      (6, 14, None)],
    }[kind]
    inp, next_block = ForwardInput(), 0
    for ctx, n, mask in seqs:
        blocks = -(-(ctx + n) // BLOCK)
        table = list(range(next_block, next_block + blocks))
        next_block += blocks
        mask = None if mask is None else [[bool(x) for x in row] for row in mask]
        inp.add([rng.randrange(5, 300) for _ in range(n)], list(range(ctx, ctx + n)),
                slots_for(table, BLOCK, ctx, n), table, ctx + n, logit_rows=list(range(n)), mask=mask)
    return inp


PROGRAM_OF = {"decode": "few", "short chain": "few", "short tree": "few", "padded few": "few", "batch": "few",
              "two rows": "few", "chain": "few", "mixed": "few", "prompt": "few", "tree": "few", "small tree": "few",
              "wide": "decode", "long chain": "model", "long tree": "model"}


def spy(forward: compiled.CompiledForward) -> list[str]:
    """The programs `forward` runs from now on, one name a call, in the list returned."""
    ran = []
    for attr, name in (("_few", "few"), ("_decode", "decode"), ("_run", "model")):
        run = getattr(forward, attr)
        if run is None:   # no kernel beside the package
            continue
        setattr(forward, attr, lambda *a, run=run, name=name: ran.append(name) or run(*a))
    return ran


@pytest.mark.parametrize("kind", PROGRAM_OF)
def test_same_logits_and_kv_as_eager(package, kind):
    """Each program equals eager: "few" (few.cpp: at most FEW_ROWS rows in all, the LM head
    inside), "decode" (at most DECODE_ROWS rows a sequence), "model" (any rows)."""
    eager, fast = runners(*package)
    inp = layout(kind, random.Random(kind))
    ran = spy(fast.compiled)
    want = eager.forward(inp)
    got = fast.forward(inp)
    assert got.shape == want.shape
    assert ran == [PROGRAM_OF[kind]]
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    assert torch.equal(got.argmax(-1), want.argmax(-1))
    for (ke, ve), (kf, vf) in zip(eager.kv_caches, fast.kv_caches):
        torch.testing.assert_close(kf, ke, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(vf, ve, rtol=1e-5, atol=1e-5)


def test_a_package_without_its_kernel_runs_its_programs(package, tmp_path):
    """Where few.cpp did not compile (a compiler too old for it), the package's programs take
    every forward: a decode row runs on the "decode" program, with eager's logits."""
    ckpt, path = package
    bare = tmp_path / path.name
    shutil.copy(path, bare)
    eager, fast = runners(ckpt, bare)
    assert fast.compiled._few is None
    ran = spy(fast.compiled)
    inp = layout("decode", random.Random(0))
    torch.testing.assert_close(fast.forward(inp), eager.forward(inp), rtol=1e-4, atol=1e-4)
    assert ran == ["decode"]


def test_padding_past_the_bound_runs_eagerly(package):
    """A long prompt chunk beside decode rows would be padded to many times its rows: eager."""
    _, fast = runners(*package)
    inp = ForwardInput()
    inp.add(list(range(5, 25)), list(range(20)), slots_for([0, 1, 2, 3, 4], BLOCK, 0, 20), [0, 1, 2, 3, 4], 20)
    for b in range(3):
        table = [6 + 2 * b, 7 + 2 * b]
        inp.add([7], [4], slots_for(table, BLOCK, 4, 1), table, 5, logit_rows=[0])
    assert fast._compiled_forward(inp) is None
    assert fast.forward(inp).shape[0] == 3


def test_a_mask_past_its_bound_runs_eagerly(package, monkeypatch):
    """A chunk whose visibility mask would pass _COMPILED_MAX_MASK elements runs eagerly, with
    the eager logits."""
    from specserve import runner as runner_mod

    eager, fast = runners(*package)
    inp = layout("prompt", random.Random(0))
    monkeypatch.setattr(runner_mod, "_COMPILED_MAX_MASK", 11 * 11)   # 11 rows, more than one head a group
    assert fast._compiled_forward(inp) is None
    torch.testing.assert_close(fast.forward(inp), eager.forward(inp))
    monkeypatch.setattr(runner_mod, "_COMPILED_MAX_MASK", 1 << 25)
    assert fast._compiled_forward(inp) is not None


PROMPTS = [[5, 9, 23, 7], [40, 41, 42, 43, 44, 45, 46, 47, 48, 3], [100] * 3]
GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)


def engine(pair, compile="auto", **kw) -> LLM:
    target, draft = pair
    args = dict(target=str(target), draft=str(draft), dtype="float32", device="cpu", progress=False,
                num_blocks=96, block_size=BLOCK, cpu_compile=compile)
    args.update(kw)
    return LLM(**args)


@pytest.mark.parametrize("tree", ["chain", "fixed", "dynamic"])
def test_greedy_speculation_equals_target_only_on_the_compiled_forward(pair, package, tree):
    ref = engine(pair, draft="none")
    assert ref.engine.target.compiled is not None
    want = [o.token_ids for o in ref.generate(PROMPTS, GREEDY)]
    eager = engine(pair, compile="off", draft="none")
    assert [o.token_ids for o in eager.generate(PROMPTS, GREEDY)] == want
    llm = engine(pair, spec_mode="static", spec_depth=4, spec_tree=tree, spec__branching=[3, 2, 1])
    assert llm.engine.target.compiled is not None and llm.engine.draft.compiled is not None
    assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY)] == want
    totals = llm.engine.spec.totals
    assert 0 < totals.num_accepted_tokens < totals.num_draft_tokens   # the draft is wrong sometimes
    llm.engine.pool.check_all_free()


def test_sampling_follows_the_target_on_the_compiled_forward(pair, package):
    from tests.engine.test_lossless import PROMPT, TEMPERATURE, TOP_K, TOP_P, bound, exact_joint, tv

    n, prompt, length = 1500, PROMPT, 3
    sampling = dict(temperature=TEMPERATURE, top_k=TOP_K, top_p=TOP_P)
    exact = exact_joint(pair[0], length=length)
    llm = engine(pair, spec_mode="static", spec_depth=length - 1, num_blocks=4 * n, max_num_seqs=n,
                 max_num_batched_tokens=16 * n, max_waiting_requests=n)
    params = [SamplingParams(max_tokens=length, seed=i, ignore_eos=True, **sampling) for i in range(n)]
    counts = {}
    for o in llm.generate([prompt] * n, params):
        counts[tuple(o.token_ids)] = counts.get(tuple(o.token_ids), 0) + 1
    llm.engine.pool.check_all_free()
    assert llm.engine.spec.totals.num_accepted_tokens < llm.engine.spec.totals.num_draft_tokens
    assert set(counts) <= set(exact)
    assert tv(counts, n, exact) < bound(len(exact), n)


def test_aborts_free_every_block(pair, package):
    llm = engine(pair, spec_mode="static", spec_depth=3)
    eng = llm.engine
    for i, p in enumerate(PROMPTS):
        eng.add_request(f"r{i}", p, GREEDY)
    for _ in range(3):
        eng.step()
    for i in range(len(PROMPTS)):
        eng.abort_request(f"r{i}")
    eng.step()
    assert not eng.has_unfinished_requests()
    eng.pool.check_all_free()


def test_a_package_built_while_serving_is_taken_up(pair, package, tmp_path, monkeypatch, caplog):
    """No package where the engine looks: it serves eagerly, then takes the package up between
    steps once it lies there, and probes the controller's step costs again."""
    monkeypatch.setenv("SPECSERVE_CACHE_DIR", str(tmp_path))
    llm = engine(pair, draft="none")
    eng = llm.engine
    assert eng.target.compiled is None and [b[0] for b in eng._building] == ["target"]
    before = [o.token_ids for o in llm.generate(PROMPTS[:1], GREEDY)]
    assert eng.target.compiled is None
    eng._building[0][2].parent.mkdir(parents=True, exist_ok=True)
    shutil.copy(compiled.kernel_path(package[1]), compiled.kernel_path(eng._building[0][2]))
    shutil.copy(package[1], eng._building[0][2])
    eng._next_build_check = 0.0
    eng.spec._detached = object()   # a controller kept while a static depth plans: its costs are stale now
    after = [o.token_ids for o in llm.generate(PROMPTS[:1], GREEDY)]
    assert eng.target.compiled is not None and not eng._building and eng.spec._detached is None
    assert after == before


def test_the_profile_is_keyed_by_the_package_a_model_runs(pair, package):
    """Step costs measured on one package's programs are not read for another's (a new version
    of the compiled code, another layout): the profile's key names the package."""
    from specserve import profile

    llm = engine(pair, draft="none")
    assert llm.engine.target.compiled is not None
    assert profile.profile_key(llm.engine, [1, 2], 4)["compiled"] == [package[1].name, None]


def test_a_failed_build_leaves_the_engine_eager(pair, tmp_path, monkeypatch, caplog):
    import subprocess
    import sys

    monkeypatch.setenv("SPECSERVE_CACHE_DIR", str(tmp_path))
    llm = engine(pair, draft="none")
    eng = llm.engine
    name, runner, path, _ = eng._building[0]
    failed = subprocess.Popen([sys.executable, "-c", "raise SystemExit(1)"])
    failed.wait()
    eng._building = [(name, runner, path, failed)]
    eng._next_build_check = 0.0
    llm.generate(PROMPTS[:1], GREEDY)
    assert eng.target.compiled is None and not eng._building
    assert "building the compiled forward failed" in caplog.text


def test_unusable_package_is_ignored(tmp_path, package):
    model, _ = load_model(package[0], dtype="float32", progress=False)
    bad = tmp_path / "bad.pt2"
    bad.write_bytes(b"not a package")
    assert compiled.load(bad, model) is None


@pytest.mark.parametrize("program,seqs,rows", [("few", 1, 1), ("decode", 17, 1), ("model", 1, 17)])
def test_the_programs_read_the_models_own_weights(package, program, seqs, rows):
    """The package holds no weights: each program reads the model's tensors, so a change to
    one shows in the next call."""
    _, fast = runners(*package)
    inp = ForwardInput()
    for b in range(seqs):
        table = list(range(5 * b, 5 * b + 5))
        inp.add(list(range(5, 5 + rows)), list(range(rows)), slots_for(table, BLOCK, 0, rows), table, rows,
                logit_rows=list(range(rows)))
    ran = spy(fast.compiled)
    before = fast.forward(inp)
    with torch.no_grad():
        fast.model.layers[0].feed_forward.w2.weight.mul_(0.0)
    after = fast.forward(inp)
    assert ran == [program, program] and not torch.allclose(before, after)


def test_the_package_key_follows_the_models_shape_not_its_weights(tmp_path):
    a = make_checkpoint(tmp_path / "a", num_hidden_layers=1, with_tokenizer=False)
    b = make_checkpoint(tmp_path / "b", num_hidden_layers=2, with_tokenizer=False)
    c = make_noisy_copy(a, tmp_path / "c", seed=1, scale=0.5)
    ma, mb, mc = (load_model(p, dtype="float32", progress=False)[0] for p in (a, b, c))
    assert not torch.equal(ma.layers[0].feed_forward.w2.weight, mc.layers[0].feed_forward.w2.weight)
    assert compiled.package_path(ma, 16) == compiled.package_path(mc, 16)
    assert compiled.package_path(ma, 16) != compiled.package_path(mb, 16)
    assert compiled.package_path(ma, 16) != compiled.package_path(ma, 32)


def test_a_weight_in_another_layout_is_refused(package):
    """The programs read each weight in the row-major layout they were compiled for: a model
    whose weight is laid out otherwise runs eagerly."""
    model, _ = load_model(package[0], dtype="float32", progress=False)
    w2 = model.layers[0].feed_forward.w2
    w2.weight = torch.nn.Parameter(w2.weight.detach().t().contiguous().t(), requires_grad=False)
    assert compiled.load(package[1], model) is None


# -- the few-row kernel on shapes beside the package's ------------------------------------------

@pytest.fixture(scope="module")
def kernel(tmp_path_factory):
    return compiled.compile_kernel(tmp_path_factory.mktemp("kernel") / "few.so")


OTHER_SHAPES = {   # q/k/v biases, an untied head and widths no multiple of a vector (18, 200); plain Llama
    "qwen2": dict(hidden_size=72, intermediate_size=200, num_attention_heads=4, num_key_value_heads=1),
    "llama": {},
}


@pytest.fixture(scope="module")
def other_shapes(tmp_path_factory):
    root = tmp_path_factory.mktemp("shapes")
    return {arch: make_checkpoint(root / arch, arch=arch, with_tokenizer=False, **kw)
            for arch, kw in OTHER_SHAPES.items()}


@pytest.mark.parametrize("threads", [1, 3])
@pytest.mark.parametrize("arch", OTHER_SHAPES)
def test_the_few_kernel_equals_eager_on_other_shapes(kernel, other_shapes, arch, threads):
    """The kernel alone (no package) against eager, on every layout it takes: logits, argmax and
    the pool's keys and values. On one thread, and on three, which cut a sequence's context into
    three pieces whose softmaxes are combined."""
    eager, fast = runners(other_shapes[arch], None)
    fast.use_compiled(compiled.FewKernel(kernel, fast.model))
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for kind in [k for k, program in PROGRAM_OF.items() if program == "few"]:
            inp = layout(kind, random.Random(kind))
            want, got = eager.forward(inp), fast.forward(inp)
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4, msg=kind)
            assert torch.equal(got.argmax(-1), want.argmax(-1)), kind
    finally:
        torch.set_num_threads(before)
    for (ke, ve), (kf, vf) in zip(eager.kv_caches, fast.kv_caches):
        torch.testing.assert_close(kf, ke, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(vf, ve, rtol=1e-5, atol=1e-5)


def test_the_few_kernel_refuses_indices_out_of_range(kernel, other_shapes):
    """A block id, slot or token past its table is an error, not a read or write out of bounds."""
    model, args = load_model(other_shapes["llama"], dtype="float32", progress=False)
    few = compiled.FewKernel(kernel, model)
    pool = torch.zeros(args.num_layers, 4, BLOCK, args.num_kv_heads, args.head_dim)
    ok = dict(ids=torch.tensor([[5]]), pos=torch.tensor([[6]]), k_pool=pool, v_pool=pool.clone(),
              tables=torch.tensor([[0, 1]]), ctx_lens=torch.tensor([6]), mask=torch.ones(1, 1, 1, dtype=torch.bool),
              slots=torch.tensor([6]))
    hidden, logits = few(**ok)
    assert hidden.shape == (1, args.hidden_size) and logits.shape == (1, args.vocab_size)
    for name, bad in [("tables", torch.tensor([[0, 4]])), ("slots", torch.tensor([16])),
                      ("ids", torch.tensor([[10**6]])), ("ctx_lens", torch.tensor([9]))]:
        with pytest.raises(ValueError, match="out of range"):
            few(**(ok | {name: bad}))
