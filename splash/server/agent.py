"""The agent API of a chat request: its tools, output constraint (compiled off the event loop), template kwargs,
and the OutputMode that reads its output. The parsers default from the model's type unless
``server.tool_call_parser`` / ``server.reasoning_parser`` name one (``none`` turns it off).
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Callable

from splash.server import structured
from splash.server.chat_output import OutputMode
from splash.server.protocol import APIError
from splash.server.tool_choice import forced_spec, read_tools
from splash.tokenizer import Tokenizer

# model_type -> (tool-call parser, reasoning parser); DeepSeek-V3 and V3.1 share a type: the template tells them apart
_BY_TYPE = {"glm_moe_dsa": ("glm45", "glm45"), "glm4_moe": ("glm45", "glm45"), "glm5_next": ("glm45", "glm45"),
            "deepseek_v32": ("deepseek_v32", "deepseek_v3"), "deepseek_v3": ("deepseek_v31", "deepseek_v3")}


def resolve_parsers(tool_flag: str, reason_flag: str, model_type: str | None,
                    chat_template: str | None) -> tuple[str | None, str | None]:
    tool, reason = _BY_TYPE.get(model_type or "", (None, None))
    if tool == "deepseek_v31" and chat_template and "```json" in chat_template:
        tool = "deepseek_v3"     # V3's template wraps the arguments in a ```json fence, V3.1's does not
    tool = tool if tool_flag == "auto" else (None if tool_flag == "none" else tool_flag)
    reason = reason if reason_flag == "auto" else (None if reason_flag == "none" else reason_flag)
    return tool, reason


@dataclass
class Prepared:
    grammar: Any = None                          # xgrammar CompiledGrammar, or None
    mode: OutputMode = field(default_factory=OutputMode)
    tools: list[dict] | None = None              # as the chat template receives them


class AgentAPI:
    def __init__(self, tok: Tokenizer, vocab_size: int, tool_parser: str | None = None,
                 reasoning_parser: str | None = None, stopping: Callable[[], bool] = lambda: False) -> None:
        self.compiler = structured.GrammarCompiler(tok, vocab_size, stopping)
        self.tool_parser, self.reasoning_parser = tool_parser, reasoning_parser

    async def completion(self, req: Any) -> Any:
        return await self.compiler.compile(structured.from_structured_outputs(req.structured_outputs))

    async def chat(self, req: Any) -> Prepared:
        kwargs = template_kwargs(req.chat_template_kwargs)
        if req.functions or req.function_call not in (None, "none"):
            raise APIError(400, "'functions' / 'function_call' are deprecated by OpenAI: send 'tools' / "
                                "'tool_choice'", param="functions" if req.functions else "function_call")
        tc = read_tools(req.tools, req.tool_choice)
        spec = structured.pick(structured.from_response_format(req.response_format),
                               structured.from_structured_outputs(req.structured_outputs),
                               forced_spec(tc, req.parallel_tool_calls))
        grammar = await self.compiler.compile(spec)
        mode = OutputMode(self.reasoning_parser, self.tool_parser, tc if req.tools else None, kwargs,
                          constrained=grammar is not None)
        return Prepared(grammar, mode, template_tools(tc))


def template_kwargs(kwargs: dict | None) -> dict:
    """A request's ``chat_template_kwargs``; the template's own inputs are not the client's to set."""
    kwargs = kwargs or {}
    for key in ("messages", "tools", "add_generation_prompt", "documents"):
        if key in kwargs:
            raise APIError(400, f"'chat_template_kwargs' may not set {key!r}", param="chat_template_kwargs")
    return kwargs


def template_tools(tc: Any) -> list[dict] | None:
    """The checked tools (``read_tools``) as the chat template receives them."""
    return [{"type": "function", "function": f} for f in tc.tools] or None


def with_prompt(prepared: Prepared, tok: Tokenizer, prompt: list[int]) -> Prepared:
    """``prepared`` knowing whether the rendered prompt ends with <think> (the output starts in reasoning)."""
    if prepared.mode.reasoner is None:
        return prepared
    tail = tok.decode(prompt[-16:], skip_special_tokens=False).rstrip()
    return replace(prepared, mode=replace(prepared.mode, thinking_opened=tail.endswith("<think>")))
