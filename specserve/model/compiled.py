"""The CPU forward compiled ahead of time: one package per model, built once and cached.

On the CPU a small model's eager step is hundreds of dispatched torch ops, each a few
microseconds, around a few dozen matrix products: the host work, not the arithmetic or the
weights' bytes, sets its speed. `dense_forward` is the whole forward (every layer, attention
included) written as one traceable function of plain tensors; torch.export traces it with the
batch, the rows per sequence, the blocks per sequence and the pool size symbolic, and
AOTInductor compiles it into C++ (the norms and RoPE as fused loops) behind one call. A package
holds two such programs, and beside it a kernel written by hand:

- "few" (few.cpp, compiled with the package), for at most FEW_ROWS rows in all (a decode step or a
  verify at low batch, a draft level): the whole forward and the LM head in one parallel region,
  every weight streamed once at the memory's speed, where a BLAS call for so few rows runs at a
  fraction of it and a compiled program's loops meet once a loop;
- "decode", for at most DECODE_ROWS rows a sequence at any batch: the BLAS's matmuls, the
  attention as fused sums that read the context's keys and values where the pool holds them;
- "model", for any rows: the BLAS's matmuls, the context gathered for torch's CPU flash attention.

None holds the weights: the loader hands each the model's own tensors. Loading takes
milliseconds; building takes minutes, so a package is built once per model shape,
torch, CPU and version of this code, in a process of its own at low priority, into the user's
cache directory (`specserve calibrate` builds it ahead), and the engine takes it up when it
appears.

Layout of a call. A forward of B sequences is laid out as [B, q] rows, q the largest number of
new rows of any sequence; a shorter sequence is padded with rows that see only themselves and
write nothing. Row t of sequence b sees key j < ctx_lens[b] (its cached context, read from the
pool through its block table) and its own new rows as mask[b, t] says (causal for a chain or a
prompt chunk, the tree's ancestors for a tree). The call returns the new rows' keys and values
instead of writing them: the caller writes them into the pool with one index_copy_ per pool,
and the rows of one forward that see each other take them from the call's own tensors. The
arithmetic is the eager forward's (model/llama.py) in another order of evaluation: the logits
agree to float32 rounding (tests/engine/test_compiled.py).
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import json
import logging
import os
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from specserve.model.llama import CausalLM, apply_rope, rope_full_tables

logger = logging.getLogger("specserve")

FORMAT = 5   # bump when the call's signature or layout changes (the weights' strides included)
FEW_ROWS = 16   # forwards of at most this many rows in all take the "few" kernel
DECODE_ROWS = 2   # other forwards of at most this many rows a sequence take the "decode" program
PROGRAMS = ("decode", "model")   # the package's compiled programs ("few" is few.cpp)
_SOURCES = ("compiled.py", "llama.py", "few.cpp")   # the code a package is compiled from
_STALE_LOCK_S = 1800.0   # a build lock older than this belongs to a build that died


def dense_forward(
    model: CausalLM,
    input_ids: torch.Tensor,  # [B, q] int64
    positions: torch.Tensor,  # [B, q] int64
    k_pool: torch.Tensor,  # [L, NB, BS, Hkv, D]
    v_pool: torch.Tensor,  # [L, NB, BS, Hkv, D]
    tables: torch.Tensor,  # [B, W] int64: block ids of each sequence's context (any id past it)
    ctx_lens: torch.Tensor,  # [B] int64: cached keys each sequence's new rows see
    mask: torch.Tensor,  # [B, q, q] bool: new row t sees new row j
    program: str = "model",  # one of PROGRAMS: which attention (the module docstring)
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # hidden [B*q, H]; new K, V [L, B*q, Hkv, D]
    args = model.args
    B, q = input_ids.shape
    Hq, Hkv, D = args.num_heads, args.num_kv_heads, args.head_dim
    S = tables.shape[1] * k_pool.shape[2]   # context keys gathered per sequence
    x = model.tok_embeddings.weight[input_ids.reshape(-1)]  # [T, H]
    cos, sin = rope_full_tables(model.rope_cos[positions.reshape(-1)], model.rope_sin[positions.reshape(-1)], x.dtype)
    in_context = torch.arange(S, device=x.device)[None, :] < ctx_lens[:, None]  # [B, S]
    visible = torch.cat([in_context[:, None, :].expand(B, q, S), mask], dim=2)  # [B, q, S + q]
    attention = _flash_attention if program == "model" else _direct_attention
    keys, values = [], []
    for layer_index, layer in enumerate(model.layers):
        attn, ffn = layer.attention, layer.feed_forward
        qkv = F.linear(layer.attention_norm.forward(x), attn.wqkv.weight, attn.wqkv.bias)
        qh, kh, vh = qkv.split([Hq * D, Hkv * D, Hkv * D], dim=-1)
        qh, kh, vh = qh.reshape(-1, Hq, D), kh.reshape(-1, Hkv, D), vh.reshape(-1, Hkv, D)
        if attn.q_norm is not None:
            qh, kh = attn.q_norm.forward(qh), attn.k_norm.forward(kh)
        qk = apply_rope(torch.cat([qh, kh], dim=1), cos, sin)
        qh, kh = qk[:, :Hq], qk[:, Hq:]
        keys.append(kh)
        values.append(vh)
        out = attention(qh.reshape(B, q, Hkv, Hq // Hkv, D), kh.reshape(B, q, Hkv, D), vh.reshape(B, q, Hkv, D),
                        k_pool[layer_index][tables].reshape(B, S, Hkv, D),
                        v_pool[layer_index][tables].reshape(B, S, Hkv, D), visible, attn.scale)
        h = x + F.linear(out.reshape(B * q, Hq * D), attn.wo.weight)
        gate, up = F.linear(layer.ffn_norm.forward(h), ffn.w13.weight).chunk(2, dim=-1)
        x = h + F.linear(F.silu(gate) * up, ffn.w2.weight)
    return model.norm.forward(x), torch.stack(keys), torch.stack(values)


def _flash_attention(qh, kh, vh, k_ctx, v_ctx, visible, scale):
    """softmax(q k^T * scale, over the visible keys) v by torch's CPU flash attention: queries
    qh [B, q, Hkv, G, D] (G query heads a KV head), the new rows' keys and values kh, vh
    [B, q, Hkv, D] after the context's k_ctx, v_ctx [B, S, Hkv, D]; visible [B, q, S + q].
    Returns [B, q, Hkv, G, D]. A KV head's G query heads are G rows of one attention."""
    B, q, Hkv, G, D = qh.shape
    S = k_ctx.shape[1]
    k_all = torch.cat([k_ctx, kh], dim=1).transpose(1, 2)   # [B, Hkv, S + q, D]
    v_all = torch.cat([v_ctx, vh], dim=1).transpose(1, 2)
    qg = qh.permute(0, 2, 1, 3, 4).reshape(B, Hkv, q * G, D)
    rows_visible = visible[:, :, None, :].expand(B, q, G, S + q).reshape(B, 1, q * G, S + q)
    out = F.scaled_dot_product_attention(qg, k_all, v_all, attn_mask=rows_visible, scale=scale)
    return out.reshape(B, Hkv, q, G, D).permute(0, 2, 1, 3, 4)


