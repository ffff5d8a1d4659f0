"""Structured output and forced tool calls on the real server (``mpiexec -n 2``, tiny random-weight model), under
live layout switches: 50 requests each of a JSON schema, ``tool_choice: "required"``, ``choice`` and ``regex``,
sampled at temperature 1 while POST /v1/layout pins tp → dp_attn → cp → dop; every output must parse and validate
(``jsonschema``). A random-weight model follows the grammar only because the sampler masks its logits: without the
mask almost no output would even be JSON. Plus the 400s of grammars that do not compile, and the official ``openai``
client: ``tools=`` with ``tool_choice``, ``.parse(response_format=PydanticModel)`` and streaming with tools.
"""
from __future__ import annotations

import json
import re
import threading

import httpx
import pytest
from server_util import mpiexec_path, run_server, save_preset

jsonschema = pytest.importorskip("jsonschema")
openai = pytest.importorskip("openai")
pydantic = pytest.importorskip("pydantic")


pytestmark = pytest.mark.skipif(mpiexec_path() is None, reason="mpiexec not found")
TOKEN = "grammar-admin"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
N = 50
LAYOUTS = ["dp_attn", "cp", "dop", "tp"]

# short, closed schemas: a random model's output ends within max_tokens only where the schema bounds it. (A string's
# maxLength is not used: xgrammar 0.2.9 compiles it to a character class that admits raw control characters.)
SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"},
                                           "n": {"type": "integer", "minimum": 0, "maximum": 99},
                                           "tag": {"type": "string", "enum": ["a", "bb", "ccc"]},
                                           "s": {"type": "string", "pattern": "^[a-z]{1,3}$"}},
          "required": ["ok", "n", "tag", "s"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
             "type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Rome"]},
                                              "days": {"type": "integer", "minimum": 1, "maximum": 7}},
             "required": ["city", "days"], "additionalProperties": False}}},
         {"type": "function", "function": {"name": "ping", "parameters": {
             "type": "object", "properties": {"loud": {"type": "boolean"}}, "required": ["loud"],
             "additionalProperties": False}}}]
CHOICES = ["yes", "no", "maybe \"so\""]
REGEX = r"[a-z]{2,4}-\d{1,3}"
MAX_TOKENS = 64   # SCHEMA's longest output is 54 tokens of the byte tokenizer
TOOL_MAX_TOKENS = 80   # the longest forced call of TOOLS is 71


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    ckpt = save_preset("tiny-mla", tmp_path_factory.mktemp("ckpt") / "tiny-mla")
    yield from run_server(tmp_path_factory.mktemp("server"), f"""
model: {{model: {ckpt}}}
layout: {{layout: tp}}
cache: {{kv_cache_memory_bytes: 8MiB}}
server: {{port: 0, quiet: true, admin_token: {TOKEN}, tool_call_parser: glm45}}
""")


def _chat(url: str, body: dict) -> dict:
    r = httpx.post(f"{url}/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}],
                                                       "max_tokens": MAX_TOKENS, "temperature": 1.0, **body},
                   timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def _under_switches(url: str, bodies: list[dict]) -> list[dict]:
    """Send every body at once from threads while the layout is pinned through LAYOUTS; the answers in order."""
    out: list = [None] * len(bodies)

    def run(i: int) -> None:
        try:
            out[i] = _chat(url, bodies[i])
        except BaseException as e:  # noqa: BLE001 — reported below
            out[i] = e

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(bodies))]
    for t in threads:
        t.start()
    for lay in LAYOUTS:
        r = httpx.post(f"{url}/v1/layout", json={"layout": lay}, headers=AUTH, timeout=60)
        assert r.status_code == 200, r.text
    for t in threads:
        t.join(300)
    errors = [o for o in out if isinstance(o, BaseException)]
    assert not errors, errors[0]
    return out


def _switched(url: str) -> int:
    return httpx.get(f"{url}/v1/layout", timeout=10).json()["switch_count"]


