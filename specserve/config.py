"""Every setting of specserve, as msgspec Structs loaded from TOML.

A TOML file maps 1:1 onto `EngineConfig`: one table per section below. An unknown key,
a wrong type or a value out of range is a `ConfigError` naming the key, the value and
what is allowed. Paths may start with `embedded:` (the pair shipped inside the package)
and relative paths are taken relative to the config file.
"""

from __future__ import annotations

import difflib
import os
import re
import tomllib
from pathlib import Path
from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta, Struct

from specserve.errors import ConfigError

ASSETS_DIR = Path(__file__).resolve().parent / "assets"
EMBEDDED_TARGET = "embedded:tiny-target"
EMBEDDED_DRAFT = "embedded:tiny-draft"

PositiveInt = Annotated[int, Meta(ge=1)]
NonNegInt = Annotated[int, Meta(ge=0)]
Dtype = Literal["auto", "float32", "bfloat16", "float16", "float64"]


class _Section(Struct, kw_only=True, forbid_unknown_fields=True):
    pass


class ModelConfig(_Section):
    """[target]: the model whose output is served."""

    path: str = EMBEDDED_TARGET  # a local Hugging Face directory
    dtype: Dtype = "auto"  # auto = the checkpoint's dtype (float32 on CPU for 16-bit ones)
    max_model_len: PositiveInt | None = None  # default: the checkpoint's max_position_embeddings


class DraftConfig(_Section):
    """[draft]: what proposes tokens. Swapping the draft is an edit of this table only."""

    kind: Literal["model", "ngram", "none"] = "model"
    path: str | None = EMBEDDED_DRAFT  # for kind = "model": a Hugging Face directory
    dtype: Dtype = "auto"
    ngram_min: PositiveInt = 1  # for kind = "ngram": shortest suffix to look up
    ngram_max: PositiveInt = 4  # ... and the longest (tried first)


MAX_DEPTH = 16   # the deepest speculation any setting may ask for
MAX_TREE_NODES = 512   # the largest tree (draft tokens of one sequence in one step)


class SpecConfig(_Section):
    """[spec]: how deep and wide to speculate."""

    mode: Literal["adaptive", "static"] = "adaptive"   # adaptive: the controller plans every step
    depth: NonNegInt = 4  # static depth; 0 = plain decode
    max_depth: Annotated[int, Meta(ge=0, le=MAX_DEPTH)] = 8  # adaptive plans 0..max_depth
    tree: Literal["chain", "fixed", "dynamic"] = "chain"
    branching: list[PositiveInt] = []  # fixed trees: children per depth, e.g. [4, 2, 2, 1]
    num_nodes: PositiveInt = 16  # dynamic trees: node budget (root excluded)
    topk: PositiveInt = 4  # dynamic trees: children expanded per frontier node


class CacheConfig(_Section):
    """[cache]: the one paged KV pool shared by target and draft."""

    block_size: Annotated[int, Meta(ge=1, le=1024)] = 16
    kv_cache_bytes: PositiveInt = 512 * 1024 * 1024  # CPU: the pool's size in bytes
    memory_fraction: Annotated[float, Meta(gt=0.0, le=1.0)] = 0.9  # CUDA: of free memory after weights
    num_blocks: PositiveInt | None = None  # overrides both sizings when set
    enable_prefix_caching: bool = True


class SchedulerConfig(_Section):
    """[scheduler]: continuous batching."""

    max_num_seqs: PositiveInt = 64
    max_num_batched_tokens: PositiveInt = 2048
    enable_chunked_prefill: bool = True
    max_waiting_requests: PositiveInt = 1024  # beyond this, add_request refuses (HTTP 429)


