"""The OpenAI-compatible HTTP front door (DESIGN.md §7): aiohttp on an engine backend.

The backend is an engine-core process (`specserve serve`: core.EngineCoreClient) or an
engine on a worker thread of this process (AsyncEngine: tests, embedding); both have one
interface. This event loop only parses requests, tokenizes prompts and writes chunks:
streams, /health and /metrics stay responsive while a step computes. A request's life here:

    parse + validate (400/404) -> tokenize -> n x AsyncEngine.generate (400/429 at admission)
    -> first output -> headers -> chunks as outputs arrive -> usage -> [DONE]

Every exit path closes the engine iterators, and closing one that has not finished aborts
its request: a client that goes away (write fails, or aiohttp cancels the handler) frees
its KV blocks at once. A client that stays but takes nothing is cut off (`_send`).
"""

from __future__ import annotations

import asyncio
import codecs
import contextlib
import logging
import os
import signal
import socket
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path

import msgspec
from aiohttp import web

from specserve.config import EngineConfig
from specserve.core import EngineCoreClient, EngineGroup
from specserve.engine import AsyncEngine, EngineDeadError, LLMEngine, QueueFullError, RequestOutput
from specserve.errors import InvalidRequestError, SpecserveError
from specserve.metrics import ServerMetrics
from specserve.model.loader import load_sampling_defaults
from specserve.sampling import SamplingParams
from specserve.server import logprobs as logprobs_json
from specserve.server import protocol

logger = logging.getLogger("specserve.server")

_json = msgspec.json.Encoder()  # compact: no spaces, as SSE events should be
_PAGE = (Path(__file__).parent / "static" / "chat.html").read_bytes()   # GET /: the chat page


class ApiError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, type: str = "invalid_request_error",
                 code: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.type, self.code = status, message, param, type, code
        self.headers = headers

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> web.Response:
        resp = web.Response(status=self.status, body=_json.encode(self.body()), content_type="application/json",
                            headers=self.headers)
        if self.status in (408, 413):   # the rest of the body is not read: the connection cannot go on
            resp.force_close()
        return resp


def _shutting_down() -> ApiError:
    return ApiError(503, "the server is shutting down; retry on another replica", type="service_unavailable",
                    code="shutting_down")


@dataclass
class ServerState:
    cfg: EngineConfig
    model_name: str
    metrics: ServerMetrics
    async_engine: AsyncEngine | EngineCoreClient | EngineGroup   # started with the app
    max_token_bytes: int = 1   # the longest vocabulary entry in UTF-8 bytes: bytes of text per token at most
    draining: bool = False
    num_inflight: int = 0
    idle: asyncio.Event | None = None  # set while num_inflight == 0
    token_text: logprobs_json.TokenText | None = None
    sampling_defaults: dict = field(default_factory=dict)   # the model's, for fields a request leaves out


    def serves(self, name: str) -> bool:
        """The served name, or, when none is configured, the target's path as the user gave it
        (vLLM's name for a model: `vllm bench serve --model DIR` sends it)."""
        return name == self.model_name or (self.cfg.server.served_model_name is None and
                                           os.path.abspath(os.path.expanduser(name)) == self.cfg.target.path)


STATE = web.AppKey("specserve_state", ServerState)


# -- request parsing --------------------------------------------------------------------------


@dataclass
class Choice:  # one engine request
    index: int
    prompt_idx: int
    prompt_ids: list[int]
    params: SamplingParams
    echo: str | None = None   # completions with echo: the prompt's text, sent before the output
    max_name: str = "max_tokens"   # the request's name for the budget (chat: max_completion_tokens if sent)


# Prompts longer than this (characters in all) are tokenized on a worker thread, so that the
# event loop keeps serving streams and /health meanwhile.
_INLINE_TEXT = 16384
COMPLETION_MAX_TOKENS = 16   # a completion without max_tokens (OpenAI's default, vLLM's)
# Text longer than this is first counted piece by piece, at most this many characters a piece:
# a tokenizer's encoding of a 4 MiB prompt (ids, offsets, token strings) takes hundreds of MiB,
# while counting stops as soon as the pieces need more tokens than the context holds. A piece
# boundary can change the count by a few tokens, so each piece's count is taken _SLACK lower.
_PIECE, _SLACK = 65536, 8


def _context_error(max_model_len: int, what: str, chat: bool) -> ApiError:
    return ApiError(400, f"this model's maximum context length is {max_model_len} tokens; the prompt {what}",
                    "messages" if chat else "prompt", code="context_length_exceeded")


def _encode(tokenizer, text: str, max_model_len: int, chat: bool, **kwargs) -> list[int]:
    if len(text) > _PIECE:
        count, start = 0, 0
        while start < len(text):
            end = min(start + _PIECE, len(text))
            if end < len(text):   # cut after whitespace where there is some, as pre-tokenizers split
                cut = max(text.rfind(" ", start, end), text.rfind("\n", start, end))
                end = cut + 1 if cut > start else end
            count += max(0, len(tokenizer.encode(text[start:end], add_special_tokens=False)) - _SLACK)
            if count > max_model_len:
                raise _context_error(max_model_len, f"needs more than {count} tokens", chat)
            start = end
    return tokenizer.encode(text, **kwargs)


