"""The real server under ``mpiexec -n 2`` on a tiny checkpoint, driven by the official ``openai`` client.

One server for the whole module (started once, ~4 s); greedy outputs are compared token for token with the
offline ``LLM.generate`` on the same checkpoint (one process). The last test stops the server with SIGTERM
and checks that every rank exits 0.
"""
from __future__ import annotations

import json
import signal
import threading
import time

import httpx
import pytest
from server_util import mpiexec_path, offline_reference, run_server, save_preset

openai = pytest.importorskip("openai")
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from splash.tokenizer import load_tokenizer  # noqa: E402

pytestmark = pytest.mark.skipif(mpiexec_path() is None, reason="mpiexec not found")
TOKEN = "s3cret-admin"
MODEL = "tiny-mla"
PROMPTS = [[1, 2, 3, 4, 5], [72, 101, 108, 108, 111], [10, 20, 30], [200, 100, 50, 25, 12, 6, 3], [7] * 12,
           [65, 66, 67, 68], [255, 254], [99, 98, 97, 96, 95, 94]]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return save_preset("tiny-mla", tmp_path_factory.mktemp("ckpt") / MODEL)


@pytest.fixture(scope="module")
def server(ckpt, tmp_path_factory):
    yield from run_server(tmp_path_factory.mktemp("server"), f"""
model: {{model: {ckpt}}}
cache: {{kv_cache_memory_bytes: 8MiB}}
server: {{port: 0, quiet: true, admin_token: {TOKEN}}}
""")


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def offline(ckpt):
    return offline_reference(ckpt)


@pytest.fixture(scope="module")
def tok(ckpt):
    return load_tokenizer(ckpt, 320)


def _ids(choice) -> list[int]:
    return choice.model_extra["token_ids"]


def test_models_and_health(server, client):
    assert [m.id for m in client.models.list().data] == [MODEL]
    h = httpx.get(f"{server.url}/health").json()
    assert h["status"] == "ok" and h["world_size"] == 2


def test_completion_token_ids_match_offline(client, offline):
    r = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=12, temperature=0,
                                  extra_body={"return_token_ids": True})
    ch = r.choices[0]
    assert _ids(ch) == offline(PROMPTS[0], 12)
    assert ch.finish_reason in ("length", "stop") and r.usage.completion_tokens == len(_ids(ch))
    assert r.usage.prompt_tokens == len(PROMPTS[0])


def test_text_prompt_and_text(client, offline, tok):
    r = client.completions.create(model=MODEL, prompt="Hello, SPLASH", max_tokens=10, temperature=0,
                                  extra_body={"return_token_ids": True})
    want = offline(tok.encode("Hello, SPLASH", add_special_tokens=True), 10)
    assert _ids(r.choices[0]) == want
    assert r.choices[0].text == tok.decode(want)


def test_chat_matches_offline(client, offline, tok):
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi there"}]
    r = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=9, temperature=0,
                                       extra_body={"return_token_ids": True})
    prompt = tok.encode(tok.apply_chat_template(msgs), add_special_tokens=False)
    want = offline(prompt, 9)
    assert _ids(r.choices[0]) == want
    assert r.choices[0].message.role == "assistant" and r.choices[0].message.content == tok.decode(want)
    assert r.object == "chat.completion"


def test_streaming_completion(client, offline, tok):
    stream = client.completions.create(model=MODEL, prompt=PROMPTS[1], max_tokens=20, temperature=0, stream=True,
                                       extra_body={"return_token_ids": True})
    text, ids, finish = "", [], None
    for chunk in stream:
        for ch in chunk.choices:
            text += ch.text
            ids += _ids(ch)
            finish = ch.finish_reason or finish
    want = offline(PROMPTS[1], 20)
    assert ids == want and text == tok.decode(want) and finish in ("length", "stop")


def test_streaming_chat(client, offline, tok):
    msgs = [{"role": "user", "content": "stream please"}]
    stream = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=15, temperature=0, stream=True,
                                            stream_options={"include_usage": True})
    text, roles, finish, usage = "", [], None, None
    for chunk in stream:
        usage = chunk.usage or usage
        for ch in chunk.choices:
            roles += [ch.delta.role] if ch.delta.role else []
            text += ch.delta.content or ""
            finish = ch.finish_reason or finish
    want = offline(tok.encode(tok.apply_chat_template(msgs), add_special_tokens=False), 15)
    assert roles == ["assistant"] and text == tok.decode(want) and finish in ("length", "stop")
    assert usage is not None and usage.completion_tokens == len(want)


def test_raw_sse_framing(server):
    with httpx.stream("POST", f"{server.url}/v1/completions", timeout=30,
                      json={"prompt": PROMPTS[2], "max_tokens": 4, "temperature": 0, "stream": True}) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        lines = [ln for ln in r.iter_lines() if ln]
    assert all(ln.startswith("data: ") for ln in lines) and lines[-1] == "data: [DONE]"
    assert json.loads(lines[0][6:])["object"] == "text_completion"