class ServerConfig(_Section):
    """[server]: the OpenAI-compatible HTTP front door."""

    host: str = "127.0.0.1"
    port: Annotated[int, Meta(ge=0, le=65535)] = 8000
    served_model_name: str | None = None  # default: the target directory's name
    shutdown_timeout_s: Annotated[float, Meta(ge=0.0)] = 30.0
    # A connection must send a request head within this, and is closed when idle this long or
    # when its client takes none of a response this long (its requests are aborted).
    idle_timeout_s: Annotated[float, Meta(gt=0.0)] = 15.0
    body_timeout_s: Annotated[float, Meta(gt=0.0)] = 30.0   # a request body must arrive within this
    max_connections: PositiveInt = 1024    # more open connections are closed at once
    # The engine core in a process of its own (ZMQ to this one: core.py), so that HTTP, JSON
    # and tokenization never hold the GIL a step needs; false: a worker thread of this process.
    engine_process: bool = True
    # Engine cores behind this server (data parallel, each its own process): on the CPU each
    # takes its share of the cores, with GPUs one GPU each. Requests go to the core holding
    # the longest prefix of their prompt, else to the least loaded.
    engines: Annotated[int, Meta(ge=1, le=64)] = 1
    # GET/POST /admin/speculation: read or switch the speculation setting of the running
    # server. Off by default: it changes how every client is served.
    admin_api: bool = False
    # Clients must send `Authorization: Bearer <api_key>` on /v1/ and /admin/ routes (/health,
    # /metrics and the chat page stay open). `specserve serve` takes $SPECSERVE_API_KEY.
    api_key: Annotated[str, Meta(min_length=1)] | None = None
    # Web pages of these origins may call the API from a browser (CORS), e.g.
    # ["http://localhost:3000"], or ["*"] for any; none by default (the chat page is this origin).
    allowed_origins: list[str] = []


class CpuConfig(_Section):
    """[cpu]: how forwards use the CPU (ignored on other devices)."""

    threads: PositiveInt | None = None  # torch intra-op threads; default: torch's (the cores)
    # Linear layers of float32 models: "onednn" packs each weight once for oneDNN, which streams
    # weights from memory faster than torch's default path but costs more per call; "auto" packs
    # the models (or, in a small model, the layers) too big for the CPU's caches; "torch": F.linear.
    linear: Literal["auto", "onednn", "torch"] = "auto"
    # glibc: keep allocations up to 32 MiB on a heap that is not handed back (cpu_malloc.py).
    heap_malloc: bool = True
    # Float32 models: "auto" runs each model's forward compiled ahead of time (model/compiled.py)
    # once a build of it is cached, building it in the background the first time; "off": eager.
    compile: Literal["auto", "off"] = "auto"


class EngineConfig(_Section):
    target: ModelConfig = msgspec.field(default_factory=ModelConfig)
    draft: DraftConfig = msgspec.field(default_factory=DraftConfig)
    spec: SpecConfig = msgspec.field(default_factory=SpecConfig)
    cache: CacheConfig = msgspec.field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = msgspec.field(default_factory=SchedulerConfig)
    server: ServerConfig = msgspec.field(default_factory=ServerConfig)
    cpu: CpuConfig = msgspec.field(default_factory=CpuConfig)
    device: Literal["auto", "cpu", "cuda"] = "auto"
    # Decode steps, chain verify passes and draft levels replayed from CUDA graphs, padded to a
    # captured batch size (graphs.py); on the CPU the same padded path runs eagerly.
    cuda_graphs: bool = False
    seed: int = 0


def resolve_path(path: str, base_dir: Path | None = None) -> Path:
    """`embedded:NAME` -> the package's assets; relative paths -> relative to base_dir."""
    if path.startswith("embedded:"):
        return ASSETS_DIR / path.removeprefix("embedded:")
    p = Path(os.path.expanduser(path))
    if not p.is_absolute() and base_dir is not None:
        p = base_dir / p
    return p


def _check_keys(data: dict, struct_type: type, where: str, source: str) -> None:
    """Unknown keys, with the allowed ones listed (msgspec's own message does not list them)."""
    allowed = {f.name: f.type for f in msgspec.structs.fields(struct_type)}
    for key, value in data.items():
        name = f"{where}.{key}" if where else key
        if key not in allowed:
            raise ConfigError(
                f"{source}: unknown key '{name}'; allowed keys"
                f"{' in [' + where + ']' if where else ''}: {', '.join(sorted(allowed))}"
            )
        sub = allowed[key]
        if isinstance(sub, type) and issubclass(sub, Struct):
            if not isinstance(value, dict):
                raise ConfigError(f"{source}: '{name}' must be a table ([{name}]), got {value!r}")
            _check_keys(value, sub, name, source)