def _tokenize(tokenizer, req: protocol.ChatRequest | protocol.CompletionRequest, chat: bool,
              max_model_len: int) -> list[list[int]]:
    if not chat:
        prompts = [req.prompt] if isinstance(req.prompt, str) or isinstance(req.prompt[0], int) else req.prompt
        return [_encode(tokenizer, p, max_model_len, chat, add_special_tokens=req.add_special_tokens is not False)
                if isinstance(p, str) else list(p) for p in prompts]
    if not getattr(tokenizer, "chat_template", None):
        raise ApiError(400, "this model has no chat template; use /v1/completions", "messages")
    # Text parts join with newlines, as vLLM renders them for a text-only template.
    rendered = [{"role": m.role, "content": m.content if isinstance(m.content, str) else
                 "\n".join(part.text for part in m.content or [])} for m in req.messages]
    try:
        text = tokenizer.apply_chat_template(rendered, tokenize=False, add_generation_prompt=req.add_generation_prompt,
                                             continue_final_message=req.continue_final_message,
                                             **(req.chat_template_kwargs or {}))
    except Exception as e:  # a template that rejects the conversation (roles, order)
        raise ApiError(400, f"the chat template rejected the messages: {e}", "messages") from None
    # The template writes BOS and the like.
    return [_encode(tokenizer, text, max_model_len, chat, add_special_tokens=bool(req.add_special_tokens))]


def _text_size(req, chat: bool) -> int:
    """Characters of text to tokenize (of the largest prompt, for completions)."""
    if chat:
        return sum(len(m.content) if isinstance(m.content, str) else sum(len(p.text or "") for p in m.content or [])
                   for m in req.messages)
    if isinstance(req.prompt, str):
        return len(req.prompt)
    return max((len(p) for p in req.prompt if isinstance(p, str)), default=0)


async def _parse(state: ServerState, raw: bytes, chat: bool) -> tuple[list[Choice], bool, bool, bool]:
    """-> (choices, stream, stream options, provenance). Raises ApiError naming the field and what
    is allowed."""
    try:
        req = protocol.parse(raw, chat)
    except protocol.ProtocolError as e:
        raise ApiError(400, e.message, e.param) from None
    if req.model is not None and not state.serves(req.model):
        raise ApiError(404, f"the model '{req.model}' does not exist; this server serves '{state.model_name}'",
                       "model", code="model_not_found")
    tokenizer = state.async_engine.tokenizer
    size = _text_size(req, chat)
    max_model_len = state.async_engine.max_model_len
    if size > max_model_len * state.max_token_bytes:
        # A token covers at most max_token_bytes bytes of text: so many cannot fit the context,
        # and tokenizing them would only cost time and memory.
        raise _context_error(max_model_len, f"has {size} characters: more than so many tokens can hold", chat)
    if size > _INLINE_TEXT:
        prompts = await asyncio.to_thread(_tokenize, tokenizer, req, chat, max_model_len)
    else:
        prompts = _tokenize(tokenizer, req, chat, max_model_len)
    if len(prompts) * req.n > protocol.MAX_CHOICES:
        raise ApiError(400, f"{len(prompts)} prompts x n = {req.n} make {len(prompts) * req.n} completions; at most "
                            f"{protocol.MAX_CHOICES} per request", "n")
    max_name = "max_completion_tokens" if chat and req.max_completion_tokens is not None else "max_tokens"
    max_tokens = getattr(req, max_name)
    if chat:
        logprobs, prompt_logprobs, echo = (req.top_logprobs or 0) if req.logprobs else None, None, False
    else:   # echo with max_tokens 0 needs the prompt's logprobs (that is all it computes)
        logprobs, echo = req.logprobs, req.echo
        prompt_logprobs = logprobs if echo and logprobs is not None else (0 if echo and max_tokens == 0 else None)

    def default(name: str, value):   # the request's, else the model's (generation_config.json), else value
        given = getattr(req, name)
        return given if given is not None else state.sampling_defaults.get(name, value)

    choices = []
    for p, prompt_ids in enumerate(prompts):
        echo_text = None
        if echo:
            prompt = req.prompt if isinstance(req.prompt, str) or isinstance(req.prompt[0], int) else req.prompt[p]
            echo_text = prompt if isinstance(prompt, str) else tokenizer.decode(prompt_ids)
        # Absent max_tokens: 16 for a completion (OpenAI's legacy default, and vLLM's); the
        # room left in the context for a chat, at least 1, so that a prompt that fills the
        # context gets the engine's own "maximum context length" error.
        budget = (max_tokens if max_tokens is not None else
                  max(1, max_model_len - len(prompt_ids)) if chat else COMPLETION_MAX_TOKENS)
        for i in range(req.n):
            try:
                params = SamplingParams(
                    max_tokens=budget, temperature=default("temperature", 1.0),
                    top_p=default("top_p", 1.0), top_k=default("top_k", 0) or 0,
                    # seed -1: none (vLLM's, and clients' "random"); choice i of n gets seed + i.
                    seed=None if req.seed in (None, -1) else (req.seed + i) % 2**64, stop=req.stops,
                    stop_token_ids=list(req.stop_token_ids or []), ignore_eos=req.ignore_eos,
                    min_tokens=req.min_tokens if max_tokens is not None else min(req.min_tokens, budget),
                    logprobs=logprobs, prompt_logprobs=prompt_logprobs,
                    presence_penalty=req.presence_penalty, frequency_penalty=req.frequency_penalty,
                    repetition_penalty=default("repetition_penalty", 1.0),
                    skip_special_tokens=req.skip_special_tokens,
                    include_stop_str_in_output=req.include_stop_str_in_output,
                    logit_bias={int(t): b for t, b in req.logit_bias.items()} if req.logit_bias else None)
            except InvalidRequestError as e:
                param = max_name if e.param == "max_tokens" else e.param
                raise ApiError(400, str(e).replace("max_tokens", max_name, 1), param) from None
            choices.append(Choice(p * req.n + i, p, prompt_ids, params, echo_text, max_name))
    return choices, req.stream, req.stream_options or protocol.StreamOptions(), req.provenance


