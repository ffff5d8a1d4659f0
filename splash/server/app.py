"""The HTTP API on rank 0 (FastAPI): OpenAI-compatible completions/chat, models, health, metrics, layout control.

Every error is OpenAI-shaped, ``{"error": {"message", "type", "param", "code"}}``, and fails only its own request;
a request whose client disconnects is cancelled, streaming or not.
"""
from __future__ import annotations

import asyncio
import hmac
import ipaddress
import json
import logging
import sys
import time
import uuid
from dataclasses import dataclass, field
from importlib import metadata
from typing import Any, AsyncIterator, Callable

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException

from splash.config.serve_config import ServerSection
from splash.engine.sampling import SamplingParams
from splash.errors import EngineBusy
from splash.server import admission_cost, chat_output
from splash.server import protocol as P
from splash.server.agent import AgentAPI, Prepared, template_kwargs, template_tools, with_prompt
from splash.server.body import ClientGone, read_json, until_disconnected
from splash.server.engine_loop import EngineLoop, EngineStopped
from splash.server.generation import Delta, Generation
from splash.server.json_body import ResponseBuilder
from splash.server.logprobs import ResponseExtras
from splash.server.metrics import Metrics
from splash.server.prompts import PromptReader
from splash.server.tool_choice import read_tools
from splash.tokenizer import Tokenizer

_log = logging.getLogger("splash")
try:
    SPLASH_VERSION = metadata.version("splash")
except metadata.PackageNotFoundError:   # run from a source tree that was never installed
    SPLASH_VERSION = "unknown"
DEFAULT_COMPLETION_MAX_TOKENS = 16   # OpenAI's default for /v1/completions
SAME_NAMED = ("temperature", "top_p", "ignore_eos", "min_p", "repetition_penalty", "presence_penalty",
              "frequency_penalty", "min_tokens", "skip_special_tokens", "spaces_between_special_tokens",
              "include_stop_str_in_output")   # request fields SamplingParams takes as they are


@dataclass
class ServerState:
    loop: EngineLoop
    tokenizer: Tokenizer
    metrics: Metrics
    model_name: str
    max_model_len: int
    vocab_size: int
    host: str = "127.0.0.1"
    admin_token: str | None = None
    api_key: str | None = None                   # when set, every route but OPEN_ROUTES needs it as a bearer token
    world_size: int = 1
    created: int = field(default_factory=P.now)
    limits: ServerSection = field(default_factory=ServerSection)   # the request limits (config section server)
    tool_call_parser: str | None = None          # splash.server.agent.resolve_parsers
    reasoning_parser: str | None = None
    sampling_defaults: dict[str, Any] = field(default_factory=dict)   # splash.server.startup.sampling_defaults
    say: Callable[[str], None] = lambda message: None   # rank 0's console line for admin actions (frontend.serve)
    model_root: str | None = None                 # the model directory (or preset) served, as vLLM's card's root


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def admin_token_required(host: str, admin_token: str | None) -> bool:
    """The admin rule: a configured token is always required; a non-loopback bind always requires one."""
    return admin_token is not None or not is_loopback(host)


def check_admin(state: ServerState, authorization: str | None) -> None:
    if not admin_token_required(state.host, state.admin_token):
        return
    if not state.admin_token:   # None, or an empty token (refused at startup; never a key that anyone holds)
        raise P.APIError(403, f"layout control is disabled: the server listens on {state.host} (not loopback) "
                              "and server.admin_token is not set", "permission_error")
    if not bearer_matches(authorization, state.admin_token):
        raise P.APIError(401, "missing or invalid admin token: send 'Authorization: Bearer <server.admin_token>'",
                         "authentication_error", code="invalid_token")


def bearer_matches(authorization: str | None, secret: str) -> bool:
    """``Authorization: Bearer <secret>``, compared in constant time; an empty secret never matches."""
    scheme, _, token = (authorization or "").partition(" ")
    token = token.strip()
    return scheme.lower() == "bearer" and bool(token) and bool(secret) and hmac.compare_digest(token.encode(),
                                                                                             secret.encode())


