"""Structured output: what a request constrains its output to, and the grammar xgrammar compiles for it.

A request names at most one constraint (a second is a 400 naming it): OpenAI's ``response_format``, vLLM's
``structured_outputs`` (exactly one of STRUCTURED_KEYS), or chat's forced ``tool_choice``
(splash.server.tool_choice). Schemas compile with ``any_whitespace=False`` (vLLM's ``disable-any-whitespace``), so
a model cannot spend its tokens on whitespace. Compilation runs in a worker thread through one cached
``xgrammar.GrammarCompiler`` per server; xgrammar releases the GIL while it compiles (measured: a 1.1 s compile
left the other threads' longest pause at 5 ms), so the engine thread keeps stepping. The compiles have daemon threads
of their own (COMPILE_THREADS): a compile that times out still runs to its end (xgrammar cannot be interrupted), so in
asyncio's default executor a few costly schemas would hold every worker for minutes, stalling each text prompt's
tokenization behind them, and any pool Python joins at exit would hold a stopping server until they end. A
constraint that does not compile (or not within COMPILE_TIMEOUT_S, queueing included) is a 400 with xgrammar's
message.
"""
from __future__ import annotations

import asyncio
import functools
import json
import queue
import re
import threading
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, Callable

from splash.server.protocol import APIError
from splash.tokenizer import Tokenizer

CACHE_BYTES = 256 << 20   # xgrammar's compiled-grammar cache (LRU by bytes)
COMPILE_TIMEOUT_S = 30.0  # a constraint that takes longer to compile is answered with a 400
STOP_POLL_S = 0.1         # how often a request waiting for its compile checks whether the server is stopping
COMPILE_THREADS = 2       # grammar compiles at once; more wait in their pool, never in asyncio's default executor
ANY_OBJECT = '{"type": "object"}'   # json_object
_WHERE = re.compile(r"^\[[^\]]*\]\s*\S+:\d+:\s*")   # xgrammar's "[time] file.cc:line: " prefix


@dataclass(frozen=True)
class GrammarSpec:
    """``kind``: json (source: schema text), regex or grammar (EBNF); ``param``: the request field it came from."""
    kind: str
    source: str
    param: str


def _schema_text(schema: Any, param: str) -> str:
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except json.JSONDecodeError as e:
            raise APIError(400, f"'{param}' is not valid JSON: {e}", param=param) from None
    if not isinstance(schema, dict):
        raise APIError(400, f"'{param}' must be a JSON schema object, got {type(schema).__name__}", param=param)
    return json.dumps(schema)   # the schema's own property order is the output's order


def from_response_format(rf: dict | None) -> GrammarSpec | None:
    if rf is None:
        return None
    kind = rf.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return GrammarSpec("json", ANY_OBJECT, "response_format")
    if kind == "json_schema":
        js = rf.get("json_schema")
        if not isinstance(js, dict) or not isinstance(js.get("name"), str):
            raise APIError(400, "'response_format.json_schema' must be an object with a 'name' and a 'schema'",
                           param="response_format.json_schema")
        schema = js.get("schema", {"type": "object"})   # OpenAI: no schema = any object
        return GrammarSpec("json", _schema_text(schema, "response_format.json_schema.schema"),
                           "response_format.json_schema.schema")
    raise APIError(400, f"'response_format.type' must be one of text, json_object, json_schema; got {kind!r}",
                   param="response_format.type")


STRUCTURED_KEYS = ("json", "json_object", "regex", "choice", "grammar")
STRUCTURED_IGNORED = ("disable_any_whitespace", "disable_additional_properties", "whitespace_pattern",
                      "disable_fallback", "backend")


def from_structured_outputs(so: dict | None) -> GrammarSpec | None:
    if so is None:
        return None
    unknown = [k for k in so if k not in STRUCTURED_KEYS + STRUCTURED_IGNORED + ("structural_tag",)]
    if unknown:
        where = f"structured_outputs.{unknown[0]}"
        raise APIError(400, f"unknown field '{where}'", param=where)
    if so.get("structural_tag") is not None:
        raise APIError(400, "'structured_outputs.structural_tag' is not supported by this server",
                       param="structured_outputs.structural_tag")
    given = [k for k in STRUCTURED_KEYS if so.get(k) not in (None, False)]
    if len(given) != 1:
        raise APIError(400, "'structured_outputs' must set exactly one of " + ", ".join(STRUCTURED_KEYS)
                       + (f" (got {', '.join(given)})" if given else ""), param="structured_outputs")
    key = given[0]
    value, param = so[key], f"structured_outputs.{key}"
    if key == "json":
        return GrammarSpec("json", _schema_text(value, param), param)
    if key == "json_object":
        return GrammarSpec("json", ANY_OBJECT, param)
    if key == "choice":
        if not isinstance(value, list) or not value or not all(isinstance(c, str) and c for c in value):
            raise APIError(400, f"'{param}' must be a non-empty list of non-empty strings", param=param)
        return GrammarSpec("grammar", choice_ebnf(value), param)
    if not isinstance(value, str) or not value:
        raise APIError(400, f"'{param}' must be a non-empty string", param=param)
    return GrammarSpec(key, value, param)


def pick(*specs: GrammarSpec | None) -> GrammarSpec | None:
    given = [s for s in specs if s is not None]
    if len(given) > 1:
        raise APIError(400, f"'{given[1].param.split('.')[0]}' cannot be combined with "
                            f"'{given[0].param.split('.')[0]}': a request takes one output constraint",
                       param=given[1].param.split(".")[0])
    return given[0] if given else None


def choice_ebnf(choices: list[str]) -> str:
    """EBNF whose language is exactly ``choices`` (JSON string escapes are xgrammar's literal escapes)."""
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