# -- running requests -------------------------------------------------------------------------


class _Run:
    """The engine requests of one HTTP request, started together and always closed together."""

    def __init__(self, state: ServerState, choices: list[Choice], id_prefix: str, chat: bool,
                 provenance: bool = False, response_id: str | None = None):
        self.state, self.choices, self.chat, self.id = state, choices, chat, response_id or id_prefix
        self.gens: list[AsyncIterator[RequestOutput]] = [
            state.async_engine.generate(c.prompt_ids, c.params, f"{id_prefix}-{c.index}") for c in choices
        ]
        self.arrival = time.monotonic()
        self.created = int(time.time())   # the response's `created`: when the request came, as OpenAI stamps it
        self.last_time: list[float | None] = [None] * len(choices)
        self.num_tokens = [0] * len(choices)
        self.logprobs_sent = [0] * len(choices)   # output tokens whose logprobs went out
        self.text_offset = [0] * len(choices)     # completions' text_offset of the next token
        # The provenance extension: per choice, each output token's "accepted draft token?",
        # the tokens already sent, and a UTF-8 decoder that carries split characters over.
        self.provenance = provenance
        self.drafted: list[list[bool]] = [[] for _ in choices]
        self.pieces_sent = [0] * len(choices)
        self.utf8 = [codecs.getincrementaldecoder("utf-8")("replace") for _ in choices] if provenance else []
        self.unshown: list[list[list]] = [[] for _ in choices]   # per token: [characters not sent, drafted?, 1 or 0]
        self.special_ids = set(state.async_engine.tokenizer.all_special_ids) if provenance else set()

    async def first_outputs(self) -> list[RequestOutput]:
        """Admit every choice and wait for its first output; the first refusal (400, 429, 503) wins."""
        results = await asyncio.gather(*(g.__anext__() for g in self.gens), return_exceptions=True)
        for r in results:
            if isinstance(r, QueueFullError):
                raise ApiError(429, str(r), type="rate_limit_error", code="queue_full", headers={"Retry-After": "1"})
            if isinstance(r, InvalidRequestError):
                param = r.param
                if param == "prompt" and self.chat:
                    param = "messages"
                elif param == "max_tokens":   # named as the request named it
                    param = self.choices[0].max_name
                code = "context_length_exceeded" if "context length" in str(r) or "KV cache" in str(r) else None
                raise ApiError(400, str(r), param, code=code)
            if isinstance(r, EngineDeadError):
                raise ApiError(503, str(r), type="service_unavailable", code="engine_unavailable")
            if isinstance(r, StopAsyncIteration):  # cannot happen: the last output is always yielded
                raise ApiError(500, "the engine returned no output", type="internal_error")
            if isinstance(r, BaseException):
                raise r
            if r.finish_reason == "error":
                raise ApiError(500, f"the engine failed this request: {r.error}", type="internal_error",
                               code="request_failed")
        self.state.metrics.prompt_tokens.inc(self.usage()["prompt_tokens"])
        for i, out in enumerate(results):
            self.observe(i, out)
        return results

    def observe(self, i: int, out: RequestOutput) -> None:
        if out.finish_reason == "error":
            raise RequestFailedError(out.error)
        now, m = time.monotonic(), self.state.metrics
        k = len(out.new_token_ids)
        if k:
            if self.last_time[i] is None:
                m.time_to_first_token.observe(now - self.arrival)
                m.generation_tokens.inc(k)
            else:
                m.observe_tokens(k, now - self.last_time[i])
            self.last_time[i] = now
        self.num_tokens[i] = len(out.token_ids)  # all so far, after any cut at a stop string
        if self.provenance:
            self.drafted[i] += [True] * out.num_drafted + [False] * (k - out.num_drafted)
        if out.finished:
            m.e2e_request_latency.observe(now - self.arrival)

    async def rest(self, firsts: list[RequestOutput]) -> AsyncIterator[tuple[int, RequestOutput]]:
        """(choice position, output) for every output after the first ones, as they arrive."""
        live = [i for i, out in enumerate(firsts) if not out.finished]
        if len(live) == 1:  # the common case: no tasks
            i = live[0]
            async for out in self.gens[i]:
                self.observe(i, out)
                yield i, out
            return
        merged: asyncio.Queue = asyncio.Queue()

        async def pump(i: int):
            try:
                async for out in self.gens[i]:
                    merged.put_nowait((i, out))
            except BaseException as e:
                merged.put_nowait((i, e))
                raise
            finally:
                merged.put_nowait((i, None))

        tasks = [asyncio.create_task(pump(i)) for i in live]
        try:
            remaining = len(live)
            while remaining:
                i, item = await merged.get()
                if item is None:
                    remaining -= 1
                elif isinstance(item, BaseException):
                    raise item
                else:
                    self.observe(i, item)
                    yield i, item
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def close(self) -> None:
        """Close every engine iterator: the unfinished ones abort their requests."""
        for g in self.gens:
            try:
                await g.aclose()
            except Exception:  # an iterator that failed is closed already
                pass

    def logprobs(self, i: int, out: RequestOutput, with_prompt: bool) -> dict | None:
        """The logprobs object for choice i's tokens not sent yet (and its prompt's, for echo);
        None where the request did not ask for them."""
        c = self.choices[i]
        if c.params.logprobs is None:   # an echo of max_tokens 0 computes prompt logprobs unasked
            return None
        with_prompt = with_prompt and c.params.prompt_logprobs is not None
        entries, tokens = [], []
        if with_prompt:
            entries, tokens = out.prompt_logprobs[:len(c.prompt_ids)], list(c.prompt_ids)
        if c.params.logprobs is not None:
            start, end = self.logprobs_sent[i], len(out.token_ids)
            entries, tokens = entries + out.logprobs[start:end], tokens + out.token_ids[start:end]
            self.logprobs_sent[i] = end
        if self.chat:
            return logprobs_json.chat(entries, tokens, self.state.token_text)
        obj, self.text_offset[i] = logprobs_json.completion(entries, tokens, self.state.token_text,
                                                            self.text_offset[i])
        return obj

    def pieces(self, i: int, out: RequestOutput) -> list[list]:
        """Choice i's tokens not sent yet as [text, accepted draft tokens?, number of tokens],
        one piece per run of tokens of one provenance. The texts are the chunk's text shared
        out in token order, each token taking as many characters as its own text has: text
        the output leaves out (a stop string, the EOS token's, skipped special tokens) is in
        no piece, and a token whose text is held back takes it in a later chunk."""
        start, end = self.pieces_sent[i], len(out.token_ids)
        self.pieces_sent[i] = end
        queue = self.unshown[i]
        skip = self.special_ids if self.choices[i].params.skip_special_tokens else ()
        for tok, drafted in zip(out.token_ids[start:end], self.drafted[i][start:end]):
            n = 0 if tok in skip else len(self.utf8[i].decode(self.state.token_text.bytes(tok)))
            queue.append([n, drafted, 1])
        text, pieces = out.new_text, []
        while queue and (text or queue[0][0] == 0 or out.finished):
            n, drafted, count = queue[0]
            share, text = text[:n], text[n:]
            if len(share) < n and not out.finished:
                queue[0] = [n - len(share), drafted, 0]   # the rest of its text comes later
            else:
                queue.pop(0)
            if pieces and pieces[-1][1] == drafted:
                pieces[-1][0] += share
                pieces[-1][2] += count
            elif share or count:
                pieces.append([share, drafted, count])
        if text:   # text no token accounts for (the U+FFFD of bytes left at the end)
            pieces.append([text, False, 0])
        return pieces

    def usage(self, i: int | None = None) -> dict:
        """The request's usage so far, or choice i's."""
        if i is not None:
            prompt, completion = len(self.choices[i].prompt_ids), self.num_tokens[i]
        else:   # the prompt counts once, whatever n is
            prompt = sum({c.prompt_idx: len(c.prompt_ids) for c in self.choices}.values())
            completion = sum(self.num_tokens)
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