ADMIN_ROUTES = frozenset({("POST", "/v1/layout"), ("POST", "/reset_prefix_cache"),
                          ("POST", "/update_weights_from_disk"), ("POST", "/abort_request")})
OPEN_ROUTES = frozenset({"/health", "/metrics", "/version"})   # no API key: probes and scrapers


class _RequireAPIKey:
    """vLLM's --api-key: with ``server.api_key`` set, a request without ``Authorization: Bearer <key>`` is a 401
    before its body is read, on every route but /health, /metrics and /version (vLLM guards /v1 only; here
    /tokenize and /detokenize, which cost work, too). An admin route whose admin token is required checks that
    token instead (one Authorization header cannot carry both)."""

    def __init__(self, app: Any, state: ServerState) -> None:
        self.app, self.state = app, state

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        s = self.state
        if scope["type"] == "http" and s.api_key is not None and self._guarded(scope):
            auth = next((v.decode("latin-1") for k, v in scope.get("headers", ()) if k == b"authorization"), None)
            if not bearer_matches(auth, s.api_key):
                error = P.APIError(401, "missing or invalid API key: send 'Authorization: Bearer <server.api_key>'",
                                   "authentication_error", code="invalid_api_key")
                response = JSONResponse(error.body(), status_code=401, headers={"WWW-Authenticate": "Bearer"})
                return await response(scope, receive, send)
        return await self.app(scope, receive, send)

    def _guarded(self, scope: dict) -> bool:
        path, method = scope.get("path", ""), scope.get("method", "")
        if (method, path) in ADMIN_ROUTES:
            return not admin_token_required(self.state.host, self.state.admin_token)
        return method != "OPTIONS" and path not in OPEN_ROUTES


def _sse(obj: Any) -> str:
    return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n"


if sys.version_info >= (3, 11):
    async def _within(aw: Any, timeout_s: float) -> Any:
        """``aw`` awaited with a deadline: 3 µs where ``asyncio.wait_for`` costs 9 (it wraps ``aw`` in a task),
        and it runs once per streamed chunk."""
        async with asyncio.timeout(timeout_s):
            return await aw
else:
    _within = asyncio.wait_for


class ClientTooSlow(Exception):
    """No part of a client's answer could be written for server.read_timeout_s: its connection is closed."""


class _CountRequests:
    """Counts answered requests by route (``other`` for unknown paths, so random paths cannot grow /metrics) and
    status. An exception no handler answered becomes a counted 500 here and is not re-raised, so uvicorn keeps
    the keep-alive connection instead of resetting it. A client whose answer cannot be written for
    ``send_timeout_s`` (it stopped reading, or reads too slowly to make room in its socket buffers) is dropped,
    so what its answer holds on rank 0 (a finished response, a stream's queued events) is let go."""

    def __init__(self, app: Any, metrics: Metrics, routes: frozenset[str] = frozenset(),
                 send_timeout_s: float = 30.0) -> None:
        self.app, self.metrics, self.routes, self.send_timeout_s = app, metrics, routes, send_timeout_s

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path = scope.get("path", "")
        endpoint = path if path in self.routes else "other"

        started = False

        async def send_wrapper(message: dict) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
                self.metrics.requests.labels(endpoint, str(message["status"])).inc()
            try:   # uvicorn's send waits while the client's buffers are full
                await _within(send(message), self.send_timeout_s)
            except (asyncio.TimeoutError, TimeoutError):
                raise ClientTooSlow(f"no part of the answer could be written for {self.send_timeout_s:g}s "
                                    "(server.read_timeout_s): the client is not reading; closing the connection") \
                    from None

        try:
            await self.app(scope, receive, send_wrapper)
        except ClientTooSlow as e:
            _log.warning("%s %s: %s", scope.get("method"), endpoint, e)
            raise   # uvicorn closes the connection; the response's generator ends, cancelling what still runs
        except Exception as e:  # noqa: BLE001 — one request fails, never the connection or the server
            _log.error("internal error answering %s %s: %s: %s", scope.get("method"), endpoint, type(e).__name__,
                       P.quote(str(e), 200))
            if started:   # a body was under way: ending the connection is the only way to say it broke
                raise
            body = json.dumps(P.internal_error(e)).encode()
            await send_wrapper({"type": "http.response.start", "status": 500,
                                "headers": [(b"content-type", b"application/json"),
                                            (b"content-length", str(len(body)).encode())]})
            await send_wrapper({"type": "http.response.body", "body": body})