def tokenizer_info(tok: Tokenizer, vocab_size: int) -> Any:
    """xgrammar's view of the vocabulary: the model's ``vocab_size`` rows, tokens as the tokenizer encodes them;
    special tokens (and ids past the tokenizer) are empty, so a grammar never emits them as text — the stop tokens
    (EOS, stop_token_ids) end the output by id."""
    import xgrammar as xgr

    n = min(tok.vocab_size, vocab_size)
    encoded = [""] * n
    for text, i in tok.hf.get_vocab(with_added_tokens=True).items():
        if i < n:
            encoded[i] = text
    for i, added in tok.hf.get_added_tokens_decoder().items():
        if i < n and added.special:
            encoded[i] = ""
    try:
        meta = xgr.TokenizerInfo._detect_metadata_from_hf(tok.hf.to_str())
    except Exception:  # noqa: BLE001 — an unusual tokenizer.json: treat tokens as raw text
        meta = {"vocab_type": xgr.VocabType.RAW, "add_prefix_space": False}
    stops = [tok.eos_token_id] if tok.eos_token_id is not None and tok.eos_token_id < vocab_size else None
    return xgr.TokenizerInfo(encoded, meta["vocab_type"], vocab_size=vocab_size, stop_token_ids=stops,
                             add_prefix_space=meta["add_prefix_space"])


def _can_start(compiled: Any, vocab_size: int) -> bool:
    """Whether some token (a stop token counts) is allowed first: a grammar whose language is empty ("root ::=
    root", an empty character class) compiles, but would leave its request nothing to sample."""
    import xgrammar as xgr

    bitmask = xgr.allocate_token_bitmask(1, vocab_size)
    xgr.GrammarMatcher(compiled).fill_next_token_bitmask(bitmask)
    return bool((bitmask != 0).any())


class _DaemonWorkers:
    """`n` daemon threads running submitted calls in order (started on first use). concurrent.futures' pools are
    joined when the interpreter exits; these are not, so a compile still running never delays a server's exit."""

    def __init__(self, n: int, name: str) -> None:
        self.n, self.name = n, name
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._started = False
        self._lock = threading.Lock()

    def submit(self, fn, *args) -> Future:
        with self._lock:
            if not self._started:
                for i in range(self.n):
                    threading.Thread(target=self._work, name=f"{self.name}-{i}", daemon=True).start()
                self._started = True
        fut: Future = Future()
        self._jobs.put((fut, fn, args))
        return fut

    def _work(self) -> None:
        while True:
            fut, fn, args = self._jobs.get()
            if not fut.set_running_or_notify_cancel():   # cancelled while queued (its request timed out)
                continue
            try:
                fut.set_result(fn(*args))
            except BaseException as e:  # noqa: BLE001 — handed to the awaiting request
                fut.set_exception(e)


class GrammarCompiler:
    """Built on first use; ``compile`` runs in a worker thread. ``stopping()`` says the server is draining: a request
    still waiting for its compile then gets a 503 at once instead of outliving the drain (uvicorn would cancel it
    with a bare 500)."""

    def __init__(self, tok: Tokenizer, vocab_size: int, stopping: Callable[[], bool] = lambda: False) -> None:
        self.tok, self.vocab_size, self.stopping = tok, vocab_size, stopping
        self._compiler = None
        self._lock = threading.Lock()
        self._workers = _DaemonWorkers(COMPILE_THREADS, "splash-grammar")

    def _get(self) -> Any:
        with self._lock:
            if self._compiler is None:
                import xgrammar as xgr
                self._compiler = xgr.GrammarCompiler(tokenizer_info(self.tok, self.vocab_size), max_threads=1,
                                                     cache_limit_bytes=CACHE_BYTES)
            return self._compiler

    def compile_sync(self, spec: GrammarSpec) -> Any:
        c = self._get()
        compile_kind = {"json": functools.partial(c.compile_json_schema, any_whitespace=False),
                        "regex": c.compile_regex, "grammar": c.compile_grammar}[spec.kind]
        try:
            compiled = compile_kind(spec.source)
        except (RuntimeError, ValueError, TypeError) as e:   # xgrammar's errors for bad schemas/regexes/EBNF
            lines = str(e).strip().splitlines()
            msg = _WHERE.sub("", lines[-1]) if lines else type(e).__name__
            raise APIError(400, f"'{spec.param}' cannot be compiled into a grammar: {msg[:500]}",
                           param=spec.param, code="invalid_grammar") from None
        if not _can_start(compiled, self.vocab_size):
            raise APIError(400, f"'{spec.param}' admits no output: no token (not even the end) can start it",
                           param=spec.param, code="invalid_grammar")
        return compiled

    async def compile(self, spec: GrammarSpec | None) -> Any:
        if spec is None:
            return None
        aio = asyncio.get_running_loop()
        job = self._workers.submit(self.compile_sync, spec)
        work = asyncio.wrap_future(job)
        deadline = aio.time() + COMPILE_TIMEOUT_S
        try:
            while not work.done():
                left = deadline - aio.time()
                if self.stopping():
                    raise APIError(503, "the server is shutting down", "service_unavailable")
                if left <= 0 and not job.running():   # never started: other requests' compiles held the workers
                    raise APIError(503, f"the grammar compiler was busy with other requests for {COMPILE_TIMEOUT_S:g} "
                                        "s; retry later", "service_unavailable", headers={"Retry-After": "5"})
                if left <= 0:
                    raise APIError(400, f"'{spec.param}' did not compile into a grammar within "
                                        f"{COMPILE_TIMEOUT_S:g} s", param=spec.param, code="invalid_grammar")
                await asyncio.wait({work}, timeout=min(STOP_POLL_S, left))
        finally:
            work.cancel()   # a queued compile is dropped; a running one finishes in the background
        return work.result()