# -- handlers ---------------------------------------------------------------------------------


async def _read_body(request: web.Request) -> bytes:
    """The body, within the server's body timeout (a client that drips it is answered 408)."""
    try:
        return await asyncio.wait_for(request.read(), request.app[STATE].cfg.server.body_timeout_s)
    except asyncio.TimeoutError:
        raise ApiError(408, f"the request body did not arrive within {request.app[STATE].cfg.server.body_timeout_s:g} "
                            "s", code="body_timeout") from None


def _check_serving(state: ServerState) -> None:
    if state.draining:
        raise _shutting_down()
    engine = state.async_engine
    if engine is None or not engine.is_alive:
        why = "it is restarting after an error" if engine is not None and engine.restarting else "it is not running"
        raise ApiError(503, f"the engine cannot take requests now: {why}; retry shortly",
                       type="service_unavailable", code="engine_unavailable")


class RequestFailedError(Exception):
    """The engine failed this request alone (finish_reason "error")."""


async def _generate(request: web.Request, chat: bool) -> web.StreamResponse:
    state = request.app[STATE]
    try:
        _check_serving(state)
        choices, stream, options, provenance = await _parse(state, await _read_body(request), chat)
        engine = state.async_engine   # each core's queue holds max_waiting_requests; a dead core's, none
        cores = [c for c in engine.cores if c.is_alive] if isinstance(engine, EngineGroup) else [engine]
        waiting = sum(c.num_waiting() for c in cores)
        limit = state.cfg.scheduler.max_waiting_requests * max(1, len(cores))
        if waiting + len(choices) > limit:
            raise ApiError(429, f"{waiting} requests are waiting and this one adds {len(choices)}; at most {limit} "
                                "may wait (scheduler.max_waiting_requests); try again later",
                           type="rate_limit_error", code="queue_full", headers={"Retry-After": "1"})
    except ApiError as e:
        return e.response()
    state.num_inflight += 1
    state.idle.clear()
    kind = "chatcmpl" if chat else "cmpl"
    # A client's X-Request-Id names the response, as in vLLM ("cmpl-<id>"); the engine's own ids
    # stay unique whatever clients send.
    given = request.headers.get("X-Request-Id", "")
    response_id = f"{kind}-{given}" if 0 < len(given) <= 256 and given.isprintable() else None
    run = _Run(state, choices, f"{kind}-{uuid.uuid4().hex}", chat, provenance, response_id)
    try:
        try:
            firsts = await run.first_outputs()
        except ApiError as e:
            return e.response()
        if stream:
            return await _stream(request, run, firsts, options)
        try:
            resp = await _complete(run, firsts)
        except (EngineDeadError, RequestFailedError) as e:
            return _stream_error(e).response()
        with contextlib.suppress(ConnectionError):   # a client gone: nothing left to free
            await resp.prepare(request)
            await _send(request, resp.write_eof())
        return resp
    finally:
        await run.close()
        state.num_inflight -= 1
        if state.num_inflight == 0:
            state.idle.set()


