"""Logprobs in the shapes OpenAI and vLLM return them, from the engine's `TokenLogprobs`.

* completions (``logprobs: k``): ``{"tokens", "token_logprobs", "top_logprobs", "text_offset"}``; each
  ``top_logprobs`` entry maps token text -> logprob for the chosen token and the top k (so up to k + 1 keys,
  as vLLM returns them); with ``echo`` the prompt's tokens come first, the first with ``null`` entries.
* chat (``logprobs: true``, ``top_logprobs: k``): ``{"content": [{"token", "logprob", "bytes",
  "top_logprobs": [k x {"token", "logprob", "bytes"}]}]}``.
* vLLM's ``prompt_logprobs: k``: a list over the prompt, ``null`` first, then ``{token id: {"logprob", "rank",
  "decoded_token"}}`` for the prompt token and the top k.

A token's text is its own decode (special tokens included), or ``token_id:<id>`` with vLLM's
``return_tokens_as_token_ids``; ``text_offset`` is the running sum of those texts' lengths.
"""
from __future__ import annotations

from typing import Any, Sequence

from splash.engine.sampler import TokenLogprobs
from splash.tokenizer import Tokenizer


class TokenText:
    """id -> the text a logprob entry shows for it (cached: a vocabulary is bounded)."""

    def __init__(self, tok: Tokenizer, as_ids: bool = False) -> None:
        self.tok, self.as_ids = tok, as_ids
        self._cache: dict[int, str] = {}

    def __call__(self, tid: int) -> str:
        if self.as_ids:
            return f"token_id:{tid}"
        s = self._cache.get(tid)
        if s is None:
            s = self._cache[tid] = self.tok.decode([tid], skip_special_tokens=False)
        return s


def completion_logprobs(text: TokenText, entries: Sequence[tuple[int, TokenLogprobs | None]], k: int,
                        offset: int = 0) -> dict[str, Any]:
    """OpenAI's completions ``logprobs`` object over (token id, entry) pairs; an entry None (the first prompt
    token under echo) has null logprob and top_logprobs. `offset`: text length before the first token."""
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
    """vLLM's ``prompt_logprobs``: None for the first prompt token, then {id: {logprob, rank, decoded_token}}."""
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
