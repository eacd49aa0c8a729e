"""LLMEngine: schedule -> (draft ->) target forward -> accept -> postprocess, once per step.
AsyncEngine: the same engine on a worker thread, for the asyncio server."""

from __future__ import annotations

import asyncio
import itertools
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import torch

from specserve import config as config_mod
from specserve.config import EngineConfig
from specserve.cpu_malloc import keep_large_allocations_on_heap
from specserve.detokenizer import IncrementalDetokenizer
from specserve.errors import InvalidRequestError, ModelLoadError
from specserve.kv_pool import KVPool, blocks_needed
from specserve.model.loader import load_eos_token_ids, load_model, load_tokenizer
from specserve.request import Request, RequestStats
from specserve.runner import CpuThreads, ModelRunner
from specserve.sampling import SamplingParams, make_generator
from specserve.scheduler import Scheduler, SchedulerOutput
from specserve.spec import make_speculator

logger = logging.getLogger("specserve")

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "float64": torch.float64}


@dataclass
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]  # every generated token so far
    text: str  # every generated character so far (stop strings cut)
    new_token_ids: list[int]  # since the previous output of this request
    new_text: str
    finished: bool
    finish_reason: str | None  # "stop" | "length" | "abort" | "error" | None
    stats: RequestStats = field(repr=False, default_factory=RequestStats)
    error: str | None = None   # finish_reason "error": what went wrong (the request failed alone)
    # sampling.Logprob per token of token_ids (SamplingParams.logprobs), and per prompt token
    # (None for the first; SamplingParams.prompt_logprobs); None where not asked for. The lists
    # only grow while the request runs: entries up to len(token_ids) are this output's.
    logprobs: list | None = field(repr=False, default=None)
    prompt_logprobs: list | None = field(repr=False, default=None)
    num_drafted: int = 0   # the first this many of new_token_ids are accepted draft tokens, the rest the target's
    stop_reason: int | str | None = None   # finish_reason "stop": the stop token id or stop string (EOS: None)


def _resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise config_mod.ConfigError("device = 'cuda' but no CUDA device is available; use 'cpu' or 'auto'")
    return torch.device(name)


def _dtype(name: str):
    return "auto" if name == "auto" else _DTYPES[name]


# With [cpu] linear = "auto": a model with this much linear weight is packed for oneDNN whole
# (it streams from memory every step); a smaller one only its layers of _ONEDNN_MIN_LAYER_BYTES
# or more (a small draft's LM head, which streams from beyond the L2 cache every level).
_ONEDNN_MIN_MODEL_BYTES = 8 * 2**20
_ONEDNN_MIN_LAYER_BYTES = 2**20


def _onednn_min_layer_bytes(config: config_mod.EngineConfig, model) -> int | None:
    """Which of `model`'s linear layers to pack for oneDNN: those of at least this many bytes
    (None: none)."""
    if config.cpu.linear == "torch":
        return None
    if config.cpu.linear == "onednn" or model.linear_weight_bytes() >= _ONEDNN_MIN_MODEL_BYTES:
        return 0
    return _ONEDNN_MIN_LAYER_BYTES