def _literal_choices(path: list[str]) -> tuple | None:
    """The allowed values of a Literal field at `path`, for error messages."""
    struct_type: Any = EngineConfig
    for part in path:
        if not (isinstance(struct_type, type) and issubclass(struct_type, Struct)):
            return None  # inside a list or a scalar: no Literal to list
        fields = {f.name: f.type for f in msgspec.structs.fields(struct_type)}
        struct_type = fields.get(part)
        if struct_type is None:
            return None
    if getattr(struct_type, "__origin__", None) is Literal:
        return struct_type.__args__
    return None


def _lookup(data: Any, path: list[str]) -> Any:
    for part in path:
        if isinstance(data, dict) and part in data:
            data = data[part]
        elif isinstance(data, list) and part.isdigit() and int(part) < len(data):
            data = data[int(part)]
        else:
            return None
    return data


def from_dict(data: dict, source: str = "config", base_dir: Path | None = None) -> EngineConfig:
    _check_keys(data, EngineConfig, "", source)
    try:
        cfg = msgspec.convert(data, EngineConfig)
    except msgspec.ValidationError as e:
        # msgspec says e.g. "Expected `int` >= 1 - at `$.cache.block_size`": add the key and value.
        msg = str(e)
        m = re.search(r" - at `\$\.?([^`]*)`$", msg)
        if not m:
            raise ConfigError(f"{source}: {msg}") from None
        key = m.group(1).replace("[", ".").replace("]", "")
        value = _lookup(data, key.split("."))
        why = msg[: m.start()]
        choices = _literal_choices(key.split("."))
        if choices:
            why += f"; allowed: {', '.join(map(repr, choices))}"
        raise ConfigError(f"{source}: {key} = {value!r} is invalid: {why}") from None
    if "depth" not in (data.get("spec") or {}):   # the default static depth follows a lower max_depth
        cfg.spec.depth = min(cfg.spec.depth, cfg.spec.max_depth)
    return _finish(cfg, source, base_dir)


def _finish(cfg: EngineConfig, source: str, base_dir: Path | None) -> EngineConfig:
    """Cross-field checks and path resolution."""
    cfg.target.path = str(resolve_path(cfg.target.path, base_dir))
    if cfg.draft.path:   # whatever the kind: a later override of the kind keeps this file's base
        cfg.draft.path = str(resolve_path(cfg.draft.path, base_dir))
    if cfg.draft.kind == "model" and not cfg.draft.path:
        raise ConfigError(f"{source}: draft.kind = 'model' needs draft.path (a Hugging Face directory)")
    if cfg.draft.ngram_min > cfg.draft.ngram_max:
        raise ConfigError(
            f"{source}: draft.ngram_min = {cfg.draft.ngram_min} must be <= draft.ngram_max = {cfg.draft.ngram_max}"
        )
    if cfg.spec.tree != "chain" and cfg.draft.kind == "ngram":
        raise ConfigError(f"{source}: spec.tree = '{cfg.spec.tree}' needs draft.kind = 'model'; the n-gram "
                          "drafter proposes one chain (spec.tree = 'chain')")
    if cfg.spec.tree == "fixed" and not cfg.spec.branching:
        raise ConfigError(f"{source}: spec.tree = 'fixed' needs spec.branching, e.g. [4, 2, 2, 1]")
    nodes, width = 0, 1   # the largest tree a plan may ask for
    for b in cfg.spec.branching[:cfg.spec.max_depth] if cfg.spec.tree == "fixed" else []:
        width *= b
        nodes += width
    nodes = cfg.spec.num_nodes if cfg.spec.tree == "dynamic" else nodes
    if nodes > MAX_TREE_NODES:
        key = "spec.branching" if cfg.spec.tree == "fixed" else "spec.num_nodes"
        raise ConfigError(f"{source}: {key} makes trees of {nodes} nodes; at most {MAX_TREE_NODES} (each node is a "
                          "row of every verify pass)")
    if cfg.server.engines > 1 and not cfg.server.engine_process:
        raise ConfigError(f"{source}: server.engines = {cfg.server.engines} runs each engine core in a process of "
                          "its own; it cannot be combined with server.engine_process = false")
    if cfg.spec.depth > cfg.spec.max_depth:
        raise ConfigError(f"{source}: spec.depth = {cfg.spec.depth} must be <= spec.max_depth = {cfg.spec.max_depth}")
    return cfg


