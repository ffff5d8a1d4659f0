"""OpenAI-compatible request models (pydantic, strict) and the JSON shapes of responses and errors.

A wrong type (``"max_tokens": "8"``), an out-of-range value or an unknown field is a 400 naming the field, as
OpenAI answers. Sampling fields have vLLM's names and semantics (splash.engine.sampling); inert OpenAI fields are
accepted and ignored; what is not implemented is a 400 naming the field.
"""
from __future__ import annotations

import time
from abc import abstractmethod
from typing import Annotated, Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from splash.config.serve_config import LAYOUTS

MAX_N = 64
MAX_STOP = 16
MAX_LOGPROBS = 20        # top-k logprobs per token (vLLM's default max_logprobs, OpenAI's top_logprobs limit)
MAX_LOGIT_BIAS = 300     # OpenAI's limit on logit_bias entries
MAX_PENALTY = 100.0      # repetition_penalty in [1 / MAX_PENALTY, MAX_PENALTY] (finite in float32; vLLM: > 0)
QUOTE_CHARS = 64           # an error message shows at most this many characters of one client value
MAX_MESSAGE_CHARS = 1024   # and an error message is never longer than this
Int64 = Annotated[int, Field(ge=-(2 ** 63), le=2 ** 63 - 1)]   # what the sampler's tensors can hold


def quote(value: Any, limit: int = QUOTE_CHARS) -> str:
    s = repr(value)
    if len(s) <= limit:
        return s
    return f"{s[:limit]}... ({len(s) - limit} more characters)"


def printable(text: str) -> str:
    """``text`` with any lone surrogate written as its ``\\udXXX`` escape, so it encodes as UTF-8."""
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


class APIError(Exception):
    def __init__(self, status: int, message: str, type_: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None, headers: dict[str, str] | None = None) -> None:
        if len(message) > MAX_MESSAGE_CHARS:
            message = f"{message[:MAX_MESSAGE_CHARS]}... (message cut at {MAX_MESSAGE_CHARS} characters)"
        # a client's field name or value can hold a lone surrogate: shown escaped, as UTF-8 cannot carry it
        message, param = printable(message), None if param is None else printable(param)
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code
        self.headers = headers

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.type, self.param, self.code)


def error_body(message: str, type_: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def internal_error(e: Exception) -> dict[str, Any]:
    return error_body(f"internal error: {type(e).__name__}: {quote(str(e), 200)}", "internal_error")


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")


class StreamOptions(_Strict):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class SamplingRequest(_Strict):
    model: Optional[str] = None
    max_tokens: Optional[Int64] = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    n: int = Field(1, ge=1, le=MAX_N)
    seed: Optional[int] = Field(None, ge=-(2 ** 63), le=2 ** 63 - 1 - MAX_N)
    stop: Union[str, list[str], None] = None
    stream: bool = False
    stream_options: Optional[StreamOptions] = None
    user: Optional[str] = None
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    logit_bias: Optional[dict[str, float]] = None
    # vLLM extensions
    return_token_ids: bool = False
    stop_token_ids: Optional[list[Int64]] = None
    ignore_eos: bool = False
    top_k: Optional[Int64] = Field(None, ge=-1)
    min_p: float = Field(0.0, ge=0.0, le=1.0)
    repetition_penalty: float = Field(1.0, ge=1 / MAX_PENALTY, le=MAX_PENALTY)
    min_tokens: Int64 = Field(0, ge=0)
    prompt_logprobs: Optional[int] = Field(None, ge=0, le=MAX_LOGPROBS)
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    return_tokens_as_token_ids: bool = False
    structured_outputs: Optional[dict[str, Any]] = None   # vLLM's; splash.server.structured

    def stop_strings(self) -> list[str]:
        if self.stop is None:
            return []
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop)
        if len(stops) > MAX_STOP:
            raise APIError(400, f"'stop' has {len(stops)} strings; at most {MAX_STOP} are allowed", param="stop")
        return [s for s in stops if s]

    def check_neutral(self) -> None:
        self.logit_bias_ids()

    def logit_bias_ids(self) -> dict[int, float]:
        """``logit_bias`` with int keys (OpenAI sends token ids as strings)."""
        out: dict[int, float] = {}
        for k, v in (self.logit_bias or {}).items():
            try:
                tid = int(k)
            except ValueError:
                raise APIError(400, f"'logit_bias' key {quote(k)} is not a token id", param="logit_bias") from None
            if not -100 <= v <= 100:
                raise APIError(400, f"'logit_bias' value for {quote(k)} must be in [-100, 100], got {v}",
                               param="logit_bias")
            out[tid] = v
        if len(out) > MAX_LOGIT_BIAS:
            raise APIError(400, f"'logit_bias' has {len(out)} entries; at most {MAX_LOGIT_BIAS} are allowed",
                           param="logit_bias")
        return out

    @abstractmethod
    def sample_logprobs(self) -> int | None:
        """Top-k logprobs per generated token (None: none): each request kind asks for them its own way."""