class _Handlers:
    """Route bodies, kept out of create_app so each stays short."""

    def __init__(self, state: ServerState) -> None:
        self.s = state
        self.prompts = PromptReader(state.tokenizer, state.max_model_len, state.vocab_size)
        self.agent = AgentAPI(state.tokenizer, state.vocab_size, state.tool_call_parser, state.reasoning_parser,
                              stopping=lambda: state.loop.draining)
        self.builder = ResponseBuilder()   # large bodies: built one at a time, off the event loop

    async def body(self, request: Request, model: type) -> Any:
        lim = self.s.limits
        data = await read_json(request, lim.max_request_body_bytes, lim.read_timeout_s)
        if model in (P.ChatCompletionRequest, P.TokenizeRequest) and isinstance(data, dict):
            self.prompts.check_message_count(data.get("messages"))   # before validation, whose cost grows with them
        req = P.parse_request(model, data)
        if isinstance(req, P.SamplingRequest):   # the model's sampling defaults fill what the request left out
            unset = {k: v for k, v in self.s.sampling_defaults.items() if k != "max_tokens"
                     and k not in req.model_fields_set}
            if unset:
                req = req.model_copy(update=unset)
        return req

    def default_max_tokens(self, api_default: int) -> int:
        """max_tokens for a request without one: the model's max_new_tokens when it gives one, else the API's."""
        return self.s.sampling_defaults.get("max_tokens", api_default)

    def check(self, req: P.SamplingRequest, num_prompts: int, chat: bool) -> None:
        """The checks both endpoints make before any prompt is read, in the order their errors are answered."""
        self.check_model(req.model)
        req.check_neutral()
        P.check_stream_fields(req, chat)
        limit = self.s.limits.max_seqs_per_request
        if num_prompts * req.n > limit:
            raise P.APIError(400, f"the request asks for {num_prompts} prompt(s) x n={req.n} = {num_prompts * req.n} "
                                  f"sequences; at most {limit} are allowed (server.max_seqs_per_request)",
                             param="n" if num_prompts == 1 else "prompt", code="too_many_sequences")

    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.s.model_name:
            raise P.APIError(404, f"the model {P.quote(model)} does not exist; this server serves "
                                  f"'{self.s.model_name}'", param="model", code="model_not_found")

    def max_tokens(self, requested: int | None, default: int, prompts: list[list[int]], param: str) -> int:
        """``requested`` if every prompt has room for it (else 400, as vLLM and OpenAI answer)."""
        room = self.s.max_model_len - max(map(len, prompts))
        if requested is None:
            return max(1, min(default, room))
        if requested > room:
            raise P.APIError(400, f"'{param}' is {requested}, but the prompt has {self.s.max_model_len - room} "
                                  f"tokens and the model's context (max_model_len) is {self.s.max_model_len}: at "
                                  f"most {room} tokens can be generated", param=param, code="context_length_exceeded")
        return requested

    def params(self, req: P.SamplingRequest, max_tokens: int, j: int, prompt_logprobs: int | None,
               grammar: Any) -> SamplingParams:
        seed = None if req.seed is None else req.seed + j
        bias = req.logit_bias_ids()
        bad = next((t for t in bias if not 0 <= t < self.s.vocab_size), None)
        if bad is not None:
            raise P.APIError(400, f"'logit_bias' token id {P.quote(bad)} is outside the vocabulary "
                                  f"[0, {self.s.vocab_size})",
                             param="logit_bias")
        try:
            return SamplingParams(
                max_tokens=max_tokens, seed=seed, stop_token_ids=tuple(req.stop_token_ids or ()), top_k=req.top_k or 0,
                logit_bias=bias, logprobs=req.sample_logprobs(), prompt_logprobs=prompt_logprobs, grammar=grammar,
                **{k: getattr(req, k) for k in SAME_NAMED})
        except ValueError as e:  # combinations pydantic does not see (e.g. min_tokens > max_tokens)
            raise P.APIError(400, str(e), param=str(e).split()[0]) from None

    async def answer(self, request: Request, req: P.SamplingRequest, prompts: list[list[int]], max_tokens: int,
                     prompt_logprobs: int | None, grammar: Any, agent: Prepared | None = None,
                     echo: list[str] | None = None) -> Response:
        """Admit, start and answer (streamed or not) a request whose prompts are read; ``agent`` marks chat."""
        chat = agent is not None
        cost = admission_cost.estimate(admission_cost.request_shape(req, [len(p) for p in prompts], max_tokens, chat))
        why = admission_cost.over_budget(cost, self.s.limits.max_request_mb, req.n)
        if why is not None:   # the worst case passes server.max_request_mb
            raise P.APIError(400, why, param=cost.driver, code="request_too_costly")
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex[:24]}"
        flat_prompts, flat_params = [], []
        for prompt in prompts:
            for j in range(req.n):   # prompt logprobs: computed once per prompt, by its first sample
                flat_prompts.append(prompt)
                flat_params.append(self.params(req, max_tokens, j, prompt_logprobs if j == 0 else None, grammar))
        gen = Generation(self.s.loop, self.s.tokenizer, flat_prompts, flat_params, req.stop_strings(), rid,
                         n=req.n)
        gen.start()
        gen.echo = echo
        if req.stream:
            return self.stream(gen, req, agent)
        await self.collect(request, gen)
        # built in a worker thread: with logprobs the body can hold millions of entries
        return self.builder.json_response(await self.builder.run(self.response_body, gen, req, agent))

    async def completions(self, request: Request) -> Response:
        req = await self.body(request, P.CompletionRequest)
        p = req.prompt
        self.check(req, 1 if isinstance(p, str) or (p and isinstance(p[0], int)) else len(p), chat=False)
        prompts = await self.prompts.completion(p)
        grammar = await self.agent.completion(req)
        mt = self.max_tokens(req.max_tokens, self.default_max_tokens(DEFAULT_COMPLETION_MAX_TOKENS), prompts,
                             "max_tokens")
        plp = req.prompt_logprobs
        if req.echo and req.logprobs is not None:   # echo + logprobs: the prompt's tokens carry logprobs too
            plp = max(plp or 0, req.logprobs)
        echo = None
        if req.echo:   # the prompt as echoed: the string sent, or the decoded token ids
            echo = [p] if isinstance(p, str) else list(p) if isinstance(p[0], str) else [
                self.s.tokenizer.decode(x) for x in prompts]
        return await self.answer(request, req, prompts, mt, plp, grammar, echo=echo)

    async def chat(self, request: Request) -> Response:
        req = await self.body(request, P.ChatCompletionRequest)
        self.check(req, 1, chat=True)
        agent = await self.agent.chat(req)
        messages = await asyncio.to_thread(req.template_messages)
        prompt = await self.prompts.chat(messages, agent.tools, agent.mode.template_kwargs)
        agent = with_prompt(agent, self.s.tokenizer, prompt)
        param = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
        mt = self.max_tokens(req.max_completion_tokens or req.max_tokens, self.default_max_tokens(self.s.max_model_len),
                             [prompt], param)
        return await self.answer(request, req, [prompt], mt, req.prompt_logprobs, agent.grammar, agent)

    async def tokenize(self, request: Request) -> JSONResponse:
        """vLLM's POST /tokenize: the ids a completion's text ``prompt`` or a chat's ``messages`` (with ``tools``
        and ``chat_template_kwargs``) become here; bounded as a prompt is (max_model_len)."""
        req = await self.body(request, P.TokenizeRequest)
        self.check_model(req.model)
        req.check()
        if req.messages is not None:
            tools = template_tools(read_tools(req.tools, None))
            kwargs = template_kwargs(req.chat_template_kwargs)
            messages = await asyncio.to_thread(P.template_messages, req.messages)
            text = await self.prompts.chat_text(messages, tools, kwargs, req.add_generation_prompt)
            ids = await self.prompts.tokens(text, "messages", bool(req.add_special_tokens))
        else:
            ids = await self.prompts.tokens(req.prompt, "prompt", req.add_special_tokens is not False)
        strs = [self.s.tokenizer.hf.id_to_token(i) for i in ids] if req.return_token_strs else None
        return JSONResponse({"count": len(ids), "max_model_len": self.s.max_model_len, "tokens": ids,
                             "token_strs": strs})

    async def detokenize(self, request: Request) -> JSONResponse:
        """vLLM's POST /detokenize: the text of at most max_model_len ``tokens``, special tokens kept."""
        req = await self.body(request, P.DetokenizeRequest)
        self.check_model(req.model)
        if len(req.tokens) > self.s.max_model_len:
            raise P.APIError(400, f"'tokens' has {len(req.tokens)} tokens, more than the model's context "
                                  f"(max_model_len {self.s.max_model_len})", param="tokens",
                             code="context_length_exceeded")
        self.prompts.check_vocab(req.tokens, "tokens")
        text = await asyncio.to_thread(self.s.tokenizer.decode, req.tokens, False)
        return JSONResponse({"prompt": text})

    async def collect(self, request: Request, gen: Generation) -> None:
        run = asyncio.ensure_future(gen.run_to_end())
        gone = asyncio.ensure_future(until_disconnected(request))
        try:
            await asyncio.wait({run, gone}, return_when=asyncio.FIRST_COMPLETED)
            if not run.done():
                raise ClientGone()     # nobody is waiting for the answer: stop generating it
            run.result()
        finally:
            for task in (run, gone):
                task.cancel()
            if not gen.done:
                gen.cancel()

    def response_body(self, gen: Generation, req: P.SamplingRequest, agent: Prepared | None) -> dict:
        extras = ResponseExtras(self.s.tokenizer, req, gen, agent is not None)
        choices = []
        for c in gen.choices:
            ids = c.token_ids if req.return_token_ids else None
            if agent is None:
                choice = P.choice(c.index, "text", c.text, c.finish, ids)
            else:   # reasoning_content / tool_calls (splash.server.chat_output)
                choice = P.choice(c.index, "message", *chat_output.message(agent.mode, c.text, c.finish), ids)
            choices.append(extras.decorate(choice, Delta(c, c.text, c.token_ids, c.finish, c.logprobs)))
        obj = "text_completion" if agent is None else "chat.completion"
        body = P.envelope(gen.id, obj, P.now(), self.s.model_name, choices, gen.usage())
        if agent is not None and req.prompt_logprobs is not None:   # vLLM: chat's are on the response
            body["prompt_logprobs"] = extras.prompt_body(gen.choices[0])
        return body

    def stream(self, gen: Generation, req: P.SamplingRequest, agent: Prepared | None) -> StreamingResponse:
        created, model, ids = P.now(), self.s.model_name, req.return_token_ids
        obj = "text_completion" if agent is None else "chat.completion.chunk"
        extras = ResponseExtras(self.s.tokenizer, req, gen, agent is not None)
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        readers = {c.index: chat_output.ChatStream(agent.mode) for c in gen.choices} if agent is not None else {}
        continuous = include_usage and req.stream_options.continuous_usage_stats

        def chunk(choices: list[dict]) -> str:   # the last chunk, with the usage, has no choices
            body = P.envelope(gen.id, obj, created, model, choices)
            if include_usage:   # vLLM's continuous_usage_stats: the running counts on every chunk
                body["usage"] = gen.usage() if continuous or not choices else None
            return _sse(body)

        def choice_chunk(d: Delta) -> str | None:
            i, tids = d.choice.index, d.token_ids if ids else None
            if i not in readers:   # completions
                return chunk([extras.decorate(P.choice(i, "text", d.text, d.finish, tids), d)])
            delta = readers[i].feed(d.text, last=d.finish is not None)
            if not delta and d.finish is None and not ids and not extras.pending(d):
                return None   # text held back by a parser (a marker may be starting)
            return chunk([extras.decorate(P.choice(i, "delta", delta, readers[i].finish_reason(d.finish), tids), d)])

        async def events() -> AsyncIterator[str]:
            try:
                for c in gen.choices if agent is not None else ():
                    yield chunk([P.choice(c.index, "delta", {"role": "assistant", "content": ""}, None,
                                          [] if ids else None)])
                async for deltas in gen.deltas():
                    for d in deltas:
                        if not d.text and d.finish is None and not ids and not extras.pending(d):
                            continue  # tokens whose text is held back (partial UTF-8, possible stop string)
                        # a first chunk carrying prompt logprobs is built off the loop
                        out = await self.builder.run(choice_chunk, d) if extras.heavy(d) else choice_chunk(d)
                        if out is not None:
                            yield out
                if include_usage:
                    yield chunk([])
            except P.APIError as e:
                yield _sse(e.body())
            except Exception as e:  # noqa: BLE001 — the stream ends with an error event, never mid-body
                yield _sse(P.internal_error(e))
            finally:
                if not gen.done:
                    gen.cancel()
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    def layout_body(self) -> dict:
        snap = self.s.loop.snapshot
        return {"layout": snap.layout, "mode": snap.mode, "target": snap.target,
                "allowed_layouts": list(snap.allowed_layouts),
                "switch_count": snap.total_switches,
                "switches": {f"{a}->{b}": n for (a, b), n in sorted(snap.switch_counts.items())},
                "steps": snap.steps, "scheduler": snap.scheduler}

    @staticmethod
    async def on_engine(command: Any, *args: Any) -> Any:
        """Run a command on the engine thread and wait for its answer; 503 once the engine stopped."""
        try:
            return await asyncio.wrap_future(command(*args))
        except EngineStopped as e:
            raise P.APIError(503, str(e), "service_unavailable") from None

    async def reset_prefix_cache(self, request: Request) -> JSONResponse:
        """vLLM's admin endpoint: forget every cached block no request uses (token-protected like /v1/layout)."""
        check_admin(self.s, request.headers.get("authorization"))
        return JSONResponse({"evicted_blocks": await self.on_engine(self.s.loop.reset_prefix_cache)})

    async def abort_request(self, request: Request) -> JSONResponse:
        """SGLang's admin endpoint (token-protected like /v1/layout), e.g. an RL rollout cutting its long tail: the
        sequences of response `rid`, or every one, end now with what they have (finish_reason "abort")."""
        check_admin(self.s, request.headers.get("authorization"))
        req = await self.body(request, P.AbortRequest)
        req.check()
        # a sequence's id is its response's id, "-", its choice index: only the whole response id names it
        match = (lambda rid: True) if req.abort_all else (lambda rid: rid.rpartition("-")[0] == req.rid)
        return JSONResponse({"aborted": await self.on_engine(self.s.loop.abort_matching, match)})

    async def update_weights(self, request: Request) -> JSONResponse:
        """SGLang's admin endpoint (token-protected like /v1/layout): every rank loads `model_path`'s weights into
        its current layout once the admitted requests are done (later ones wait for it); 409 while another waits."""
        check_admin(self.s, request.headers.get("authorization"))
        req = await self.body(request, P.UpdateWeightsRequest)
        self.s.say(f"splash-serve: updating the weights from {req.model_path} once the admitted requests are done")
        t0 = time.perf_counter()
        try:
            evicted = await self.on_engine(self.s.loop.update_weights, req.model_path)
        except EngineBusy as e:
            raise P.APIError(409, str(e), "conflict_error", code="engine_busy", headers={"Retry-After": "1"}) \
                from None
        except ValueError as e:
            self.s.say(f"splash-serve: weight update from {req.model_path} failed, nothing changed: {e}")
            raise P.APIError(400, str(e), param="model_path", code="update_failed") from None
        self.s.say(f"splash-serve: weights updated from {req.model_path} in {time.perf_counter() - t0:.2f} s")
        return JSONResponse({"success": True, "message": f"weights loaded from {req.model_path}",
                             "evicted_blocks": evicted})

    async def set_layout(self, request: Request) -> JSONResponse:
        check_admin(self.s, request.headers.get("authorization"))
        req = await self.body(request, P.LayoutRequest)
        req.check(self.s.loop.allowed_layouts)
        try:
            await self.on_engine(self.s.loop.set_layout, req.layout)
        except ValueError as e:
            raise P.APIError(400, str(e), param="layout", code="invalid_layout") from None
        return JSONResponse({**self.layout_body(), "requested": req.layout})


