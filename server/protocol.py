"""The OpenAI request bodies as msgspec Structs with a bound on every field (DESIGN.md §7).

`parse(raw, chat)` decodes a body or raises `ProtocolError`: a 400 naming the field, its value
(abbreviated) and what is allowed. Bodies are bounded in size (the app's client_max_size, a
413) and in nesting (MAX_DEPTH). Fields the service does not implement are refused with a 400
naming them, unless they hold the value that changes nothing (no tools, min_p 0);
unknown fields that change nothing (`user`, `metadata`) are accepted, as OpenAI's clients
send them.
"""

from __future__ import annotations

import hmac
import re
from typing import Annotated, Any

import msgspec
from msgspec import Meta, Struct

from specserve.sampling import (MAX_BIAS, MAX_BIASED_TOKENS, MAX_LOGPROBS, MAX_PENALTY, MAX_REPETITION_PENALTY,
                                MAX_SEED, MAX_TEMPERATURE, MIN_SEED)

MAX_BODY_BYTES = 4 * 2**20      # a prompt of about a million tokens
MAX_DEPTH = 16                  # nesting of arrays and objects; the deepest valid body has 5
MAX_CHOICES = 64                # prompts x n in one request
MAX_TOKENS = 2**20
MAX_STOPS, MAX_STOP_CHARS = 4, 256   # as OpenAI: up to 4 stop sequences
MAX_STOP_TOKEN_IDS = 64
MAX_MESSAGES = 1024
MAX_TEMPLATE_KWARGS = 16
MAX_NAME = 256                  # model names, roles, user ids

Name = Annotated[str, Meta(max_length=MAX_NAME)]
Stop = Annotated[str, Meta(min_length=1, max_length=MAX_STOP_CHARS)]
Tokens = Annotated[int, Meta(ge=1, le=MAX_TOKENS)]
TokenId = Annotated[int, Meta(ge=0, le=2**31 - 1)]
Penalty = Annotated[float, Meta(ge=-MAX_PENALTY, le=MAX_PENALTY)]
Bias = Annotated[float, Meta(ge=-MAX_BIAS, le=MAX_BIAS)]

# What each field allows, in words, for the error messages.
ALLOWED = {
    "model": f"a string of at most {MAX_NAME} characters",
    "user": f"a string of at most {MAX_NAME} characters",
    "stream": "true or false", "include_usage": "true or false", "ignore_eos": "true or false",
    "continuous_usage_stats": "true or false",
    "echo": "true or false",
    "logprobs": f"true or false (chat), or null or an integer in [0, {MAX_LOGPROBS}] (completions)",
    "top_logprobs": f"null or an integer in [0, {MAX_LOGPROBS}]",
    "presence_penalty": f"a number in [-{MAX_PENALTY:g}, {MAX_PENALTY:g}]",
    "frequency_penalty": f"a number in [-{MAX_PENALTY:g}, {MAX_PENALTY:g}]",
    "repetition_penalty": f"a number in (0, {MAX_REPETITION_PENALTY:g}] (1 = off)",
    "logit_bias": (f'an object of at most {MAX_BIASED_TOKENS} token ids (as strings) mapped to numbers in '
                   f'[-{MAX_BIAS:g}, {MAX_BIAS:g}], like {{"50256": -100}}'),
    "stream_options": 'an object like {"include_usage": true, "continuous_usage_stats": false}',
    "n": f"an integer in [1, {MAX_CHOICES}]",
    "max_tokens": f"null or an integer in [1, {MAX_TOKENS}] (0 with echo)",
    "max_completion_tokens": f"null or an integer in [1, {MAX_TOKENS}]",
    "min_tokens": f"an integer in [0, {MAX_TOKENS}]",
    "temperature": f"a number in [0, {MAX_TEMPERATURE:g}] (0 = greedy)",
    "top_p": "a number in (0, 1]",
    "top_k": "an integer >= 1, or 0 or -1 for no top-k",
    "seed": f"null or an integer in [{MIN_SEED}, {MAX_SEED}]",
    "stop": f"a non-empty string of at most {MAX_STOP_CHARS} characters, or a list of at most {MAX_STOPS} of them",
    "stop_token_ids": f"a list of at most {MAX_STOP_TOKEN_IDS} token ids",
    "prompt": ("a string, a list of strings, a list of token ids or a list of lists of token ids, with "
               f"at most {MAX_CHOICES} prompts"),
    "messages": f"a non-empty list of at most {MAX_MESSAGES} objects like {{\"role\": \"user\", \"content\": \"...\"}}",
    "role": f"a string of at most {MAX_NAME} characters",
    "content": 'a string, null, or a list of text parts {"type": "text", "text": "..."}',
    "type": "a string", "text": "a string",
    "add_generation_prompt": "true or false", "continue_final_message": "true or false",
    "skip_special_tokens": "true or false", "add_special_tokens": "true or false",
    "include_stop_str_in_output": "true or false",
    "chat_template_kwargs": (f"an object of at most {MAX_TEMPLATE_KWARGS} variables for the chat template, "
                             'like {"enable_thinking": false}'),
}
# apply_chat_template's own parameters and the conversation: not template variables a request sets.
RESERVED_TEMPLATE_KWARGS = frozenset({
    "conversation", "messages", "tools", "documents", "chat_template", "add_generation_prompt",
    "continue_final_message", "tokenize", "sanitize_control_tokens", "padding", "truncation", "max_length",
    "return_tensors", "return_dict", "return_assistant_tokens_mask", "tokenizer_kwargs"})

