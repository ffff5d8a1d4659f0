"""vLLM's --api-key: with server.api_key set, every /v1 route (and an admin route no admin token guards) answers
401 to a request without 'Authorization: Bearer <key>', before its body is read; /health and /metrics stay open."""
from __future__ import annotations

import asyncio

import httpx
import pytest

from splash.config.serve_config import ServerSection
from splash.server.app import ServerState, create_app
from splash.server.engine_loop import EngineLoop
from splash.server.metrics import Metrics
from splash.tokenizer import load_tokenizer

TOK = load_tokenizer(None, 320)
KEY, ADMIN = "k-123", "adm-456"
GOOD = {"prompt": [1, 2, 3], "max_tokens": 4, "temperature": 0, "return_token_ids": True}


@pytest.fixture(scope="module")
def engine():
    from splash.distributed import SingleRankCommunicator
    from splash.engine.llm import LLM
    return LLM(preset="tiny-mla", comm=SingleRankCommunicator(), num_kv_blocks=64).engine


def _serve(engine, checks, **state_kw):
    async def main():
        aio = asyncio.get_running_loop()
        holder = {}
        metrics = Metrics(lambda: holder["loop"].snapshot)
        loop = holder["loop"] = EngineLoop(engine, aio.call_soon_threadsafe, metrics)
        state = ServerState(loop=loop, tokenizer=TOK, metrics=metrics, model_name="tiny-mla", max_model_len=512,
                            vocab_size=320, limits=ServerSection(), **state_kw)
        loop.start()
        try:
            transport = httpx.ASGITransport(app=create_app(state))
            async with httpx.AsyncClient(transport=transport, base_url="http://t", timeout=60) as c:
                return await checks(c)
        finally:
            await asyncio.to_thread(loop.stop)
    return asyncio.run(main())


def _bearer(key: str) -> dict:
    return {"Authorization": f"Bearer {key}"}


def _refused(r: httpx.Response, code: str = "invalid_api_key") -> bool:
    return r.status_code == 401 and r.json()["error"]["code"] == code


def test_every_v1_route_needs_the_key_and_health_and_metrics_do_not(engine):
    async def checks(c):
        for method, path, body in (("POST", "/v1/completions", GOOD), ("GET", "/v1/models", None),
                                   ("GET", "/v1/layout", None), ("GET", "/v1/no-such-route", None),
                                   ("POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]})):
            for headers in ({}, _bearer("wrong"), _bearer(""), {"Authorization": KEY}, {"Authorization": f"Basic {KEY}"}):
                r = await c.request(method, path, json=body, headers=headers)
                assert _refused(r), (method, path, headers, r.status_code, r.text)
                assert r.headers["www-authenticate"] == "Bearer"
        # refused before the body is read: a body that is not JSON is still a 401, not a 400 / 415
        r = await c.post("/v1/completions", content=b"{not json", headers={"Content-Type": "application/json"})
        assert _refused(r)
        ok = await c.post("/v1/completions", json=GOOD, headers=_bearer(KEY))
        assert ok.status_code == 200 and len(ok.json()["choices"][0]["token_ids"]) == 4, ok.text
        assert (await c.get("/v1/models", headers=_bearer(KEY))).status_code == 200
        assert (await c.get("/health")).status_code == 200
        metrics = (await c.get("/metrics")).text
        return metrics

    metrics = _serve(engine, checks, api_key=KEY)
    assert 'splash_requests_total{endpoint="/v1/completions",status="401"} 6.0' in metrics, metrics


def test_without_a_key_nothing_is_asked(engine):
    async def checks(c):
        return (await c.post("/v1/completions", json=GOOD)).status_code, (await c.get("/v1/models")).status_code
    assert _serve(engine, checks) == (200, 200)


def test_admin_routes_take_the_admin_token_where_one_is_required_else_the_key(engine):
    async def loopback_no_token(c):
        layout = {"layout": "tp"}
        return [_refused(await c.post("/v1/layout", json=layout)),
                _refused(await c.post("/reset_prefix_cache")),
                (await c.post("/v1/layout", json=layout, headers=_bearer(KEY))).status_code,
                (await c.post("/reset_prefix_cache", headers=_bearer(KEY))).status_code]
    assert _serve(engine, loopback_no_token, api_key=KEY) == [True, True, 200, 200]

    async def with_admin_token(c):   # one Authorization header: the admin route asks for the admin token only
        layout = {"layout": "tp"}
        return [(await c.post("/v1/layout", json=layout, headers=_bearer(ADMIN))).status_code,
                _refused(await c.post("/v1/layout", json=layout, headers=_bearer(KEY)), "invalid_token"),
                (await c.post("/reset_prefix_cache", headers=_bearer(ADMIN))).status_code,
                _refused(await c.get("/v1/layout", headers=_bearer(ADMIN)))]
    assert _serve(engine, with_admin_token, api_key=KEY, admin_token=ADMIN) == [200, True, 200, True]
