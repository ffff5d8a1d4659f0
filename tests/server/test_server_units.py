"""Server pieces without MPI: stop strings, validation, the admin rule, and the whole app
in-process (one rank, real Engine on the tiny preset, httpx's ASGI transport)."""
from __future__ import annotations

import asyncio
import json
import re
import time

import httpx
import pytest

from splash.engine.messages import TokenEvent
from splash.engine.sampling import SamplingParams
from splash.server.app import ServerState, admin_token_required, create_app, is_loopback
from splash.server.generation import Generation
from splash.server.protocol import APIError, CompletionRequest, LayoutRequest, parse_request
from splash.server.watchdog import StepChannel
from splash.tokenizer import load_tokenizer

TOK = load_tokenizer(None, 320)


class FakeLoop:
    def __init__(self) -> None:
        self.added, self.aborted = [], []

    def add(self, reqs, sink) -> None:
        self.added += reqs
        self.sink = sink

    def abort(self, ids) -> None:
        self.aborted += ids


def _drive(text: str, stops: list[str], finish_at_end: str = "length"):
    """Feed ``text``'s byte tokens one event at a time; return (streamed text, choice, fake loop)."""
    loop = FakeLoop()

    async def main():
        gen = Generation(loop, TOK, [[1]], [SamplingParams()], stops, "t")
        gen.start()
        ids = TOK.encode(text)
        for i, t in enumerate(ids):
            loop.sink([TokenEvent("t-0", t, finish_at_end if i == len(ids) - 1 else None)])
        streamed = ""
        async for deltas in gen.deltas():
            streamed += "".join(d.text for d in deltas)
        return streamed, gen.choices[0]

    streamed, choice = asyncio.run(main())
    return streamed, choice, loop


def test_stop_string_cuts_text_and_aborts():
    streamed, c, loop = _drive("hello world, bye", ["world"])
    assert streamed == c.text == "hello " and c.finish == "stop"
    assert loop.aborted == ["t-0"]
    assert TOK.decode(c.token_ids) == "hello world"   # tokens up to the one completing the stop string


def test_stop_string_prefix_is_held_back_then_released():
    streamed, c, loop = _drive("abcwoXYZ", ["world"])
    assert streamed == c.text == "abcwoXYZ" and c.finish == "length" and loop.aborted == []


def test_multibyte_text_streams_whole_characters():
    streamed, c, _ = _drive("naïve — ünïcode ✓", [])
    assert streamed == "naïve — ünïcode ✓" and "\ufffd" not in streamed


def test_validation_messages_name_the_field():
    with pytest.raises(APIError) as e:
        parse_request(CompletionRequest, {"prompt": "x", "max_tokens": "8"})
    assert e.value.status == 400 and e.value.param == "max_tokens"
    with pytest.raises(APIError, match="unknown field 'nope'"):
        parse_request(CompletionRequest, {"prompt": "x", "nope": 1})
    with pytest.raises(APIError, match="greater than or equal to 1"):
        parse_request(CompletionRequest, {"prompt": "x", "max_tokens": 0})
    with pytest.raises(APIError, match="must be a JSON object"):
        parse_request(CompletionRequest, [1])
    req = parse_request(CompletionRequest, {"prompt": [1, 2], "temperature": 0, "stop": "x"})
    assert req.prompt == [1, 2] and req.stop_strings() == ["x"]
    with pytest.raises(APIError, match="invalid layout"):
        parse_request(LayoutRequest, {"layout": "diagonal"}).check(("tp", "dop"))
    with pytest.raises(APIError, match="invalid layout"):
        parse_request(LayoutRequest, {"layout": "cp"}).check(("tp", "dop"))   # a layout, but not allowed
    parse_request(LayoutRequest, {"layout": "auto"}).check(("tp",))
    long = APIError(400, "x" * 5000)   # no error message is longer than MAX_MESSAGE_CHARS (plus the note)
    assert long.message == "x" * 1024 + "... (message cut at 1024 characters)" and long.body()["error"]["message"] == long.message
    assert APIError(400, "y" * 1024).message == "y" * 1024


