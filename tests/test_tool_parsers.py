"""Tool-call and reasoning parsers (splash.server.tool_parsers, splash.server.reasoning, splash.server.chat_output)
on recorded outputs in each family's real format: whole, streamed in random chunk splits, and malformed.

The expected values are facts of vLLM's parsers on the same strings (read from vLLM's glm4_moe, deepseekv3,
deepseekv31 and deepseekv32 tool parsers and its deepseek_r1 / glm45 / deepseek_v3 reasoning parsers):
* glm45: the call's name is the text before the first newline; ``<arg_key>``/``<arg_value>`` pairs are stripped;
  a value stays a string when the tool's schema types it "string", else it is read as JSON (left a string when it
  is not JSON); content is the text before the first ``<tool_call>``.
* deepseek_v3 / deepseek_v31: the arguments are the JSON text between the separators, passed through unchanged;
  content before ``<｜tool▁calls▁begin｜>`` (None when empty).
* deepseek_v32 (DSML): ``string="true"`` values are strings; ``string="false"`` values are JSON (the meaning the
  V3.2 template gives the attribute).
* reasoning: deepseek_r1 — reasoning up to ``</think>`` (a leading ``<think>`` dropped), everything reasoning
  without ``</think>``; glm45 — reasoning only with both tags, else all content; deepseek_v3 — deepseek_r1 with
  ``thinking`` on, all content without.
Where SPLASH differs from vLLM it is on purpose and named here: a section with no complete call is returned as
content (vLLM's DeepSeek parsers drop it), and GLM's ``<tool_call>name<arg_key>`` without a newline is read
(GLM-5's template writes it so).
"""
from __future__ import annotations

import json
import random

import pytest

from splash.server import reasoning, tool_parsers
from splash.server.chat_output import ChatStream, OutputMode, message
from splash.server.tool_choice import read_tools

WEATHER = {"name": "get_weather", "parameters": {"type": "object", "properties": {
    "city": {"type": "string"}, "days": {"type": "integer"}, "code": {"type": "string"}}}}
TOOLS = [WEATHER]

GLM_TWO = ("Let me look.<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Beijing</arg_value>\n"
           "<arg_key>days</arg_key>\n<arg_value>3</arg_value>\n<arg_key>code</arg_key>\n<arg_value>007</arg_value>\n"
           "</tool_call>\n<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>上海</arg_value>\n"
           "<arg_key>extra</arg_key>\n<arg_value>{\"a\": [1, 2]}</arg_value>\n</tool_call>")
GLM5_INLINE = "<tool_call>get_weather<arg_key>city</arg_key><arg_value>Paris</arg_value></tool_call>"
V31 = ("Checking<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{\"city\": \"Paris\", \"days\": 2}"
       "<｜tool▁call▁end｜><｜tool▁call▁begin｜>get_time<｜tool▁sep｜>{}<｜tool▁call▁end｜><｜tool▁calls▁end｜>")
V3 = ("<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_current_weather\n```json\n"
      "{\"location\": \"Beijing\"}\n```<｜tool▁call▁end｜>\n<｜tool▁call▁begin｜>function<｜tool▁sep｜>"
      "get_current_weather\n```json\n{\"location\": \"Shanghai\"}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>")
V32 = ("Sure.\n\n<｜DSML｜function_calls>\n<｜DSML｜invoke name=\"get_weather\">\n"
       "<｜DSML｜parameter name=\"city\" string=\"true\">杭州</｜DSML｜parameter>\n"
       "<｜DSML｜parameter name=\"days\" string=\"false\">3</｜DSML｜parameter>\n</｜DSML｜invoke>\n"
       "<｜DSML｜invoke name=\"get_weather\">\n<｜DSML｜parameter name=\"city\" string=\"true\">北京</｜DSML｜parameter>\n"
       "<｜DSML｜parameter name=\"opts\" string=\"false\">{\"unit\": \"C\"}</｜DSML｜parameter>\n</｜DSML｜invoke>\n"
       "</｜DSML｜function_calls>")