def test_n_choices(client, offline):
    r = client.completions.create(model=MODEL, prompt=PROMPTS[3], max_tokens=8, temperature=0, n=2,
                                  extra_body={"return_token_ids": True})
    assert sorted(c.index for c in r.choices) == [0, 1]
    assert all(_ids(c) == offline(PROMPTS[3], 8) for c in r.choices)
    r = client.completions.create(model=MODEL, prompt=PROMPTS[3], max_tokens=8, temperature=1.0, top_p=0.9, n=3,
                                  seed=7, extra_body={"return_token_ids": True})
    assert sorted(c.index for c in r.choices) == [0, 1, 2] and all(len(_ids(c)) >= 1 for c in r.choices)


def test_seeded_sampling_is_reproducible(client):
    kw = dict(model=MODEL, prompt=PROMPTS[4], max_tokens=10, temperature=0.8, seed=1234,
              extra_body={"return_token_ids": True})
    a, b = (client.completions.create(**kw) for _ in range(2))
    assert _ids(a.choices[0]) == _ids(b.choices[0])


def test_concurrent_requests(client, offline):
    """Mixed streaming / non-streaming requests from 16 threads, batched together by the engine."""
    n_threads, mt = 16, 24
    prompts = [PROMPTS[i % len(PROMPTS)] + [i] for i in range(n_threads)]
    want = offline.many(prompts, mt)
    got: dict[int, list[int]] = {}
    errors: list[BaseException] = []

    def run(i: int) -> None:
        try:
            kw = dict(model=MODEL, prompt=prompts[i], max_tokens=mt, temperature=0,
                      extra_body={"return_token_ids": True})
            if i % 2:
                got[i] = [t for c in client.completions.create(stream=True, **kw) for ch in c.choices
                          for t in _ids(ch)]
            else:
                got[i] = _ids(client.completions.create(**kw).choices[0])
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(n_threads)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors
    assert [got[i] for i in range(n_threads)] == want


def test_stop_strings_and_stop_token_ids(client, offline, tok):
    want = offline(PROMPTS[5], 24)
    text = tok.decode(want)
    stop = next((ch for ch in text[1:] if ch.isascii() and ch.isprintable()), None)
    if stop is not None:
        r = client.completions.create(model=MODEL, prompt=PROMPTS[5], max_tokens=24, temperature=0, stop=[stop])
        assert r.choices[0].text == text[:text.index(stop)] and r.choices[0].finish_reason == "stop"
    k = 3
    first = want.index(want[k])
    r = client.completions.create(model=MODEL, prompt=PROMPTS[5], max_tokens=24, temperature=0,
                                  extra_body={"stop_token_ids": [want[k]], "return_token_ids": True})
    assert _ids(r.choices[0]) == want[:first + 1] and r.choices[0].finish_reason == "stop"


BAD = [
    ("/v1/completions", b"{not json", 400, "malformed JSON"),
    ("/v1/completions", {"prompt": "x", "max_tokens": "8"}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "x", "temperature": "hot"}, 400, "temperature"),
    ("/v1/completions", {"prompt": "x", "bogus_field": 1}, 400, "bogus_field"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 0}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "x", "max_tokens": -3}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": [1] * 5000, "max_tokens": 4}, 400, "max_model_len"),
    ("/v1/completions", {"prompt": [1, 99999]}, 400, "vocabulary"),
    ("/v1/completions", {"prompt": ""}, 400, "empty"),
    ("/v1/completions", {"max_tokens": 4}, 400, "prompt"),
    ("/v1/completions", {"prompt": "x", "n": 0}, 400, "n"),
    ("/v1/completions", {"prompt": "x", "model": "gpt-4"}, 404, "does not exist"),
    ("/v1/chat/completions", {"messages": []}, 400, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "x"}]}, 400, "role"),
    ("/v1/chat/completions", [1, 2], 400, "JSON object"),
    ("/v1/nope", {}, 404, "Not Found"),
]


@pytest.mark.parametrize("path,body,status,needle", BAD, ids=[f"{p}-{n}" for p, _, _, n in BAD])
def test_bad_input_gets_4xx(server, path, body, status, needle):
    kw = {"content": body} if isinstance(body, bytes) else {"json": body}
    r = httpx.post(f"{server.url}{path}", timeout=10, **kw)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and needle in err["message"] + str(err["param"])


def test_openai_client_raises_bad_request(client):
    with pytest.raises(openai.BadRequestError, match="max_tokens"):
        client.completions.create(model=MODEL, prompt="x", max_tokens=0)
    with pytest.raises(openai.BadRequestError, match="max_model_len"):
        client.completions.create(model=MODEL, prompt=[5] * 4096, max_tokens=1)