def test_admin_rule():
    assert is_loopback("127.0.0.1") and is_loopback("::1") and is_loopback("localhost")
    assert not is_loopback("0.0.0.0") and not is_loopback("10.1.2.3") and not is_loopback("myhost")
    assert not admin_token_required("127.0.0.1", None)
    assert admin_token_required("127.0.0.1", "t")
    assert admin_token_required("0.0.0.0", None) and admin_token_required("0.0.0.0", "t")


def test_step_channel_single_rank_is_plain():
    from splash.distributed import SingleRankCommunicator
    ch = StepChannel(SingleRankCommunicator())
    assert ch.broadcast_obj({"kind": "step"}) == {"kind": "step"} and ch.size == 1 and ch.rank == 0


@pytest.fixture(scope="module")
def engine():
    from splash.distributed import SingleRankCommunicator
    from splash.engine.llm import LLM
    return LLM(preset="tiny-mla", comm=SingleRankCommunicator(), num_kv_blocks=64).engine


def test_app_in_process(engine):
    """Completions, streaming and layout control through the real app + engine thread, one rank."""
    from splash.server.engine_loop import EngineLoop
    from splash.server.metrics import Metrics

    async def main():
        aio = asyncio.get_running_loop()
        holder = {}
        metrics = Metrics(lambda: holder["loop"].snapshot)
        loop = holder["loop"] = EngineLoop(engine, aio.call_soon_threadsafe, metrics,
                                           allowed_layouts=("tp", "dp_attn", "dop"))
        state = ServerState(loop=loop, tokenizer=TOK, metrics=metrics, model_name="tiny-mla", max_model_len=4096,
                            vocab_size=320)
        loop.start()
        try:
            transport = httpx.ASGITransport(app=create_app(state))
            async with httpx.AsyncClient(transport=transport, base_url="http://t") as c:
                body = {"prompt": [1, 2, 3], "max_tokens": 6, "temperature": 0, "return_token_ids": True}
                r1, r2 = await asyncio.gather(c.post("/v1/completions", json=body),
                                              c.post("/v1/completions", json={**body, "stream": True}))
                lay = await c.post("/v1/layout", json={"layout": "dop"})
                refused = await c.post("/v1/layout", json={"layout": "cp"})   # a layout, but not an allowed one
                metrics_text = (await c.get("/metrics")).text
        finally:
            await asyncio.to_thread(loop.stop)
        return r1, r2, lay, refused, metrics_text, loop

    r1, r2, lay, refused, metrics_text, loop = asyncio.run(main())
    ids = r1.json()["choices"][0]["token_ids"]
    assert len(ids) == 6 and re.fullmatch(r"cmpl-[0-9a-f]{24}", r1.json()["id"])   # OpenAI's id shape
    chunks = [json.loads(x[6:]) for x in r2.text.split("\n\n") if x.startswith("data: {")]
    assert {ch["id"] for ch in chunks} == {chunks[0]["id"]} != {r1.json()["id"]}   # one id per request
    assert [t for ch in chunks for t in ch["choices"][0]["token_ids"]] == ids
    assert r2.text.rstrip().endswith("data: [DONE]")
    assert lay.status_code == 200 and lay.json()["allowed_layouts"] == ["tp", "dp_attn", "dop"]
    assert refused.status_code == 400 and refused.json()["error"]["code"] == "invalid_layout"
    assert "splash_generated_tokens_total 12.0" in metrics_text
    assert not loop._thread.is_alive() and loop.error is None


def test_engine_thread_sleeps_when_idle(engine):
    """No work: the engine thread waits on its condition instead of spinning."""
    from splash.server.engine_loop import EngineLoop

    loop = EngineLoop(engine, lambda fn: fn()).start()
    try:
        steps, cpu0 = loop.steps, time.process_time()
        time.sleep(0.5)
        cpu = time.process_time() - cpu0
        assert loop.steps == steps and loop.alive
    finally:
        loop.stop(5)
    assert cpu < 0.1, f"idle engine thread used {cpu:.2f}s of CPU in 0.5s"


def test_engine_thread_runs_with_the_start_up_heap_frozen(engine):
    """The objects alive when the engine thread starts are frozen for the cyclic GC (its full collections, which a
    burst of forecasts triggers, then scan only newer objects) and released when it stops."""
    import gc
    from splash.server.engine_loop import EngineLoop

    loop = EngineLoop(engine, lambda fn: fn()).start()
    try:
        assert gc.get_freeze_count() > 10_000
    finally:
        loop.stop(5)
    assert gc.get_freeze_count() == 0


