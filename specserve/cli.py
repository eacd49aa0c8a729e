"""`specserve serve | generate`: the command line."""

from __future__ import annotations

import argparse
import importlib.metadata
import logging
import os
import sys
import time

from specserve.errors import SpecserveError


def _int_in(low: int, high: int | None = None):
    """An argparse type: an integer in [low, high], else argparse's one-line error naming the flag."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"invalid int value: {text!r}") from None
        if value < low or (high is not None and value > high):
            bound = f"in [{low}, {high}]" if high is not None else f">= {low}"
            raise argparse.ArgumentTypeError(f"must be an integer {bound}, got {value}")
        return value
    return parse


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid float value: {text!r}") from None
    if not value >= 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a number of seconds >= 0, got {text}")
    return value


def _add_engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", help="TOML config (default: the embedded pair, configs/tiny.toml)")
    p.add_argument("--target", help="target model directory (overrides [target] path)")
    p.add_argument("--draft", help="draft model directory, or 'ngram' / 'none' (overrides [draft])")
    p.add_argument("--draft-kind", choices=["model", "ngram", "none"])
    p.add_argument("--device", choices=["auto", "cpu", "cuda"])
    p.add_argument("--dtype", choices=["auto", "float32", "bfloat16", "float16", "float64"])
    p.add_argument("--spec-mode", choices=["adaptive", "static"])
    p.add_argument("--spec-depth", type=_int_in(0))
    p.add_argument("--spec-tree", choices=["chain", "fixed", "dynamic"])
    p.add_argument("--num-blocks", type=_int_in(1))
    p.add_argument("--max-num-seqs", type=_int_in(1))
    p.add_argument("--cpu-threads", type=_int_in(1), help="torch intra-op threads (default: torch's choice)")
    p.add_argument("--cpu-compile", choices=["auto", "off"],
                   help="float32 forwards compiled ahead of time, built once in the background (default: auto)")


def _engine_config(args):
    from specserve import config as config_mod

    cfg = config_mod.load(args.config) if args.config else config_mod.default()
    overrides = {
        "target": args.target, "draft": args.draft, "draft_kind": args.draft_kind, "device": args.device,
        "dtype": args.dtype, "spec_mode": args.spec_mode, "spec_depth": args.spec_depth,
        "spec_tree": args.spec_tree, "num_blocks": args.num_blocks, "max_num_seqs": args.max_num_seqs,
        "cpu_threads": args.cpu_threads, "cpu_compile": args.cpu_compile,
    }
    if args.target and not args.draft and not args.draft_kind and not args.config:
        overrides["draft_kind"] = "none"
    depth = overrides["spec_depth"]
    if depth is not None and depth > config_mod.MAX_DEPTH:
        raise config_mod.ConfigError(f"--spec-depth {depth} is too deep: at most {config_mod.MAX_DEPTH}")
    if depth is not None and depth > cfg.spec.max_depth:   # a deeper static depth raises the cap with it
        overrides["spec__max_depth"] = depth
    return config_mod.with_overrides(cfg, **overrides)


def cmd_generate(args) -> int:
    from specserve.llm import LLM
    from specserve.sampling import SamplingParams

    from specserve import config as config_mod

    from specserve.errors import ConfigError, InvalidRequestError

    prompts = args.prompt or ["def fibonacci(n):"]
    try:   # checked before anything loads, and named as the flag
        params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                                top_k=args.top_k, seed=args.seed)
    except InvalidRequestError as e:
        flag = f"--{e.param.replace('_', '-')}" if e.param else "a sampling flag"
        raise ConfigError(f"argument {flag}: {e}") from None
    cfg = _engine_config(args)
    # The prompts run together: no batch is ever larger, so the controller probes no larger one.
    cfg = config_mod.with_overrides(cfg, max_num_seqs=min(cfg.scheduler.max_num_seqs, len(prompts)))
    print(f"target: {cfg.target.path}\ndraft:  {cfg.draft.kind} {cfg.draft.path or ''}", file=sys.stderr)
    llm = LLM(cfg)
    start = time.perf_counter()
    outs = llm.generate(prompts, params, progress=len(prompts) > 1)
    elapsed = time.perf_counter() - start
    num_tokens = 0
    for prompt, out in zip(prompts, outs):
        num_tokens += len(out.token_ids)
        print(f"--- {prompt!r} ({len(out.token_ids)} tokens, {out.finish_reason}, "
              f"{out.stats.mean_tokens_per_pass:.2f} tokens per target pass)", file=sys.stderr, flush=True)
        print(prompt + out.text, flush=True)   # stdout: the text alone
    print(f"--- {num_tokens} tokens in {elapsed:.2f} s ({num_tokens / elapsed:.1f} tokens/s)", file=sys.stderr)
    return 0


def cmd_serve(args) -> int:
    from specserve import config as config_mod
    from specserve.server.app import serve

    cfg = _engine_config(args)
    cfg = config_mod.with_overrides(cfg, host=args.host, port=args.port, admin_api=True if args.admin_api else None,
                                    shutdown_timeout_s=args.shutdown_timeout,
                                    engine_process=False if args.engine_thread else None, engines=args.engines,
                                    api_key=os.environ.get("SPECSERVE_API_KEY") or None,
                                    served_model_name=args.served_model_name)
    if args.ray:
        from specserve.server.ray_serve import serve_on_ray

        serve_on_ray(cfg, args.replicas, args.max_replicas)
        return 0
    serve(cfg)
    return 0


def cmd_calibrate(args) -> int:
    from specserve.engine import LLMEngine

    from specserve import profile

    cfg = _engine_config(args)
    where = profile.cache_dir()
    try:   # before minutes of measuring, not after
        where.mkdir(parents=True, exist_ok=True)
        probe_file = where / f".writable.{os.getpid()}"
        probe_file.write_text("")
        probe_file.unlink()
    except OSError as e:
        raise SpecserveError(f"cannot write profiles to {where}: {e.strerror or e} "
                             "(set SPECSERVE_CACHE_DIR to a writable folder)") from None
    cfg.spec.mode = "static"   # the engine's own start-up probe is not wanted: this one is thorough
    from specserve.model import compiled

    compiled.build_for(cfg)
    engine = LLMEngine(cfg)
    spec = engine.spec
    if spec.drafter is None:
        print("specserve: nothing to calibrate: this setup has no draft ([draft] kind = 'none')", file=sys.stderr)
        return 2
    path = profile.calibrate(engine, spec.buckets(), spec.nodes_at(spec.max_depth()) + 1)
    print(f"profile written to {path}; `specserve serve` with this setup starts from it")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="specserve", description="speculative-decoding inference service")
    parser.add_argument("--version", action="version", version=f"specserve {importlib.metadata.version('specserve')}")
    sub = parser.add_subparsers(dest="command")

    p = serve_parser = sub.add_parser("serve", help="serve the OpenAI-compatible HTTP API (default: the embedded pair)")
    _add_engine_args(p)
    p.add_argument("--host")
    p.add_argument("--port", type=_int_in(0, 65535))
    p.add_argument("--served-model-name", help="the model's name in the API, e.g. the Hugging Face id clients "
                   "send (default: the target directory's name; sets [server] served_model_name)")
    p.add_argument("--shutdown-timeout", type=_seconds, help="seconds SIGTERM waits for requests in flight")
    p.add_argument("--admin-api", action="store_true",
                   help="serve GET/POST /admin/speculation, to switch between adaptive and a static depth "
                        "while running (sets [server] admin_api)")
    p.add_argument("--engines", type=_int_in(1, 64),
                   help="engine cores behind the server (data parallel; sets [server] engines)")
    p.add_argument("--ray", action="store_true", help="serve on Ray Serve, one engine per replica (pip install -e "
                   "'.[ray]'; the cluster of RAY_ADDRESS, else a local one)")
    p.add_argument("--replicas", type=_int_in(1), help="with --ray: replicas (engines; default 1)")
    p.add_argument("--max-replicas", type=_int_in(1), help="with --ray: scale up to this many on requests in flight")
    p.add_argument("--engine-thread", action="store_true",
                   help="run the engine on a thread of the server's process instead of an engine-core process "
                        "(sets [server] engine_process = false)")
    p.set_defaults(func=cmd_serve)

    p = sub.add_parser("calibrate", help="measure the step costs of a setup once, for faster starts")
    _add_engine_args(p)
    p.set_defaults(func=cmd_calibrate)

    p = sub.add_parser("generate", help="generate offline and print the text")
    _add_engine_args(p)
    p.add_argument("--prompt", action="append", help="a prompt (repeat for a batch)")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int)
    p.set_defaults(func=cmd_generate)

    args = parser.parse_args(argv)
    if args.command == "serve":
        if args.ray and (args.engines is not None or args.engine_thread):
            other = "--engines" if args.engines is not None else "--engine-thread"
            serve_parser.error(f"argument --ray: not allowed with {other} (Ray runs one engine per replica: use "
                               "--replicas)")
        if not args.ray and (args.replicas is not None or args.max_replicas is not None):
            flag = "--replicas" if args.replicas is not None else "--max-replicas"
            serve_parser.error(f"argument {flag}: only with --ray")
        if args.engine_thread and args.engines is not None and args.engines > 1:
            serve_parser.error(f"argument --engine-thread: not allowed with --engines {args.engines} "
                               "(each engine core runs in a process of its own)")
        if args.ray and args.max_replicas is not None and args.max_replicas < (args.replicas or 1):
            serve_parser.error(f"argument --max-replicas: {args.max_replicas} is below --replicas {args.replicas or 1}")
        if args.replicas is None:
            args.replicas = 1
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        return args.func(args)
    except SpecserveError as e:
        print(f"specserve: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    except Exception as e:   # a fault of ours: one line here, the traceback in the log at debug level
        logging.getLogger("specserve").debug("unexpected error", exc_info=True)
        print(f"specserve: error: {type(e).__name__}: {e} (run with SPECSERVE_DEBUG=1 for the traceback)",
              file=sys.stderr)
        if os.environ.get("SPECSERVE_DEBUG"):
            raise
        return 1


if __name__ == "__main__":
    sys.exit(main())