def test_json_schema_under_switches(server):
    before = _switched(server.url)
    rf = {"type": "json_schema", "json_schema": {"name": "thing", "schema": SCHEMA, "strict": True}}
    outs = _under_switches(server.url, [{"response_format": rf, "seed": i} for i in range(N)])
    valid = 0
    for o in outs:
        choice = o["choices"][0]
        assert choice["finish_reason"] == "stop", choice
        jsonschema.validate(json.loads(choice["message"]["content"]), SCHEMA)
        valid += 1
    assert valid == N
    assert _switched(server.url) - before >= len(LAYOUTS) - 1   # the layouts really changed under the requests


def test_tool_choice_required_under_switches(server):
    outs = _under_switches(server.url, [{"tools": TOOLS, "tool_choice": "required", "parallel_tool_calls": False,
                                         "max_tokens": TOOL_MAX_TOKENS, "seed": 100 + i} for i in range(N)])
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
    for o in outs:
        choice = o["choices"][0]
        assert choice["finish_reason"] == "tool_calls", choice
        calls = choice["message"]["tool_calls"]
        assert len(calls) == 1 and choice["message"]["content"] is None
        fn = calls[0]["function"]
        jsonschema.validate(json.loads(fn["arguments"]), schemas[fn["name"]])
        assert calls[0]["type"] == "function" and calls[0]["id"].startswith("call_")


def test_choice_and_regex_under_switches(server):
    bodies = [{"structured_outputs": {"choice": CHOICES}, "seed": 200 + i} for i in range(N)]
    bodies += [{"structured_outputs": {"regex": REGEX}, "seed": 300 + i} for i in range(N)]
    outs = _under_switches(server.url, bodies)
    for o in outs[:N]:
        assert o["choices"][0]["message"]["content"] in CHOICES
    for o in outs[N:]:
        assert re.fullmatch(REGEX, o["choices"][0]["message"]["content"]), o["choices"][0]


def test_completions_structured_outputs(server):
    r = httpx.post(f"{server.url}/v1/completions", json={"prompt": "x", "max_tokens": MAX_TOKENS,
                                                         "structured_outputs": {"json": SCHEMA}, "n": 3},
                   timeout=60)
    assert r.status_code == 200, r.text
    for c in r.json()["choices"]:
        jsonschema.validate(json.loads(c["text"]), SCHEMA)


@pytest.mark.parametrize("body, param", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}}},
     "response_format.json_schema.schema"),
    ({"structured_outputs": {"regex": "(unclosed"}}, "structured_outputs.regex"),
    ({"structured_outputs": {"grammar": "root ::= undefined_rule"}}, "structured_outputs.grammar"),
    ({"structured_outputs": {"json": "{not json"}}, "structured_outputs.json"),
    ({"structured_outputs": {"choice": []}}, "structured_outputs.choice"),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs"),
    ({"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}}, "structured_outputs"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "bogus"}}}],
      "tool_choice": "required"}, "tool_choice"),
    # they compile, but admit no output at all: the engine would have nothing to sample
    ({"structured_outputs": {"grammar": "root ::= root"}}, "structured_outputs.grammar"),
    ({"structured_outputs": {"regex": r"[^\s\S]"}}, "structured_outputs.regex"),
])
def test_bad_constraints_are_400_naming_the_field(server, body, param):
    r = httpx.post(f"{server.url}/v1/chat/completions",
                   json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, **body}, timeout=30)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param, err
    # and the server keeps serving
    assert _chat(server.url, {"max_tokens": 2})["choices"][0]["finish_reason"] in ("length", "stop")


@pytest.mark.parametrize("stream", [False, True])
def test_a_grammar_that_dead_ends_after_its_first_token_is_the_requests_400(server, stream):
    """'a' is allowed first, then nothing is (an empty character class): the request fails alone with a client
    error, not an internal_error."""
    body = {"prompt": "x", "max_tokens": 8, "stream": stream,
            "structured_outputs": {"grammar": 'root ::= "a" [^\\x00-\\U0010FFFF]'}}
    r = httpx.post(f"{server.url}/v1/completions", json=body, timeout=60)
    if stream:
        assert r.status_code == 200
        errors = [json.loads(ln[6:])["error"] for ln in r.text.splitlines()
                  if ln.startswith("data: {") and '"error"' in ln]
        assert len(errors) == 1 and r.text.rstrip().endswith("data: [DONE]"), r.text
        err = errors[0]
    else:
        assert r.status_code == 400, r.text
        err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and "grammar allows no next token" in err["message"], err
    assert _chat(server.url, {"max_tokens": 2})["choices"][0]["finish_reason"] in ("length", "stop")