def create_app(state: ServerState) -> FastAPI:
    app = FastAPI(title="SPLASH", description="OpenAI-compatible API of splash-serve")
    h = _Handlers(state)

    @app.exception_handler(P.APIError)
    async def _api_error(_: Request, e: P.APIError) -> JSONResponse:
        return JSONResponse(e.body(), status_code=e.status, headers=e.headers)

    @app.exception_handler(ClientGone)
    async def _gone(_: Request, e: ClientGone) -> Response:
        return Response(status_code=499)   # never delivered: the client closed the connection

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, e: StarletteHTTPException) -> JSONResponse:
        kind = "not_found_error" if e.status_code == 404 else "invalid_request_error"
        return JSONResponse(P.error_body(str(e.detail), kind), status_code=e.status_code)

    app.add_api_route("/v1/completions", h.completions, methods=["POST"])
    app.add_api_route("/v1/chat/completions", h.chat, methods=["POST"])
    app.add_api_route("/v1/layout", h.set_layout, methods=["POST"])
    app.add_api_route("/reset_prefix_cache", h.reset_prefix_cache, methods=["POST"])
    app.add_api_route("/update_weights_from_disk", h.update_weights, methods=["POST"])
    app.add_api_route("/abort_request", h.abort_request, methods=["POST"])
    app.add_api_route("/tokenize", h.tokenize, methods=["POST"])
    app.add_api_route("/detokenize", h.detokenize, methods=["POST"])

    @app.get("/version")
    async def version() -> dict:
        return {"version": SPLASH_VERSION}

    @app.get("/v1/layout")
    async def get_layout() -> dict:
        return h.layout_body()

    @app.get("/v1/models")
    async def models() -> dict:
        card = {"id": state.model_name, "object": "model", "created": state.created, "owned_by": "splash",
                "root": state.model_root or state.model_name, "parent": None, "max_model_len": state.max_model_len}
        return {"object": "list", "data": [card]}

    @app.get("/health")
    async def health() -> JSONResponse:
        """503 while stopping, or ``stalled`` when the step in flight has run past server.collective_timeout_s."""
        loop, snap = state.loop, state.loop.snapshot
        running_s = loop.stalled_s()
        status = "ok" if loop.alive else "stopping"
        if status == "ok" and running_s > state.limits.collective_timeout_s:
            status = "stalled"
        return JSONResponse({"status": status, "layout": snap.layout if snap else None,
                             "world_size": state.world_size, "step_running_s": round(running_s, 3)},
                            status_code=200 if status == "ok" else 503)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(state.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    routes = frozenset(getattr(r, "path", "") for r in app.routes)
    app.add_middleware(_RequireAPIKey, state=state)   # inside the count: its 401s are counted like every answer
    app.add_middleware(_CountRequests, metrics=state.metrics, routes=routes,
                       send_timeout_s=state.limits.read_timeout_s)
    return app