def test_layout_endpoints_and_auth(server):
    url = f"{server.url}/v1/layout"
    g = httpx.get(url).json()
    assert g["layout"] in g["allowed_layouts"] and g["mode"] in ("auto", "pinned") and g["switch_count"] >= 0
    assert httpx.post(url, json={"layout": "dop"}).status_code == 401
    assert httpx.post(url, json={"layout": "dop"}, headers={"Authorization": "Bearer wrong"}).status_code == 401
    auth = {"Authorization": f"Bearer {TOKEN}"}
    bad = httpx.post(url, json={"layout": "zigzag"}, headers=auth)
    assert bad.status_code == 400 and "zigzag" in bad.json()["error"]["message"]
    assert httpx.post(url, json={"layout": 3}, headers=auth).status_code == 400
    ok = httpx.post(url, json={"layout": g["layout"]}, headers=auth)
    assert ok.status_code == 200, ok.text


def test_client_disconnect_aborts_request(server):
    with httpx.stream("POST", f"{server.url}/v1/completions", timeout=30,
                      json={"prompt": PROMPTS[6], "max_tokens": 3000, "stream": True, "ignore_eos": True}) as r:
        for i, _ in enumerate(r.iter_lines()):
            if i > 5:
                break
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        running = _metric(server, "splash_requests_running")
        if running == 0:
            break
        time.sleep(0.1)
    assert running == 0


def _metric(server, name: str, **labels) -> float:
    """The value of the sample called ``name`` (e.g. 'x_total', 'x_count') with these labels."""
    for fam in text_string_to_metric_families(httpx.get(f"{server.url}/metrics").text):
        for s in fam.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                return s.value
    raise KeyError((name, labels))


def test_metrics_parse(server, client):
    client.completions.create(model=MODEL, prompt=PROMPTS[7], max_tokens=5, temperature=0)
    fams = {f.name: f for f in text_string_to_metric_families(httpx.get(f"{server.url}/metrics").text)}
    for name in ("splash_current_layout", "splash_layout_switches", "splash_kv_capacity_tokens",
                 "splash_kv_used_tokens", "splash_requests_running", "splash_requests_waiting",
                 "splash_generated_tokens", "splash_step_duration_seconds"):
        assert name in fams, name
    layout = httpx.get(f"{server.url}/v1/layout").json()["layout"]
    assert _metric(server, "splash_current_layout", layout=layout) == 1.0
    assert sum(s.value for s in fams["splash_current_layout"].samples) == 1.0
    assert _metric(server, "splash_generated_tokens_total") >= 5
    assert _metric(server, "splash_kv_capacity_tokens", layout="tp") > 0
    assert _metric(server, "splash_step_duration_seconds_count") > 0
    assert fams["splash_step_duration_seconds"].type == "histogram"


def test_prefix_cache_usage_metrics_and_reset(server, client, offline):
    """A prompt sent again finds its full blocks cached (usage.prompt_tokens_details.cached_tokens, the prefix-cache
    counters) and gives the same tokens; POST /reset_prefix_cache needs the admin token and empties the cache of the
    blocks no request uses, after which the same prompt finds nothing."""
    prompt = list(range(30, 80))                       # 50 tokens: 3 full 16-token blocks before the last token
    ids = {"return_token_ids": True}
    first = client.completions.create(model=MODEL, prompt=prompt, max_tokens=4, temperature=0, extra_body=ids)
    hits0 = _metric(server, "splash_prefix_cache_hits_total")
    again = client.completions.create(model=MODEL, prompt=prompt, max_tokens=4, temperature=0, extra_body=ids)
    assert again.usage.prompt_tokens_details.cached_tokens == 48, again.usage
    assert _ids(again.choices[0]) == _ids(first.choices[0]) == offline(prompt, 4)
    assert _metric(server, "splash_prefix_cache_hits_total") == hits0 + 48
    assert _metric(server, "splash_prefix_cache_queries_total") >= 100
    assert sum(_metric(server, "splash_prefix_cache_blocks", rank=str(r)) for r in range(2)) > 0
    url = f"{server.url}/reset_prefix_cache"
    assert httpx.post(url).status_code == 401
    ok = httpx.post(url, headers={"Authorization": f"Bearer {TOKEN}"})
    assert ok.status_code == 200 and ok.json()["evicted_blocks"] > 0, ok.text
    cold = client.completions.create(model=MODEL, prompt=prompt, max_tokens=4, temperature=0, extra_body=ids)
    assert cold.usage.prompt_tokens_details.cached_tokens == 0 and _ids(cold.choices[0]) == _ids(first.choices[0])


def test_sigterm_stops_every_rank_with_0(server):
    """Last: SIGTERM to the process group (what a terminal's Ctrl-C or a supervisor sends)."""
    assert server.stop(signal.SIGTERM, timeout=30) == 0, server.output()
    assert "stopped" in server.output()

