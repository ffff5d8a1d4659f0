"""Hardening without MPI: the real app + engine thread on one rank, in process (httpx's ASGI transport).

Whatever one client sends, the worst it gets is an error for itself: each check below sends one bad request
next to a good one and checks the status of the bad one, the tokens of the good one, and that the engine
thread lives on.
"""
from __future__ import annotations

import asyncio
import time

import httpx
import pytest

from splash.config.serve_config import ServerSection
from splash.engine.messages import EngineRequest
from splash.engine.sampling import SamplingParams
from splash.server.app import ServerState, check_admin, create_app
from splash.server.engine_loop import EngineLoop, EngineStopped
from splash.server.metrics import Metrics
from splash.server.protocol import APIError
from splash.tokenizer import load_tokenizer

from server_util import in_process

TOK = load_tokenizer(None, 320)
GOOD = {"prompt": [1, 2, 3], "max_tokens": 6, "temperature": 0, "return_token_ids": True}


def _serve(engine, checks, max_outstanding_seqs=None, **limits):
    """Run ``checks(client, loop)`` (async) against a fresh app on ``engine``; returns its result."""
    return in_process(engine, checks, max_outstanding_seqs, limits, tokenizer=TOK)


def _ids(r: httpx.Response) -> list[int]:
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["token_ids"]


def test_tiny_temperature_is_greedy_and_a_sampling_failure_fails_one_request(engine, monkeypatch):
    """Temperature 1e-40 samples greedily: 1/T would overflow the logits to NaN and abort every rank."""
    real = engine.sampler.sample

    def sample(logits, req_ids):   # a batch holding a request whose sampling raises (seed 666 marks it)
        if any(engine.sampler.states[r].params.seed == 666 for r in req_ids):
            raise RuntimeError("probability tensor contains either inf, nan or element < 0")
        return real(logits, req_ids)

    monkeypatch.setattr(engine.sampler, "sample", sample)

    async def checks(c, loop):
        greedy = await c.post("/v1/completions", json=GOOD)
        tiny, bad, other = await asyncio.gather(
            c.post("/v1/completions", json={**GOOD, "temperature": 1e-40}),
            c.post("/v1/completions", json={**GOOD, "temperature": 0.7, "seed": 666}),
            c.post("/v1/completions", json={**GOOD, "temperature": 0.7, "seed": 1, "max_tokens": 30}))
        stream = await c.post("/v1/completions", json={**GOOD, "temperature": 0.5, "seed": 666, "stream": True})
        after = await c.post("/v1/completions", json=GOOD)
        return greedy, tiny, bad, other, stream, after, loop.alive, loop.outstanding

    greedy, tiny, bad, other, stream, after, alive, outstanding = _serve(engine, checks)
    assert _ids(tiny) == _ids(greedy) == _ids(after)
    assert bad.status_code == 500 and "sampling request" in bad.json()["error"]["message"]
    assert len(_ids(other)) == 30
    assert stream.status_code == 200 and '"error"' in stream.text and stream.text.rstrip().endswith("[DONE]")
    assert alive and outstanding == 0


def test_statuses_of_bad_bodies(engine):
    """Bad bodies get 400s naming the field and a non-JSON content type a 415 (not a 500, a silent cap or an
    accepted body); a body without a content type is read as JSON."""
    deep = b'{"prompt": ' + b"[" * 5000 + b"]" * 5000 + b"}"
    chat_bad = {"messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]}
    chat_img = {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}

    async def checks(c, _):
        return await asyncio.gather(
            c.post("/v1/completions", content=deep, headers={"content-type": "application/json"}),
            c.post("/v1/chat/completions", json=chat_bad),
            c.post("/v1/chat/completions", json=chat_img),
            c.post("/v1/completions", json={**GOOD, "max_tokens": 10 ** 12}),
            c.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}],
                                                 "max_completion_tokens": 10 ** 12}),
            c.post("/v1/completions", content=b'{"prompt": [1], "max_tokens": 2}',
                   headers={"content-type": "text/plain"}),
            c.post("/v1/completions", content=b'{"prompt": [1], "max_tokens": 2}'),   # no content type: JSON
            c.post("/v1/completions", content=b'{"prompt": "\xff"}'),   # not UTF-8
            c.post("/v1/completions", json=GOOD))

    deep_r, chat_r, img_r, mt_r, mct_r, plain_r, bare_r, utf_r, good_r = _serve(engine, checks)
    assert deep_r.status_code == 400 and "nested too deep" in deep_r.json()["error"]["message"]
    assert utf_r.status_code == 400 and utf_r.json()["error"]["code"] == "invalid_json", utf_r.text
    assert chat_r.status_code == 400 and chat_r.json()["error"]["param"] == "messages.0.content.0"
    assert img_r.status_code == 400 and "only text parts" in img_r.json()["error"]["message"]
    assert mt_r.status_code == 400 and mt_r.json()["error"]["code"] == "context_length_exceeded"
    assert mct_r.status_code == 400 and mct_r.json()["error"]["param"] == "max_completion_tokens"
    assert plain_r.status_code == 415 and bare_r.status_code == 200
    assert len(_ids(good_r)) == 6