CASES = [  # (parser, output, content, [(name, arguments as parsed JSON)])
    ("glm45", GLM_TWO, "Let me look.", [("get_weather", {"city": "Beijing", "days": 3, "code": "007"}),
                                        ("get_weather", {"city": "上海", "extra": {"a": [1, 2]}})]),
    ("glm45", GLM5_INLINE, None, [("get_weather", {"city": "Paris"})]),
    ("glm45", "no calls here", "no calls here", []),
    ("deepseek_v31", V31, "Checking", [("get_weather", {"city": "Paris", "days": 2}), ("get_time", {})]),
    ("deepseek_v3", V3, None, [("get_current_weather", {"location": "Beijing"}),
                               ("get_current_weather", {"location": "Shanghai"})]),
    ("deepseek_v32", V32, "Sure.\n\n", [("get_weather", {"city": "杭州", "days": 3}),
                                       ("get_weather", {"city": "北京", "opts": {"unit": "C"}})]),
]
MALFORMED = [  # a section with no complete call: all of it is content
    ("glm45", "Hi <tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Par"),
    ("glm45", "<tool_call></tool_call>"),
    ("deepseek_v31", "x<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather{\"city\": 1}<｜tool▁call▁end｜>"),
    ("deepseek_v31", "x<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{\"ci"),
    ("deepseek_v3", "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>f\n{\"a\": 1}<｜tool▁call▁end｜>"),
    ("deepseek_v32", "<｜DSML｜function_calls>\n<｜DSML｜invoke name=\"f\">\n<｜DSML｜parameter name=\"a\" string="),
]


def _calls(calls: list[dict]) -> list[tuple[str, object]]:
    return [(c["name"], json.loads(c["arguments"])) for c in calls]


@pytest.mark.parametrize("parser, text, content, calls", CASES)
def test_whole_output(parser, text, content, calls):
    got_content, got = tool_parsers.parse(parser, text, TOOLS)
    assert got_content == content
    assert _calls(got) == calls


def test_deepseek_arguments_pass_through_verbatim():
    _, calls = tool_parsers.parse("deepseek_v31", V31, TOOLS)
    assert calls[0]["arguments"] == "{\"city\": \"Paris\", \"days\": 2}"


def _splits(text: str, rng: random.Random) -> list[str]:
    cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(1, 12))))
    return [text[a:b] for a, b in zip([0] + cuts, cuts + [len(text)])]


def _stream(parser: str, pieces: list[str]) -> tuple[str, list[dict]]:
    s = tool_parsers.ToolStream(parser, TOOLS)
    content, calls = "", {}
    outs = [s.feed(p) for p in pieces] + [s.finish()]
    for c, deltas in outs:
        content += c
        for d in deltas:
            call = calls.setdefault(d["index"], {"name": None, "arguments": "", "id": None})
            if "id" in d:
                assert call["id"] is None and d["type"] == "function" and d["function"]["arguments"] == ""
                call["id"], call["name"] = d["id"], d["function"]["name"]
            else:
                call["arguments"] += d["function"]["arguments"]
    return content, [calls[i] for i in sorted(calls)]


CUT_SHORT = MALFORMED[3][1]   # a DeepSeek call cut inside its arguments: it streamed as a call before the end


@pytest.mark.parametrize("parser, text, content, calls", CASES + [(p, t, t, []) for p, t in MALFORMED])
def test_streamed_in_random_splits_adds_up_to_the_whole(parser, text, content, calls):
    rng = random.Random(sum(map(ord, text)))
    for _ in range(25):
        got_content, got = _stream(parser, _splits(text, rng))
        assert (got_content or None) == content
        if text == CUT_SHORT:
            assert [c["name"] for c in got] in ([], ["get_weather"])
            continue
        assert [(c["name"], json.loads(c["arguments"])) for c in got] == calls


@pytest.mark.parametrize("parser, text", MALFORMED)
def test_malformed_output_is_content(parser, text):
    assert tool_parsers.parse(parser, text, TOOLS) == (text, [])