def _direct_attention(qh, kh, vh, k_ctx, v_ctx, visible, scale):
    """The same attention written as sums of products, which the compiler fuses into loops that
    read the context's keys and values where the pool holds them, with no gathered copy and no
    call into a library: for a few rows a sequence (decode, draft levels) that is most of the
    attention's cost. Its work grows as rows x keys without a BLAS, so longer chunks take
    _flash_attention."""
    B, q, Hkv, G, D = qh.shape
    S = k_ctx.shape[1]
    q6 = qh[:, :, None]   # [B, q, 1, Hkv, G, D]
    scores = torch.cat([(q6 * k_ctx[:, None, :, :, None, :]).sum(-1),
                        (q6 * kh[:, None, :, :, None, :]).sum(-1)], dim=2) * scale   # [B, q, S + q, Hkv, G]
    scores = scores.masked_fill(~visible[:, :, :, None, None], float("-inf"))
    p = torch.softmax(scores, dim=2)[..., None]
    return (p[:, :, :S] * v_ctx[:, None, :, :, None, :]).sum(2) + (p[:, :, S:] * vh[:, None, :, :, None, :]).sum(2)


class _Traced(torch.nn.Module):
    def __init__(self, model: CausalLM, program: str = "model"):
        super().__init__()
        self.model = model
        self.program = program

    def forward(self, input_ids, positions, k_pool, v_pool, tables, ctx_lens, mask):
        return dense_forward(self.model, input_ids, positions, k_pool, v_pool, tables, ctx_lens, mask, self.program)