def test_body_size_sequence_and_queue_limits(engine):
    """Items 2 and 8: bodies are bounded (413), prompts × n is bounded (400), a full queue answers 429."""
    async def checks(c, loop):
        big = await c.post("/v1/completions", json={"prompt": "x" * 5000, "max_tokens": 1})
        many = await c.post("/v1/completions", json={"prompt": [[1]] * 5, "n": 2, "max_tokens": 1})
        async def chunks():
            for _ in range(10):
                yield b"x" * 1000

        chunked = await c.post("/v1/completions", content=chunks(), headers={"content-type": "application/json"})
        long_run = asyncio.ensure_future(c.post("/v1/completions", json={**GOOD, "max_tokens": 60,
                                                                         "ignore_eos": True}))
        while loop.outstanding == 0:
            await asyncio.sleep(0.01)
        full = await c.post("/v1/completions", json={**GOOD, "n": 2})
        return big, many, chunked, full, await long_run

    big, many, chunked, full, long_run = _serve(engine, checks, max_request_body_bytes=4096, max_seqs_per_request=8,
                                                max_outstanding_seqs=2)
    assert big.status_code == 413 and chunked.status_code == 413
    assert many.status_code == 400 and many.json()["error"]["code"] == "too_many_sequences"
    assert full.status_code == 429 and full.headers["retry-after"] == "1"
    assert len(_ids(long_run)) == 60


def test_overlong_text_prompt_is_refused_without_tokenising_it_all(engine):
    """A huge text prompt is measured on a bounded prefix (the whole text took ~4 µs per character
    to tokenise here, holding the interpreter)."""
    text = "hello world " * 200_000   # 2.4 MB

    async def checks(c, _):
        t0 = time.perf_counter()
        r = await c.post("/v1/completions", json={"prompt": text, "max_tokens": 1})
        return r, time.perf_counter() - t0, await c.post("/v1/completions", json=GOOD)

    r, dt, good = _serve(engine, checks, max_request_body_bytes=8 << 20)
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded", r.text
    assert dt < 5.0, dt
    assert len(_ids(good)) == 6


def test_metrics_label_unknown_paths_as_one_value(engine):
    """Random 404 paths do not grow /metrics."""
    async def checks(c, _):
        for i in range(40):
            assert (await c.get(f"/random/{i}/x{i}")).status_code == 404
        await c.post("/v1/completions", json=GOOD)
        return (await c.get("/metrics")).text

    text = _serve(engine, checks)
    lines = [ln for ln in text.splitlines() if ln.startswith("splash_requests_total")]
    assert 'splash_requests_total{endpoint="other",status="404"} 40.0' in lines
    assert any('endpoint="/v1/completions"' in ln for ln in lines) and "random" not in text


def test_health_reports_a_stalled_step_and_drain_refuses_new_requests(engine):
    """Items 4 and 6: /health is 503 'stalled' while a step runs past the limit; a draining loop answers 503."""
    async def checks(c, loop):
        ok = await c.get("/health")
        loop.step_started = time.monotonic() - 100.0     # as if the step in flight had run 100 s
        stalled = await c.get("/health")
        loop.step_started = None
        loop.begin_drain()
        refused = await c.post("/v1/completions", json=GOOD)
        return ok, stalled, refused

    ok, stalled, refused = _serve(engine, checks, collective_timeout_s=60.0)
    assert ok.status_code == 200 and ok.json()["status"] == "ok"
    assert stalled.status_code == 503 and stalled.json()["status"] == "stalled"
    assert stalled.json()["step_running_s"] >= 100
    assert refused.status_code == 503 and refused.headers["retry-after"]


def test_a_request_waiting_for_its_grammar_is_refused_once_the_loop_drains(engine, monkeypatch):
    """The app hands the grammar compiler the loop's drain state: a request whose compile is still running when
    the stop signal comes is answered 503 within a poll, not after its compile (which would outlive the drain)."""
    from splash.server.structured import GrammarCompiler
    monkeypatch.setattr(GrammarCompiler, "compile_sync", lambda self, spec: time.sleep(8.0))

    async def checks(c, loop):
        asyncio.get_running_loop().call_later(0.3, loop.begin_drain)
        t0 = time.monotonic()
        r = await c.post("/v1/completions", json={**GOOD, "structured_outputs": {"regex": "a+"}})
        return r, time.monotonic() - t0

    refused, waited = _serve(engine, checks)
    assert refused.status_code == 503, refused.text
    assert refused.json()["error"]["type"] == "service_unavailable"
    assert waited < 4.0, waited


def test_empty_bearer_token_never_matches():
    """An empty configured token never matches, not even 'Authorization: Bearer ' (empty)."""
    state = ServerState(loop=EngineLoop.__new__(EngineLoop), tokenizer=TOK, metrics=None, model_name="m",
                        max_model_len=8, vocab_size=320, host="0.0.0.0", admin_token="")
    for header in ("Bearer ", "Bearer", "", None):
        with pytest.raises(APIError) as e:
            check_admin(state, header)
        assert e.value.status in (401, 403)
    state.admin_token = "s3cret"
    check_admin(state, "Bearer s3cret")
    with pytest.raises(APIError):
        check_admin(state, "Bearer ")


def test_engine_loop_refuses_adds_while_draining(engine):
    loop = EngineLoop(engine, lambda fn: fn()).start()
    try:
        loop.begin_drain()
        with pytest.raises(EngineStopped):
            loop.add([EngineRequest("r", (1, 2), SamplingParams())], lambda items: None)
        assert loop.outstanding == 0
    finally:
        loop.stop(5)


def test_repeated_log_lines_are_rate_limited():
    """A deferred pin retried every step is logged rate-limited (not ~19 warnings a second)."""
    import logging

    from splash.server.http import RateLimitFilter

    flt = RateLimitFilter(burst=3, window_s=0.2)

    def rec(i):
        return logging.LogRecord("splash.switch", logging.WARNING, __file__, 1,
                                 "switch %s -> %s deferred: %s", ("tp", "dp_attn", f"needs {i} blocks"), None)

    passed = [flt.filter(rec(i)) for i in range(100)]
    assert sum(passed) == 3
    time.sleep(0.25)
    r = rec(101)
    assert flt.filter(r) and "97 similar message(s) suppressed" in r.getMessage()