def _stream_error(e: Exception) -> ApiError:
    if isinstance(e, RequestFailedError):
        return ApiError(500, f"the engine failed this request: {e}", type="internal_error", code="request_failed")
    return ApiError(503, str(e), type="service_unavailable", code="engine_unavailable")


def _header(run: _Run) -> dict:
    return {"id": run.id, "created": run.created, "model": run.state.model_name}


async def _complete(run: _Run, firsts: list[RequestOutput]) -> web.Response:
    final = {i: out for i, out in enumerate(firsts) if out.finished}
    async with contextlib.aclosing(run.rest(firsts)) as outputs:
        async for i, out in outputs:
            if out.finished:
                final[i] = out
    choices = []
    for i, c in enumerate(run.choices):
        out = final[i]
        logprobs = run.logprobs(i, out, with_prompt=True)
        if run.chat:
            choices.append({"index": c.index, "message": {"role": "assistant", "content": out.text},
                            "logprobs": logprobs, "finish_reason": out.finish_reason, "stop_reason": out.stop_reason})
        else:
            choices.append({"index": c.index, "text": (c.echo or "") + out.text, "logprobs": logprobs,
                            "finish_reason": out.finish_reason, "stop_reason": out.stop_reason})
    body = {**_header(run), "object": "chat.completion" if run.chat else "text_completion",
            "choices": choices, "usage": run.usage()}
    return web.Response(body=_json.encode(body), content_type="application/json")


def _cut_off(transport, seconds: float) -> None:
    logger.warning("a client took none of its response for %g s (server.idle_timeout_s): closing its connection",
                   seconds)
    transport.abort()


async def _send(request: web.Request, write) -> None:
    """Await one write of a response (the coroutine `write`). A write waits only while the
    transport's buffer is over its high-water mark, and the buffer shrinks whenever the client
    takes bytes. A client that takes none for [server] idle_timeout_s (checked every quarter of
    it) has its connection aborted, which cancels the handler and with it the client's requests,
    instead of holding the connection, and the output queued for it, for ever. A client that
    reads slowly is never cut off, however long the whole response takes."""
    transport = request.transport
    if transport is None or transport.is_closing():
        write.close()
        raise ConnectionResetError("the client went away")
    seconds = request.app[STATE].cfg.server.idle_timeout_s
    tick = seconds / 4
    loop = asyncio.get_running_loop()
    last, quiet = transport.get_write_buffer_size(), 0.0

    def check() -> None:
        nonlocal last, quiet, timer
        size = transport.get_write_buffer_size()
        quiet = 0.0 if size < last else quiet + tick
        last = size
        if quiet >= seconds:
            _cut_off(transport, seconds)
        else:
            timer = loop.call_later(tick, check)

    timer = loop.call_later(tick, check)
    try:
        await write
    finally:
        timer.cancel()


