"""The API that existing clients speak, in-process (one rank, real engine on a tiny checkpoint with a tokenizer,
httpx's ASGI transport): vLLM's `bench serve --backend openai` request body replayed as vLLM sends it,
lm-evaluation-harness' `local-completions` log-likelihood body (echo + logprobs) scored as lm-eval scores it
and compared with transformers, the vLLM sampling parameters, chat logprobs, and the 400s for what is not
implemented."""
from __future__ import annotations

import asyncio
import json
import re

import httpx
import pytest
import torch
from hf_models import hf_logits, random_prompts

from splash.server.app import ServerState, create_app
from splash.tokenizer import load_tokenizer

MODEL = "tiny"
TOL = 1e-4


@pytest.fixture(scope="module")
def ckpt(tiny_ckpt):
    return tiny_ckpt("dense")


@pytest.fixture(scope="module")
def hf(hf_ref):
    return hf_ref("dense")


@pytest.fixture(scope="module")
def tok(ckpt):
    return load_tokenizer(ckpt, 260)


@pytest.fixture(scope="module")
def api(ckpt, tok):
    """call(list of (path, body)) -> list of httpx responses, all sent concurrently to one app + engine thread."""
    from splash.distributed import SingleRankCommunicator
    from splash.engine.llm import LLM
    from splash.server.engine_loop import EngineLoop
    from splash.server.metrics import Metrics

    engine = LLM(str(ckpt), comm=SingleRankCommunicator(), num_kv_blocks=128, block_size=4,
                 max_num_batched_tokens=16).engine

    def call(reqs):
        async def main():
            aio = asyncio.get_running_loop()
            holder = {}
            metrics = Metrics(lambda: holder["loop"].snapshot)
            loop = holder["loop"] = EngineLoop(engine, aio.call_soon_threadsafe, metrics)
            state = ServerState(loop=loop, tokenizer=tok, metrics=metrics, model_name=MODEL, max_model_len=1024,
                                vocab_size=260)
            loop.start()
            try:
                async with httpx.AsyncClient(transport=httpx.ASGITransport(app=create_app(state)),
                                             base_url="http://t", timeout=120) as c:
                    return await asyncio.gather(*(c.post(p, json=b) for p, b in reqs))
            finally:
                await asyncio.to_thread(loop.stop)
        return asyncio.run(main())

    return call


def _sse(r) -> list[dict]:
    return [json.loads(x[6:]) for x in r.text.split("\n\n") if x.startswith("data: {")]


def test_vllm_bench_serve_openai_body(api):
    """The body vLLM's `bench serve --backend openai` posts (vllm/benchmarks/lib/endpoint_request_func.py,
    async_request_openai_completions: repetition_penalty 1.0, logprobs from --logprobs (None by default),
    stream with include_usage, ignore_eos from --ignore-eos, then --extra-body / sampling flags merged in)."""
    bodies = [{"model": MODEL, "prompt": "The quick brown fox " * (i + 1), "repetition_penalty": 1.0,
               "max_tokens": 8 + i, "logprobs": lp, "stream": True, "stream_options": {"include_usage": True},
               "ignore_eos": True, **extra}
              for i, (lp, extra) in enumerate([(None, {}), (None, {"temperature": 0.0}), (3, {}),
                                                (None, {"top_k": 5, "top_p": 0.9, "min_p": 0.1, "temperature": 0.8})])]
    for i, r in enumerate(api([("/v1/completions", b) for b in bodies])):
        assert r.status_code == 200, r.text
        chunks = _sse(r)
        usage = [c["usage"] for c in chunks if c.get("usage") and not c["choices"]]
        assert usage and usage[-1]["completion_tokens"] == 8 + i and r.text.rstrip().endswith("data: [DONE]")
        token_chunks = [c for c in chunks if c["choices"]]
        assert token_chunks and isinstance(token_chunks[0]["choices"][0]["text"], str)
        if bodies[i]["logprobs"]:
            n = sum(len(c["choices"][0]["logprobs"]["tokens"]) for c in token_chunks)
            assert n == 8 + i


def _lm_eval_loglikelihood(choice, ctxlen: int) -> tuple[float, bool]:
    """lm-eval's parse_logprobs for local-completions (lm_eval/models/openai_completions.py)."""
    lps = choice["logprobs"]["token_logprobs"][ctxlen:-1]
    tops = choice["logprobs"]["top_logprobs"][ctxlen:-1]
    return sum(lps), all(t == max(top.values()) for t, top in zip(lps, tops))


