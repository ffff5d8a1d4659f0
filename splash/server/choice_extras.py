"""What a choice (or a stream chunk) carries besides its text: the echoed prompt, logprobs in OpenAI's shapes
and vLLM's prompt_logprobs; and the chat messages as the template sees them."""
from __future__ import annotations

from splash.server import protocol as P
from splash.server.generation import Choice, Delta, Generation
from splash.server.logprobs import TokenText, chat_logprobs, completion_logprobs, prompt_logprobs_body
from splash.tokenizer import Tokenizer


def chat_messages(req: P.ChatCompletionRequest) -> list[dict]:
    """Messages for the chat template: multi-part text content joined (with newlines, as vLLM), ``developer``
    rendered as ``system``. The parts were checked to be text (``ChatCompletionRequest.check_content``)."""
    out = []
    for m in req.messages:
        d = m.model_dump(exclude_none=True)
        if d.get("role") == "developer":
            d["role"] = "system"
        if isinstance(m.content, list):
            d["content"] = "\n".join(part["text"] for part in m.content)
        out.append(d)
    return out


class ResponseExtras:
    """What a choice (or stream chunk) adds for echo, logprobs and prompt_logprobs (splash.server.logprobs)."""

    def __init__(self, tok: Tokenizer, req: P.SamplingRequest, gen: Generation, chat: bool) -> None:
        self.req, self.gen, self.chat = req, gen, chat
        self.k = req.sample_logprobs()
        self.text = TokenText(tok, req.return_tokens_as_token_ids)
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