def load(path: str | os.PathLike) -> EngineConfig:
    """Load a TOML config; errors name the file and the key."""
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"config file not found: {p}")
    try:
        data = tomllib.loads(p.read_text())
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{p}: not valid TOML: {e}") from None
    except UnicodeDecodeError as e:
        raise ConfigError(f"{p}: not UTF-8 text (TOML files are UTF-8): {e}") from None
    return from_dict(data, source=str(p), base_dir=p.resolve().parent)


def default() -> EngineConfig:
    """The embedded pair with the default settings (what `specserve serve` runs with no config)."""
    return from_dict({}, source="defaults")


# Keyword overrides accepted by LLM(...) and the CLI: short name -> (section, field).
_SHORT_NAMES = {
    "target": ("target", "path"),
    "max_model_len": ("target", "max_model_len"),
    "draft": ("draft", "path"),
    "draft_kind": ("draft", "kind"),
    "spec_mode": ("spec", "mode"),
    "spec_depth": ("spec", "depth"),
    "spec_tree": ("spec", "tree"),
    "cpu_threads": ("cpu", "threads"),
    "cpu_compile": ("cpu", "compile"),
}


_TOP_LEVEL = ("device", "seed", "cuda_graphs")


def with_overrides(cfg: EngineConfig, **overrides: Any) -> EngineConfig:
    """Apply keyword overrides: a short name above, `dtype` (both models), any field name that is
    unique across sections (`block_size`, `max_num_seqs`, ...), or `section__field`."""
    draft, kind = overrides.get("draft"), overrides.get("draft_kind")
    if draft is not None and kind is not None and kind != (draft if draft in ("ngram", "none") else "model"):
        raise ConfigError(f"the draft {str(draft)!r} and the draft kind {kind!r} disagree: give one of them")
    data = msgspec.to_builtins(cfg)
    fields_by_name: dict[str, list[str]] = {}
    for section in ("target", "draft", "spec", "cache", "scheduler", "server", "cpu"):
        for f in msgspec.structs.fields(getattr(cfg, section)):
            fields_by_name.setdefault(f.name, []).append(section)
    for name, value in overrides.items():
        if value is None:
            continue
        if name == "dtype":
            data["target"]["dtype"] = value
            data["draft"]["dtype"] = value
        elif name in _TOP_LEVEL:
            data[name] = value
        elif name == "draft" and value in ("ngram", "none"):
            data["draft"]["kind"] = value
        elif name in _SHORT_NAMES:
            section, key = _SHORT_NAMES[name]
            data[section][key] = str(value) if key == "path" else value
            if name == "draft":
                data["draft"]["kind"] = "model"
        elif "__" in name:
            section, key = name.split("__", 1)
            data.setdefault(section, {})[key] = value
        elif len(fields_by_name.get(name, [])) == 1:
            data[fields_by_name[name][0]][name] = value
        else:
            allowed = sorted({*_SHORT_NAMES, "dtype", *_TOP_LEVEL} | {
                n for n, s in fields_by_name.items() if len(s) == 1})
            close = difflib.get_close_matches(name, allowed, n=1)
            hint = f"; did you mean '{close[0]}'?" if close else ""
            raise ConfigError(f"unknown setting '{name}'{hint}; allowed: {', '.join(allowed)} (or section__field)")
    return from_dict(data, source="settings")