def test_lm_eval_loglikelihood_body_matches_hf(api, hf):
    """lm-eval's log-likelihood request: token-id prompts (context + continuation), max_tokens 1, logprobs 1,
    echo; the continuation's summed logprob equals transformers' log-softmax within 1e-4."""
    ctxs = random_prompts([7, 12, 3], seed=21)
    conts = random_prompts([4, 1, 6], seed=22)
    body = {"model": MODEL, "prompt": [c + x for c, x in zip(ctxs, conts)], "temperature": 0, "max_tokens": 1,
            "logprobs": 1, "seed": 1234, "echo": True}
    r, = api([("/v1/completions", body)])
    assert r.status_code == 200, r.text
    choices = sorted(r.json()["choices"], key=lambda c: c["index"])
    for ch, ctx, cont in zip(choices, ctxs, conts):
        seq = ctx + cont
        ll, greedy = _lm_eval_loglikelihood(ch, len(ctx))
        ref = torch.log_softmax(hf_logits(hf, seq), -1)
        want = sum(float(ref[p - 1, seq[p]]) for p in range(len(ctx), len(seq)))
        assert abs(ll - want) < TOL
        assert greedy == all(int(ref[p - 1].argmax()) == seq[p] for p in range(len(ctx), len(seq)))
        lp = ch["logprobs"]
        assert len(lp["tokens"]) == len(seq) + 1 and lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
        assert lp["text_offset"][0] == 0 and lp["text_offset"] == sorted(lp["text_offset"])


def test_echo_text_and_prompt_logprobs(api, hf, tok):
    prompt = random_prompts([9], seed=3)[0]
    r1, r2, r3 = api([
        ("/v1/completions", {"prompt": "Hello there", "max_tokens": 3, "temperature": 0, "echo": True}),
        ("/v1/completions", {"prompt": prompt, "max_tokens": 2, "temperature": 0, "prompt_logprobs": 2}),
        ("/v1/completions", {"prompt": prompt, "max_tokens": 3, "logprobs": 1, "return_token_ids": True,
                             "return_tokens_as_token_ids": True})])
    assert r1.json()["choices"][0]["text"].startswith("Hello there")
    c3 = r3.json()["choices"][0]   # vLLM's return_tokens_as_token_ids: logprob entries name tokens by id
    assert c3["logprobs"]["tokens"] == [f"token_id:{t}" for t in c3["token_ids"]] and len(c3["token_ids"]) == 3
    assert all(k.startswith("token_id:") for top in c3["logprobs"]["top_logprobs"] for k in top)
    plp = r2.json()["choices"][0]["prompt_logprobs"]
    ref = torch.log_softmax(hf_logits(hf, prompt), -1)
    assert plp[0] is None and len(plp) == len(prompt)
    for p in range(1, len(prompt)):
        entry = plp[p][str(prompt[p])]
        assert abs(entry["logprob"] - float(ref[p - 1, prompt[p]])) < TOL
        assert entry["rank"] == 1 + int((ref[p - 1] > ref[p - 1, prompt[p]]).sum())
        assert set(map(int, plp[p])) >= set(ref[p - 1].topk(2).indices.tolist())


def test_chat_logprobs_and_content_parts(api, hf, tok):
    msgs = [{"role": "developer", "content": "be brief"},
            {"role": "user", "content": [{"type": "text", "text": "hi"}, {"type": "text", "text": "there"}]}]
    plain = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi\nthere"}]
    r1, r2, r3 = api([
        ("/v1/chat/completions", {"messages": msgs, "max_tokens": 5, "temperature": 0, "logprobs": True,
                                  "top_logprobs": 3, "user": "u1", "metadata": {"k": "v"}, "store": False,
                                  "return_token_ids": True}),
        ("/v1/chat/completions", {"messages": plain, "max_tokens": 5, "temperature": 0, "return_token_ids": True}),
        ("/v1/chat/completions", {"messages": plain, "max_tokens": 5, "temperature": 0, "stream": True,
                                  "logprobs": True}),
    ])
    a, b = r1.json()["choices"][0], r2.json()["choices"][0]
    assert re.fullmatch(r"chatcmpl-[0-9a-f]{24}", r1.json()["id"]) and r1.json()["object"] == "chat.completion"
    assert a["token_ids"] == b["token_ids"] and a["message"]["content"] == b["message"]["content"]
    content = a["logprobs"]["content"]
    prompt = tok.encode(tok.apply_chat_template(plain), add_special_tokens=False)
    ref = torch.log_softmax(hf_logits(hf, prompt + a["token_ids"]), -1)
    for t, (tid, e) in enumerate(zip(a["token_ids"], content)):
        assert abs(e["logprob"] - float(ref[len(prompt) - 1 + t, tid])) < TOL
        assert e["token"] == tok.decode([tid], skip_special_tokens=False) and len(e["top_logprobs"]) == 3
        assert e["bytes"] == list(e["token"].encode())
    streamed = [e for c in _sse(r3) for ch in c["choices"] if ch.get("logprobs") for e in ch["logprobs"]["content"]]
    # the same tokens' logprobs; the two requests may share a step or not (arrival timing), and where torch's GEMM
    # runs (the router, a tied LM head, projections too narrow to pack) a row rounds differently at another batch
    # size: a few fp32 ulps (1.2e-6 seen)
    assert [e["logprob"] for e in streamed] == pytest.approx([e["logprob"] for e in content], abs=1e-5)


