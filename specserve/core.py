"""The engine core in a process of its own (DESIGN.md §7, vLLM v1's split).

The core process owns the scheduler, the pool, the models and the controller, and runs
`LLMEngine.step` in a loop that never waits on HTTP. The API server process talks to it
through `EngineCoreClient`, which has AsyncEngine's interface, so the app serves either.
Messages are msgspec (msgpack) Structs over two ZMQ sockets: adds, aborts and control to the
core; each step's outputs (new token ids, finish reasons, logprobs, provenance) and the
engine's snapshot (what /metrics shows) back, batched per step. The API server makes the
text: incremental detokenization and stop strings run in its process, not the core's.

Supervision: a core that dies (its loop raised, or it was killed) is noticed by the client
within `_POLL_S`; every stream in flight ends with EngineDeadError, /health answers 503
while a new core starts on fresh sockets, and `restarts` counts it.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import multiprocessing
import os
import tempfile
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

import msgspec

from specserve.config import EngineConfig
from specserve.detokenizer import IncrementalDetokenizer
from specserve.engine import EngineDeadError, QueueFullError, RequestOutput, outputs
from specserve.errors import InvalidRequestError, SpecserveError
from specserve.sampling import SamplingParams

logger = logging.getLogger("specserve")

_POLL_S = 0.2            # the client checks the core is alive at least this often
_SNAPSHOT_S = 0.1        # the core sends its snapshot at most this often
_START_TIMEOUT_S = 900   # loading a large pair takes a while


# -- messages ---------------------------------------------------------------------------------


class AddRequest(msgspec.Struct, tag=True):
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams


class Abort(msgspec.Struct, tag=True):
    request_ids: list[str]


class SetSpeculation(msgspec.Struct, tag=True):
    call_id: int
    mode: Any                  # as the caller sent them: the engine validates (a 400 naming the field)
    depth: Any = None


class Shutdown(msgspec.Struct, tag=True):
    pass


class CoreOutput(msgspec.Struct, array_like=True):
    request_id: str
    prompt_token_ids: list[int] | None   # with a request's first output only
    new_token_ids: list[int]   # text is made from them in the API server (detokenize=False here)
    finished: bool
    finish_reason: str | None
    error: str | None
    num_drafted: int
    logprobs: list | None            # entries of new_token_ids
    prompt_logprobs: list | None     # with the first output only
    stop_reason: int | None = None   # a stop token id that ended it


class Ready(msgspec.Struct, tag=True):
    max_model_len: int
    snapshot: dict


class Failed(msgspec.Struct, tag=True):   # the engine could not be built: why, in one line
    message: str


class Step(msgspec.Struct, tag=True):
    outputs: list[CoreOutput]
    snapshot: dict | None


class Refused(msgspec.Struct, tag=True):   # add_request raised: the request never ran
    request_id: str
    queue_full: bool
    message: str
    param: str | None


class Reply(msgspec.Struct, tag=True):
    call_id: int
    result: dict | None
    message: str | None
    param: str | None
    snapshot: dict | None = None   # the engine's state after the call: an idle core sends no Step


ToCore = AddRequest | Abort | SetSpeculation | Shutdown
FromCore = Ready | Step | Refused | Reply | Failed


class EngineStartError(EngineDeadError, SpecserveError):
    """The engine core could not be built (a bad checkpoint or setting): a user's error."""


# -- the core process -------------------------------------------------------------------------