def test_deepseek_arguments_stream_before_the_call_closes():
    s = tool_parsers.ToolStream("deepseek_v31", TOOLS)
    head = "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{\"city\": \"Pa"
    _, deltas = s.feed(head)
    assert deltas[0]["function"]["name"] == "get_weather"
    assert "".join(d["function"]["arguments"] for d in deltas) == "{\"city\": \"Pa"
    _, deltas = s.feed("ris\"}<｜tool▁call")     # a split end marker is held back, never sent as arguments
    assert "".join(d["function"]["arguments"] for d in deltas) == "ris\"}"


REASONING = [  # (parser, kwargs, output, reasoning_content, content)
    ("deepseek_r1", None, "<think>plan it</think>The answer.", "plan it", "The answer."),
    ("deepseek_r1", None, "plan it</think>The answer.", "plan it", "The answer."),
    ("deepseek_r1", None, "still thinking", "still thinking", None),
    ("deepseek_r1", None, "<think>a</think>", "a", None),
    ("glm45", None, "<think>plan</think>Answer", "plan", "Answer"),
    ("glm45", None, "Answer only", None, "Answer only"),
    ("glm45", None, "<think>cut off", None, "<think>cut off"),
    ("deepseek_v3", {"thinking": True}, "plan</think>Answer", "plan", "Answer"),
    ("deepseek_v3", {"thinking": False}, "plan</think>Answer", None, "plan</think>Answer"),
    ("deepseek_v3", None, "Answer", None, "Answer"),
]


@pytest.mark.parametrize("parser, kwargs, text, r, c", REASONING)
def test_reasoning_whole_and_streamed(parser, kwargs, text, r, c):
    assert reasoning.split(parser, text, kwargs) == (r, c)
    if parser == "glm45" and "</think>" not in text:
        return   # vLLM streams an unclosed <think> as reasoning but returns it whole as content: not compared
    rng = random.Random(7)
    for _ in range(25):
        s = reasoning.ReasoningStream(parser, kwargs)
        parts = [s.feed(p) for p in _splits(text, rng)] + [s.finish()]
        got_r, got_c = "".join(p[0] for p in parts), "".join(p[1] for p in parts)
        assert (got_r or None, got_c or None) == (r, c)


def test_reasoning_then_tool_call_as_a_chat_message_and_stream():
    text = "<think>need weather</think>I'll check." + GLM5_INLINE
    mode = OutputMode("glm45", "glm45", read_tools([{"type": "function", "function": WEATHER}], None))
    msg, finish = message(mode, text, "stop")
    assert finish == "tool_calls" and msg["reasoning_content"] == "need weather" and msg["content"] == "I'll check."
    assert _calls([c["function"] for c in msg["tool_calls"]]) == [("get_weather", {"city": "Paris"})]
    rng = random.Random(3)
    for _ in range(10):
        st = ChatStream(mode)
        pieces = _splits(text, rng)
        deltas = [st.feed(p, last=i == len(pieces) - 1) for i, p in enumerate(pieces)]
        assert "".join(d.get("reasoning_content", "") for d in deltas) == "need weather"
        assert "".join(d.get("content", "") for d in deltas) == "I'll check."
        args = "".join(tc["function"].get("arguments", "") for d in deltas for tc in d.get("tool_calls", ()))
        assert json.loads(args) == {"city": "Paris"} and st.finish_reason("stop") == "tool_calls"


def test_no_tools_means_no_parsing():
    mode = OutputMode("glm45", "glm45", None)
    msg, finish = message(mode, GLM5_INLINE, "stop")
    assert msg["content"] == GLM5_INLINE and "tool_calls" not in msg and finish == "stop"


def test_a_parser_that_fails_leaves_the_text_as_content(monkeypatch):
    def boom(*_a, **_k):
        raise RuntimeError("parser bug")
    monkeypatch.setattr(tool_parsers, "parse", boom)
    monkeypatch.setattr(tool_parsers.ToolStream, "feed", boom)
    mode = OutputMode(None, "glm45", read_tools([{"type": "function", "function": WEATHER}], None))
    msg, finish = message(mode, GLM5_INLINE, "stop")
    assert msg == {"role": "assistant", "content": GLM5_INLINE} and finish == "stop"
    st = ChatStream(mode)
    assert st.feed("abc") == {"content": "abc"} and st.feed("def", last=True) == {"content": "def"}


