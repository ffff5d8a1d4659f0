"""Rendering a model's shipped chat template (Jinja) the way transformers' ``apply_chat_template`` does: the same
sandboxed environment, filters, globals and variables, then the request's ``chat_template_kwargs``. A message's
``reasoning_content`` is also given as ``thinking`` (and the older names fill it); keys whose value is None are
left out. tests/test_chat_template.py compares the text with transformers on GLM and DeepSeek templates.
"""
from __future__ import annotations

import functools
import json
from datetime import datetime
from typing import Any

REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


@functools.lru_cache(maxsize=8)
def compile_template(template: str) -> Any:
    import jinja2
    from jinja2 import nodes
    from jinja2.ext import Extension
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class Generation(Extension):
        """``{% generation %}…{% endgeneration %}`` marks assistant text for training masks: here it renders as is."""
        tags = {"generation"}

        def parse(self, parser: Any) -> Any:
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

        def _render(self, caller: Any) -> str:
            return caller()

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None,
               sort_keys: bool = False) -> str:
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[Generation, jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(template)


def _for_template(messages: list[dict], arguments_as_mapping: bool) -> list[dict]:
    out = []
    for m in messages:
        m = {k: v for k, v in m.items() if v is not None}   # OpenAI's content=None: templates want the key absent
        r = next((m[k] for k in REASONING_FIELDS if m.get(k) is not None), None)
        if r is not None:
            m = {"thinking": r, **m, "reasoning_content": r}
        if arguments_as_mapping and m.get("role") == "assistant" and isinstance(m.get("tool_calls"), list):
            m["tool_calls"] = [_parsed_arguments(c) for c in m["tool_calls"]]
        out.append(m)
    return out


def _parsed_arguments(call: Any) -> Any:
    """A tool call whose JSON-object ``arguments`` text is parsed (as vLLM does), for templates that iterate
    ``arguments.items()`` (GLM, DeepSeek-V3.2)."""
    fn = call.get("function") if isinstance(call, dict) else None
    if not isinstance(fn, dict) or not isinstance(fn.get("arguments"), str):
        return call
    try:
        args = json.loads(fn["arguments"])
    except json.JSONDecodeError:
        return call
    return {**call, "function": {**fn, "arguments": args}} if isinstance(args, dict) else call


def render(template: str, messages: list[dict], *, tools: list[dict] | None = None,
           add_generation_prompt: bool = True, special_tokens: dict[str, str] | None = None,
           kwargs: dict | None = None) -> str:
    """The prompt text; ValueError naming the template's complaint when it raises."""
    import jinja2

    variables = {**(special_tokens or {}), **(kwargs or {})}
    as_mapping = ".items()" in template and "arguments" in template
    try:
        return compile_template(template).render(messages=_for_template(messages, as_mapping), tools=tools, documents=None,
                                         add_generation_prompt=add_generation_prompt, **variables)
    except jinja2.exceptions.TemplateError as e:
        raise ValueError(f"chat template failed: {e}") from None
    except (TypeError, AttributeError, KeyError, IndexError, ArithmeticError) as e:   # a template reading a message
        # it cannot use, or computing with it what it cannot (a division by its count; the sandbox's range limit)
        raise ValueError(f"chat template failed on these messages: {type(e).__name__}: {e}") from None