async def _stream(request: web.Request, run: _Run, firsts: list[RequestOutput], options: protocol.StreamOptions):
    """SSE as OpenAI streams it: `data: <compact json>\\n\\n` per chunk, the role with the first
    token, finish_reason on the last content chunk, the usage chunk (choices: []) when asked
    (and, with continuous_usage_stats, each chunk's choice's usage so far in the chunk), then
    `data: [DONE]\\n\\n`. Empty intermediate deltas (text held back by the detokenizer:
    a partial UTF-8 character, a possible stop-string prefix) are not sent."""
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream; charset=utf-8",
                                       "Cache-Control": "no-cache"})
    await resp.prepare(request)
    header = _header(run)
    obj = "chat.completion.chunk" if run.chat else "text_completion"
    sent_first = [False] * len(run.choices)
    continuous_usage = options.include_usage and options.continuous_usage_stats

    def event(i: int, out: RequestOutput) -> bytes | None:
        c = run.choices[i]
        first = not sent_first[i]
        if not out.new_text and not out.finished and not (first and c.echo is not None):
            return None   # the held-back tokens' logprobs go with the next event
        sent_first[i] = True
        choice = {"index": c.index}
        if run.chat:
            delta = {"content": out.new_text}
            if first:
                delta = {"role": "assistant", **delta}
            choice["delta"] = delta
        else:
            choice["text"] = (c.echo if first and c.echo is not None else "") + out.new_text
        choice["logprobs"] = run.logprobs(i, out, with_prompt=first)
        if run.provenance:
            choice["provenance"] = run.pieces(i, out)
        choice["finish_reason"] = out.finish_reason if out.finished else None
        if out.finished:
            choice["stop_reason"] = out.stop_reason
        chunk = {**header, "object": obj, "choices": [choice]}
        if continuous_usage:
            chunk["usage"] = run.usage(i)
        return b"data: " + _json.encode(chunk) + b"\n\n"

    try:
        for i, out in enumerate(firsts):
            if (data := event(i, out)) is not None:
                await _send(request, resp.write(data))
        # aclosing: leaving early (a failed write) stops the pumps of n > 1 before run.close()
        async with contextlib.aclosing(run.rest(firsts)) as outputs:
            async for i, out in outputs:
                if (data := event(i, out)) is not None:
                    await _send(request, resp.write(data))
        if options.include_usage:
            await _send(request, resp.write(b"data: " + _json.encode({**header, "object": obj, "choices": [],
                                                                        "usage": run.usage()}) + b"\n\n"))
        await _send(request, resp.write(b"data: [DONE]\n\n"))
        await _send(request, resp.write_eof())
    except (ConnectionResetError, ConnectionError):
        logger.info("client went away mid-stream; its requests are aborted")
    except (EngineDeadError, RequestFailedError) as e:  # headers are sent: the error goes in the stream
        try:
            error = _json.encode(_stream_error(e).body())
            await _send(request, resp.write(b"data: " + error + b"\n\ndata: [DONE]\n\n"))
            await _send(request, resp.write_eof())
        except ConnectionError:
            pass
    return resp


async def handle_chat(request: web.Request) -> web.StreamResponse:
    return await _generate(request, chat=True)


async def handle_completions(request: web.Request) -> web.StreamResponse:
    return await _generate(request, chat=False)


def _model(state: ServerState) -> dict:
    return {"id": state.model_name, "object": "model", "created": int(time.time()), "owned_by": "specserve",
            "root": state.cfg.target.path, "parent": None, "max_model_len": state.async_engine.max_model_len}


async def handle_models(request: web.Request) -> web.Response:
    body = {"object": "list", "data": [_model(request.app[STATE])]}
    return web.Response(body=_json.encode(body), content_type="application/json")


async def handle_model(request: web.Request) -> web.Response:
    """GET /v1/models/{model}: the served model, or a 404 naming the one asked for."""
    state, name = request.app[STATE], request.match_info["model"]
    if not state.serves(name):
        raise ApiError(404, f"the model '{name}' does not exist; this server serves '{state.model_name}'", "model",
                       code="model_not_found")
    return web.Response(body=_json.encode(_model(state)), content_type="application/json")


async def handle_health(request: web.Request) -> web.Response:
    state = request.app[STATE]
    try:
        _check_serving(state)
    except ApiError as e:
        return e.response()
    return web.Response(body=b'{"status":"ok"}', content_type="application/json")


async def handle_metrics(request: web.Request) -> web.Response:
    body, content_type = request.app[STATE].metrics.render()
    return web.Response(body=body, headers={"Content-Type": content_type})


def _allowed_origin(request: web.Request) -> str | None:
    origin, allowed = request.headers.get("Origin"), request.app[STATE].cfg.server.allowed_origins
    return origin if origin is not None and ("*" in allowed or origin in allowed) else None


async def _cors_headers(request: web.Request, response: web.StreamResponse) -> None:
    """Before any response's headers go out (streams included): let an allowed origin read it."""
    if (origin := _allowed_origin(request)) is not None:
        response.headers["Access-Control-Allow-Origin"] = origin
        response.headers["Vary"] = "Origin"


async def handle_preflight(request: web.Request) -> web.Response:
    """OPTIONS from a browser asking whether its page may POST here (CORS): 204 for an allowed
    origin, 403 otherwise."""
    if _allowed_origin(request) is None:
        raise ApiError(403, f"the origin {request.headers.get('Origin')!r} may not call this server "
                            "([server] allowed_origins)", code="origin_not_allowed")
    return web.Response(status=204, headers={
        "Access-Control-Allow-Methods": "GET, POST, OPTIONS",
        "Access-Control-Allow-Headers": request.headers.get("Access-Control-Request-Headers",
                                                            "Authorization, Content-Type"),
        "Access-Control-Max-Age": "600"})


