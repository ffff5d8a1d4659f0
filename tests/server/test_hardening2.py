"""Request hardening without MPI: the real app, engine thread and uvicorn (with splash's h11 protocol) on one
rank in process, on a loopback socket, so keep-alive connections and idle sockets are the real thing.

Each check sends what a hostile client sends and asserts the answer for it alone: a 400 naming the field, a
connection that survives, a counted status, a bounded message.
"""
from __future__ import annotations

import asyncio
import json
import socket
import threading
import time

import httpx
import pytest
import uvicorn

from splash.config.serve_config import ServerSection
from splash.server.app import ServerState, create_app
from splash.server.engine_loop import EngineLoop
from splash.server.http import protocol_class
from splash.server.metrics import Metrics
from splash.tokenizer import Tokenizer, build_byte_tokenizer, load_tokenizer

TOK = load_tokenizer(None, 320)
GOOD = {"prompt": [1, 2, 3], "max_tokens": 6, "temperature": 0, "return_token_ids": True}
CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "temperature": 0}


@pytest.fixture(scope="module")
def engine():
    from splash.distributed import SingleRankCommunicator
    from splash.engine.llm import LLM
    return LLM(preset="tiny-mla", comm=SingleRankCommunicator(), num_kv_blocks=64).engine


def _http(engine, checks, read_timeout_s: float = 30.0, tokenizer=TOK, send_buffer: int | None = None, **limits):
    """Run ``checks(url, state)`` (async) against uvicorn serving a fresh app on ``engine``; returns its result."""
    async def main():
        aio = asyncio.get_running_loop()
        holder = {}
        metrics = Metrics(lambda: holder["loop"].snapshot)
        loop = holder["loop"] = EngineLoop(engine, aio.call_soon_threadsafe, metrics)
        state = ServerState(loop=loop, tokenizer=tokenizer, metrics=metrics, model_name="tiny-mla", max_model_len=512,
                            vocab_size=320, limits=ServerSection(read_timeout_s=read_timeout_s, **limits))
        sock = socket.create_server(("127.0.0.1", 0))
        if send_buffer is not None:   # accepted connections inherit it
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, send_buffer)
        config = uvicorn.Config(create_app(state), log_level="warning", access_log=False, lifespan="off",
                                ws="none", http=protocol_class(32 * 1024, read_timeout_s, metrics.count_unrouted))
        server = uvicorn.Server(config)
        loop.start()
        task = asyncio.ensure_future(server.serve(sockets=[sock]))
        while not server.started:
            await asyncio.sleep(0.01)
        try:
            return await checks(f"http://127.0.0.1:{sock.getsockname()[1]}", state)
        finally:
            server.should_exit = True
            await task
            await asyncio.to_thread(loop.stop)
            sock.close()
            assert loop.error is None, loop.error
    return asyncio.run(main())


def _request(method: str, path: str, body: dict | bytes | None = None) -> bytes:
    raw = body if isinstance(body, bytes) else (json.dumps(body).encode() if body is not None else b"")
    head = f"{method} {path} HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\nContent-Length: {len(raw)}\r\n"
    return head.encode() + b"\r\n" + raw


async def _exchange(url: str, requests: list[bytes]) -> list[tuple[int, bytes]]:
    """Send `requests` one after another on ONE connection; (status, body) of each answer (an answer missing:
    the server closed the connection)."""
    host, port = url.rsplit("/", 1)[-1].split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    out = []
    try:
        for req in requests:
            writer.write(req)
            await writer.drain()
            line = await asyncio.wait_for(reader.readline(), 30)
            if not line:
                break
            headers = {}
            while (h := await reader.readline()) not in (b"\r\n", b""):
                k, _, v = h.decode().partition(":")
                headers[k.strip().lower()] = v.strip()
            if headers.get("transfer-encoding") == "chunked":
                body = b""
                while size := int((await reader.readline()).strip(), 16):
                    body += await reader.readexactly(size)
                    await reader.readline()
                await reader.readline()
            else:
                body = await reader.readexactly(int(headers.get("content-length", 0)))
            out.append((int(line.split()[1]), body))
    finally:
        writer.close()
    return out


