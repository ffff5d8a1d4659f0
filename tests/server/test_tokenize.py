"""vLLM's POST /tokenize and /detokenize and GET /version: the ids a prompt or a chat becomes are the ids the
completion and chat endpoints generate from, and bad input is a 400 naming the field."""
from __future__ import annotations

from importlib import metadata

import pytest

from server_util import in_process
from splash.server.prompts import CHARS_PER_TOKEN
from splash.tokenizer import load_tokenizer

TOK = load_tokenizer(None, 320)
CHAT = [{"role": "developer", "content": "be brief"}, {"role": "user", "content": [{"type": "text", "text": "hi"}]}]
TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]


def _serve(engine, checks, **kw):
    return in_process(engine, lambda c, _: checks(c), **kw)


def test_tokenize_gives_the_ids_the_generating_endpoints_read(engine):
    async def checks(c):
        text = await c.post("/tokenize", json={"prompt": "héllo wörld", "return_token_strs": True})
        # the prompt tokens a completion reports for the same text
        comp = await c.post("/v1/completions", json={"prompt": "héllo wörld", "max_tokens": 1, "echo": True,
                                                       "logprobs": 0, "return_tokens_as_token_ids": True})
        chat = await c.post("/tokenize", json={"messages": CHAT})
        chat_done = await c.post("/v1/chat/completions", json={"messages": CHAT, "max_tokens": 1})
        no_gen = await c.post("/tokenize", json={"messages": CHAT, "add_generation_prompt": False})
        return text, comp, chat, chat_done, no_gen

    text, comp, chat, chat_done, no_gen = _serve(engine, checks)
    body = text.json()
    assert text.status_code == 200 and body["tokens"] == TOK.encode("héllo wörld", True)
    assert body["count"] == len(body["tokens"]) and body["max_model_len"] == 512
    assert body["token_strs"] == [TOK.hf.id_to_token(i) for i in body["tokens"]]
    echoed = [int(t.split(":")[1]) for t in comp.json()["choices"][0]["logprobs"]["tokens"]][:body["count"]]
    assert echoed == body["tokens"]
    assert chat.status_code == 200 and chat.json()["token_strs"] is None
    assert chat.json()["count"] == chat_done.json()["usage"]["prompt_tokens"]
    # developer -> system, text parts joined: the same text the chat template renders for a chat request
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    assert chat.json()["tokens"] == TOK.encode(TOK.apply_chat_template(msgs), False)
    assert no_gen.json()["tokens"] == TOK.encode(TOK.apply_chat_template(msgs, add_generation_prompt=False), False)


def test_detokenize_version_and_the_model_card(engine):
    ids = TOK.encode("round trip", False)

    async def checks(c):
        return ((await c.post("/detokenize", json={"tokens": ids})).json(), (await c.get("/version")).json(),
                (await c.get("/v1/models")).json()["data"][0])
    text, version, card = _serve(engine, checks, model_root="/models/tiny")
    assert text == {"prompt": "round trip"} and version == {"version": metadata.version("splash")}
    assert card["id"] == "tiny-mla" and card["root"] == "/models/tiny" and card["parent"] is None


@pytest.mark.parametrize("path, body, status, param", [
    ("/tokenize", {}, 400, "messages"),
    ("/tokenize", {"prompt": "a", "messages": CHAT}, 400, "prompt"),
    ("/tokenize", {"prompt": "a", "tools": TOOLS}, 400, "tools"),
    ("/tokenize", {"prompt": "a", "model": "other"}, 404, "model"),
    ("/tokenize", {"prompt": "a", "continue_final_message": True}, 400, "continue_final_message"),
    ("/tokenize", {"prompt": "a" * 600}, 400, "prompt"),                        # 600 tokens >= max_model_len 512
    ("/tokenize", {"prompt": "a" * (CHARS_PER_TOKEN * 512 + 1)}, 400, "prompt"),  # refused on its prefix
    ("/tokenize", {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, 400, "messages.0.content.0"),
    ("/tokenize", {"messages": CHAT, "chat_template_kwargs": {"tools": []}}, 400, "chat_template_kwargs"),
    ("/tokenize", {"messages": CHAT, "tools": [{"type": "function"}]}, 400, "tools.0"),
    ("/tokenize", {"messages": [{"role": "user", "content": "x"}] * 600}, 400, "messages"),
    ("/detokenize", {"tokens": [1, 320]}, 400, "tokens"),
    ("/detokenize", {"tokens": [-1]}, 400, "tokens"),
    ("/detokenize", {"tokens": [1] * 513}, 400, "tokens"),
    ("/detokenize", {"tokens": ["1"]}, 400, "tokens.0"),
    ("/detokenize", {"tokens": [1], "model": "other"}, 404, "model"),
])
def test_bad_input_is_an_error_naming_the_field(engine, path, body, status, param):
    async def checks(c):
        bad = await c.post(path, json=body)
        good = await c.post("/tokenize", json={"prompt": "still here"})
        return bad, good
    bad, good = _serve(engine, checks)
    assert bad.status_code == status and bad.json()["error"]["param"] == param, bad.text
    assert good.status_code == 200 and good.json()["count"] > 0
