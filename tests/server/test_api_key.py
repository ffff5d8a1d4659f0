"""vLLM's --api-key, in process on one rank.

With server.api_key set, every route but /health, /metrics and /version answers 401 to a request without
'Authorization: Bearer <key>', before its body is read; an admin route takes the admin token where one is required.
"""
from __future__ import annotations

from server_util import in_process

KEY, ADMIN = "k-123", "adm-456"
GOOD = {"prompt": [1, 2, 3], "max_tokens": 4, "temperature": 0, "return_token_ids": True}
CHAT = [{"role": "system", "content": "be brief"}, {"role": "user", "content": [{"type": "text", "text": "hi"}]}]


def _serve(engine, checks, **state_kw):
    return in_process(engine, lambda c, _: checks(c), **state_kw)


def _bearer(key: str) -> dict:
    return {"Authorization": f"Bearer {key}"}


def _refused(r, code: str = "invalid_api_key") -> bool:
    return r.status_code == 401 and r.json()["error"]["code"] == code


def test_every_route_needs_the_key_but_health_metrics_and_version(engine):
    async def checks(c):
        for method, path, body in (("POST", "/v1/completions", GOOD), ("GET", "/v1/models", None),
                                   ("GET", "/v1/layout", None), ("GET", "/v1/no-such-route", None),
                                   ("POST", "/tokenize", {"prompt": "hi"}), ("POST", "/detokenize", {"tokens": [1]}),
                                   ("POST", "/v1/chat/completions", {"messages": CHAT})):
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
        assert (await c.post("/tokenize", json={"prompt": "hi"}, headers=_bearer(KEY))).status_code == 200
        for path in ("/health", "/version"):
            assert (await c.get(path)).status_code == 200
        return (await c.get("/metrics")).text

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
