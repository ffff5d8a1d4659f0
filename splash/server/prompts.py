"""Turning a request's prompt (text, token ids, lists of either, chat messages) into checked token ids, with bounded
work: a token-id prompt's length is checked before its vocabulary, a chat's message count before its messages are
validated; the chat template is rendered, and text tokenised (``encode_batch`` releases the GIL), in worker threads;
a text longer than ``CHARS_PER_TOKEN`` × ``max_model_len`` characters is first tokenised only up to that many
characters: if that prefix does not fit the context, the rest is never tokenised.
"""
from __future__ import annotations

import asyncio
from typing import Any

from splash.server import protocol as P
from splash.tokenizer import Tokenizer

CHARS_PER_TOKEN = 8   # no real text averages more characters per token than this


def context_error(where: str, n: int | str, max_model_len: int) -> P.APIError:
    return P.APIError(400, f"{where} has {n} tokens, but the model's context (max_model_len) is {max_model_len} "
                           "tokens, including at least one generated token",
                      param=where, code="context_length_exceeded")


class PromptReader:
    def __init__(self, tokenizer: Tokenizer, max_model_len: int, vocab_size: int) -> None:
        self.tok, self.max_model_len, self.vocab_size = tokenizer, max_model_len, vocab_size

    def check_ids(self, ids: list[int], where: str) -> list[int]:
        if not ids:
            raise P.APIError(400, f"{where} is empty (it must contain at least one token)", param=where)
        if len(ids) >= self.max_model_len:
            raise context_error(where, len(ids), self.max_model_len)
        return self.check_vocab(ids, where)

    def check_vocab(self, ids: list[int], where: str) -> list[int]:
        bad = next((t for t in ids if t < 0 or t >= self.vocab_size), None)
        if bad is not None:
            raise P.APIError(400, f"{where} contains token id {P.quote(bad)}, outside the vocabulary "
                                  f"[0, {self.vocab_size})", param=where)
        return ids

    async def tokens(self, text: str, where: str, special: bool) -> list[int]:
        """``text``'s ids if it could be a prompt here (fewer than max_model_len tokens; else 400)."""
        cap = CHARS_PER_TOKEN * self.max_model_len
        if len(text) > cap:
            head = (await asyncio.to_thread(self.tok.encode_batch, [text[:cap]], special))[0]
            if len(head) >= self.max_model_len:
                raise context_error(where, f"more than {len(head) - 1}", self.max_model_len)
        ids = (await asyncio.to_thread(self.tok.encode_batch, [text], special))[0]
        if len(ids) >= self.max_model_len:
            raise context_error(where, len(ids), self.max_model_len)
        return ids

    async def encode(self, text: str, where: str, special: bool) -> list[int]:
        return self.check_ids(await self.tokens(text, where, special), where)

    async def completion(self, prompt: Any) -> list[list[int]]:
        if isinstance(prompt, str):
            return [await self.encode(prompt, "prompt", True)]
        if not prompt:
            raise P.APIError(400, "prompt is empty", param="prompt")
        if isinstance(prompt[0], int):
            return [self.check_ids(list(prompt), "prompt")]
        if isinstance(prompt[0], str):
            return [await self.encode(x, f"prompt[{i}]", True) for i, x in enumerate(prompt)]
        return [self.check_ids(list(x), f"prompt[{i}]") for i, x in enumerate(prompt)]

    def check_message_count(self, messages: Any) -> None:
        """Every message a chat template renders takes at least one token, and one must be left to generate: more
        messages than that cannot fit, and are refused before their (per-message) validation and rendering."""
        if isinstance(messages, list) and len(messages) >= self.max_model_len:
            raise P.APIError(400, f"'messages' has {len(messages)} messages, but the model's context (max_model_len) "
                                  f"is {self.max_model_len} tokens: each message takes at least one token, and at "
                                  "least one token must be left to generate", param="messages",
                             code="context_length_exceeded")

    async def chat_text(self, messages: list[dict[str, Any]], tools: list[dict] | None = None,
                        kwargs: dict | None = None, add_generation_prompt: bool = True) -> str:
        try:   # in a worker thread: a Jinja template over many messages or tools runs for seconds of Python
            return await asyncio.to_thread(self.tok.apply_chat_template, messages, add_generation_prompt,
                                           tools=tools, kwargs=kwargs)
        except ValueError as e:
            raise P.APIError(400, str(e), param="messages") from None

    async def chat(self, messages: list[dict[str, Any]], tools: list[dict] | None = None,
                   kwargs: dict | None = None) -> list[int]:
        return await self.encode(await self.chat_text(messages, tools, kwargs), "messages", False)