def run_core(config: EngineConfig, in_addr: str, out_addr: str, cpus: list[int] | None = None) -> None:
    """The core process's main: build the engine, then step while there is work and wait on
    the input socket while there is none. An exception that escapes a step ends the process
    (the client restarts it). Its lifetime is the API server's: signals to the process group
    are left to the server (which drains, then sends Shutdown), and a core whose server is
    gone exits."""
    import signal

    import zmq

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN)
    parent = os.getppid()
    if cpus:   # one of several cores on this machine: its share of the CPUs
        os.sched_setaffinity(0, cpus)

    from specserve.engine import LLMEngine

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s [core] %(message)s")
    ctx = zmq.Context()
    inbox, outbox = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
    inbox.connect(in_addr)
    outbox.connect(out_addr)
    encode, decode = msgspec.msgpack.Encoder().encode, msgspec.msgpack.Decoder(ToCore).decode
    try:
        engine = LLMEngine(config, progress=False, detokenize=False)   # the API server detokenizes
    except Exception as e:   # the message goes to the server; a bad checkpoint or setting is no bug to trace
        if not isinstance(e, SpecserveError):
            logger.exception("the engine could not start")
        outbox.send(encode(Failed(str(e) if isinstance(e, SpecserveError) else f"{type(e).__name__}: {e}")))
        inbox.close(linger=0)
        outbox.close(linger=5000)   # the message is delivered before the process ends
        ctx.term()
        raise SystemExit(1) from None
    outbox.send(encode(Ready(engine.max_model_len, engine.snapshot())))
    first_output: set[str] = set()   # requests whose first output is still to come
    last_snapshot, stepped = 0.0, False
    while os.getppid() == parent:
        busy = engine.has_unfinished_requests() or bool(engine._aborted)
        timeout = 0 if busy else int(_SNAPSHOT_S * 1000)
        while inbox.poll(timeout):
            timeout = 0
            try:
                msg = decode(inbox.recv())
            except msgspec.DecodeError:   # a message of the wrong shape costs only itself
                logger.exception("the engine core dropped a message it could not read")
                continue
            if isinstance(msg, AddRequest):
                try:
                    engine.add_request(msg.request_id, msg.prompt_ids, msg.params)
                    first_output.add(msg.request_id)
                except InvalidRequestError as e:
                    outbox.send(encode(Refused(msg.request_id, isinstance(e, QueueFullError), str(e), e.param)))
            elif isinstance(msg, Abort):
                for request_id in msg.request_ids:
                    engine.abort_request(request_id)
            elif isinstance(msg, SetSpeculation):
                try:
                    reply = Reply(msg.call_id, engine.set_speculation(msg.mode, msg.depth), None, None,
                                  engine.snapshot())
                except InvalidRequestError as e:
                    reply = Reply(msg.call_id, None, str(e), e.param)
                outbox.send(encode(reply))
            else:
                return
        sent = []
        if engine.has_unfinished_requests() or engine._aborted:
            stepped = True
            for out in engine.step():
                first = out.request_id in first_output
                if first or out.finished:
                    first_output.discard(out.request_id)
                end = len(out.token_ids)
                sent.append(CoreOutput(
                    out.request_id, out.prompt_token_ids if first else None, out.new_token_ids,
                    out.finished, out.finish_reason, out.error, out.num_drafted,
                    out.logprobs[end - len(out.new_token_ids):end] if out.logprobs is not None else None,
                    out.prompt_logprobs if first else None, out.stop_reason))
        else:
            engine.idle()
        now = time.monotonic()
        snapshot = None
        if stepped and now - last_snapshot >= _SNAPSHOT_S:   # an idle engine's state does not change
            snapshot, last_snapshot, stepped = engine.snapshot(), now, False
        if sent or snapshot is not None:
            outbox.send(encode(Step(sent, snapshot)))


# -- the client in the API server -------------------------------------------------------------