def supported(model: CausalLM) -> bool:
    """The compiled forward covers float32 models on the CPU with fused projections."""
    first = model.layers[0]
    return (model.device.type == "cpu" and model.dtype == torch.float32
            and hasattr(first.attention, "wqkv") and hasattr(first.feed_forward, "w13"))


def example_inputs(model: CausalLM, block_size: int, q: int = 3) -> tuple[torch.Tensor, ...]:
    """Inputs to trace with: sizes distinct from each other, so no two symbolic sizes merge."""
    args = model.args
    B, W, NB = 5 - q, 5, 17
    pool = (args.num_layers, NB, block_size, args.num_kv_heads, args.head_dim)
    return (torch.zeros(B, q, dtype=torch.int64), torch.arange(q).repeat(B, 1) + 40,
            torch.zeros(pool), torch.zeros(pool), torch.arange(B * W).reshape(B, W) % NB,
            torch.full((B,), 40, dtype=torch.int64), torch.ones(q, q, dtype=torch.bool).tril().repeat(B, 1, 1))


# The programs' bounds: the most sequences and the most rows a sequence each takes.
_LIMITS = {"decode": (1 << 14, DECODE_ROWS), "model": (1 << 14, 1 << 14)}


def _compile(checkpoint: str, dtype: str, block_size: int, name: str) -> list[str]:
    """Export and compile the program `name` of the checkpoint's forward; returns the files
    AOTInductor wrote for it."""
    from torch._inductor import aot_compile
    from torch.export import Dim, export

    from specserve.model.loader import load_model

    model, _ = load_model(checkpoint, dtype=dtype, progress=False)
    max_batch, max_rows = _LIMITS[name]
    B, q = Dim("batch", min=1, max=max_batch), Dim("rows", min=1, max=max_rows)
    W, NB = Dim("blocks", min=1, max=1 << 20), Dim("pool_blocks", min=1, max=1 << 24)
    shapes = ({0: B, 1: q}, {0: B, 1: q}, {1: NB}, {1: NB}, {0: B, 1: W}, {0: B}, {0: B, 1: q, 2: q})
    with torch.inference_mode():
        program = export(_Traced(model, name).eval(), example_inputs(model, block_size, min(3, max_rows)),
                         dynamic_shapes=shapes)
    args, kwargs = program.example_inputs
    options = {"aot_inductor.package": True, "aot_inductor.package_constants_in_so": False}
    return aot_compile(program.module(check_guards=False), args, kwargs, options=options)


def build(checkpoint, dtype: str, block_size: int, out: Path) -> Path:
    """Export and compile `dense_forward` for the checkpoint into the package `out` (written
    whole or not at all), one program of PROGRAMS each, after the few-row kernel beside it
    (`kernel_path`; where it does not compile, the programs run every forward). Each program
    is one C++ compile on one core: they run in processes of their own (this module's
    `--program`), as many at once as this process may use cores. None holds the weights: the
    loader hands them the model's own tensors (`load`)."""
    import tempfile
    from concurrent.futures import ThreadPoolExecutor

    from torch._inductor.package import package_aoti

    out.parent.mkdir(parents=True, exist_ok=True)
    try:
        compile_kernel(kernel_path(out))
    except (OSError, subprocess.CalledProcessError) as e:
        print(f"the few-row kernel did not compile ({e}); the compiled programs take its forwards",
              file=sys.stderr, flush=True)
    tmp = out.with_name(f"{out.stem}.{os.getpid()}.tmp.pt2")
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1

    def compile_apart(name: str) -> list[str]:
        listing = Path(scratch) / f"{name}.json"
        subprocess.run([sys.executable, "-m", "specserve.model.compiled", str(checkpoint), "--dtype", dtype,
                        "--block-size", str(block_size), "--program", name, "--out", str(listing)],
                       check=True, stdin=subprocess.DEVNULL)
        return json.loads(listing.read_text())

    with tempfile.TemporaryDirectory() as scratch, ThreadPoolExecutor(min(len(PROGRAMS), cores)) as pool:
        files = dict(zip(PROGRAMS, pool.map(compile_apart, PROGRAMS)))
    package_aoti(str(tmp), files)
    tmp.replace(out)
    return out