# Fields this server does not implement, and the value of each that changes nothing.
# OpenAI's and vLLM's fields that would change the output: read from the body as sent.
NOT_IMPLEMENTED = {
    "suffix": (None, ""), "best_of": (None, 1), "tools": (None, []), "functions": (None, []),
    "tool_choice": (None, "none"), "function_call": (None, "none"), "response_format": (None, {"type": "text"}),
    "modalities": (None, ["text"]), "audio": (None,), "web_search_options": (None,), "reasoning_effort": (None,),
    "min_p": (None, 0, 0.0), "bad_words": (None, []), "allowed_token_ids": (None,), "use_beam_search": (None, False),
    "truncate_prompt_tokens": (None,), "prompt_logprobs": (None,),
    "guided_json": (None,), "guided_regex": (None,), "guided_choice": (None,), "guided_grammar": (None,),
    "structured_outputs": (None,), "spaces_between_special_tokens": (None, True),
    "return_tokens_as_token_ids": (None, False), "logits_processors": (None, []), "length_penalty": (None, 1, 1.0),
    "detokenize": (None, True),
}
NOT_IMPLEMENTED_IN_CHAT = {"echo": (None, False), "chat_template": (None,)}   # no templates from requests


def api_key_refusal(path: str, authorization: str | None, api_key: str | None) -> str | None:
    """Why a request may not use `path` ([server] api_key set and the API's routes, /v1/ and
    /admin/, asked for without `Authorization: Bearer <key>`), else None."""
    if api_key is None or not path.startswith(("/v1/", "/admin/")):
        return None
    scheme, _, given = (authorization or "").partition(" ")
    if scheme.lower() == "bearer" and hmac.compare_digest(given.strip().encode(), api_key.encode()):
        return None
    return ("this server needs an API key: send `Authorization: Bearer <key>`" if not authorization
            else "the API key given is not this server's")


class ProtocolError(Exception):
    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.message, self.param = message, param


class StreamOptions(Struct, forbid_unknown_fields=True):   # null is "not given", as at the top level
    include_usage: bool | None = False
    continuous_usage_stats: bool | None = False   # vLLM's: with include_usage, usage in every chunk too
    include_obfuscation: bool | None = None   # OpenAI's padding of chunks against side channels: none is sent