def test_parsers_default_from_the_model_and_flags_override():
    from pathlib import Path

    from splash.cli.args import build_config
    from splash.server.agent import resolve_parsers
    fixtures = Path(__file__).parent / "fixtures" / "chat_templates"
    v31 = (fixtures / "deepseek-v3.1.jinja").read_text(encoding="utf-8")
    assert resolve_parsers("auto", "auto", "glm_moe_dsa", None) == ("glm45", "glm45")
    assert resolve_parsers("auto", "auto", "deepseek_v32", None) == ("deepseek_v32", "deepseek_v3")
    assert resolve_parsers("auto", "auto", "deepseek_v3", v31) == ("deepseek_v31", "deepseek_v3")
    assert resolve_parsers("auto", "auto", "deepseek_v3", "...```json...") == ("deepseek_v3", "deepseek_v3")
    assert resolve_parsers("deepseek_v31", "none", "glm_moe_dsa", None) == ("deepseek_v31", None)
    assert resolve_parsers("auto", "auto", "llama", None) == (None, None)
    cfg = build_config(["--tool-call-parser", "glm45", "--reasoning-parser", "deepseek_r1"])
    assert (cfg.server.tool_call_parser, cfg.server.reasoning_parser) == ("glm45", "deepseek_r1")


def test_a_prompt_that_opens_thinking_starts_the_output_in_reasoning():
    """GLM-5.x's template ends the prompt with <think> (thinking on): the answer is "plan</think>answer"."""
    from pathlib import Path

    from splash.server.agent import Prepared, with_prompt
    from splash.tokenizer import Tokenizer, build_byte_tokenizer
    template = (Path(__file__).parent / "fixtures" / "chat_templates" / "glm-5.3-flash.jinja").read_text("utf-8")
    tok = Tokenizer(build_byte_tokenizer(), chat_template=template)
    msgs = [{"role": "user", "content": "hi"}]
    on = with_prompt(Prepared(mode=OutputMode("glm45")), tok, tok.encode(tok.apply_chat_template(msgs)))
    off = with_prompt(Prepared(mode=OutputMode("glm45", template_kwargs={"enable_thinking": False})), tok,
                      tok.encode(tok.apply_chat_template(msgs, kwargs={"enable_thinking": False})))
    assert on.mode.thinking_opened and not off.mode.thinking_opened
    assert message(on.mode, "plan</think>answer", "stop")[0]["reasoning_content"] == "plan"
    assert message(on.mode, "plan</think>answer", "stop")[0]["content"] == "answer"
    assert message(off.mode, "answer", "stop")[0] == {"role": "assistant", "content": "answer"}
    st = ChatStream(on.mode)
    parts = [st.feed(p) for p in ("pl", "an</th", "ink>ans", "wer")] + [st.feed("", last=True)]
    assert "".join(p.get("reasoning_content", "") for p in parts) == "plan"
    assert "".join(p.get("content", "") for p in parts) == "answer"


def test_config_offers_exactly_the_tool_call_parsers():
    """server.tool_call_parser's choices (which --tool-call-parser takes too) are auto, none and the parsers here."""
    from splash.config.serve_config import choices
    assert choices("tool_call_parser") == ("auto", "none", *tool_parsers.FORMATS)


REQUIRED_OUT = ('[{"name": "get_weather", "parameters": {"city": "Paris", "days": 2}}, '
                '{"name": "get_time", "parameters": {"zone": "UTC"}}]')