class LLMEngine:
    def __init__(self, config: EngineConfig, progress: bool = True, detokenize: bool = True):
        """detokenize: produce text and match stop strings here (False: the caller does it from
        the token ids, as the API server does for an engine-core process; outputs carry no text)."""
        self.config = config
        self.detokenize = detokenize
        self.device = _resolve_device(config.device)
        if self.device.type == "cpu" and config.cpu.heap_malloc:
            keep_large_allocations_on_heap()   # before anything big is allocated: cpu_malloc.py
        if config.cpu.threads:
            torch.set_num_threads(config.cpu.threads)
        torch.manual_seed(config.seed)
        target, self.target_args = load_model(
            config.target.path, dtype=_dtype(config.target.dtype), device=self.device, progress=progress
        )
        self.tokenizer = load_tokenizer(config.target.path)
        # generation_config.json's (else config.json's) ids and the tokenizer's eos_token, as vLLM
        # stops: a ChatML fine-tune's tokenizer ends turns in <|im_end|> while its config files
        # often still name the base model's <|endoftext|>.
        self.eos_token_ids = load_eos_token_ids(config.target.path)
        if self.tokenizer.eos_token_id is not None and self.tokenizer.eos_token_id not in self.eos_token_ids:
            self.eos_token_ids.append(self.tokenizer.eos_token_id)
        positions = self.target_args.max_position_embeddings
        if config.target.max_model_len and config.target.max_model_len > positions:
            raise config_mod.ConfigError(
                f"target.max_model_len = {config.target.max_model_len} is more than the {positions} positions "
                f"of {config.target.path} (max_position_embeddings in its config.json)")
        self.max_model_len = config.target.max_model_len or positions

        draft_model = draft_args = None
        if config.draft.kind == "model":
            draft_model, draft_args = load_model(
                config.draft.path, dtype=_dtype(config.draft.dtype), device=self.device, progress=progress
            )
            # Pairs share a tokenizer, not always an embedding size (Qwen2.5-7B pads its vocabulary to
            # 152064, Qwen2.5-0.5B to 151936): the tokenizer is what must agree, and the draft's
            # distributions are padded to the target's width with zeros.
            needed = min(len(self.tokenizer), self.target_args.vocab_size)  # ids the target can see or emit
            if draft_args.vocab_size < needed:
                raise ModelLoadError(
                    f"draft {config.draft.path} has vocab_size {draft_args.vocab_size}, fewer than the "
                    f"{needed} token ids of the target ({config.target.path}): the pair must share one tokenizer"
                )
            self._check_same_tokenizer(config.draft.path)
            spec = config.spec
            width = {"fixed": max(spec.branching, default=0), "dynamic": spec.topk}.get(spec.tree, 1)
            if width > draft_args.vocab_size:
                key = "spec.branching" if spec.tree == "fixed" else "spec.topk"
                raise config_mod.ConfigError(f"{key} asks for {width} children of a node, more than the "
                                             f"{draft_args.vocab_size} tokens of the draft's vocabulary")
            draft_positions = draft_args.max_position_embeddings
            if config.target.max_model_len and config.target.max_model_len > draft_positions:
                raise config_mod.ConfigError(
                    f"target.max_model_len = {config.target.max_model_len} is more than the {draft_positions} "
                    f"positions of the draft {config.draft.path} (max_position_embeddings in its config.json)")
            if draft_positions < self.max_model_len:
                logger.warning("the context is cut to %d tokens: the draft %s has max_position_embeddings %d, "
                               "fewer than the target's %d", draft_positions, config.draft.path, draft_positions,
                               self.max_model_len)
                self.max_model_len = draft_positions

        # One pool: every block holds `block_size` positions of BOTH models' KV.
        block_size = config.cache.block_size
        bytes_per_block = self.target_args.kv_bytes_per_block(block_size, target.dtype)
        if draft_model is not None:
            bytes_per_block += draft_args.kv_bytes_per_block(block_size, draft_model.dtype)
        num_blocks = config.cache.num_blocks or self._size_pool(bytes_per_block)
        self.pool = KVPool(num_blocks, block_size, enable_prefix_caching=config.cache.enable_prefix_caching)
        threads = CpuThreads(torch.get_num_threads())
        self.target = ModelRunner(target, self.target_args, num_blocks, block_size, self.device, threads)
        self.draft = (ModelRunner(draft_model, draft_args, num_blocks, block_size, self.device, threads)
                      if draft_model else None)
        self._building: list[tuple] = []   # (name, runner, package, build process) not yet compiled
        self._next_build_check = 0.0
        if config.cpu.compile == "auto" and self.device.type == "cpu":
            self._use_compiled(config, block_size)
        for name, runner in (("target", self.target), ("draft", self.draft)):
            # A compiled forward runs its own matmuls; its runner's linear layers (the LM head,
            # forwards it does not take) keep F.linear.
            min_bytes = (None if runner is None or runner.compiled is not None
                         else _onednn_min_layer_bytes(config, runner.model))
            if min_bytes is not None and (packed := runner.model.pack_for_onednn(min_bytes)):
                if config.cpu.linear == "auto" and not self._packed_is_faster(runner):
                    runner.model.unpack_onednn()
                    logger.info("%s: F.linear measured faster than oneDNN here: kept", name)
                else:
                    logger.info("%s: %d linear layers run through oneDNN with packed weights", name, packed)
        if config.cuda_graphs:
            self._use_graphs(config, block_size)
        self.pool_bytes = num_blocks * bytes_per_block
        self.scheduler = Scheduler(config.scheduler, self.pool, self.max_model_len, has_draft_kv=self.draft is not None)
        self.spec = make_speculator(config, self)
        self._start_builds()
        self.requests: dict[str, Request] = {}
        self._ids = itertools.count()
        self._aborted: list[Request] = []
        self._last_step_end: float | None = None   # None: idle since (see idle())
        self.num_failed = 0      # requests that failed alone (finish_reason "error")
        self.num_restarts = 0    # times the engine was reset after its loop died
        logger.info(
            "pool: %d blocks x %d tokens = %d tokens, %.1f MiB (%d bytes per block)",
            num_blocks, block_size, num_blocks * block_size, self.pool_bytes / 2**20, bytes_per_block,
        )
        if num_blocks * block_size < self.max_model_len:
            logger.warning("the KV pool holds %d tokens, fewer than the context (max_model_len %d): a request "
                           "longer than the pool is refused (raise [cache] kv_cache_bytes or memory_fraction, "
                           "or lower target.max_model_len)", num_blocks * block_size, self.max_model_len)

    def _use_compiled(self, config: EngineConfig, block_size: int) -> None:
        """[cpu] compile = "auto": each float32 model runs its compiled forward when one is cached;
        one that is not is built in a process of its own, and taken up between steps when it is
        ready (_take_up_compiled)."""
        from specserve.model import compiled

        paths = {"target": config.target.path, "draft": config.draft.path if config.draft.kind == "model" else None}
        for name, runner in (("target", self.target), ("draft", self.draft)):
            if runner is None or paths[name] is None or not compiled.supported(runner.model):
                continue
            package = compiled.package_path(runner.model, block_size)
            forward = compiled.load(package, runner.model) if package.is_file() else None
            if forward is not None:
                runner.use_compiled(forward)
                logger.info("%s: compiled forward from %s", name, package)
                continue
            self._building.append((name, runner, package, paths[name]))

    def _start_builds(self) -> None:
        """Start building the compiled forwards that are not cached, once the engine is ready: the
        start-up probe runs without a compiler beside it."""
        from specserve.model import compiled

        started = []
        for name, runner, package, checkpoint in self._building:
            proc = compiled.build_in_background(checkpoint, "float32", self.pool.block_size, package)
            if proc is not None:
                logger.info("%s: building its compiled forward in the background (a few minutes, once; "
                            "log: %s); eager until then", name, package.with_suffix(".log"))
            else:   # another process builds it (its lock), or builds are off
                logger.info("%s: eager until its compiled forward appears at %s", name, package)
            started.append((name, runner, package, proc))
        self._building = started

    def _take_up_compiled(self) -> None:
        """Between steps, at most every 2 s: load the compiled forwards whose build has finished.
        The controller's step costs are probed again (a few seconds, once): they have changed."""
        from specserve.model import compiled

        self._next_build_check = time.perf_counter() + 2.0
        waiting, taken = [], False
        for name, runner, package, proc in self._building:
            if proc is not None and proc.poll() is None or proc is None and not package.is_file():
                waiting.append((name, runner, package, proc))   # still building (here or elsewhere)
            elif proc is not None and proc.returncode != 0:
                logger.warning("%s: building the compiled forward failed; staying eager (see %s)",
                               name, package.with_suffix(".log"))
            elif (forward := compiled.load(package, runner.model)) is not None:   # load() warns when it cannot
                runner.use_compiled(forward)
                logger.info("%s: now on its compiled forward (%s)", name, package)
                taken = True
        self._building = waiting
        if taken:
            self.spec.costs_changed()

    def _packed_is_faster(self, runner: ModelRunner) -> bool:
        """[cpu] linear = "auto": whether the model's oneDNN-packed forward beats F.linear on this
        machine, timed warm over the row counts steps run (1, 4, 16, 64), each way twice. Which
        path wins depends on the CPU's memory and on the BLAS, not only on the weights' size."""
        from specserve.profile import dummy_input

        inputs = [dummy_input(self.pool, 1, rows, 32) for rows in (1, 4, 16, 64)]

        def seconds() -> float:
            for inp in inputs:   # a warm-up: oneDNN builds a primitive per row count
                runner.forward(inp)[-1, 0].item()
            start = time.perf_counter()
            for _ in range(2):
                for inp in inputs:
                    runner.forward(inp)[-1, 0].item()
            return time.perf_counter() - start

        packed = seconds()
        layers = {m: m.__dict__.pop("onednn") for m in runner.model.modules() if "onednn" in m.__dict__}
        plain = seconds()
        for module, weights in layers.items():
            module.__dict__["onednn"] = weights
        return packed < 0.9 * plain

    def _use_graphs(self, config: EngineConfig, block_size: int) -> None:
        """cuda_graphs: both runners serve their uniform forwards from graphs (graphs.py), captured
        here on CUDA: decode steps and chain verify passes (1 to max_depth + 1 rows a sequence)
        of the target, and draft levels (one row) and catch-ups (two rows)."""
        max_rows = max(config.spec.max_depth, 1) + 1
        max_blocks = -(-(self.max_model_len + max_rows) // block_size)
        if self.device.type != "cuda":
            logger.warning("cuda_graphs = true on %s: nothing to capture; the padded forwards run eagerly",
                           self.device.type)
        pool = torch.cuda.graph_pool_handle() if self.device.type == "cuda" else None
        started = time.perf_counter()
        captured = 0
        for runner, rows in ((self.target, range(1, max_rows + 1)), (self.draft, [1, 2])):
            if runner is None:
                continue
            runner.use_graphs(config.scheduler.max_num_seqs, max_rows, max_blocks, pool=pool)
            if self.device.type == "cuda":
                captured += runner.graphs.capture_all(list(rows))
        if captured:
            logger.info("captured %d CUDA graphs in %.1f s", captured, time.perf_counter() - started)

    def _size_pool(self, bytes_per_block: int) -> int:
        if self.device.type == "cuda":
            # fuse_projections freed the unfused weights into the caching allocator; hand them
            # back first or the driver does not count them as free.
            torch.cuda.empty_cache()
            free, _ = torch.cuda.mem_get_info(self.device)
            budget = int(free * self.config.cache.memory_fraction)
        else:
            budget = self.config.cache.kv_cache_bytes
        num_blocks = budget // bytes_per_block
        if num_blocks < 2:
            raise config_mod.ConfigError(
                f"cache: {budget} bytes hold only {num_blocks} blocks of {bytes_per_block} bytes; "
                f"raise cache.kv_cache_bytes (or memory_fraction on CUDA)"
            )
        return num_blocks

    def _check_same_tokenizer(self, draft_path: str) -> None:
        try:
            draft_tok = load_tokenizer(draft_path)
        except ModelLoadError:
            return  # a draft without its own tokenizer files uses the target's
        probe = "def f(x):\n    return x  # ünïcode 你好 🙂"
        if draft_tok.encode(probe) != self.tokenizer.encode(probe):
            raise ModelLoadError(
                f"draft {draft_path} tokenizes text differently from target {self.config.target.path}: "
                "a draft model must share the target's tokenizer"
            )

    # -- requests ------------------------------------------------------------------------

    def add_request(
        self, request_id: str | None, prompt: str | list[int], params: SamplingParams | None = None
    ) -> Request:
        params = params or SamplingParams()
        params.validate()
        request_id = request_id if request_id is not None else f"req-{next(self._ids)}"
        if request_id in self.requests:
            raise InvalidRequestError(f"request id {request_id!r} is already in use", param="request_id")
        prompt_ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        vocab = self.target_args.vocab_size
        bad = [t for t in prompt_ids if not (isinstance(t, int) and 0 <= t < vocab)]
        if bad:
            why = (" (its text: the tokenizer has more tokens than the model's vocab_size)"
                   if isinstance(prompt, str) else "")
            raise InvalidRequestError(f"prompt token ids must be in [0, {vocab}); got {bad[:5]}{why}", param="prompt")
        if not prompt_ids:
            raise InvalidRequestError("prompt is empty", param="prompt")
        if params.logit_bias and (bad := [t for t in params.logit_bias if t >= vocab]):
            raise InvalidRequestError(f"logit_bias names token ids outside the vocabulary [0, {vocab}): {bad[:5]}",
                                      param="logit_bias")
        total = len(prompt_ids) + params.max_tokens
        if total > self.max_model_len:
            raise InvalidRequestError(
                f"this model's maximum context length is {self.max_model_len} tokens; the request asks for "
                f"{total} ({len(prompt_ids)} in the prompt, {params.max_tokens} to generate)",
                param="max_tokens" if len(prompt_ids) < self.max_model_len else "prompt",
            )
        # KV for every token but the last one generated, which is never computed (a request for
        # prompt logprobs alone, max_tokens 0, computes its whole prompt).
        kv_tokens = max(len(prompt_ids), total - 1)
        if blocks_needed(kv_tokens, self.pool.block_size) > self.pool.num_blocks:
            raise InvalidRequestError(
                f"the request needs {kv_tokens} tokens of KV cache but the whole pool holds "
                f"{self.pool.num_blocks * self.pool.block_size}",
                param="max_tokens",
            )
        if len(self.scheduler.waiting) >= self.config.scheduler.max_waiting_requests:
            raise QueueFullError(
                f"{len(self.scheduler.waiting)} requests are waiting (scheduler.max_waiting_requests); try again later"
            )
        req = Request(
            request_id,
            prompt_ids,
            params,
            self.eos_token_ids,
            detokenizer=IncrementalDetokenizer(self.tokenizer, prompt_ids, params.stop, params.skip_special_tokens,
                                               params.min_tokens, params.include_stop_str_in_output)
            if self.detokenize
            else None,
            generator=make_generator(params.seed) if params.seed is not None else None,
        )
        self.requests[request_id] = req
        self.scheduler.add(req)
        return req

    def abort_request(self, request_id: str) -> None:
        req = self.requests.pop(request_id, None)
        if req is not None and not req.is_finished:
            self.scheduler.finish(req, "abort")
            self.spec.forget(req)
            self._aborted.append(req)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    def speculation(self) -> dict:
        """The speculation setting in use: {"mode": "adaptive"}, {"mode": "static", "depth": d},
        or {"mode": "off"} (no draft)."""
        return self.spec.setting()

    def snapshot(self) -> dict:
        """The engine's state as plain data (what /metrics and /stats show; the engine-core
        process sends it with its outputs)."""
        totals, controller = self.spec.totals, self.spec.controller
        return {
            "running": len(self.scheduler.running), "waiting": len(self.scheduler.waiting),
            "kv_usage": self.pool.usage, "blocks_held": self.pool.num_blocks - self.pool.num_free_blocks,
            "prefix_cache_queries": self.pool.prefix_cache_query_tokens,
            "prefix_cache_hits": self.pool.prefix_cache_hit_tokens,
            "restarts": self.num_restarts, "failed": self.num_failed, "speculation": self.speculation(),
            "preemptions": self.scheduler.num_preemptions,
            "num_drafts": totals.num_drafts, "num_draft_tokens": totals.num_draft_tokens,
            "num_accepted_tokens": totals.num_accepted_tokens,
            "accepted_per_position": list(totals.accepted_per_position),
            "tokens_per_pass": totals.mean_tokens_per_pass, "depth": totals.last_depth,
            "controller": controller.snapshot() if controller is not None else None,
        }

    def set_speculation(self, mode: str, depth: int | None = None) -> dict:
        """Switch to the adaptive controller or a static depth between two steps (exact either
        way); InvalidRequestError names what cannot be. Returns the new setting."""
        setting = self.spec.set_setting(mode, depth)
        logger.info("speculation set to %s", setting)
        return setting

    # -- one step ------------------------------------------------------------------------

    def idle(self) -> None:
        """The caller is about to wait for work: the time until the next step is nobody's cost."""
        self._last_step_end = None

    @torch.inference_mode()
    def step(self) -> list[RequestOutput]:
        start = time.perf_counter()
        plan = self.spec.plan(self.scheduler.running)
        batch = self.scheduler.schedule(plan.nodes)
        try:
            new_tokens = self.spec.step(batch, plan)
        except Exception:
            # Past the requests' own parts (which fail alone: spec.failed), a step that raises
            # is run again one sequence at a time, so that only the one whose data breaks it fails.
            logger.exception("engine step failed; running its sequences one at a time")
            self.spec.recover()
            new_tokens = {}
            for seq in batch.seqs:
                try:
                    new_tokens.update(self.spec.step(SchedulerOutput([seq]), plan))
                except Exception as e:
                    self.spec.failed[seq.request.request_id] = f"the engine step serving this request failed: {e!r}"
            self.spec.recover(keep_failed=True)
        for request_id, message in self.spec.failed.items():
            if (req := self.requests.get(request_id)) is not None:
                self._fail(req, message)
        self.spec.failed.clear()
        outputs = self._postprocess(batch, new_tokens)
        # A step costs the process from the end of the one before (unless it idled since): the
        # caller's handling of the outputs, in a server its SSE events, is part of every step.
        end = time.perf_counter()
        self.spec.end_step(end - (start if self._last_step_end is None else self._last_step_end))
        self._last_step_end = end
        if self._building and end > self._next_build_check:
            self._take_up_compiled()
            self._last_step_end = time.perf_counter()
        return outputs

    def _postprocess(self, batch: SchedulerOutput, new_tokens: dict[str, list[int]]) -> list[RequestOutput]:
        outputs = [self._output(req) for req in self._aborted]
        self._aborted.clear()
        now = time.monotonic()
        for s in batch.seqs:
            req = s.request
            if req.is_finished:   # failed in this step (or aborted): reported above
                continue
            toks = new_tokens.get(req.request_id)
            if toks is None:  # a prefill chunk that did not reach the end of the prompt
                req.num_computed_tokens += s.num_new_tokens
                self.scheduler.postprocess(req)
                continue
            # The verify pass computed the pending token and every accepted node: all but the
            # last new token (the bonus, or the one sampled token) now have target KV.
            req.num_computed_tokens += s.num_new_tokens + len(toks) - 1
            req.stats.num_target_passes += 1
            if req.stats.first_token_time is None:
                req.stats.first_token_time = now
            try:
                reason = self._append(req, toks)
            except Exception as e:   # its detokenizer or stop check: this request fails alone
                logger.exception("request %s failed in its output", req.request_id)
                self._fail(req, f"producing this request's output failed: {e!r}")
                outputs.append(self._output(self._aborted.pop()))
                continue
            if reason is None:
                self.scheduler.postprocess(req)
            else:
                self.scheduler.finish(req, reason)
                self.spec.forget(req)
                self.requests.pop(req.request_id, None)
            outputs.append(self._output(req))
        return outputs

    def _append(self, req: Request, toks: list[int]) -> str | None:
        """Append the step's tokens, cutting exactly where the target alone would have stopped."""
        params, reason = req.params, None
        if params.max_tokens == 0:   # prompt logprobs only
            return "length"
        kept = 0
        for tok in toks:
            req.token_ids.append(tok)
            kept += 1
            n_out = req.num_output_tokens
            # min_tokens holds back EOS and stop_token_ids alike (SamplingParams' contract).
            if n_out >= params.min_tokens and (
                tok in req.stop_token_ids or (tok in req.eos_token_ids and not params.ignore_eos)
            ):
                reason = "stop"
                # vLLM: null for the tokenizer's eos_token; generation_config's other EOS ids
                # (Llama 3.1's <|eom_id|>, Gemma's <end_of_turn>) act as stop_token_ids: their id.
                primary = tok == self.tokenizer.eos_token_id and not params.ignore_eos
                req.stop_reason = None if primary else tok
            elif n_out >= params.max_tokens or req.num_tokens >= self.max_model_len:
                reason = "length"
            if reason:
                break
        if req.detokenizer is not None:
            # The text of an EOS or stop token id is not output (vLLM's rule, as OpenAI's stop).
            hidden = reason == "stop" and not params.include_stop_str_in_output
            delta, stop_index = req.detokenizer.append(toks[:kept - hidden])
            if stop_index is not None:
                drop = kept - 1 - stop_index  # tokens after the one that completed the stop string
                if drop:
                    del req.token_ids[-drop:]
                reason, req.stop_reason = "stop", req.detokenizer.stop_string
            elif reason is not None:
                delta += req.detokenizer.flush()
                if req.detokenizer.stopped:
                    reason, req.stop_reason = "stop", req.detokenizer.stop_string
            req.new_text += delta
        if req.logprobs is not None:
            del req.logprobs[req.num_output_tokens:]   # the step's tokens past the end
        return reason

    def _fail(self, req: Request, message: str) -> None:
        """End one request with finish_reason "error": its blocks go back, its stream gets the
        message, nothing else is touched."""
        self.num_failed += 1
        self.requests.pop(req.request_id, None)
        req.error = message
        if not req.is_finished:
            self.scheduler.finish(req, "error")
        self.spec.forget(req)
        self._aborted.append(req)

    def reset(self) -> None:
        """Start over after the engine loop died: a new pool and scheduler (the models and their
        KV tensors stay), no requests; the controller keeps what it learned of the machine."""
        config, old_pool, old_scheduler = self.config, self.pool, self.scheduler
        self.pool = KVPool(self.pool.num_blocks, self.pool.block_size,
                           enable_prefix_caching=config.cache.enable_prefix_caching)
        self.scheduler = Scheduler(config.scheduler, self.pool, self.max_model_len, has_draft_kv=self.draft is not None)
        # /metrics' counters never go back: the new pool and scheduler go on from the old ones' counts
        self.pool.prefix_cache_query_tokens = old_pool.prefix_cache_query_tokens
        self.pool.prefix_cache_hit_tokens = old_pool.prefix_cache_hit_tokens
        self.scheduler.num_preemptions = old_scheduler.num_preemptions
        for req in list(self.requests.values()):
            self.spec.forget(req)
        self.spec.recover()
        self.requests.clear()
        self._aborted.clear()
        self._last_step_end = None
        self.num_restarts += 1

    def _output(self, req: Request) -> RequestOutput:
        new_ids = req.token_ids[req.num_prompt_tokens + req.num_reported_tokens :]
        req.num_reported_tokens = req.num_output_tokens
        num_drafted, req.num_step_drafted = min(req.num_step_drafted, len(new_ids)), 0
        new_text, req.new_text = req.new_text, ""
        req.text += new_text
        return RequestOutput(
            request_id=req.request_id,
            prompt_token_ids=req.prompt_token_ids,
            token_ids=req.output_token_ids,
            text=req.text,
            new_token_ids=new_ids,
            new_text=new_text,
            finished=req.is_finished,
            finish_reason=req.finish_reason,
            stop_reason=req.stop_reason,
            stats=req.stats,
            error=req.error,
            logprobs=req.logprobs,
            prompt_logprobs=req.prompt_logprobs,
            num_drafted=num_drafted,
        )


class QueueFullError(InvalidRequestError):
    """The waiting queue is full (HTTP 429)."""


class EngineDeadError(RuntimeError):
    """The engine loop died; the server reports 503."""


async def outputs(queue: asyncio.Queue) -> AsyncIterator[RequestOutput]:
    """One request's outputs from its queue, up to the finished one; an exception put on the
    queue (the engine died, the request was refused) is raised."""
    while True:
        item = await queue.get()
        if isinstance(item, BaseException):
            raise item
        yield item
        if item.finished:
            return


def _resolve(future: asyncio.Future, value) -> None:
    if not future.done():
        future.set_result(value)


class AsyncEngine:
    """The engine on a worker thread: steps run off the event loop, so streaming, health
    and metrics stay responsive while a step computes. Requests enter and leave through a
    thread-safe command queue drained between steps.

    Supervision: if the engine loop dies (an error outside what a step isolates), every
    stream in flight gets an EngineDeadError, the engine is reset (a new pool and scheduler:
    LLMEngine.reset) and the loop goes on; `restarting` is true meanwhile."""

    def __init__(self, engine: LLMEngine):
        self.engine = engine
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._wake = threading.Event()
        self._streams: dict[str, asyncio.Queue] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._stopping = False
        self.error: BaseException | None = None   # why the engine loop last died
        self.restarting = False

    @property
    def is_alive(self) -> bool:
        return not self.restarting and self._thread is not None and self._thread.is_alive()

    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run, name="specserve-engine", daemon=True)
        self._thread.start()

    async def shutdown(self) -> None:
        self._stopping = True
        self._wake.set()
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join, 10.0)

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    def snapshot(self) -> dict:
        return self.engine.snapshot()

    def num_waiting(self) -> int:
        return len(self.engine.scheduler.waiting)

    async def generate(
        self, prompt: str | list[int], params: SamplingParams, request_id: str
    ) -> AsyncIterator[RequestOutput]:
        """Stream outputs of one request. Leaving the iterator early (a client disconnect)
        aborts the request, and its blocks return to the pool."""
        if not self.is_alive:
            raise EngineDeadError(f"the engine is not running: {self.error!r}")
        stream: asyncio.Queue = asyncio.Queue()
        self._streams[request_id] = stream
        added = self._loop.create_future()  # resolved by the engine thread: None or the error
        self._commands.put(("add", (request_id, prompt, params), added, None))
        self._wake.set()
        finished = False
        try:
            # Inside the try: a caller cancelled while the add is pending still aborts it.
            error = await self._answer(added)
            if error is not None:
                finished = True  # never added: nothing to abort (and the id may be another request's)
                raise error
            async for out in outputs(stream):
                finished = out.finished
                yield out
        finally:
            self._streams.pop(request_id, None)
            if not finished:
                self.abort(request_id)

    def abort(self, request_id: str) -> None:
        self._commands.put(("abort", request_id, None, None))
        self._wake.set()

    async def set_speculation(self, mode: str, depth: int | None = None) -> dict:
        """LLMEngine.set_speculation on the engine thread, between two steps."""
        if not self.is_alive:
            raise EngineDeadError(f"the engine is not running: {self.error!r}")
        done = self._loop.create_future()
        self._commands.put(("speculation", (mode, depth), done, None))
        self._wake.set()
        result = await self._answer(done)
        if isinstance(result, BaseException):
            raise result
        return result

    async def _answer(self, future: asyncio.Future):
        """The engine thread's answer to a command. Polling: an engine that stops before
        draining the command must not hang the caller."""
        while True:
            try:
                return await asyncio.wait_for(asyncio.shield(future), 0.5)
            except asyncio.TimeoutError:
                if not self.is_alive:
                    raise EngineDeadError(f"the engine is not running: {self.error!r}") from None

    def _drain_commands(self) -> None:
        while True:
            try:
                kind, arg, done, result = self._commands.get_nowait()
            except queue.Empty:
                return
            if kind == "add":
                error = None
                try:
                    self.engine.add_request(*arg)
                except Exception as e:  # a bad request never harms the others
                    error = e
                self._loop.call_soon_threadsafe(_resolve, done, error)
            elif kind == "abort":
                self.engine.abort_request(arg)
            elif kind == "speculation":
                try:
                    result = self.engine.set_speculation(*arg)
                except Exception as e:   # a bad setting is the caller's error, never the engine's
                    result = e
                self._loop.call_soon_threadsafe(_resolve, done, result)

    def _run(self) -> None:
        while not self._stopping:
            try:
                self._drain_commands()
                if not self.engine.has_unfinished_requests() and not self.engine._aborted:
                    self.engine.idle()
                    self._wake.wait(0.05)
                    self._wake.clear()
                    continue
                outputs = self.engine.step()
                if outputs:
                    self._loop.call_soon_threadsafe(self._deliver, outputs)
            except Exception as e:   # the loop died: every stream learns it, the engine starts over
                logger.exception("engine loop died; resetting the engine")
                self.restarting, self.error = True, e
                self.fail_all(EngineDeadError(f"the engine stopped ({e!r}) and is restarting; retry"))
                time.sleep(0.1)   # a fault that repeats at once does not spin the core
                self.engine.reset()
                self.restarting = False

    def fail_all(self, error: Exception) -> None:
        """End every stream in flight with `error` (thread-safe)."""
        self._loop.call_soon_threadsafe(self._fail_all, error)

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if stream is not None:
                stream.put_nowait(out)

    def _fail_all(self, error: Exception) -> None:
        for stream in self._streams.values():
            stream.put_nowait(error)
