"""The models' shipped chat templates rendered by SPLASH (splash.server.prompts → splash.chat_template) and by
transformers' ``apply_chat_template`` give the same text: with tools, tool-role messages, assistant tool calls,
reasoning turns and the thinking switches (``chat_template_kwargs``). The templates are public model data stored
in tests/fixtures/chat_templates (SOURCES.md there says where each came from).

SPLASH gets the conversation as an OpenAI client sends it (tool-call arguments as JSON text); transformers gets
what its documentation asks for: arguments as a mapping for templates that iterate them (GLM, DeepSeek-V3.2) and
the text for templates that concatenate it (DeepSeek-V3.1) — so the test also checks SPLASH's choice between the two.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest

transformers = pytest.importorskip("transformers")

from splash.tokenizer import Tokenizer, build_byte_tokenizer  # noqa: E402

FIXTURES = Path(__file__).parent / "fixtures" / "chat_templates"
TEMPLATES = {"glm-4.5": "glm-4.5.jinja", "glm-5.3-flash": "glm-5.3-flash.jinja",
             "deepseek-v3.1": "deepseek-v3.1.jinja", "deepseek-v3.2": "deepseek-v3.2.jinja"}
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Weather of a city — 天气",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                   "required": ["city"]}}}]
CALL = {"id": "call_1", "type": "function",
        "function": {"name": "get_weather", "arguments": json.dumps({"city": "北京", "days": 2})}}

CONVERSATIONS = {
    "plain": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello"}],
    "agent": [{"role": "system", "content": "You can call tools."},
              {"role": "user", "content": "Weather in Beijing?"},
              {"role": "assistant", "content": None, "tool_calls": [CALL]},
              {"role": "tool", "tool_call_id": "call_1", "content": "{\"temp\": 21}"}],
    "reasoning": [{"role": "user", "content": "2+2?"},
                  {"role": "assistant", "content": "4", "reasoning_content": "two and two"},
                  {"role": "user", "content": "and 3+3?"}],
}
CASES = [("plain", False, {}), ("plain", True, {}), ("agent", True, {}), ("reasoning", False, {}),
         ("reasoning", False, {"enable_thinking": False}), ("reasoning", False, {"enable_thinking": True}),
         ("agent", True, {"thinking": True}), ("plain", False, {"thinking": True})]


def _for_transformers(messages: list[dict], as_mapping: bool) -> list[dict]:
    out = []
    for m in messages:
        m = {k: v for k, v in m.items()}
        if as_mapping and m.get("tool_calls"):
            m["tool_calls"] = [{**c, "function": {**c["function"], "arguments": json.loads(c["function"]["arguments"])}}
                               for c in m["tool_calls"]]
        out.append(m)
    return out


@pytest.fixture(scope="module")
def hf_tok():
    return transformers.PreTrainedTokenizerFast(tokenizer_object=build_byte_tokenizer(), bos_token="<|bos|>",
                                                eos_token="<|eos|>")


@pytest.mark.parametrize("name", TEMPLATES)
@pytest.mark.parametrize("conv, tools, kwargs", CASES)
def test_same_text_as_transformers(hf_tok, name, conv, tools, kwargs):
    template = (FIXTURES / TEMPLATES[name]).read_text(encoding="utf-8")
    tok = Tokenizer(build_byte_tokenizer(), bos_token="<|bos|>", eos_token="<|eos|>", chat_template=template)
    messages = CONVERSATIONS[conv]
    if name == "deepseek-v3.1" and conv == "agent":
        # V3.1's template concatenates strings: an assistant tool-call turn needs "content" to be a string
        messages = [({**m, "content": ""} if m.get("tool_calls") else m) for m in messages]
    ours = tok.apply_chat_template(messages, tools=TOOLS if tools else None, kwargs=kwargs)
    theirs = hf_tok.apply_chat_template(_for_transformers(messages, name != "deepseek-v3.1"),
                                        tools=TOOLS if tools else None, add_generation_prompt=True,
                                        tokenize=False, chat_template=template, **kwargs)
    assert ours == theirs


def test_the_thinking_switch_reaches_the_template():
    template = (FIXTURES / "glm-5.3-flash.jinja").read_text(encoding="utf-8")
    tok = Tokenizer(build_byte_tokenizer(), chat_template=template)
    msgs = CONVERSATIONS["plain"]
    assert tok.apply_chat_template(msgs).endswith("<|assistant|><think>")
    assert tok.apply_chat_template(msgs, kwargs={"enable_thinking": False}).endswith("<|assistant|><think></think>")


def test_a_template_error_is_a_value_error():
    tok = Tokenizer(build_byte_tokenizer(), chat_template="{{ raise_exception('roles!') }}")
    with pytest.raises(ValueError, match="roles!"):
        tok.apply_chat_template(CONVERSATIONS["plain"])


@pytest.mark.parametrize("template", ["{{ 1 / (messages | length - 1) }}",
                                      "{% for i in range(messages | length * 200000) %}{% endfor %}"])
def test_a_template_computing_what_it_cannot_from_the_messages_is_a_value_error(template):
    """ZeroDivisionError, and the sandbox's OverflowError for a range over 100,000: the request's 400, not a 500."""
    tok = Tokenizer(build_byte_tokenizer(), chat_template=template)
    with pytest.raises(ValueError, match="chat template failed on these messages: (ZeroDivision|Overflow)Error"):
        tok.apply_chat_template([{"role": "user", "content": "hi"}])


def test_the_generation_tag_renders_its_body_as_transformers_does(hf_tok):
    """``{% generation %}`` (the assistant-mask tag of some templates) renders its body unchanged."""
    template = ("{% for m in messages %}<{{ m.role }}>{% if m.role == 'assistant' %}{% generation %}"
                "{{ m.content }}{% endgeneration %}{% else %}{{ m.content }}{% endif %}{% endfor %}")
    msgs = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello there"}]
    tok = Tokenizer(build_byte_tokenizer(), chat_template=template)
    ours = tok.apply_chat_template(msgs, add_generation_prompt=False)
    assert ours == "<user>hi<assistant>hello there"
    assert ours == hf_tok.apply_chat_template(msgs, tokenize=False, chat_template=template)