class Weather(pydantic.BaseModel):
    city: str = pydantic.Field(pattern="^[A-Z][a-z]{1,4}$")
    hot: bool


def test_openai_client_parse_tools_and_streaming(server):
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=60)
    msgs = [{"role": "user", "content": "weather?"}]
    parsed = client.chat.completions.parse(model=None, messages=msgs, response_format=Weather,
                                           max_tokens=MAX_TOKENS, temperature=0)
    assert isinstance(parsed.choices[0].message.parsed, Weather)

    named = client.chat.completions.create(
        model=None, messages=msgs, tools=TOOLS, max_tokens=TOOL_MAX_TOKENS, seed=7,
        tool_choice={"type": "function", "function": {"name": "get_weather"}})
    call = named.choices[0].message.tool_calls[0]
    assert call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments), TOOLS[0]["function"]["parameters"])

    stream = client.chat.completions.create(model=None, messages=msgs, tools=TOOLS, tool_choice="required",
                                            parallel_tool_calls=False, max_tokens=TOOL_MAX_TOKENS, seed=7, stream=True)
    calls: dict[int, dict] = {}
    finish = None
    for chunk in stream:
        ch = chunk.choices[0]
        finish = ch.finish_reason or finish
        for tc in ch.delta.tool_calls or ():
            c = calls.setdefault(tc.index, {"name": "", "arguments": ""})
            c["name"] += tc.function.name or ""
            c["arguments"] += tc.function.arguments or ""
    assert finish == "tool_calls" and len(calls) == 1
    fn = calls[0]
    schema = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}[fn["name"]]
    jsonschema.validate(json.loads(fn["arguments"]), schema)
    # the same request not streamed gives the same call (same seed)
    whole = client.chat.completions.create(model=None, messages=msgs, tools=TOOLS, tool_choice="required",
                                           parallel_tool_calls=False, max_tokens=TOOL_MAX_TOKENS, seed=7)
    got = whole.choices[0].message.tool_calls[0].function
    assert (got.name, json.loads(got.arguments)) == (fn["name"], json.loads(fn["arguments"]))


# a GLM-format call the random model is made to write (a regex constraint), read back by the glm45 parser under
# tool_choice "auto": the parsing path of a real GLM model's answers, end to end
GLM_CALL = (r"Let me check\.<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>(Paris|Rome)</arg_value>\n"
            r"<arg_key>days</arg_key>\n<arg_value>[1-7]</arg_value>\n</tool_call>")


def test_openai_client_auto_tool_calls_parsed_from_the_models_format(server):
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=60)
    kw = dict(model=None, messages=[{"role": "user", "content": "weather?"}], tools=TOOLS, max_tokens=160, seed=3,
              extra_body={"structured_outputs": {"regex": GLM_CALL}})
    whole = client.chat.completions.create(**kw)
    msg = whole.choices[0].message
    assert whole.choices[0].finish_reason == "tool_calls" and msg.content == "Let me check."
    assert msg.tool_calls[0].function.name == "get_weather"
    args = json.loads(msg.tool_calls[0].function.arguments)
    jsonschema.validate(args, TOOLS[0]["function"]["parameters"])   # "days" came back as an integer

    content, calls, finish = "", {}, None
    for chunk in client.chat.completions.create(**kw, stream=True):
        ch = chunk.choices[0]
        finish = ch.finish_reason or finish
        content += ch.delta.content or ""
        for tc in ch.delta.tool_calls or ():
            c = calls.setdefault(tc.index, {"name": "", "arguments": ""})
            c["name"] += tc.function.name or ""
            c["arguments"] += tc.function.arguments or ""
    assert (content, finish) == ("Let me check.", "tool_calls")
    assert [(c["name"], json.loads(c["arguments"])) for c in calls.values()] == [("get_weather", args)]