async def _post(url: str, path: str, body) -> httpx.Response:
    async with httpx.AsyncClient(base_url=url, timeout=60) as c:
        return await c.post(path, json=body)


# ---- bad values are 400s naming the field --------------------------------------------------------------------
SURROGATE = '"He\\udc00llo"'   # as JSON text: the escape decodes to a lone surrogate
BAD_BODIES = [   # (path, raw JSON body, the field the 400 must name)
    ("/v1/completions", f'{{"prompt": {SURROGATE}, "max_tokens": 2}}', "prompt"),
    ("/v1/completions", f'{{"prompt": ["ok", {SURROGATE}], "max_tokens": 2}}', "prompt.1"),
    ("/v1/chat/completions", f'{{"messages": [{{"role": "user", "content": {SURROGATE}}}]}}', "messages.0.content"),
    ("/v1/chat/completions",
     f'{{"messages": [{{"role": "user", "content": [{{"type": "text", "text": {SURROGATE}}}]}}]}}',
     "messages.0.content.0.text"),
    ("/v1/completions", f'{{"prompt": [1], "stop": [{SURROGATE}]}}', "stop.0"),
    ("/v1/completions", '{"prompt": [1], "max_tokens": 2, "logit_bias": {"\\ud800": 1}}', "logit_bias.\\ud800"),
    ("/v1/completions", '{"prompt": [1], "max_tokens": ' + "9" * 5000 + "}", "max_tokens"),
    ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "x"}], "seed": -' + "1" * 5000 + "}", "seed"),
    ("/v1/completions", '{"prompt": [1], "top_k": 9223372036854775808}', "top_k"),
    ("/v1/completions", '{"prompt": [1], "max_tokens": 2, "stop_token_ids": [18446744073709551616]}',
     "stop_token_ids.0"),
    ("/v1/completions", '{"prompt": [1], "min_tokens": 9223372036854775808}', "min_tokens"),
    ("/v1/completions", '{"prompt": [1], "top_p": 1e-46}', "top_p"),
    ("/v1/completions", '{"prompt": [1], "min_p": 1e-40}', "min_p"),
    ("/v1/completions", '{"prompt": [1], "presence_penalty": -1e-45}', "presence_penalty"),
    ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "x"}], "frequency_penalty": 1e-300}',
     "frequency_penalty"),
    ("/v1/completions", '{"prompt": [1], "repetition_penalty": 1e-39}', "repetition_penalty"),
    ("/v1/completions", '{"prompt": [1], "temperature": 1e400}', "temperature"),
]


def test_unusable_values_are_400s_naming_the_field(engine):
    """Values nothing can use are 400s naming the field, never 500s or garbage: lone surrogates (the tokenizer
    cannot take them), 5,000-digit integers (past the int-parsing limit), top_k >= 2**63 (overflows the sampler),
    float32-underflowing top_p and repetition_penalty (every token masked; NaN logprobs)."""
    async def checks(url, _):
        reqs = [_request("POST", path, body.encode()) for path, body, _ in BAD_BODIES]
        answers = await _exchange(url, reqs + [_request("POST", "/v1/completions", GOOD)])
        tiny_t = await _post(url, "/v1/completions", {**GOOD, "temperature": 1e-46})
        return answers, tiny_t

    answers, tiny_t = _http(engine, checks)
    assert len(answers) == len(BAD_BODIES) + 1, "the keep-alive connection was closed"
    for (path, body, field), (status, raw) in zip(BAD_BODIES, answers):
        err = json.loads(raw)["error"]
        assert status == 400 and err["param"] == field, (path, body[:80], status, err)
        assert field.split(".")[0] in err["message"] and len(err["message"]) < 400, err
    assert answers[-1][0] == 200 and len(json.loads(answers[-1][1])["choices"][0]["token_ids"]) == 6
    # a temperature below 1e-5 samples greedily (as vLLM): it never reaches float32
    assert tiny_t.status_code == 200 and tiny_t.json()["choices"][0]["token_ids"] == json.loads(
        answers[-1][1])["choices"][0]["token_ids"]