def test_sampling_parameters_through_the_api(api):
    base = {"prompt": [5, 6, 7, 8], "max_tokens": 8, "temperature": 0, "return_token_ids": True, "ignore_eos": True}
    plain, biased, penal, seeded, seeded2 = api([
        ("/v1/completions", base),
        ("/v1/completions", {**base, "logit_bias": {"65": 100}}),
        ("/v1/completions", {**base, "repetition_penalty": 1.5, "frequency_penalty": 1.0, "presence_penalty": 1.0}),
        ("/v1/completions", {**base, "temperature": 1.0, "top_k": 3, "min_p": 0.05, "seed": 9}),
        ("/v1/completions", {**base, "temperature": 1.0, "top_k": 3, "min_p": 0.05, "seed": 9}),
    ])
    ids = lambda r: r.json()["choices"][0]["token_ids"]  # noqa: E731
    assert ids(biased) == [65] * 8
    assert len(set(ids(penal))) >= len(set(ids(plain))) and ids(seeded) == ids(seeded2)


def test_stop_string_options(api, tok):
    base = {"prompt": [5, 6, 7, 8], "max_tokens": 12, "temperature": 0, "ignore_eos": True}
    full, = api([("/v1/completions", base)])
    text = full.json()["choices"][0]["text"]
    stop = next((ch for ch in text[2:] if ch.isprintable()), None)
    if stop is None:
        pytest.skip("greedy text of this checkpoint has no printable character to stop on")
    cut, incl, late = api([("/v1/completions", {**base, "stop": [stop]}),
                           ("/v1/completions", {**base, "stop": [stop], "include_stop_str_in_output": True}),
                           ("/v1/completions", {**base, "stop": [stop], "min_tokens": 12})])
    i = text.index(stop)
    assert cut.json()["choices"][0]["text"] == text[:i]
    assert incl.json()["choices"][0]["text"] == text[:i + 1]
    assert late.json()["choices"][0]["text"] == text   # no stop string before min_tokens


BAD = [
    ({"tools": [{"type": "function", "function": {"description": "no name"}}]}, "tools.0.function.name"),
    ({"tool_choice": "auto"}, "tool_choice"),     # a tool choice without tools
    ({"functions": [{"name": "f"}]}, "functions"),
    ({"response_format": {"type": "xml"}}, "response_format.type"),
    ({"top_logprobs": 2}, "top_logprobs"),
    ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
     "messages.0.content.0"),
]


def test_unsupported_chat_fields_are_named_400s(api):
    msgs = [{"role": "user", "content": "hi"}]
    rs = api([("/v1/chat/completions", {"messages": msgs, "max_tokens": 2, **extra}) for extra, _ in BAD]
             + [("/v1/completions", {"prompt": "x", "logit_bias": {"999": 1}}),
                ("/v1/completions", {"prompt": "x", "logit_bias": {"a": 1}}),
                ("/v1/completions", {"prompt": "x", "min_tokens": 5, "max_tokens": 2}),
                ("/v1/completions", {"prompt": "x", "logprobs": 21}),
                ("/v1/completions", {"prompt": "x", "suffix": "tail"}),
                ("/v1/chat/completions", {"messages": msgs, "max_tokens": 2, "tool_choice": "none",
                                          "response_format": {"type": "text"}, "parallel_tool_calls": False})])
    fields = [f for _, f in BAD] + ["logit_bias", "logit_bias", "min_tokens", "logprobs", "suffix"]
    for r, f in zip(rs, fields):
        assert r.status_code == 400, (f, r.text)
        assert r.json()["error"]["param"] == f, (f, r.json())
    assert rs[-1].status_code == 200, rs[-1].text
