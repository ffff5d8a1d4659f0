"""One HTTP request's generations: its choices (prompts × n), fed by the engine thread, detokenised here.

A stop string ends a choice with finish_reason ``"stop"`` (cut before it, or after it with
``include_stop_str_in_output``; never before ``min_tokens`` tokens, as vLLM) and aborts its engine request.
While streaming, the last ``len(longest stop) - 1`` characters are held back, so text that turns out to begin a
stop string is never sent. Prompt logprobs are computed once per prompt, by its group's first choice, and
shared by the group; a choice waiting for them sends nothing, so its first delta can carry them.
"""
from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any, AsyncIterator

from splash.engine.messages import EngineRequest
from splash.engine.sampling import SamplingParams
from splash.server.engine_loop import Aborted, EngineLoop, EngineStopped, Overloaded
from splash.server import protocol as P
from splash.server.protocol import APIError
from splash.tokenizer import IncrementalDetokenizer, Tokenizer


@dataclass
class Choice:
    index: int
    req_id: str
    detok: IncrementalDetokenizer
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish: str | None = None
    emitted_chars: int = 0
    emitted_ids: int = 0
    checked: int = 0        # stop strings were searched in text[:checked]
    logprobs: list = field(default_factory=list)      # TokenLogprobs per token id (when the request asked)
    prompt_logprobs: list | None = None               # TokenLogprobs of prompt tokens 1.. (prompt_logprobs)
    min_tokens: int = 0                               # no stop string ends the choice before this many tokens
    include_stop: bool = False                        # include_stop_str_in_output
    awaits_prompt_logprobs: bool = False              # its group's prompt logprobs have not arrived yet
    cached_tokens: int = 0                            # prompt tokens the prefix cache held for it


@dataclass
class Delta:
    choice: Choice
    text: str
    token_ids: list[int]
    finish: str | None
    logprobs: list = field(default_factory=list)      # aligned with token_ids