def test_error_messages_quote_a_bounded_prefix(engine):
    """An error message quotes a bounded prefix of a 100,000-character input, not the whole of it."""
    big = "z" * 100_000
    bodies = [("/v1/completions", {"prompt": [1], "model": big}), ("/v1/completions", {"prompt": [1], "n": big}),
              ("/v1/completions", {"prompt": [1], big: 1}),
              ("/v1/completions", {"prompt": [1], "logit_bias": {big: 1}}),
              ("/v1/completions", {"prompt": [1], "logit_bias": {"9" * 4000: 1}}),
              ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": big}]}]}),
              ("/v1/layout", {"layout": big})]

    async def checks(url, _):
        return await _exchange(url, [_request("POST", p, b) for p, b in bodies])

    answers = _http(engine, checks)
    assert len(answers) == len(bodies)
    for (path, _), (status, raw) in zip(bodies, answers):
        assert 400 <= status < 500 and len(raw) < 1500, (path, status, len(raw))


def test_internal_errors_are_counted_and_keep_the_connection(engine, monkeypatch):
    """A server fault (the generic 500 path) leaves the keep-alive connection usable for the next request, writes
    no traceback and is counted in splash_requests_total (both endpoints)."""
    from splash.server.prompts import PromptReader

    async def broken(self, *_):
        raise RuntimeError("injected failure")

    monkeypatch.setattr(PromptReader, "completion", broken)
    monkeypatch.setattr(PromptReader, "chat", broken)

    async def checks(url, _):
        answers = await _exchange(url, [_request("POST", "/v1/completions", GOOD),
                                        _request("POST", "/v1/chat/completions", CHAT),
                                        _request("POST", "/v1/completions", {"prompt": [1], "n": 0}),
                                        _request("GET", "/health")])
        garbage = [s for s, _ in await _exchange(url, [b"NOT HTTP AT ALL\r\n\r\n"])]
        async with httpx.AsyncClient(base_url=url) as c:
            return answers, (await c.get("/metrics")).text, garbage

    answers, metrics, garbage = _http(engine, checks)
    assert [s for s, _ in answers] == [500, 500, 400, 200], answers
    assert garbage == [400]   # uvicorn's own answer to what h11 cannot parse: counted as well
    assert json.loads(answers[0][1])["error"]["type"] == "internal_error"
    for line in ('endpoint="/v1/completions",status="500"} 1.0', 'endpoint="/v1/chat/completions",status="500"} 1.0',
                 'endpoint="/v1/completions",status="400"} 1.0', 'endpoint="/health",status="200"} 1.0',
                 'endpoint="other",status="400"} 1.0'):
        assert line in metrics, line


def test_stop_ids_covering_the_vocabulary_honour_min_tokens(engine):
    """min_tokens holds when stop_token_ids cover the whole vocabulary."""
    body = {**GOOD, "stop_token_ids": list(range(320)), "min_tokens": 2, "max_tokens": 5}

    async def checks(url, _):
        return await asyncio.gather(_post(url, "/v1/completions", body),
                                    _post(url, "/v1/completions", {**body, "temperature": 0.8, "seed": 3}))

    for r in checks_result if (checks_result := _http(engine, checks)) else ():
        choice = r.json()["choices"][0]
        assert r.status_code == 200 and len(choice["token_ids"]) == 3 and choice["finish_reason"] == "stop", r.text


# ---- idle connections -------------------------------------------------------------------------------------
def _fd_count() -> int:
    import os
    return len(os.listdir("/proc/self/fd"))