@pytest.mark.parametrize("choice, text, want", [
    ("required", REQUIRED_OUT, [("get_weather", {"city": "Paris", "days": 2}), ("get_time", {"zone": "UTC"})]),
    ({"type": "function", "function": {"name": "get_time"}}, ' {"zone": "UTC"}', [("get_time", {"zone": "UTC"})]),
])
def test_forced_tool_calls_as_a_message_and_a_stream(choice, text, want):
    """``tool_choice: "required"`` / a named function: the grammar-shaped output becomes ``tool_calls`` (the named
    function's arguments as the model wrote them); streamed in any pieces, the argument deltas add up to them."""
    tools = [{"type": "function", "function": WEATHER},
             {"type": "function", "function": {"name": "get_time"}}]   # no parameters: any object
    mode = OutputMode(None, None, read_tools(tools, choice), constrained=True)
    msg, finish = message(mode, text, "stop")
    assert finish == "tool_calls" and msg["content"] is None
    assert _calls([c["function"] for c in msg["tool_calls"]]) == want
    rng = random.Random(5)
    for _ in range(20):
        st = ChatStream(mode)
        pieces = _splits(text, rng)
        deltas = [st.feed(p, last=i == len(pieces) - 1) for i, p in enumerate(pieces)]
        calls: dict[int, list] = {}
        for d in deltas:
            assert "content" not in d
            for tc in d.get("tool_calls", ()):
                got = calls.setdefault(tc["index"], ["", ""])
                got[0] += tc["function"].get("name") or ""
                got[1] += tc["function"].get("arguments", "")
        assert [(n, json.loads(a)) for _, (n, a) in sorted(calls.items())] == want
        assert st.finish_reason("stop") == "tool_calls"


def test_a_forced_output_cut_short_is_content():
    mode = OutputMode(None, None, read_tools([{"type": "function", "function": WEATHER}], "required"),
                      constrained=True)
    cut = REQUIRED_OUT[:40]
    msg, finish = message(mode, cut, "length")
    assert msg == {"role": "assistant", "content": cut} and finish == "length"
    # a whole array that is not the calls' shape is content too
    assert message(mode, '[{"name": "get_weather"}]', "stop")[0]["content"] == '[{"name": "get_weather"}]'


def test_forced_spec_is_the_schema_the_output_must_match():
    """The grammar of a forced call: a named function's parameters (none: any object); "required": an array of
    {name, parameters} per tool, at most one without parallel calls; "auto" and "none" force nothing."""
    from splash.server.tool_choice import forced_spec
    tools = [{"type": "function", "function": WEATHER}, {"type": "function", "function": {"name": "get_time"}}]
    named = forced_spec(read_tools(tools, {"type": "function", "function": {"name": "get_time"}}), None)
    assert (named.kind, named.param) == ("json", "tool_choice") and json.loads(named.source) == {"type": "object", "properties": {}}
    req = json.loads(forced_spec(read_tools(tools, "required"), False).source)
    assert req["maxItems"] == 1 and req["minItems"] == 1
    names = [c["properties"]["name"]["enum"] for c in req["items"]["anyOf"]]
    assert names == [["get_weather"], ["get_time"]]
    assert req["items"]["anyOf"][0]["properties"]["parameters"] == WEATHER["parameters"]
    assert "maxItems" not in json.loads(forced_spec(read_tools(tools[:1], "required"), None).source)
    assert forced_spec(read_tools(tools, "auto"), None) is None and forced_spec(read_tools(tools, "none"), None) is None


class _CountedList(list):
    iterations = 0

    def __iter__(self):
        _CountedList.iterations += 1
        return super().__iter__()


STREAMED_CALLS = {   # (what opens the section, one call)
    "glm45": ("", "<tool_call>t7\n<arg_key>city</arg_key><arg_value>Paris</arg_value></tool_call>"),
    "deepseek_v31": ("<｜tool▁calls▁begin｜>", "<｜tool▁call▁begin｜>t7<｜tool▁sep｜>{\"city\": 1}<｜tool▁call▁end｜>"),
    "deepseek_v32": ("<｜DSML｜function_calls>", "<｜DSML｜invoke name=\"t7\"><｜DSML｜parameter name=\"city\" "
                                               "string=\"true\">Paris</｜DSML｜parameter></｜DSML｜invoke>"),
}