class CompletionRequest(SamplingRequest):
    prompt: Union[str, list[int], list[str], list[list[int]]]
    echo: bool = False
    logprobs: Optional[int] = Field(None, ge=0, le=MAX_LOGPROBS)
    best_of: Optional[int] = None
    suffix: Optional[str] = None

    def sample_logprobs(self) -> int | None:
        return self.logprobs

    def check_neutral(self) -> None:
        super().check_neutral()
        if self.best_of is not None and self.best_of != self.n:
            raise APIError(400, "'best_of' other than n is not supported by this server", param="best_of")
        if self.suffix:
            raise APIError(400, "'suffix' is not supported by this server", param="suffix")


class ChatMessage(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Union[str, list[dict[str, Any]], None] = None
    name: Optional[str] = None


class ChatCompletionRequest(SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: Optional[Int64] = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: Optional[int] = Field(None, ge=0, le=MAX_LOGPROBS)
    # inert OpenAI fields: accepted, ignored (as OpenAI ignores them for generation)
    metadata: Optional[dict[str, str]] = None
    store: Optional[bool] = None
    service_tier: Optional[str] = None
    prompt_cache_key: Optional[str] = None
    safety_identifier: Optional[str] = None
    # the agent API (splash.server.agent checks them)
    parallel_tool_calls: Optional[bool] = None
    tools: Optional[list[Any]] = None
    tool_choice: Union[str, dict[str, Any], None] = None
    response_format: Optional[dict[str, Any]] = None
    chat_template_kwargs: Optional[dict[str, Any]] = None
    # deprecated by OpenAI: a 400 naming them (splash.server.agent)
    functions: Optional[list[Any]] = None
    function_call: Union[str, dict[str, Any], None] = None

    def sample_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    def check_neutral(self) -> None:
        super().check_neutral()
        if self.top_logprobs is not None and not self.logprobs:
            raise APIError(400, "'top_logprobs' needs 'logprobs': true", param="top_logprobs")
        check_text_parts(self.messages)

    def template_messages(self) -> list[dict]:
        return template_messages(self.messages)


def check_text_parts(messages: list[ChatMessage]) -> None:
    """Content parts: text only (images and other parts: 400 naming the part)."""
    for i, m in enumerate(messages):
        for j, part in enumerate(m.content if isinstance(m.content, list) else ()):
            where, param = f"messages[{i}].content[{j}]", f"messages.{i}.content.{j}"
            if part.get("type") != "text":
                raise APIError(400, f"{where}: only text parts (type 'text') are supported, got type "
                                    f"{str(part.get('type'))[:40]!r}", param=param)
            if not isinstance(part.get("text"), str):
                raise APIError(400, f"{where}.text must be a string, got {type(part.get('text')).__name__}",
                               param=param)


def template_messages(messages: list[ChatMessage]) -> list[dict]:
    """Messages for the chat template: text parts joined with newlines (as vLLM), ``developer`` as ``system``."""
    out = []
    for m in messages:
        d = m.model_dump(exclude_none=True)
        if d.get("role") == "developer":
            d["role"] = "system"
        if isinstance(m.content, list):
            d["content"] = "\n".join(part["text"] for part in m.content)
        out.append(d)
    return out


class TokenizeRequest(_Strict):
    """vLLM's POST /tokenize: a text ``prompt``, or chat ``messages`` rendered as a chat request's would be."""
    model: Optional[str] = None
    prompt: Optional[str] = None
    messages: Optional[list[ChatMessage]] = Field(None, min_length=1)
    tools: Optional[list[Any]] = None
    chat_template_kwargs: Optional[dict[str, Any]] = None
    add_generation_prompt: bool = True
    add_special_tokens: Optional[bool] = None    # None: True for a prompt, False for messages (as vLLM)
    return_token_strs: bool = False

    def check(self) -> None:
        if (self.prompt is None) == (self.messages is None):
            raise APIError(400, "give exactly one of 'prompt' and 'messages'",
                           param="prompt" if self.prompt is not None else "messages")
        if self.prompt is not None and (self.tools is not None or self.chat_template_kwargs is not None):
            raise APIError(400, "'tools' and 'chat_template_kwargs' go with 'messages', not 'prompt'",
                           param="tools" if self.tools is not None else "chat_template_kwargs")
        if self.messages is not None:
            check_text_parts(self.messages)


class AbortRequest(_Strict):
    """SGLang's POST /abort_request: one request's sequences (`rid`: its response id) or all (`abort_all`)."""
    rid: Optional[str] = Field(None, min_length=1)
    abort_all: bool = False

    def check(self) -> None:
        if (self.rid is None) != self.abort_all:
            raise APIError(400, "give 'rid' (a response id) or 'abort_all': true, not both",
                           param="rid" if self.rid is not None else "abort_all")


class UpdateWeightsRequest(_Strict):
    """SGLang's POST /update_weights_from_disk: a checkpoint directory on the server's machine, same architecture."""
    model_path: str = Field(min_length=1)


class DetokenizeRequest(_Strict):
    """vLLM's POST /detokenize: the text of ``tokens``, special tokens included."""
    model: Optional[str] = None
    tokens: list[int]


class LayoutRequest(_Strict):
    layout: str

    def check(self, allowed: tuple[str, ...]) -> None:
        if self.layout != "auto" and self.layout not in allowed:
            known = "" if self.layout in LAYOUTS else " (not a layout)"
            raise APIError(400, f"invalid layout {quote(self.layout)}{known}: choose one of "
                                f"{', '.join(allowed + ('auto',))}", param="layout", code="invalid_layout")


def validation_message(err: ValidationError) -> tuple[str, str | None]:
    e = err.errors(include_url=False)[0]
    loc = [str(p) for p in e.get("loc", ())]
    # strip the union-member tags pydantic adds to the location (e.g. 'str', 'list[int]')
    param = ".".join(p for p in loc if not any(c in p for c in "[]") and p not in ("str", "int", "float",
                                                                                     "bool", "dict"))
    param = param[:QUOTE_CHARS]
    kind = e.get("type", "")
    if kind == "extra_forbidden":
        return f"unknown field '{param}'", param or None
    if kind == "missing":
        return f"missing required field '{param}'", param or None
    got = e.get("input")
    shown = quote(got) if not isinstance(got, (dict, list)) else type(got).__name__
    return f"invalid value for '{param}': {e.get('msg', 'invalid')} (got {shown})", param or None


def parse_request(model: type[BaseModel], data: Any) -> Any:
    if not isinstance(data, dict):
        raise APIError(400, f"the request body must be a JSON object, got {type(data).__name__}")
    try:
        return model.model_validate(data)
    except ValidationError as e:
        msg, param = validation_message(e)
        raise APIError(400, msg, param=param) from None
    except RecursionError:
        raise APIError(400, "the request body is nested too deeply") from None


def now() -> int:
    return int(time.time())


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict[str, Any]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


def choice(index: int, key: str, value: Any, finish: str | None, token_ids: list[int] | None) -> dict:
    """`key` is "text", "message" or "delta"; vLLM's `token_ids` when asked for."""
    out: dict[str, Any] = {"index": index, key: value, "logprobs": None, "finish_reason": finish}
    if token_ids is not None:
        out["token_ids"] = token_ids
    return out


def envelope(obj_id: str, obj: str, created: int, model: str, choices: list[dict],
             usage_: dict | None = None) -> dict:
    out: dict[str, Any] = {"id": obj_id, "object": obj, "created": created, "model": model, "choices": choices}
    if usage_ is not None:
        out["usage"] = usage_
    return out


def check_stream_fields(req: Any, chat: bool) -> None:
    """Streaming options that cannot apply are 400s, as vLLM answers them (it refuses chat's streamed
    ``prompt_logprobs`` rather than drop them)."""
    if req.stream_options is not None and not req.stream:
        raise APIError(400, "'stream_options' can only be set when 'stream' is true", param="stream_options")
    if chat and req.stream and req.prompt_logprobs is not None:
        raise APIError(400, "'prompt_logprobs' is not available with 'stream': true on chat completions; send the "
                            "request without streaming", param="prompt_logprobs")