def idle_socket_count(want: int) -> int:
    """`want`, or fewer when this process may not open that many descriptors (raised to the hard limit)."""
    import resource
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < want + 200 and hard > soft:
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, want + 200), hard))
        soft = min(hard, want + 200)
    return max(0, min(want, (soft - 200) // 2))   # in process, each socket is two descriptors


def test_idle_connections_close_after_the_read_timeout(engine):
    """A connection that never sends a byte gets a 408 and is closed server.read_timeout_s after its accept
    (else enough of them exhaust the descriptors and block accept()); the server serves meanwhile, and its
    descriptors come back."""
    n = idle_socket_count(1000)
    assert n >= 200

    async def checks(url, _):
        base = _fd_count()
        host, port = url.rsplit("/", 1)[-1].split(":")
        conns = [await asyncio.open_connection(host, int(port)) for _ in range(n)]
        t_open = time.monotonic()
        health = await _exchange(url, [_request("GET", "/health")])
        served = await _post(url, "/v1/completions", GOOD)
        answers = await asyncio.gather(*(asyncio.wait_for(r.read(), 20) for r, _ in conns))
        waited = time.monotonic() - t_open
        for _, w in conns:
            w.close()
        await asyncio.sleep(0.2)
        async with httpx.AsyncClient(base_url=url) as c:
            metrics = (await c.get("/metrics")).text
        return base, health, served, answers, waited, _fd_count(), metrics

    base, health, served, answers, waited, after, metrics = _http(engine, checks, read_timeout_s=1.0)
    assert f'splash_requests_total{{endpoint="other",status="408"}} {float(n)}' in metrics   # counted too
    assert health[0][0] == 200 and served.status_code == 200
    assert all(a.startswith(b"HTTP/1.1 408 ") and b"server.read_timeout_s" in a for a in answers), answers[:2]
    assert waited < 10, waited
    assert after <= base + 2, (base, after)


# ---- request cost: bounded before admission, prompt logprobs once per prompt --------------------------------
def test_admission_cost_estimates_are_upper_bounds():
    from splash.server.admission_cost import MB, RequestShape, estimate, over_budget

    plp = estimate(RequestShape((3500,), 16, 1, None, 20))
    # this request's response measured 79.2 MB (docs/benchmarks.md, "Hardening 2: a costly request's price")
    assert 79.2 * 1e6 <= plp.response_bytes <= 1.2 * 79.2 * 1e6
    assert plp.logprob_entries == 3499 * 21 * 16 and plp.driver == "prompt_logprobs"
    chat = estimate(RequestShape((3500,), 16, 1, None, 20, prompt_k_per_choice=False))
    assert chat.logprob_entries == 3499 * 21 and chat.response_bytes < plp.response_bytes / 15
    echo = estimate(RequestShape((3500,), 16, 1, 20, None, echo=True, echo_k=20))
    assert echo.rank0_bytes > 10 * plp.rank0_bytes / 2   # echo entries are per choice, prompt logprobs shared
    msg = over_budget(plp, 64, n=16)
    assert msg and "server.max_request_mb" in msg and "'prompt_logprobs' or 'n'" in msg
    assert over_budget(plp, plp.response_bytes / MB + 1) is None


PLP_PROMPT = list(range(1, 201))


def test_prompt_logprobs_are_computed_once_per_prompt_and_shared(engine, monkeypatch):
    """Prompt logprobs are computed once per prompt (not once per sample, n x the rows), and chat computes one
    copy to return one. Rows counted where the engine computes them."""
    import splash.engine.engine as eng

    rows = []
    real = eng.prompt_logprobs

    def counting(logits, targets, k):
        rows.append(len(targets))
        return real(logits, targets, k)

    monkeypatch.setattr(eng, "prompt_logprobs", counting)
    body = {"prompt": [PLP_PROMPT, PLP_PROMPT[:50]], "n": 4, "max_tokens": 3, "prompt_logprobs": 5,
            "temperature": 0.9, "seed": 1}
    chat = {**CHAT, "n": 3, "prompt_logprobs": 2}

    async def checks(url, _):
        out = {}
        for name, path, b in (("cmpl", "/v1/completions", body), ("chat", "/v1/chat/completions", chat),
                              ("stream", "/v1/completions", {**body, "stream": True}),
                              ("echo", "/v1/completions", {**body, "prompt": PLP_PROMPT, "echo": True,
                                                           "logprobs": 3, "prompt_logprobs": None})):
            rows.clear()
            r = await _post(url, path, b)
            out[name] = (r, sum(rows))
        return out

    out = _http(engine, checks)
    r, n_rows = out["cmpl"]
    choices = r.json()["choices"]
    assert r.status_code == 200 and n_rows == 199 + 49, n_rows        # once per prompt, not n times
    for c in choices:
        group = choices[c["index"] - c["index"] % 4]
        assert c["prompt_logprobs"] == group["prompt_logprobs"] and len(c["prompt_logprobs"]) == (
            200 if c["index"] < 4 else 50)
    r, n_rows = out["chat"]
    assert r.status_code == 200 and len(r.json()["choices"]) == 3 and n_rows == len(r.json()["prompt_logprobs"]) - 1
    r, n_rows = out["stream"]
    firsts = {}
    for line in r.text.splitlines():
        if line.startswith("data: {"):
            for c in json.loads(line[6:])["choices"]:
                firsts.setdefault(c["index"], c)
    assert n_rows == 199 + 49 and sorted(firsts) == list(range(8))
    assert all(len(firsts[i]["prompt_logprobs"]) == (200 if i < 4 else 50) for i in range(8))
    r, n_rows = out["echo"]
    assert n_rows == 199
    for c in r.json()["choices"]:   # each echoed choice carries the prompt's logprobs (null for the first token)
        lp = c["logprobs"]["token_logprobs"]
        assert lp[0] is None and all(v is not None for v in lp[1:]) and len(lp) == 203


def test_request_cost_above_the_budget_is_a_400_naming_it(engine):
    big = {"prompt": PLP_PROMPT, "n": 8, "max_tokens": 1, "prompt_logprobs": 20}

    async def checks(url, _):
        return await asyncio.gather(_post(url, "/v1/completions", big),
                                    _post(url, "/v1/completions", {**big, "prompt_logprobs": 2}),
                                    _post(url, "/v1/chat/completions", {**CHAT, "n": 8, "logprobs": True,
                                                                        "top_logprobs": 20, "max_tokens": 500}))

    over, under, chat = _http(engine, checks, max_request_mb=2.0)
    err = over.json()["error"]
    assert over.status_code == 400 and err["code"] == "request_too_costly" and err["param"] == "prompt_logprobs"
    assert "server.max_request_mb" in err["message"] and "2 MB" in err["message"]
    assert under.status_code == 200 and len(under.content) < 2 << 20 and len(under.json()["choices"]) == 8
    assert chat.status_code == 400 and chat.json()["error"]["param"] == "logprobs", chat.text


def test_stream_options_and_usage_stats(engine):
    """As vLLM: stream_options with stream false is a 400; continuous_usage_stats puts the running usage on every
    chunk; a streamed chat with prompt_logprobs is a 400."""
    opts = {"include_usage": True, "continuous_usage_stats": True}

    async def checks(url, _):
        async with httpx.AsyncClient(base_url=url, timeout=60) as c:
            return await asyncio.gather(
                c.post("/v1/completions", json={**GOOD, "stream_options": {"include_usage": True}}),
                c.post("/v1/chat/completions", json={**CHAT, "stream": False, "stream_options": opts}),
                c.post("/v1/chat/completions", json={**CHAT, "stream": True, "prompt_logprobs": 1}),
                c.post("/v1/completions", json={**GOOD, "stream": True, "stream_options": opts}))

    no_stream, chat_no_stream, chat_plp, cont = _http(engine, checks)
    for r, field in ((no_stream, "stream_options"), (chat_no_stream, "stream_options"),
                     (chat_plp, "prompt_logprobs")):
        assert r.status_code == 400 and r.json()["error"]["param"] == field, r.text
    events = [json.loads(ln[6:]) for ln in cont.text.splitlines() if ln.startswith("data: {")]
    used = [e["usage"]["completion_tokens"] for e in events]
    assert len(events) >= 6 and used == sorted(used) and used[-1] == 6 and used[0] >= 1, used
    assert all(e["usage"]["prompt_tokens"] == 3 for e in events)


def test_chat_message_count_is_bounded_before_validation(engine):
    """Validating and rendering a chat costs time per message, on rank 0 (8 MiB of empty messages: about 1 s of
    validation and, with a model's Jinja template, 3 s of rendering). Each message takes at least one token, so
    max_model_len (512 here) messages or more are refused before any is validated: the 400 names the count, not the
    bad role of the last message. One message fewer is read as usual (its bad role is the error)."""
    many = [{"role": "user", "content": ""}] * 511

    async def checks(url, _):
        return await _exchange(url, [_request("POST", "/v1/chat/completions", {"messages": many + [{"role": "x"}]}),
                                     _request("POST", "/v1/chat/completions", {"messages": many[1:] + [{"role": "x"}]}),
                                     _request("POST", "/v1/chat/completions", CHAT)])

    (s1, r1), (s2, r2), (s3, _) = _http(engine, checks)
    e1, e2 = json.loads(r1)["error"], json.loads(r2)["error"]
    assert s1 == 400 and e1["param"] == "messages" and e1["code"] == "context_length_exceeded", e1
    assert "512 messages" in e1["message"], e1
    assert s2 == 400 and e2["param"] == "messages.510.role", e2
    assert s3 == 200


class _RecordingTokenizer(Tokenizer):
    """The byte tokenizer, noting the thread each chat template render runs on."""

    def __init__(self) -> None:
        super().__init__(build_byte_tokenizer(), bos_token="<|bos|>", eos_token="<|eos|>")
        self.threads: list[threading.Thread] = []

    def apply_chat_template(self, *args, **kwargs) -> str:
        self.threads.append(threading.current_thread())
        return super().apply_chat_template(*args, **kwargs)


def test_chat_template_renders_off_the_event_loop(engine):
    """A model's Jinja template is Python that runs for seconds over thousands of messages or tools: it runs in a
    worker thread, so the event loop (every stream, /health) keeps its turns."""
    tok = _RecordingTokenizer()

    async def checks(url, _):
        loop_thread = threading.current_thread()
        r = await _post(url, "/v1/chat/completions", CHAT)
        return loop_thread, r

    loop_thread, r = _http(engine, checks, tokenizer=tok)
    assert r.status_code == 200 and tok.threads, r.text
    assert all(t is not loop_thread for t in tok.threads), tok.threads


def _read_until_quiet(s: socket.socket, quiet_s: float) -> tuple[bytes, bool]:
    """(what arrived, whether the server closed the connection) reading until EOF or `quiet_s` of silence."""
    s.settimeout(quiet_s)
    out = b""
    try:
        while chunk := s.recv(65536):
            out += chunk
        return out, True
    except TimeoutError:
        return out, False
    except ConnectionResetError:
        return out, True


def test_a_client_that_takes_none_of_its_answer_is_dropped(engine):
    """A client that sends a request and reads nothing holds its answer on rank 0 once the socket buffers are full
    (a finished response, a stream's queued events): after server.read_timeout_s without taking a byte, its
    connection is closed; other clients are served."""
    body = {"prompt": [1, 2, 3], "max_tokens": 48, "n": 4, "logprobs": 20, "ignore_eos": True, "stream": True}

    async def checks(url, _):
        host, port = url.rsplit("/", 1)[-1].split(":")
        s = socket.socket()
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 2048)
        s.connect((host, int(port)))
        try:
            s.sendall(_request("POST", "/v1/completions", body))
            await asyncio.sleep(4)   # the answer (~100 KB of events) fills the buffers and waits
            data, closed = await asyncio.to_thread(_read_until_quiet, s, 5.0)
        finally:
            s.close()
        return data, closed, await _post(url, "/v1/completions", GOOD)

    data, closed, good = _http(engine, checks, read_timeout_s=1.0, send_buffer=4096)
    assert data.startswith(b"HTTP/1.1 200") and len(data) > 4096, data[:200]
    assert closed and b"data: [DONE]" not in data, (closed, len(data), data[-200:])
    assert good.status_code == 200 and len(good.json()["choices"][0]["token_ids"]) == 6