# Instruction sets by the CPU capability torch reports, which keys the package (package_path): a
# kernel built for one machine runs on any other of the same key.
_ARCH_FLAGS = {"AVX512": ["-mavx512f", "-mavx512dq", "-mavx512bw", "-mavx512vl", "-mavx2", "-mfma",
                          "-mprefer-vector-width=512"],
               "AVX2": ["-mavx2", "-mfma"]}


def kernel_path(package: Path) -> Path:
    return package.with_suffix(".so")


def compile_kernel(out: Path) -> Path:
    """Compile few.cpp into the shared library `out` (written whole or not at all): a few
    seconds. OpenMP's runtime is the one torch loaded (the same soname), so the kernel's threads
    are torch's intra-op threads."""
    tmp = out.with_name(f"{out.name}.{os.getpid()}.tmp")
    flags = _ARCH_FLAGS.get(torch.backends.cpu.get_cpu_capability(), [])
    cmd = [os.environ.get("CXX", "c++"), "-O3", "-std=c++17", "-ffp-contract=fast", "-fopenmp", "-fPIC", "-shared",
           *flags, str(Path(__file__).with_name("few.cpp")), "-o", str(tmp)]
    subprocess.run(cmd, check=True, stdin=subprocess.DEVNULL)
    tmp.replace(out)
    return out


class _Layer(ctypes.Structure):
    _fields_ = [(name, ctypes.c_void_p) for name in
                ("attn_norm", "wqkv", "bqkv", "q_norm", "k_norm", "wo", "ffn_norm", "w13", "w2")]


class _Model(ctypes.Structure):
    _fields_ = [*((name, ctypes.c_int64) for name in ("hidden", "num_layers", "num_heads", "num_kv_heads",
                                                      "head_dim", "inter", "vocab", "max_pos")),
                ("eps", ctypes.c_float), ("scale", ctypes.c_float),
                *((name, ctypes.c_void_p) for name in ("embed", "norm", "output", "rope_cos", "rope_sin")),
                ("layers", ctypes.POINTER(_Layer))]


class FewKernel:
    """few.cpp's forward over `model`'s own weights (no copy; it keeps them referenced): the
    hidden rows and the logits of at most a few rows, their keys and values written into the
    pool at their slots."""

    def __init__(self, path: Path, model: CausalLM):
        self._lib = ctypes.CDLL(str(path))
        self._fn = self._lib.specserve_few_forward
        self._fn.restype = ctypes.c_int
        i64, ptr = ctypes.c_int64, ctypes.c_void_p
        self._fn.argtypes = [ptr, i64, i64, ptr, ptr, ptr, ptr, i64, i64, ptr, i64, ptr, ptr, ptr, ptr, ptr]
        args = model.args

        def at(t: torch.Tensor | None) -> int | None:
            if t is None:
                return None
            if t.dtype != torch.float32 or not t.is_contiguous():
                raise ValueError(f"a weight of shape {tuple(t.shape)} is not contiguous float32")
            self._weights.append(t)
            return t.data_ptr()

        self._weights: list[torch.Tensor] = []
        layers = []
        for layer in model.layers:
            attn, ffn = layer.attention, layer.feed_forward
            layers.append(_Layer(at(layer.attention_norm.weight), at(attn.wqkv.weight), at(attn.wqkv.bias),
                                 at(attn.q_norm.weight if attn.q_norm is not None else None),
                                 at(attn.k_norm.weight if attn.k_norm is not None else None),
                                 at(attn.wo.weight), at(layer.ffn_norm.weight), at(ffn.w13.weight),
                                 at(ffn.w2.weight)))
        self._layers = (_Layer * len(layers))(*layers)
        self._model = _Model(args.hidden_size, args.num_layers, args.num_heads, args.num_kv_heads, args.head_dim,
                             args.intermediate_size, args.vocab_size, model.rope_cos.shape[0],
                             model.norm.eps, model.layers[0].attention.scale, at(model.tok_embeddings.weight),
                             at(model.norm.weight), at(model.output.weight), at(model.rope_cos),
                             at(model.rope_sin), self._layers)
        self._hidden, self._vocab = args.hidden_size, args.vocab_size

    def __call__(self, ids, pos, k_pool, v_pool, tables, ctx_lens, mask, slots) -> tuple[torch.Tensor, torch.Tensor]:
        B, q = ids.shape
        _, NB, BS, _, _ = k_pool.shape
        hidden = torch.empty(B * q, self._hidden)
        logits = torch.empty(B * q, self._vocab)
        rc = self._fn(ctypes.byref(self._model), B, q, ids.data_ptr(), pos.data_ptr(), k_pool.data_ptr(),
                      v_pool.data_ptr(), NB, BS, tables.data_ptr(), tables.shape[1], ctx_lens.data_ptr(),
                      mask.data_ptr(), slots.data_ptr(), hidden.data_ptr(), logits.data_ptr())
        if rc == 3:
            raise MemoryError("few-row forward: no memory for its buffers")
        if rc:
            raise ValueError(f"few-row forward: {('a context or block table', 'a token, position or slot')[rc - 1]} "
                             "out of range")
        return hidden, logits