@pytest.mark.parametrize("parser", sorted(STREAMED_CALLS))
def test_a_stream_of_many_calls_reads_each_call_once(parser):
    """A client can force any number of calls in the model's format (a regex constraint beside tool_choice auto)
    with thousands of tools. The stream re-read its whole call section per token and scanned the tools per
    argument: 4,000 one-character deltas of GLM calls with 8,000 tools cost 106 s of the event loop (55 s of
    /health on a 2-rank server). Now each complete call is read once, its tools by name."""
    tools = _CountedList({"name": f"t{i}", "parameters": {"type": "object", "properties": {
        "city": {"type": "string"}}}} for i in range(2000))
    head, call = STREAMED_CALLS[parser]
    text = head + call * 61
    s = tool_parsers.ToolStream(parser, tools)
    read = [0]
    calls = s.fmt.calls
    s.fmt.calls = lambda section, t: (read.__setitem__(0, read[0] + len(section)), calls(section, t))[1]
    _CountedList.iterations = 0
    content, args = "", {}
    for i, ch in enumerate(text):
        c, deltas = s.feed(ch)
        content += c
        for d in deltas:
            args[d["index"]] = args.get(d["index"], "") + d["function"]["arguments"]
    content += s.finish()[0]
    assert content == "" and len(args) == 61 and all(json.loads(a)["city"] for a in args.values())
    assert _CountedList.iterations <= 1                       # the tools, looked up by name
    assert read[0] <= 2 * len(text) * len(call)               # each call read while it is open, not the section


def test_a_forced_stream_of_many_calls_reads_each_call_once(monkeypatch):
    """tool_choice "required" streamed: the JSON array was scanned from its start per token."""
    from splash.server import tool_choice
    tools = [{"type": "function", "function": WEATHER}]
    one = json.dumps({"name": "get_weather", "parameters": {"city": "Paris"}})
    text = "[" + ", ".join([one] * 100) + "]"
    looked = [0]
    value_end = tool_choice._value_end
    monkeypatch.setattr(tool_choice, "_value_end", lambda s, i: (looked.__setitem__(0, looked[0] + 1),
                                                                 value_end(s, i))[1])
    st = ChatStream(OutputMode(tools=read_tools(tools, "required"), constrained=True))
    args: dict = {}
    for i, ch in enumerate(text):
        for tc in st.feed(ch, last=i == len(text) - 1).get("tool_calls", ()):
            args[tc["index"]] = args.get(tc["index"], "") + tc["function"]["arguments"]
    assert [json.loads(a) for a in args.values()] == [{"city": "Paris"}] * 100
    assert looked[0] <= 3 * len(text)    # values read per token: those of the open call, not of every call


LONG_CALLS = {   # (the call up to its arguments, after them)
    "glm45": ("<tool_call>t7\n<arg_key>city</arg_key><arg_value>", "</arg_value></tool_call>"),
    "deepseek_v31": ("<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>t7<｜tool▁sep｜>{\"city\": \"", "\"}<｜tool▁call▁end｜>"),
    "deepseek_v3": ("<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>t7\n```json\n{\"city\": \"",
                    "\"}\n```<｜tool▁call▁end｜>"),
    "deepseek_v32": ("<｜DSML｜function_calls><｜DSML｜invoke name=\"t7\"><｜DSML｜parameter name=\"city\" "
                     "string=\"true\">", "</｜DSML｜parameter></｜DSML｜invoke>"),
}


@pytest.mark.parametrize("parser", sorted(LONG_CALLS))
def test_one_long_call_is_not_re_read_per_token(parser):
    """One call with 6,000 characters of arguments (a file a coding agent writes), one character per delta: the
    stream re-read the open call from its start per token (32,000 characters: 17.8 s for GLM's format, 13.7 s for
    DSML, 0.5 s for DeepSeek's). Now an open GLM/DSML call is not read until its close marker arrives, and a DeepSeek
    call's arguments are read on from where the last read stopped."""
    head, tail = LONG_CALLS[parser]
    text = head + "ab<｜`\n" * 1000 + tail    # pieces of end markers inside the arguments
    s = tool_parsers.ToolStream(parser, TOOLS)
    read = [0]
    calls = s.fmt.calls
    s.fmt.calls = lambda section, t: (read.__setitem__(0, read[0] + len(section)), calls(section, t))[1]
    args: dict = {}
    for ch in text:
        for d in s.feed(ch)[1]:
            args[d["index"]] = args.get(d["index"], "") + d["function"]["arguments"]
    s.finish()
    assert list(args.values()) == [c["arguments"] for c in tool_parsers.parse(parser, text, TOOLS)[1]]
    assert read[0] <= 2 * len(text) + len(head) ** 2