class _Stream:
    """One request's outputs as the client rebuilds them (RequestOutput holds every token so
    far), detokenized here: the text, and the cut at a stop string (the client then aborts the
    core's request, which may have run a step or two past it)."""

    def __init__(self, detokenizer):
        self.detokenizer = detokenizer
        self.done = False
        self.queue: asyncio.Queue = asyncio.Queue()
        self.prompt_token_ids: list[int] = []
        self.token_ids: list[int] = []
        self.text = ""
        self.logprobs: list | None = None
        self.prompt_logprobs: list | None = None

    def output(self, o: CoreOutput) -> RequestOutput:
        """The output for the client; `done` is set when it is the last (the core's finish, or
        a stop string found here)."""
        if o.prompt_token_ids is not None:
            self.prompt_token_ids, self.prompt_logprobs = o.prompt_token_ids, o.prompt_logprobs
        new, finished, reason, error = o.new_token_ids, o.finished, o.finish_reason, o.error
        try:
            # The core's "stop" is an EOS or stop token id: its text is not output (LLMEngine._append).
            hidden = reason == "stop" and not self.detokenizer.include_stop
            delta, stop_index = self.detokenizer.append(new[:len(new) - hidden])
            stop_reason = o.stop_reason
            if stop_index is not None:   # keep the token that completed the stop string, cut the rest
                new, finished, reason = new[:stop_index + 1], True, "stop"
                stop_reason = self.detokenizer.stop_string
            elif finished:
                delta += self.detokenizer.flush()
                if self.detokenizer.stopped:
                    reason, stop_reason = "stop", self.detokenizer.stop_string
        except Exception as e:   # this request's text: it fails alone
            delta, finished, reason, error = "", True, "error", f"producing this request's text failed: {e!r}"
            stop_reason = None
        self.token_ids += new
        self.text += delta
        if o.logprobs is not None:
            self.logprobs = (self.logprobs or []) + o.logprobs[:len(new)]
        self.done = finished
        return RequestOutput(o.request_id, self.prompt_token_ids, list(self.token_ids), self.text, new,
                             delta, finished, reason, error=error, logprobs=self.logprobs,
                             prompt_logprobs=self.prompt_logprobs, num_drafted=min(o.num_drafted, len(new)),
                             stop_reason=stop_reason)


_COUNTERS = ("prefix_cache_queries", "prefix_cache_hits", "failed", "preemptions", "num_drafts",
             "num_draft_tokens", "num_accepted_tokens")


def _add(a: list, b: list) -> list:
    return [x + y for x, y in itertools.zip_longest(a, b, fillvalue=0)]


