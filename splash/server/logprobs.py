"""Logprobs in the shapes OpenAI and vLLM return them (from the engine's `TokenLogprobs`), and what a choice or
stream chunk carries besides its text (``ResponseExtras``: echo, logprobs, prompt_logprobs).

Completions' ``top_logprobs`` entries map token text -> logprob for the chosen token and the top k (up to k + 1
keys, as vLLM); with ``echo`` the prompt's tokens come first, the first with ``null`` entries. A token's text is
its own decode (special tokens included), or ``token_id:<id>`` with vLLM's ``return_tokens_as_token_ids``.
"""
from __future__ import annotations

import functools
from typing import Any, Callable, Sequence

from splash.engine.sampler import TokenLogprobs
from splash.server import protocol as P
from splash.server.generation import Choice, Delta, Generation
from splash.tokenizer import Tokenizer


TokenText = Callable[[int], str]   # id -> the text a logprob entry shows for it


def token_text(tok: Tokenizer, as_ids: bool = False) -> TokenText:
    if as_ids:
        return lambda tid: f"token_id:{tid}"
    return functools.cache(lambda tid: tok.decode([tid], skip_special_tokens=False))   # a vocabulary is bounded


def completion_logprobs(text: TokenText, entries: Sequence[tuple[int, TokenLogprobs | None]], k: int,
                        offset: int = 0) -> dict[str, Any]:
    """`offset`: text length before the first token; an entry None (the first echoed prompt token) is null."""
    tokens, lps, tops, offsets = [], [], [], []
    for tid, e in entries:
        s = text(tid)
        tokens.append(s)
        offsets.append(offset)
        offset += len(s)
        if e is None:
            lps.append(None)
            tops.append(None)
            continue
        lps.append(e.logprob)
        top = {s: e.logprob}
        for t, v in e.top[:k]:
            top.setdefault(text(t), v)
        tops.append(top)
    return {"tokens": tokens, "token_logprobs": lps, "top_logprobs": tops, "text_offset": offsets}


def _chat_entry(text: TokenText, tid: int, lp: float) -> dict[str, Any]:
    s = text(tid)
    return {"token": s, "logprob": lp, "bytes": list(s.encode("utf-8", errors="replace"))}


def chat_logprobs(text: TokenText, entries: Sequence[TokenLogprobs], k: int) -> dict[str, Any]:
    content = []
    for e in entries:
        item = _chat_entry(text, e.token, e.logprob)
        item["top_logprobs"] = [_chat_entry(text, t, v) for t, v in e.top[:k]]
        content.append(item)
    return {"content": content}


def prompt_logprobs_body(text: TokenText, entries: Sequence[TokenLogprobs | None], k: int) -> list[Any]:
    out: list[Any] = []
    for e in entries:
        if e is None:
            out.append(None)
            continue
        d = {str(e.token): {"logprob": e.logprob, "rank": e.rank, "decoded_token": text(e.token)}}
        for rank, (t, v) in enumerate(e.top[:k], start=1):
            d.setdefault(str(t), {"logprob": v, "rank": rank, "decoded_token": text(t)})
        out.append(d)
    return out


class ResponseExtras:
    def __init__(self, tok: Tokenizer, req: P.SamplingRequest, gen: Generation, chat: bool) -> None:
        self.req, self.gen, self.chat = req, gen, chat
        self.k = req.sample_logprobs()
        self.text = token_text(tok, req.return_tokens_as_token_ids)
        self.echo = gen.echo
        self.offset: dict[int, int] = {}      # text length already sent per choice (completions text_offset)
        self.started: set[int] = set()
        self._prompt_bodies: dict[int, list | None] = {}   # per prompt: its n choices share one body

    def pending(self, d: Delta) -> bool:
        """A chunk must go out even without text: its logprobs, or the first chunk of an echo."""
        return bool(d.logprobs) or (self.echo is not None and d.choice.index not in self.started)

    def heavy(self, d: Delta) -> bool:
        """The chunk carries a prompt's logprobs (prompt_logprobs, or echo + logprobs): worth a worker thread."""
        first = d.choice.index not in self.started
        return first and (self.req.prompt_logprobs is not None or (self.echo is not None and self.k is not None))

    def prompt_body(self, c: Choice) -> list | None:
        """vLLM's prompt_logprobs of `c`'s prompt, built once and shared by the prompt's choices."""
        group = c.index // self.req.n
        if group not in self._prompt_bodies:
            self._prompt_bodies[group] = None if c.prompt_logprobs is None else prompt_logprobs_body(
                self.text, [None, *c.prompt_logprobs], self.req.prompt_logprobs or 0)
        return self._prompt_bodies[group]

    def decorate(self, choice: dict, d: Delta) -> dict:
        c, first = d.choice, d.choice.index not in self.started
        self.started.add(c.index)
        entries = [(e.token, e) for e in d.logprobs]
        if first and self.echo is not None:
            prompt = self.gen.requests[c.index].prompt
            choice["text"] = self.echo[c.index // self.req.n] + choice["text"]
            if self.k is not None:
                entries = [(prompt[0], None), *zip(prompt[1:], c.prompt_logprobs or ()), *entries]
        if self.k is not None:
            if self.chat:
                choice["logprobs"] = chat_logprobs(self.text, [e for _, e in entries], self.k)
            else:
                lp = completion_logprobs(self.text, entries, self.k, self.offset.get(c.index, 0))
                self.offset[c.index] = self.offset.get(c.index, 0) + sum(map(len, lp["tokens"]))
                choice["logprobs"] = lp
        if first and not self.chat and self.req.prompt_logprobs is not None:
            choice["prompt_logprobs"] = self.prompt_body(c)
        return choice