class _Request(Struct, kw_only=True):
    model: Name | None = None
    user: Name | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: Annotated[int, Meta(ge=1, le=MAX_CHOICES)] = 1
    max_tokens: Tokens | None = None
    min_tokens: Annotated[int, Meta(ge=0, le=MAX_TOKENS)] = 0
    temperature: Annotated[float, Meta(ge=0.0, le=MAX_TEMPERATURE)] | None = None
    top_p: Annotated[float, Meta(gt=0.0, le=1.0)] | None = None
    top_k: Annotated[int, Meta(ge=-1, le=2**31 - 1)] | None = None
    seed: int | None = None      # checked against [MIN_SEED, MAX_SEED] by _check_numbers
    stop: Stop | Annotated[list[Stop], Meta(max_length=MAX_STOPS)] | None = None
    stop_token_ids: Annotated[list[TokenId], Meta(max_length=MAX_STOP_TOKEN_IDS)] | None = None
    ignore_eos: bool = False
    presence_penalty: Penalty = 0.0
    frequency_penalty: Penalty = 0.0
    repetition_penalty: Annotated[float, Meta(gt=0.0, le=MAX_REPETITION_PENALTY)] | None = None   # vLLM's extension
    logit_bias: Annotated[dict[str, Bias], Meta(max_length=MAX_BIASED_TOKENS)] | None = None   # token id -> bias
    # vLLM's: whether the output text shows special tokens, whether a text prompt is encoded
    # with them (None: yes for completions; no for chat, whose template writes them), and
    # whether the text ends with the stop string (or stop token) that ended it.
    skip_special_tokens: bool = True
    add_special_tokens: bool | None = None
    include_stop_str_in_output: bool = False
    # specserve's extension (the chat page): each streamed choice also carries "provenance",
    # its text in pieces [text, accepted draft tokens?, number of tokens].
    provenance: bool = False

    @property
    def stops(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])


class CompletionRequest(_Request, kw_only=True):
    prompt: str | list[Any]
    max_tokens: Annotated[int, Meta(ge=0, le=MAX_TOKENS)] | None = None   # 0: echo only
    logprobs: Annotated[int, Meta(ge=0, le=MAX_LOGPROBS)] | None = None
    echo: bool = False


class ContentPart(Struct, kw_only=True):
    type: str
    text: str | None = None


class Message(Struct, kw_only=True):
    role: Name
    content: str | list[ContentPart] | None = None


class ChatRequest(_Request, kw_only=True):
    messages: Annotated[list[Message], Meta(min_length=1, max_length=MAX_MESSAGES)]
    max_completion_tokens: Tokens | None = None
    logprobs: bool = False
    top_logprobs: Annotated[int, Meta(ge=0, le=MAX_LOGPROBS)] | None = None
    # The chat template's switches, as vLLM takes them: continue_final_message renders the
    # last message open (typically an assistant's prefix), the reply continuing it;
    # chat_template_kwargs are the template's own variables (Qwen3's enable_thinking).
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: Annotated[dict[str, Any], Meta(max_length=MAX_TEMPLATE_KWARGS)] | None = None


def _depth(obj: Any, limit: int) -> bool:
    """Whether obj nests arrays and objects deeper than `limit`."""
    if limit < 0:
        return True
    if isinstance(obj, dict):
        return any(_depth(v, limit - 1) for v in obj.values())
    if isinstance(obj, list):
        return any(_depth(v, limit - 1) for v in obj)
    return False


def _short(value: Any, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 5] + "...'" if text[0] == "'" else text[: limit - 3] + "..."


def _lookup(obj: Any, path: list[str | int]) -> Any:
    for part in path:
        try:
            obj = obj[part]
        except (KeyError, IndexError, TypeError):
            return None
    return obj


def decode_object(raw: bytes) -> dict:
    """A body as a JSON object, bounded in nesting; null fields dropped (OpenAI's clients send
    null for "not given")."""
    try:
        body = msgspec.json.decode(raw)
    except msgspec.DecodeError as e:
        raise ProtocolError(f"the request body is not valid JSON (UTF-8 text, no lone surrogates): {e}") from None
    except RecursionError:
        body = None
    if body is None or _depth(body, MAX_DEPTH):
        raise ProtocolError(f"the request body nests arrays and objects deeper than {MAX_DEPTH} levels")
    if not isinstance(body, dict):
        raise ProtocolError(f"the request body must be a JSON object, got {type(body).__name__}")
    return {k: v for k, v in body.items() if v is not None}