def test_console_panel_shows_layout_switches_and_kv_bars():
    from rich.console import Console as RichConsole

    from splash.server.console import render_panel
    from splash.server.engine_loop import EngineSnapshot

    snap = EngineSnapshot(layout="tp", mode="pinned", target="dop", allowed_layouts=("tp", "dop"),
                          switch_counts={("tp", "dop"): 2}, kv_capacity={"tp": 800, "dop": 1600}, kv_used_tokens=10,
                          kv_used_blocks=[1, 20], kv_blocks_per_rank=50, running=3, waiting=4, steps=5,
                          generated_tokens=6)
    con = RichConsole(width=100, record=True, file=open("/dev/null", "w"))
    con.print(render_panel(snap, "splash-serve", 12.5, 3))
    text = con.export_text()
    for needle in ("tp → dop", "pinned", "tp→dop: 2", "12.5", "3 running, 4 waiting", "[########............] 20/50"):
        assert needle in text, (needle, text)


def _snap(**kw):
    from splash.server.engine_loop import EngineSnapshot

    base = dict(layout="tp", mode="auto", target=None, allowed_layouts=("tp", "dop"), switch_counts={},
                kv_capacity={"tp": 800}, kv_used_tokens=10, kv_used_blocks=[1, 2], kv_blocks_per_rank=50, running=1,
                waiting=0, steps=5, generated_tokens=6)
    return EngineSnapshot(**{**base, **kw})


SCHEDULER = {"model": {"tp": {"factor": 2.0, "last_predicted_s": 0.001, "last_measured_s": 0.0025,
                              "median_error": 0.25}},
             "last_decision": {"verdict": "switch", "target": "dop", "reason": "dop is faster"}}


def test_live_console_panel_redraws_the_snapshot_with_the_cost_model_line(monkeypatch, capsys):
    """Under mpiexec with a terminal (forced here by SPLASH_CONSOLE=live) rank 0 draws the live panel: "starting…"
    until the engine has a snapshot, then the layout, the cost model's last prediction and decision."""
    import time

    from splash.server.console import Console

    monkeypatch.setenv("SPLASH_CONSOLE", "live")
    calls = []

    def snapshot():
        calls.append(1)
        return None if len(calls) == 1 else _snap(scheduler=SCHEDULER, generated_tokens=60 * len(calls))

    con = Console()
    assert con.live_ok
    with con.loading("loading weights", 2) as advance:   # the progress bar before the panel
        advance()
        advance()
    con.start_panel(snapshot, "splash-serve test")
    time.sleep(1.3)
    con.stop_panel()
    assert not con._thread.is_alive() and len(calls) >= 3
    err = re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", capsys.readouterr().err)   # the terminal's escape codes
    assert "loading weights" in err and "2/2" in err
    assert "starting…" in err and "splash-serve test" in err
    assert "step predicted 2.0 ms vs measured 2.5 ms (median error 25%)" in err
    assert "last decision: switch → dop (dop is faster)" in err and "Ctrl-C to stop" in err


def test_a_line_logged_while_the_live_panel_runs_goes_through_the_panels_console(monkeypatch):
    """rank 0's lines while the panel is live (an admin's weight update, ...) are written by the console that draws
    the panel, which puts them above it; a bare write to the terminal would land inside the panel's redraw."""
    import io
    import time

    from rich.console import Console as RichConsole

    from splash.server.console import Console

    monkeypatch.setenv("SPLASH_CONSOLE", "live")
    con = Console()
    con.rich = RichConsole(file=io.StringIO(), force_terminal=True, width=100, record=True)
    con.start_panel(lambda: None, "splash-serve test")
    time.sleep(0.3)
    con.log("splash-serve: weights updated from /ckpt in 0.12 s")
    time.sleep(0.6)
    con.stop_panel()
    text = con.rich.export_text()
    assert text.count("splash-serve: weights updated from /ckpt in 0.12 s") == 1 and "starting…" in text