def build_for(config) -> list[Path]:
    """The packages of a setup's float32 CPU models, built now where not cached (`specserve
    calibrate`, benchmarks); returns their paths."""
    from specserve.model.loader import load_model

    on_gpu = config.device == "cuda" or (config.device == "auto" and torch.cuda.is_available())
    if config.cpu.compile == "off" or on_gpu:
        return []
    models = [(config.target.path, config.target.dtype)]
    if config.draft.kind == "model":
        models.append((config.draft.path, config.draft.dtype))
    paths = []
    for checkpoint, dtype in models:
        model, _ = load_model(checkpoint, dtype=dtype, progress=False)
        if not supported(model):
            continue
        package = package_path(model, config.cache.block_size)
        if not package.is_file():
            print(f"compiling the forward of {checkpoint} (a few minutes, once)", file=sys.stderr, flush=True)
            build(checkpoint, dtype, config.cache.block_size, package)
        paths.append(package)
    return paths


# -- the cache ------------------------------------------------------------------------------------

def cache_dir() -> Path:
    base = os.environ.get("SPECSERVE_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "specserve")
    return Path(base) / "compiled"


def package_path(model: CausalLM, block_size: int) -> Path:
    """Where the package for `model` lies: keyed by the model's shape (its args), the block size,
    torch, the CPU's instruction set and the source it is compiled from. Not by the weights: a
    package holds none, so checkpoints of one shape (a fine-tune, a noisy copy) share it."""
    here = Path(__file__).parent
    key = {
        "format": FORMAT, "torch": torch.__version__, "cpu": torch.backends.cpu.get_cpu_capability(),
        "args": repr(model.args), "block_size": block_size,
        "source": hashlib.sha256(b"".join((here / name).read_bytes() for name in _SOURCES)).hexdigest(),
    }
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:20]
    return cache_dir() / f"{digest}.pt2"