async def handle_page(request: web.Request) -> web.Response:
    return web.Response(body=_PAGE, content_type="text/html", charset="utf-8")


async def handle_stats(request: web.Request) -> web.Response:
    """The figures the chat page shows beside the chat (JSON; /metrics has them all)."""
    s = request.app[STATE].async_engine.snapshot()
    body = {"mode": s["speculation"]["mode"], "depth": s["depth"], "tokens_per_pass": s["tokens_per_pass"],
            "acceptance": [n / s["num_drafts"] for n in s["accepted_per_position"]] if s["num_drafts"] else [],
            "running": s["running"], "waiting": s["waiting"], "requests_failed": s["failed"]}
    return web.Response(body=_json.encode(body), content_type="application/json")


async def handle_get_speculation(request: web.Request) -> web.Response:
    speculation = request.app[STATE].async_engine.snapshot()["speculation"]
    return web.Response(body=_json.encode(speculation), content_type="application/json")


async def handle_set_speculation(request: web.Request) -> web.Response:
    """POST /admin/speculation {"mode": "adaptive"} or {"mode": "static", "depth": d}: the
    setting applies from the engine's next step, requests in flight included (exact either
    way). 200 with the new setting, 400 naming what cannot be."""
    state = request.app[STATE]
    _check_serving(state)
    try:
        body = protocol.decode_object(await _read_body(request))
    except protocol.ProtocolError as e:
        raise ApiError(400, e.message, e.param) from None
    unknown = sorted(set(body) - {"mode", "depth"})
    if unknown:
        raise ApiError(400, f"unknown field(s) {', '.join(map(repr, unknown))}: /admin/speculation takes 'mode' "
                            "and, for mode 'static', 'depth'", param=unknown[0])
    if "mode" not in body:
        raise ApiError(400, "missing 'mode': 'adaptive' or 'static'", param="mode")
    try:
        setting = await state.async_engine.set_speculation(body["mode"], body.get("depth"))
    except InvalidRequestError as e:
        raise ApiError(400, str(e), param=e.param) from None
    except EngineDeadError as e:
        raise ApiError(503, str(e), type="service_unavailable") from None
    return web.Response(body=_json.encode(setting), content_type="application/json")


@web.middleware
async def _auth(request: web.Request, handler):
    if request.method == "OPTIONS":   # a CORS preflight: browsers send no credentials with it
        return await handler(request)
    why = protocol.api_key_refusal(request.path, request.headers.get("Authorization"),
                                   request.app[STATE].cfg.server.api_key)
    if why is not None:
        raise ApiError(401, why, code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})
    return await handler(request)


@web.middleware
async def _errors(request: web.Request, handler):
    """Errors as JSON, never a stack trace: aiohttp's own 404/405 included."""
    try:
        return await handler(request)
    except web.HTTPException as e:
        if e.status < 400:
            raise
        allow = {"Allow": e.headers["Allow"]} if "Allow" in e.headers else None   # a 405 says what is
        return ApiError(e.status, f"{request.method} {request.path}: {e.reason}", code=str(e.status),
                        headers=allow).response()
    except ApiError as e:
        return e.response()
    except (asyncio.CancelledError, ConnectionError):
        raise
    except Exception as e:
        logger.exception("internal error on %s %s", request.method, request.path)
        return ApiError(500, f"internal error: {e!r}", type="internal_error").response()


# -- the app ----------------------------------------------------------------------------------


def model_name(cfg: EngineConfig) -> str:
    return cfg.server.served_model_name or Path(cfg.target.path).name


def create_app(engine: LLMEngine | EngineCoreClient | EngineGroup, cfg: EngineConfig) -> web.Application:
    """The app for an engine (run on a worker thread) or an engine-core client; the backend
    starts and stops with the app (on its loop)."""
    backend = AsyncEngine(engine) if isinstance(engine, LLMEngine) else engine
    tokenizer = backend.tokenizer
    state = ServerState(cfg=cfg, model_name=model_name(cfg), metrics=ServerMetrics(backend.snapshot),
                        async_engine=backend,
                        max_token_bytes=max(len(t.encode("utf-8", "replace")) for t in tokenizer.get_vocab()),
                        token_text=logprobs_json.TokenText(tokenizer),
                        sampling_defaults=load_sampling_defaults(cfg.target.path))
    if state.sampling_defaults:
        logger.info("requests that leave them out get the model's sampling defaults "
                    "(generation_config.json): %s", state.sampling_defaults)
    app = web.Application(middlewares=[_errors, _auth], client_max_size=protocol.MAX_BODY_BYTES)
    app[STATE] = state

    async def start_engine(app: web.Application) -> None:
        state.idle = asyncio.Event()
        state.idle.set()
        await backend.start()

    async def stop_engine(app: web.Application) -> None:
        state.draining = True
        await backend.shutdown()

    app.on_startup.append(start_engine)
    app.on_cleanup.append(stop_engine)
    app.router.add_post("/v1/chat/completions", handle_chat)
    app.router.add_post("/v1/completions", handle_completions)
    app.router.add_get("/v1/models", handle_models)
    app.router.add_get("/v1/models/{model:.+}", handle_model)   # a name may hold "/"
    app.router.add_get("/health", handle_health)
    app.router.add_get("/metrics", handle_metrics)
    app.router.add_get("/stats", handle_stats)
    app.router.add_get("/", handle_page)
    if cfg.server.allowed_origins:
        app.router.add_route("OPTIONS", "/{path:.*}", handle_preflight)
        app.on_response_prepare.append(_cors_headers)
    if cfg.server.admin_api:
        app.router.add_get("/admin/speculation", handle_get_speculation)
        app.router.add_post("/admin/speculation", handle_set_speculation)
    return app