class EngineCoreClient:
    """AsyncEngine's interface over an engine-core process (see the module docstring)."""

    def __init__(self, config: EngineConfig, tokenizer=None, cpus: list[int] | None = None,
                 env: dict[str, str] | None = None):
        """cpus: the CPUs the core may run on (None: all); env: variables its process starts
        with (CUDA_VISIBLE_DEVICES for a core of its own GPU)."""
        from specserve.model.loader import load_tokenizer

        self.config, self.cpus, self.env = config, cpus, env or {}
        self.tokenizer = tokenizer or load_tokenizer(config.target.path)
        self.max_model_len = 0             # from the core's Ready
        self.restarts = 0
        self.restarting = False
        self.error: BaseException | None = None
        self._streams: dict[str, _Stream] = {}
        self._calls: dict[int, asyncio.Future] = {}
        self._snapshot: dict = {}
        self._carried: dict = {}   # counters of the cores that died: /metrics' counters never go back
        self._speculation: tuple[str, int | None] | None = None   # set by an operator: outlives a restart
        self._proc = None
        self._ctx = None
        self._ipc_files: list[str] = []
        self._stopping = False
        self._encode = msgspec.msgpack.Encoder().encode
        self._decode = msgspec.msgpack.Decoder(FromCore).decode

    @property
    def is_alive(self) -> bool:
        return not self.restarting and self._proc is not None and self._proc.is_alive()

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    async def start(self) -> None:
        import zmq.asyncio

        self._ctx = zmq.asyncio.Context()
        await self._spawn()
        self._watcher = asyncio.create_task(self._watch())

    async def _spawn(self) -> None:
        import zmq

        base = os.path.join(tempfile.gettempdir(), f"specserve-{os.getpid()}-{uuid.uuid4().hex[:8]}")
        in_addr, out_addr = f"ipc://{base}-in", f"ipc://{base}-out"
        self._push, self._pull = self._ctx.socket(zmq.PUSH), self._ctx.socket(zmq.PULL)
        self._push.setsockopt(zmq.LINGER, 0)
        self._push.bind(in_addr)
        self._pull.bind(out_addr)
        self._ipc_files = [base + "-in", base + "-out"]   # libzmq leaves a bound ipc endpoint's file
        spawn = multiprocessing.get_context("spawn")
        self._proc = spawn.Process(target=run_core, args=(self.config, in_addr, out_addr, self.cpus),
                                   name="specserve-core", daemon=True)
        saved = {k: os.environ.get(k) for k in self.env}
        os.environ.update(self.env)   # a spawned process starts with the environment of this moment
        try:
            self._proc.start()
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
        try:
            await self._ready()
        except BaseException:   # nothing of a core that did not start stays behind (also on ^C)
            self._close_sockets()
            if self._proc.is_alive():
                self._proc.kill()
            raise

    async def _ready(self) -> None:
        deadline = time.monotonic() + _START_TIMEOUT_S
        while time.monotonic() < deadline:
            if await self._pull.poll(int(_POLL_S * 1000)):
                msg = self._decode(await self._pull.recv())
                if isinstance(msg, Ready):
                    self.max_model_len, self._snapshot = msg.max_model_len, msg.snapshot
                    logger.info("engine core ready (pid %d)", self._proc.pid)
                    return
                if isinstance(msg, Failed):
                    await asyncio.to_thread(self._proc.join, 10.0)
                    raise EngineStartError(f"the engine core exited while starting: {msg.message}")
            elif not self._proc.is_alive():
                raise EngineDeadError(f"the engine core exited with code {self._proc.exitcode} while starting")
        raise EngineDeadError(f"the engine core did not start within {_START_TIMEOUT_S} s")

    async def _watch(self) -> None:
        while not self._stopping:
            if await self._pull.poll(int(_POLL_S * 1000)):
                self._dispatch(self._decode(await self._pull.recv()))
            elif not self._proc.is_alive() and not self._stopping:
                await self._restart()

    async def _restart(self) -> None:
        code = self._proc.exitcode
        logger.error("the engine core died (exit code %s); restarting it", code)
        self.restarting, self.error = True, EngineDeadError(f"the engine core exited with code {code}")
        self.fail_all(EngineDeadError(f"the engine stopped (its process exited with code {code}) and is "
                                      "restarting; retry"))
        self._close_sockets()
        self.restarts += 1
        for key in _COUNTERS:
            self._carried[key] = self._carried.get(key, 0) + self._snapshot.get(key, 0)
        self._carried["accepted_per_position"] = _add(self._carried.get("accepted_per_position", []),
                                                      self._snapshot.get("accepted_per_position", []))
        # The dead core's counters are carried now; until the new core's Ready replaces it, the
        # snapshot holds none of them (else they count twice) and none of its requests.
        self._snapshot = {**self._snapshot, **{key: 0 for key in _COUNTERS}, "accepted_per_position": [],
                          "running": 0, "waiting": 0, "kv_usage": 0.0, "blocks_held": 0}
        delay = 1.0
        while not self._stopping:
            try:
                await self._spawn()
                break
            except EngineDeadError as e:   # a core that cannot start: try again, less and less often
                logger.error("%s; trying again in %.0f s", e, delay)
                await asyncio.sleep(delay)
                delay = min(2 * delay, 30.0)
        if self._speculation is not None and not self._stopping:   # before any request: sockets keep order
            self._send(SetSpeculation(-1, *self._speculation))
        self.restarting = False

    def _close_sockets(self) -> None:
        """Close this core's two sockets and remove their ipc files."""
        self._push.close()
        self._pull.close()
        for path in self._ipc_files:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
        self._ipc_files = []

    def _dispatch(self, msg) -> None:
        if isinstance(msg, Step):
            if msg.snapshot is not None:
                self._snapshot = msg.snapshot
            for o in msg.outputs:
                stream = self._streams.get(o.request_id)
                if stream is not None and not stream.done:
                    out = stream.output(o)
                    stream.queue.put_nowait(out)
                    if out.finished and not o.finished:   # cut here (a stop string): the core stops too
                        self.abort(o.request_id)
        elif isinstance(msg, Refused):
            stream = self._streams.get(msg.request_id)
            if stream is not None:
                error = QueueFullError(msg.message) if msg.queue_full else InvalidRequestError(msg.message, msg.param)
                stream.queue.put_nowait(error)
        elif isinstance(msg, Reply):
            if msg.snapshot is not None:
                self._snapshot = msg.snapshot
            future = self._calls.pop(msg.call_id, None)
            if future is not None and not future.done():
                future.set_result(msg.result if msg.message is None else InvalidRequestError(msg.message, msg.param))

    def _send(self, msg) -> None:
        self._push.send(self._encode(msg))   # PUSH to a live peer: queued, never blocks here

    async def shutdown(self) -> None:
        self._stopping = True
        if self._proc is None:
            return
        if (watcher := getattr(self, "_watcher", None)) is not None:
            watcher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await watcher
        if self._proc.is_alive():
            self._send(Shutdown())
            await asyncio.to_thread(self._proc.join, 10.0)
            if self._proc.is_alive():
                self._proc.kill()
                await asyncio.to_thread(self._proc.join, 5.0)
        self._close_sockets()
        self._ctx.destroy(linger=0)
        if self._proc.exitcode is not None:   # its sentinel pipe now, not when the client is collected
            self._proc.close()
            self._proc = None

    def snapshot(self) -> dict:
        snap = {**self._snapshot, "restarts": self._snapshot.get("restarts", 0) + self.restarts}
        for key in _COUNTERS:
            snap[key] = snap.get(key, 0) + self._carried.get(key, 0)
        if "accepted_per_position" in self._carried:
            snap["accepted_per_position"] = _add(snap.get("accepted_per_position", []),
                                                 self._carried["accepted_per_position"])
        return snap

    def num_waiting(self) -> int:
        return self._snapshot.get("waiting", 0)

    async def generate(self, prompt: list[int], params: SamplingParams,
                       request_id: str) -> AsyncIterator[RequestOutput]:
        if not self.is_alive:
            raise EngineDeadError(f"the engine is not running: {self.error!r}")
        stream = self._streams[request_id] = _Stream(
            IncrementalDetokenizer(self.tokenizer, list(prompt), params.stop, params.skip_special_tokens,
                                   params.min_tokens, params.include_stop_str_in_output))
        self._send(AddRequest(request_id, list(prompt), params))
        finished = False
        try:
            async for out in outputs(stream.queue):
                finished = out.finished
                yield out
        except InvalidRequestError:
            finished = True   # refused: never added
            raise
        finally:
            self._streams.pop(request_id, None)
            if not finished and self.is_alive:
                self.abort(request_id)

    def abort(self, request_id: str) -> None:
        self._send(Abort([request_id]))

    async def set_speculation(self, mode: str, depth: int | None = None) -> dict:
        if not self.is_alive:
            raise EngineDeadError(f"the engine is not running: {self.error!r}")
        call_id = len(self._calls) + int(time.monotonic_ns())
        try:
            data = self._encode(SetSpeculation(call_id, mode, depth))
        except (OverflowError, TypeError):   # msgpack carries no int past 64 bits: no setting is one
            raise InvalidRequestError(f"mode 'static' needs an integer 'depth', got {depth!r}" if isinstance(mode, str)
                                      else f"unknown speculation mode {mode!r}: 'adaptive' or 'static'",
                                      param="depth" if isinstance(mode, str) else "mode") from None
        future = self._calls[call_id] = asyncio.get_running_loop().create_future()
        self._push.send(data)
        result = await future
        if isinstance(result, BaseException):
            raise result
        self._speculation = (mode, depth)
        return result

    def fail_all(self, error: Exception) -> None:
        for stream in self._streams.values():
            stream.queue.put_nowait(error)
        for future in self._calls.values():
            if not future.done():
                future.set_result(error)
        self._calls.clear()