def parse(raw: bytes, chat: bool) -> ChatRequest | CompletionRequest:
    """Decode a request body, or raise ProtocolError naming what is wrong."""
    body = decode_object(raw)
    try:
        req = msgspec.convert(body, ChatRequest if chat else CompletionRequest)
    except msgspec.ValidationError as e:
        raise _explain(e, body) from None
    for name, neutral in (NOT_IMPLEMENTED | NOT_IMPLEMENTED_IN_CHAT if chat else NOT_IMPLEMENTED).items():
        value = body.get(name)
        if not any(value == v and type(value) is type(v) or value is v for v in neutral):
            raise ProtocolError(f"{name} = {_short(value)}: '{name}' is not implemented by this server", name)
    if chat:
        for i, m in enumerate(req.messages):
            for j, part in enumerate(m.content if isinstance(m.content, list) else []):
                if part.type != "text" or part.text is None:
                    raise ProtocolError(f"messages[{i}].content[{j}] must be a text part "
                                        f'{{"type": "text", "text": "..."}}; other part types are not supported',
                                        f"messages[{i}].content")
        if req.top_logprobs is not None and not req.logprobs:
            raise ProtocolError("top_logprobs needs logprobs: true", "top_logprobs")
        if req.continue_final_message and req.add_generation_prompt:
            raise ProtocolError("continue_final_message continues the last message: it needs "
                                "add_generation_prompt: false", "continue_final_message")
        if reserved := sorted(RESERVED_TEMPLATE_KWARGS & set(req.chat_template_kwargs or ())):
            raise ProtocolError(f"chat_template_kwargs may not set {', '.join(map(repr, reserved))}: the request's "
                                "own fields set those", "chat_template_kwargs")
    else:
        _check_prompt(req.prompt)
        if req.max_tokens == 0 and not req.echo:
            raise ProtocolError(f"max_tokens must be an integer in [1, {MAX_TOKENS}] (0 only with echo: true), "
                                "got 0", "max_tokens")
    if req.logit_bias and not all(re.fullmatch(r"\d{1,10}", t) for t in req.logit_bias):
        bad = next(t for t in req.logit_bias if not re.fullmatch(r"\d{1,10}", t))
        raise ProtocolError(f"logit_bias must be {ALLOWED['logit_bias']}; {_short(bad)} is not a token id", "logit_bias")
    if req.seed is not None and not MIN_SEED <= req.seed <= MAX_SEED:   # wider than an int64 bound
        raise ProtocolError(f"seed must be {ALLOWED['seed']}, got {_short(req.seed)}", "seed")
    return req


def _check_prompt(prompt: str | list[Any]) -> None:
    why = ALLOWED["prompt"]
    if isinstance(prompt, str):
        return
    ok = bool(prompt) and (
        all(isinstance(t, int) and not isinstance(t, bool) for t in prompt)
        or len(prompt) <= MAX_CHOICES and (
            all(isinstance(p, str) for p in prompt)
            or all(isinstance(p, list) and p and all(isinstance(t, int) and not isinstance(t, bool) for t in p)
                   for p in prompt)))
    if not ok:
        raise ProtocolError(f"prompt must be {why}, got {_short(prompt)}", "prompt")


_PATH = re.compile(r" - at `\$(.*)`$")


def _param(parts: list[str | int]) -> str:
    return "".join(f"[{p}]" if isinstance(p, int) else (f".{p}" if i else p) for i, p in enumerate(parts))


def _explain(error: msgspec.ValidationError, body: dict) -> ProtocolError:
    """msgspec's "Expected `int` >= 1 - at `$.n`" as "n must be an integer in [1, 64], got 0"."""
    text = str(error)
    m = _PATH.search(text)
    missing = re.search(r"missing required field `(\w+)`", text)
    if missing:
        name = missing.group(1)
        return ProtocolError(f"missing '{name}': {ALLOWED.get(name, 'required')}", name)
    if not m:
        return ProtocolError(f"invalid request: {text}")
    parts: list[str | int] = [name or int(index) for name, index in re.findall(r"\.(\w+)|\[(\d+)\]", m.group(1))]
    param = _param(parts)
    field = next((p for p in reversed(parts) if isinstance(p, str)), "")
    top = next((p for p in parts if isinstance(p, str)), field)
    allowed = ALLOWED.get(field) or ALLOWED.get(top) or text[: m.start()]
    if isinstance(parts[-1], int) and top in ("stop", "stop_token_ids", "prompt"):
        param = top   # an element of a list: the list is the parameter
    if top == "messages" and field in ("role", "content", "type", "text"):
        param = _param(parts[:3])
    return ProtocolError(f"{param} must be {allowed}, got {_short(_lookup(body, parts))}", param)