class CompiledForward:
    """One forward of [B, q] rows laid out as dense_forward's: few.cpp's kernel for at most
    FEW_ROWS rows in all (where it compiled), else the package's "decode" program for at most DECODE_ROWS rows a
    sequence, else its "model" one. Each reads `model`'s own parameters and buffers (no copy).
    The runners are made directly: torch's Python wrapper (aoti_load_package) imports the
    compiler stack (seconds at every start) and parses the package's input and output tree
    specs from JSON at every call (a visible share of a decode step)."""

    def __init__(self, path: Path, model: CausalLM):
        self.name = path.name
        # program name -> its runner, kept as long as this (a file that is no package fails here)
        self._loaders = {name: torch._C._aoti.AOTIModelPackageLoader(str(path), name, False, 1, -1)
                         for name in PROGRAMS}
        traced = _Traced(model)
        weights = dict(traced.named_parameters(remove_duplicate=False)) | dict(
            traced.named_buffers(remove_duplicate=False))
        if bad := [name for name, w in weights.items() if not w.is_contiguous()]:   # the programs' layout
            raise ValueError(f"{bad[0]} is not contiguous")
        for loader in self._loaders.values():
            loader.load_constants({f: weights[f].detach() for f in loader.get_constant_fqns()}, False, True, True)
        self._decode, self._run = (self._loaders[name].boxed_run for name in ("decode", "model"))
        kernel = kernel_path(path)
        self._few = FewKernel(kernel, model) if kernel.is_file() else None

    def __call__(self, ids, pos, k_pool, v_pool, tables, ctx_lens, mask,
                 slots) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The hidden rows [B * q, H] and, from the few-row kernel, their logits (else None); the
        new rows' keys and values written into the pool at `slots` ([B * q]; < 0: nowhere)."""
        B, q = ids.shape
        if B * q <= FEW_ROWS and self._few is not None:
            return self._few(ids, pos, k_pool, v_pool, tables, ctx_lens, mask, slots)
        run = self._decode if q <= DECODE_ROWS else self._run
        hidden, k_new, v_new = run([ids, pos, k_pool, v_pool, tables, ctx_lens, mask])
        L, NB, BS, Hkv, D = k_pool.shape
        if bool((slots < 0).any()):
            keep = (slots >= 0).nonzero().squeeze(1)
            slots, k_new, v_new = slots[keep], k_new[:, keep], v_new[:, keep]
        k_pool.view(L, NB * BS, Hkv, D).index_copy_(1, slots, k_new)
        v_pool.view(L, NB * BS, Hkv, D).index_copy_(1, slots, v_new)
        return hidden, None


def load(path: Path, model: CausalLM) -> CompiledForward | None:
    """The compiled forward in `path` over `model`'s weights, or None (with a warning) when it
    cannot be used."""
    try:
        return CompiledForward(path, model)
    except Exception as e:   # a corrupt or foreign file is skipped, never fatal
        logger.warning("ignoring the compiled forward %s: %s", path, str(e).splitlines()[0] if str(e) else e)
        return None


def build_in_background(checkpoint: str, dtype: str, block_size: int, out: Path) -> subprocess.Popen | None:
    """Start building `out` in a process of its own at the lowest priority, unless another
    process is building it already (a lock file beside it) or SPECSERVE_COMPILE_BUILDS=0 (a
    deployment that only uses what `specserve calibrate` built, and the test suite). Returns the
    process, or None."""
    if os.environ.get("SPECSERVE_COMPILE_BUILDS") == "0":
        return None
    lock = out.with_suffix(".lock")
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        with contextlib.suppress(FileNotFoundError):
            if time.time() - lock.stat().st_mtime > _STALE_LOCK_S:
                lock.unlink(missing_ok=True)
        try:
            os.close(os.open(lock, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
        except FileExistsError:
            return None
        try:
            log = open(out.with_suffix(".log"), "w")
        except OSError:
            lock.unlink(missing_ok=True)
            raise
    except OSError as e:   # a read-only or missing cache directory: serve eagerly
        logger.warning("not building the compiled forward: cannot write to %s (%s)", out.parent, e.strerror or e)
        return None
    cmd = [sys.executable, "-m", "specserve.model.compiled", str(checkpoint), "--dtype", dtype,
           "--block-size", str(block_size), "--out", str(out)]
    return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                            start_new_session=True, preexec_fn=lambda: os.nice(19))


def main(argv=None) -> int:
    import argparse

    ap = argparse.ArgumentParser(description="build the compiled CPU forward of one checkpoint")
    ap.add_argument("checkpoint")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--block-size", type=int, required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--program", choices=PROGRAMS, help="compile this program alone; --out is then a JSON "
                    "list of the files it wrote (a step of a build)")
    args = ap.parse_args(argv)
    out = Path(args.out)
    if args.program:
        out.write_text(json.dumps(_compile(args.checkpoint, args.dtype, args.block_size, args.program)))
        return 0
    try:
        start = time.perf_counter()
        build(args.checkpoint, args.dtype, args.block_size, out)
        print(f"compiled forward of {args.checkpoint} written to {out} in {time.perf_counter() - start:.0f} s")
        return 0
    finally:
        out.with_suffix(".lock").unlink(missing_ok=True)


if __name__ == "__main__":
    raise SystemExit(main())