class Generation:
    def __init__(self, loop: EngineLoop, tok: Tokenizer, prompts: list[list[int]], params: list[SamplingParams],
                 stops: list[str], req_prefix: str, n: int = 1) -> None:
        """`prompts`/`params`: one per choice, `n` consecutive choices per prompt."""
        self.loop, self.stops, self.id = loop, stops, req_prefix
        self.echo: list[str] | None = None     # completions echo: the prompt text per prompt (set by the app)
        self.hold = max((len(s) for s in stops), default=1) - 1
        self.n = n
        self.choices: list[Choice] = []
        self.requests = [EngineRequest(f"{req_prefix}-{i}", prompt, p)
                         for i, (prompt, p) in enumerate(zip(prompts, params))]
        for i, (req, p) in enumerate(zip(self.requests, params)):
            detok = IncrementalDetokenizer(tok, p.skip_special_tokens)
            self.choices.append(Choice(i, req.req_id, detok, min_tokens=p.min_tokens,
                                       include_stop=p.include_stop_str_in_output,
                                       awaits_prompt_logprobs=params[i - i % n].prompt_logprobs is not None))
        self._by_id = {c.req_id: c for c in self.choices}
        self._queue: asyncio.Queue[list[Any]] = asyncio.Queue()

    def usage(self) -> dict:
        """OpenAI's usage so far: each prompt counted once, whatever its n; its cached tokens are the most any of
        its n choices found in the prefix cache."""
        n = self.n
        prompt = sum(len(r.prompt) for r in self.requests[::n])
        cached = sum(max(c.cached_tokens for c in self.choices[i:i + n]) for i in range(0, len(self.choices), n))
        return P.usage(prompt, sum(len(c.token_ids) for c in self.choices), cached)

    @property
    def done(self) -> bool:
        return all(c.finish is not None for c in self.choices)

    def start(self) -> None:
        try:
            self.loop.add(self.requests, self._queue.put_nowait)
        except EngineStopped as e:
            raise APIError(503, str(e), "service_unavailable", headers={"Retry-After": "5"}) from None
        except Overloaded as e:
            raise APIError(429, str(e), "rate_limit_error", code="overloaded", headers={"Retry-After": "1"}) from None

    def cancel(self) -> None:
        """Abort the choices that have not finished (client went away, or a stop string ended them)."""
        live = [c.req_id for c in self.choices if c.finish is None]
        for c in self.choices:
            c.finish = c.finish or "abort"
        if live:
            try:
                self.loop.abort(live)
            except EngineStopped:
                pass

    async def deltas(self) -> AsyncIterator[list[Delta]]:
        """Per batch of engine events, what each affected choice gained; ends when all finished."""
        while not self.done:
            items = await self._queue.get()
            touched: dict[int, Choice] = {}
            for ev in items:
                if isinstance(ev, BaseException):
                    self.cancel()
                    raise _as_api_error(ev)
                c = self._by_id.get(ev.req_id)
                if c is None or c.finish is not None:
                    continue
                if isinstance(ev, Aborted):   # an admin ended it: it keeps what it has
                    c.text += c.detok.flush()
                    c.finish, c.awaits_prompt_logprobs = "abort", False
                    touched[c.index] = c
                    continue
                c.cached_tokens = max(c.cached_tokens, ev.cached_tokens)
                if ev.logprobs is not None:
                    c.logprobs.append(ev.logprobs)
                if ev.prompt_logprobs is not None:   # the group's leader: share them with its group
                    for m in self.choices[c.index:c.index + self.n]:
                        m.prompt_logprobs, m.awaits_prompt_logprobs = ev.prompt_logprobs, False
                        touched[m.index] = m
                try:
                    self._push(c, ev.token, ev.finish_reason)
                except Exception as e:  # noqa: BLE001 — a choice that cannot be detokenised fails this request
                    self.cancel()
                    raise APIError(500, f"detokenising failed: {type(e).__name__}: {e}", "internal_error") from None
                touched[c.index] = c
            out = [d for d in (self._delta(c) for c in touched.values()) if d is not None]
            if out:
                yield out

    def _push(self, c: Choice, token: int, finish: str | None) -> None:
        c.token_ids.append(token)
        c.text += c.detok.push(token)
        if finish is not None:
            c.text += c.detok.flush()
        if self._check_stop(c):
            if finish is None:
                try:
                    self.loop.abort([c.req_id])
                except EngineStopped:
                    pass
            return
        if finish is not None:
            c.finish = finish

    def _check_stop(self, c: Choice) -> bool:
        if not self.stops:
            return False
        if len(c.token_ids) < c.min_tokens:   # text before min_tokens is never searched again (as vLLM)
            c.checked = len(c.text)
            return False
        start = max(0, c.checked - self.hold)
        hits = [(i, len(s)) for i, s in ((c.text.find(s, start), s) for s in self.stops) if i >= 0]
        c.checked = len(c.text)
        if not hits:
            return False
        i, n = min(hits)
        c.text = c.text[:i + n if c.include_stop else i]
        c.finish = "stop"
        return True

    def _delta(self, c: Choice) -> Delta | None:
        if c.awaits_prompt_logprobs and c.finish != "abort":
            return None
        end = len(c.text) if c.finish is not None else max(c.emitted_chars, len(c.text) - self.hold)
        text = c.text[c.emitted_chars:end]
        ids = c.token_ids[c.emitted_ids:]
        if not text and not ids and c.finish is None:
            return None
        lps = c.logprobs[c.emitted_ids:]
        c.emitted_chars, c.emitted_ids = end, len(c.token_ids)
        return Delta(c, text, ids, c.finish, lps)

    async def run_to_end(self) -> None:
        async for _ in self.deltas():
            pass


def _as_api_error(ev: BaseException) -> APIError:
    if isinstance(ev, EngineStopped):
        return APIError(503, str(ev), "service_unavailable")
    if isinstance(ev, ValueError):
        return APIError(400, str(ev))
    return APIError(500, f"{type(ev).__name__}: {ev}", "internal_error")