async def drain(app: web.Application, timeout_s: float) -> int:
    """Stop accepting (new requests and /health get 503) and wait up to timeout_s for the
    requests in flight to finish; the streams still running then end with an error event and
    [DONE]. Returns how many requests were still running at the timeout."""
    state = app[STATE]
    state.draining = True
    try:
        await asyncio.wait_for(state.idle.wait(), timeout_s)
    except asyncio.TimeoutError:
        pass
    left = state.num_inflight
    if left:
        state.async_engine.fail_all(EngineDeadError(f"the server is shutting down; this request did not finish "
                                                    f"within the {timeout_s:g} s drain"))
        try:   # their handlers write the error event and [DONE]
            await asyncio.wait_for(state.idle.wait(), 5.0)
        except asyncio.TimeoutError:
            pass
    return left


class _Runner(web.AppRunner):
    """An AppRunner whose server closes connections beyond [server] max_connections at once."""

    async def _make_server(self):
        server = await super()._make_server()
        limit = self.app[STATE].cfg.server.max_connections
        made = server.connection_made

        def connection_made(handler, transport) -> None:
            made(handler, transport)
            if len(server.connections) > limit:
                transport.close()

        server.connection_made = connection_made
        return server


def make_runner(app: web.Application, shutdown_timeout_s: float = 1.0) -> web.AppRunner:
    # handler_cancellation: a client that disconnects cancels its handler, which aborts its
    # requests even while they wait in the queue. keepalive_timeout closes a connection that
    # sends no complete request head for that long (from its start or since its last
    # response): slow or idle clients hold nothing for ever.
    # lingering_time: after an early answer (408, 413) the rest of a body is drained for at most
    # a second before the connection closes.
    return _Runner(app, handler_cancellation=True, shutdown_timeout=shutdown_timeout_s, access_log=None,
                   keepalive_timeout=app[STATE].cfg.server.idle_timeout_s, lingering_time=1.0)


def bind(host: str, port: int) -> socket.socket:
    """The listening socket, taken before the models load: a port in use is a one-line error
    at once, not a traceback after loading."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                             flags=socket.AI_PASSIVE)[0]
        sock = socket.socket(family, kind, proto)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
        sock.listen(1024)
    except OSError as e:
        raise SpecserveError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
    sock.setblocking(False)
    return sock


async def _serve(engine: LLMEngine, cfg: EngineConfig, sock: socket.socket) -> None:
    app = create_app(engine, cfg)
    runner = make_runner(app)
    await runner.setup()
    site = web.SockSite(runner, sock)
    await site.start()
    host, port = sock.getsockname()[:2]
    backend = app[STATE].async_engine
    cores = backend.cores if isinstance(backend, EngineGroup) else [backend]
    logger.info("max_model_len: %d, pid %d%s", backend.max_model_len, os.getpid(),
                f", engine core pids {', '.join(str(c.pid) for c in cores)}" if hasattr(cores[0], "pid") else "")
    logger.info("serving '%s' on http://%s:%d (OpenAI API at /v1)", model_name(cfg), host, port)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    logger.info("shutting down: refusing new requests, finishing %d in flight (at most %g s)",
                app[STATE].num_inflight, cfg.server.shutdown_timeout_s)
    left = await drain(app, cfg.server.shutdown_timeout_s)
    if left:
        logger.warning("aborting %d requests still running after %g s", left, cfg.server.shutdown_timeout_s)
    await runner.cleanup()  # cancels what is left (aborting its requests), then stops the engine
    logger.info("stopped")


def serve(cfg: EngineConfig) -> None:
    """`specserve serve`: take the port, start the engine (an engine-core process, or a worker
    thread of this one), run until SIGTERM/SIGINT."""
    sock = bind(cfg.server.host, cfg.server.port)
    logger.info("target: %s", cfg.target.path)
    logger.info("draft: %s%s", cfg.draft.kind, f" {cfg.draft.path}" if cfg.draft.kind == "model" else "")
    if cfg.server.engines > 1:
        engine = EngineGroup(cfg, cfg.server.engines)
    else:
        engine = EngineCoreClient(cfg) if cfg.server.engine_process else LLMEngine(cfg)
    asyncio.run(_serve(engine, cfg, sock))