def test_plain_console_logs_a_status_line_and_quiet_logs_nothing(monkeypatch, capsys):
    import time

    from splash.server.console import Console

    monkeypatch.setenv("SPLASH_CONSOLE", "plain")
    con = Console()
    assert not con.live_ok
    con.status_every_s = 0.05
    totals = iter(range(0, 10_000, 100))
    con.start_panel(lambda: _snap(generated_tokens=next(totals), switch_counts={("tp", "dop"): 1}), "t")
    time.sleep(0.5)
    con.stop_panel()
    lines = [x for x in capsys.readouterr().err.splitlines() if x.startswith("splash-serve: layout tp (auto)")]
    assert len(lines) >= 3 and "1 switches" in lines[-1] and "KV blocks/rank [1, 2]/50" in lines[-1]
    assert float(lines[-1].split(" tok/s")[0].rsplit(" ", 1)[1]) > 0   # the rate of generated tokens
    quiet = Console(quiet=True)
    quiet.start_panel(lambda: _snap(), "t")
    with quiet.loading("weights", 3) as advance:
        advance()
    assert quiet._thread is None and capsys.readouterr().err == ""


def test_scheduler_line_before_any_prediction():
    from splash.server.console import _scheduler_line

    assert _scheduler_line("tp", {"model": {}, "last_decision": None}) == "no prediction yet"
    line = _scheduler_line("tp", {"model": {"tp": {**SCHEDULER["model"]["tp"], "median_error": None}},
                                  "last_decision": {"verdict": "stay", "target": None, "reason": "tp leads"}})
    assert line == "step predicted 2.0 ms vs measured 2.5 ms; last decision: stay (tp leads)"


@pytest.mark.parametrize("field, value, want", [
    ("response_format", None, None),
    ("response_format", {"type": "text"}, None),
    ("response_format", {"type": "json_object"}, ("json", "ANY")),
    ("response_format", {"type": "json_schema", "json_schema": {"name": "x", "schema": '{"type": "string"}'}},
     ("json", '{"type": "string"}')),
    ("response_format", {"type": "json_schema", "json_schema": {"name": "x", "schema": "{oops"}},
     "'response_format.json_schema.schema' is not valid JSON"),
    ("response_format", {"type": "json_schema", "json_schema": {"name": "x", "schema": [1]}},
     "'response_format.json_schema.schema' must be a JSON schema object, got list"),
    ("response_format", {"type": "json_schema", "json_schema": {"schema": {}}}, "must be an object with a 'name'"),
    ("response_format", {"type": "xml"}, "'response_format.type' must be one of text, json_object, json_schema"),
    ("structured_outputs", {"regex": "a+", "backend": "xgrammar"}, ("regex", "a+")),
    ("structured_outputs", {"json_object": True}, ("json", "ANY")),
    ("structured_outputs", {"choice": ["yes", "no"]}, ("grammar", None)),
    ("structured_outputs", {"bogus": 1}, "unknown field 'structured_outputs.bogus'"),
    ("structured_outputs", {"structural_tag": "t"}, "'structured_outputs.structural_tag' is not supported"),
    ("structured_outputs", {}, "must set exactly one of json, json_object, regex, choice, grammar$"),
    ("structured_outputs", {"regex": "a", "grammar": "b"}, r"\(got regex, grammar\)"),
    ("structured_outputs", {"choice": ["a", ""]}, "'structured_outputs.choice' must be a non-empty list"),
    ("structured_outputs", {"grammar": ""}, "'structured_outputs.grammar' must be a non-empty string"),
])
def test_output_constraints_are_read_or_refused_naming_the_field(field, value, want):
    from splash.server import structured as S
    read = S.from_response_format if field == "response_format" else S.from_structured_outputs
    if isinstance(want, str):
        with pytest.raises(APIError, match=want) as e:
            read(value)
        assert e.value.status == 400
        return
    spec = read(value)
    if want is None:
        assert spec is None
        return
    assert spec.kind == want[0] and spec.param.startswith(field)
    if want[1] is not None:
        assert spec.source == (S.ANY_OBJECT if want[1] == "ANY" else want[1])


def test_one_output_constraint_per_request():
    from splash.server import structured as S
    a = S.from_response_format({"type": "json_object"})
    b = S.from_structured_outputs({"regex": "x"})
    assert S.pick(None, a) is a and S.pick(None, None) is None
    with pytest.raises(APIError, match="'structured_outputs' cannot be combined with 'response_format'"):
        S.pick(a, b)