# -- several engine cores behind one API server ----------------------------------------------


class EngineGroup:
    """N engine cores on one machine (data parallel), with EngineCoreClient's interface. On the
    CPU each core gets its share of the cores; with GPUs, one GPU each. A request goes to the
    core that last served the longest prefix of its prompt (whole KV blocks: that core's prefix
    cache holds it), unless that core has `_AFFINITY_SLACK` more requests in flight than the
    least loaded one; else to the least loaded core."""

    _AFFINITY_SLACK = 4
    _REMEMBERED_BLOCKS = 1 << 16

    def __init__(self, config: EngineConfig, num_engines: int):
        from collections import OrderedDict

        import torch

        from specserve.model.loader import load_tokenizer

        self.tokenizer = load_tokenizer(config.target.path)
        self.block_size = config.cache.block_size
        gpus = torch.cuda.device_count() if config.device in ("auto", "cuda") else 0
        cpus = sorted(os.sched_getaffinity(0))
        share = max(1, len(cpus) // num_engines)
        per_gpu = -(-num_engines // gpus) if gpus else 0
        if gpus and per_gpu > 1:   # engines on one GPU split it: each takes its part of the free memory it sees
            logger.warning("%d engines on %d GPUs: up to %d share a GPU, each taking 1/%d of "
                           "cache.memory_fraction", num_engines, gpus, per_gpu, per_gpu)
            config = msgspec.structs.replace(config, cache=msgspec.structs.replace(
                config.cache, memory_fraction=config.cache.memory_fraction / per_gpu))
        elif not gpus and num_engines > len(cpus):
            logger.warning("%d engines on %d CPUs: the last %d share one CPU", num_engines, len(cpus),
                           num_engines - len(cpus) + 1)
        self.cores = []
        for i in range(num_engines):
            if gpus:
                cfg, placement = config, dict(env={"CUDA_VISIBLE_DEVICES": str(i % gpus)})
            else:
                mine = cpus[i * share:(i + 1) * share] or cpus[-share:]
                threads = config.cpu.threads or len(mine)
                cfg = msgspec.structs.replace(config, cpu=msgspec.structs.replace(config.cpu, threads=threads))
                placement = dict(cpus=mine)
            self.cores.append(EngineCoreClient(cfg, tokenizer=self.tokenizer, **placement))
        self.inflight = [0] * num_engines
        self.routed = [0] * num_engines
        self._owner: OrderedDict[int, tuple[int, int]] = OrderedDict()   # prefix hash -> (core, its restarts)
        self._core_of: dict[str, int] = {}                   # request id -> core

    @property
    def max_model_len(self) -> int:
        return min(c.max_model_len for c in self.cores)

    @property
    def is_alive(self) -> bool:
        return any(c.is_alive for c in self.cores)

    @property
    def restarting(self) -> bool:
        return all(c.restarting for c in self.cores)

    @property
    def error(self):
        return next((c.error for c in self.cores if c.error is not None), None)

    async def start(self) -> None:
        await asyncio.gather(*(c.start() for c in self.cores))

    async def shutdown(self) -> None:
        await asyncio.gather(*(c.shutdown() for c in self.cores))

    def _prefix_hashes(self, prompt: list[int]) -> list[int]:
        hashes, h, bs = [], 0, self.block_size
        for start in range(0, len(prompt) - bs + 1, bs):
            h = hash((h, tuple(prompt[start:start + bs])))
            hashes.append(h)
        return hashes

    def route(self, prompt: list[int]) -> int:
        alive = [i for i, c in enumerate(self.cores) if c.is_alive]
        if not alive:
            return 0
        # Ties go to the core given fewer requests so far: a sequential load uses every core.
        least = min(alive, key=lambda i: (self.inflight[i], self.routed[i]))
        hashes = self._prefix_hashes(prompt)
        chosen = least
        for h in reversed(hashes):   # the longest prefix some core served (and holds: not restarted since)
            owner, restarts = self._owner.get(h, (None, 0))
            if owner is not None and restarts == self.cores[owner].restarts:
                if owner in alive and self.inflight[owner] <= self.inflight[least] + self._AFFINITY_SLACK:
                    chosen = owner
                break
        for h in hashes:
            self._owner[h] = (chosen, self.cores[chosen].restarts)
            self._owner.move_to_end(h)
        while len(self._owner) > self._REMEMBERED_BLOCKS:
            self._owner.popitem(last=False)
        return chosen

    async def generate(self, prompt: list[int], params: SamplingParams,
                       request_id: str) -> AsyncIterator[RequestOutput]:
        i = self.route(list(prompt))
        self.inflight[i] += 1
        self.routed[i] += 1
        self._core_of[request_id] = i
        try:   # closed with this stream, the core's stream aborts its request at once
            async with contextlib.aclosing(self.cores[i].generate(prompt, params, request_id)) as outs:
                async for out in outs:
                    yield out
        finally:
            self.inflight[i] -= 1
            self._core_of.pop(request_id, None)

    def abort(self, request_id: str) -> None:
        i = self._core_of.get(request_id)
        if i is not None:
            self.cores[i].abort(request_id)

    def num_waiting(self) -> int:
        return sum(c.num_waiting() for c in self.cores)

    def snapshot(self) -> dict:
        """The cores' snapshots summed (counters, queue lengths, accepted per position), the
        KV usage averaged, the speculation setting and controller of the first; each core's
        own under "engines"."""
        snaps = [{**c.snapshot(), "routed": self.routed[i]} for i, c in enumerate(self.cores)]
        total = dict(snaps[0])
        for key in ("running", "waiting", "blocks_held", "prefix_cache_queries", "prefix_cache_hits", "restarts",
                    "failed", "preemptions", "num_drafts", "num_draft_tokens", "num_accepted_tokens", "routed"):
            total[key] = sum(s.get(key, 0) for s in snaps)
        total["kv_usage"] = sum(s.get("kv_usage", 0.0) for s in snaps) / len(snaps)
        width = max(len(s.get("accepted_per_position", [])) for s in snaps)
        total["accepted_per_position"] = [sum(s["accepted_per_position"][p] for s in snaps
                                              if p < len(s.get("accepted_per_position", []))) for p in range(width)]
        drafts = total.get("num_drafts", 0)
        total["tokens_per_pass"] = ((drafts + total.get("num_accepted_tokens", 0)) / drafts) if drafts else 1.0
        total["engines"] = snaps
        return total

    async def set_speculation(self, mode: str, depth: int | None = None) -> dict:
        live = [c for c in self.cores if c.is_alive]
        if not live:
            raise EngineDeadError("no engine core is running; retry shortly")
        results = await asyncio.gather(*(c.set_speculation(mode, depth) for c in live), return_exceptions=True)
        if (refused := next((r for r in results if isinstance(r, InvalidRequestError)), None)) is not None:
            raise refused   # one config: every core refuses alike
        for c in self.cores:   # a core restarting now takes it up once it is ready (_restart)
            c._speculation = (mode, depth)
        ok = [r for r in results if not isinstance(r, BaseException)]
        if not ok:   # every live core died meanwhile: they take it up when they restart
            raise EngineDeadError("no engine core is running; retry shortly")
        return ok[0]

    def fail_all(self, error: Exception) -> None:
        for c in self.cores:
            c.fail_all(error)
