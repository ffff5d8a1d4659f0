"""The grammar mask in rank 0's sampler (splash.engine.grammar, splash.engine.sampler) on random logits, with no
server: outputs follow the grammar and end with a stop token; a grammar that breaks fails its own request only;
min_tokens never blocks the end a grammar requires; grammar compilation errors name the field."""
from __future__ import annotations

import json
import re

import pytest
import torch

pytest.importorskip("xgrammar")

from splash.engine.messages import RequestFailure  # noqa: E402
from splash.engine.sampler import Sampler  # noqa: E402
from splash.engine.sampling import SamplingParams  # noqa: E402
from splash.server.protocol import APIError  # noqa: E402
from splash.server.structured import (GrammarCompiler, GrammarSpec, choice_ebnf,  # noqa: E402
                                     from_structured_outputs)
from splash.tokenizer import load_tokenizer  # noqa: E402

V, EOS = 320, 257   # the byte tokenizer's ids in a 320-row model (ids 260.. are not tokens)


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(None, V)


@pytest.fixture(scope="module")
def compiler(tok):
    return GrammarCompiler(tok, V)


def _run(sampler: Sampler, rids: list[str], steps: int, seed: int = 0) -> dict[str, list[int]]:
    """Sample every live request for `steps` steps on random logits; a request ends at EOS."""
    g = torch.Generator().manual_seed(seed)
    out = {r: [] for r in rids}
    live = list(rids)
    for _ in range(steps):
        if not live:
            break
        toks, _ = sampler.sample(torch.randn(len(live), V, generator=g) * 4, live)
        for r, t in zip(list(live), toks):
            out[r].append(t)
            if t == EOS:
                live.remove(r)
    return out


def test_outputs_follow_their_grammars_next_to_free_rows(tok, compiler):
    schema = {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 9},
                                               "b": {"type": "boolean"}}, "required": ["a", "b"],
              "additionalProperties": False}
    js = compiler.compile_sync(GrammarSpec("json", json.dumps(schema), "x"))
    rx = compiler.compile_sync(GrammarSpec("regex", r"[a-c]{2}\d", "x"))
    s = Sampler(V, torch.Generator().manual_seed(1))
    for i in range(4):
        s.add(f"j{i}", [1], SamplingParams(max_tokens=64, grammar=js), {EOS})
        s.add(f"r{i}", [1], SamplingParams(max_tokens=64, grammar=rx), {EOS})
    s.add("free", [1], SamplingParams(max_tokens=64), {EOS})
    out = _run(s, [f"j{i}" for i in range(4)] + [f"r{i}" for i in range(4)] + ["free"], 40)
    for i in range(4):
        for rid in (f"j{i}", f"r{i}"):
            assert out[rid][-1] == EOS, out[rid]
        assert set(json.loads(tok.decode(out[f"j{i}"][:-1]))) == {"a", "b"}
        assert re.fullmatch(r"[a-c]{2}\d", tok.decode(out[f"r{i}"][:-1]))
    assert len(out["free"]) == 40 or out["free"][-1] == EOS   # the free row was not masked
    assert not s.take_failed()


def test_a_broken_grammar_fails_its_request_alone(compiler):
    rx = compiler.compile_sync(GrammarSpec("regex", r"x+", "x"))
    s = Sampler(V, torch.Generator().manual_seed(2))
    s.add("bad", [1], SamplingParams(max_tokens=8, grammar=rx), {EOS})
    s.add("good", [1], SamplingParams(max_tokens=8, grammar=rx), {EOS})
    s.add("free", [1], SamplingParams(max_tokens=8), {EOS})

    class Broken:
        def fill_next_token_bitmask(self, *_):
            raise RuntimeError("matcher exploded")

    s.grammars.matchers["bad"] = Broken()
    toks, _ = s.sample(torch.randn(3, V), ["bad", "good", "free"])
    failed = s.take_failed()
    assert list(failed) == ["bad"] and "exploded" in str(failed["bad"])
    assert toks[1] == ord("x")                    # the good grammar still masked its row
    toks, _ = s.sample(torch.randn(2, V), ["good", "free"])   # and the sampler goes on
    assert toks[0] in (ord("x"), EOS) and not s.take_failed()


def test_min_tokens_does_not_block_the_grammars_end(compiler):
    done = compiler.compile_sync(GrammarSpec("grammar", choice_ebnf(["ok"]), "x"))
    s = Sampler(V, torch.Generator().manual_seed(3))
    s.add("r", [1], SamplingParams(max_tokens=8, min_tokens=6, grammar=done), {EOS})
    out = _run(s, ["r"], 8)["r"]
    assert out == [ord("o"), ord("k"), EOS] and not s.take_failed()


@pytest.mark.parametrize("so, param", [({"json": {"type": "nope"}}, "structured_outputs.json"),
                                       ({"regex": "(("}, "structured_outputs.regex"),
                                       ({"grammar": "root ::= nothing"}, "structured_outputs.grammar")])
def test_compile_errors_are_400s_naming_the_field(compiler, so, param):
    with pytest.raises(APIError) as e:
        compiler.compile_sync(from_structured_outputs(so))
    assert e.value.status == 400 and e.value.param == param and "cannot be compiled" in e.value.message
    assert not e.value.message.split(": ", 1)[1].startswith("[")   # xgrammar's time/file prefix is dropped


def test_bench_grammar_runs_and_reports(tmp_path):
    from splash.bench.cli import main
    out = tmp_path / "g.json"
    assert main(["grammar", "--batch", "4", "--vocab", "3000", "--steps", "3", "--warmup", "1",
                 "--out", str(out)]) == 0
    res = json.loads(out.read_text())
    assert res["batch"] == 4 and res["vocab"] == 3000 and res["step_ms_grammar"] > 0 and res["step_ms_plain"] > 0


def test_a_compile_that_takes_too_long_is_a_400(tok, monkeypatch):
    import asyncio
    import time

    from splash.server import structured
    slow = GrammarCompiler(tok, V)
    monkeypatch.setattr(structured, "COMPILE_TIMEOUT_S", 0.05)
    monkeypatch.setattr(slow, "compile_sync", lambda spec: time.sleep(0.5))   # a compile that runs long
    with pytest.raises(APIError) as e:
        asyncio.run(slow.compile(GrammarSpec("regex", "a", "structured_outputs.regex")))
    assert e.value.status == 400 and "within 0.05 s" in e.value.message
    assert e.value.param == "structured_outputs.regex"


@pytest.mark.parametrize("kind, source", [("grammar", "root ::= root"), ("regex", r"[^\s\S]"),
                                          ("grammar", r"root ::= [^\x00-\U0010FFFF]")])
def test_a_grammar_that_admits_no_output_is_a_400(compiler, kind, source):
    """It compiles, but no token (not even the end) may come first: the request would have nothing to sample."""
    with pytest.raises(APIError) as e:
        compiler.compile_sync(GrammarSpec(kind, source, "structured_outputs.x"))
    assert e.value.status == 400 and e.value.param == "structured_outputs.x" and e.value.code == "invalid_grammar"
    assert "admits no output" in e.value.message


def test_a_grammar_dead_end_fails_its_request_as_the_clients_error(compiler):
    """'a' may come first, then nothing may: the row fails with a ValueError (the request's own input at fault,
    a 400 for its client), next to a free row that goes on."""
    from splash.server.engine_loop import _failure

    dead = compiler.compile_sync(GrammarSpec("grammar", r'root ::= "a" [^\x00-\U0010FFFF]', "x"))
    s = Sampler(V, torch.Generator().manual_seed(4))
    s.add("dead", [1], SamplingParams(max_tokens=8, grammar=dead), {EOS})
    s.add("free", [1], SamplingParams(max_tokens=8), {EOS})
    toks, _ = s.sample(torch.randn(2, V), ["dead", "free"])
    assert toks[0] == ord("a") and not s.take_failed()
    s.sample(torch.randn(2, V), ["dead", "free"])
    failed = s.take_failed()
    assert list(failed) == ["dead"] and isinstance(failed["dead"], ValueError)
    told = _failure("dead", failed["dead"])
    assert isinstance(told, ValueError) and "grammar allows no next token" in str(told)
    assert type(_failure("x", RuntimeError("nan logits"))) is RuntimeError   # our fault stays a 500


def test_slow_compiles_do_not_hold_the_default_executor(tok, monkeypatch):
    """Text prompts are tokenised in asyncio's default executor: 40 compiles that run long (and keep running after
    their 400) must not queue a tokenisation behind them; they wait in the compiler's own pool."""
    import asyncio
    import time

    slow = GrammarCompiler(tok, V)
    monkeypatch.setattr(slow, "compile_sync", lambda spec: time.sleep(1.0))

    async def main() -> float:
        spec = GrammarSpec("regex", "a", "structured_outputs.regex")
        compiles = [asyncio.ensure_future(slow.compile(spec)) for _ in range(40)]
        await asyncio.sleep(0.05)
        t0 = time.monotonic()
        await asyncio.to_thread(lambda: None)     # what a text prompt's tokenisation waits for
        waited = time.monotonic() - t0
        for c in compiles:
            c.cancel()
        await asyncio.gather(*compiles, return_exceptions=True)
        return waited

    assert asyncio.run(main()) < 0.5


def test_a_compile_that_never_started_is_a_503_not_the_requests_400(tok, monkeypatch):
    """Three slow compiles at once on COMPILE_THREADS (2) workers: the two that ran out their time are the
    requests' 400s; the third waited in the queue the whole time, which says nothing about its grammar: a 503 with
    Retry-After."""
    import asyncio
    import time

    from splash.server import structured
    assert structured.COMPILE_THREADS == 2
    slow = GrammarCompiler(tok, V)
    monkeypatch.setattr(structured, "COMPILE_TIMEOUT_S", 0.3)
    monkeypatch.setattr(slow, "compile_sync", lambda spec: time.sleep(1.0))

    async def main() -> list:
        spec = GrammarSpec("regex", "a", "structured_outputs.regex")
        return await asyncio.gather(*[slow.compile(spec) for _ in range(3)], return_exceptions=True)

    errors = asyncio.run(main())
    assert sorted(e.status for e in errors) == [400, 400, 503], errors
    busy = next(e for e in errors if e.status == 503)
    assert busy.type == "service_unavailable" and busy.headers == {"Retry-After": "5"}


def test_a_request_waiting_for_its_compile_gets_a_503_once_the_server_drains(tok, monkeypatch):
    """A stop signal came while the compile runs: the request is answered 503 within a poll, not left to outlive
    the drain (uvicorn cancels what is left with a bare 500)."""
    import asyncio
    import time

    stopping = [False]
    slow = GrammarCompiler(tok, V, stopping=lambda: stopping[0])
    monkeypatch.setattr(slow, "compile_sync", lambda spec: time.sleep(3.0))

    async def main() -> float:
        asyncio.get_running_loop().call_later(0.2, lambda: stopping.__setitem__(0, True))
        t0 = time.monotonic()
        with pytest.raises(APIError) as e:
            await slow.compile(GrammarSpec("regex", "a", "structured_outputs.regex"))
        assert e.value.status == 503 and e.value.type == "service_unavailable"
        return time.monotonic() - t0

    assert asyncio.run(main()) < 1.0


_EXIT_WHILE_COMPILING = """
import asyncio, sys, time
from splash.server import structured
from splash.server.protocol import APIError
from splash.tokenizer import load_tokenizer
structured.COMPILE_TIMEOUT_S = 0.1
c = structured.GrammarCompiler(load_tokenizer(None, 320), 320)
c.compile_sync = lambda spec: time.sleep(60)   # a compile xgrammar will not finish for a minute
try:
    asyncio.run(c.compile(structured.GrammarSpec("regex", "a", "structured_outputs.regex")))
except APIError as e:
    print(e.status, flush=True)
"""


def test_a_compile_still_running_does_not_hold_the_process_at_exit():
    """The request got its 400, the server stops: the compile that is still running must not keep the process
    (splash-serve's rank 0) alive until it ends."""
    import os
    import subprocess
    import sys
    import time

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([root, os.environ.get("PYTHONPATH", "")])}
    t0 = time.monotonic()
    proc = subprocess.Popen([sys.executable, "-c", _EXIT_WHILE_COMPILING], env=env, stdout=subprocess.PIPE, text=True)
    try:
        out, _ = proc.communicate(timeout=20)
    finally:
        proc.kill()
    assert out.strip() == "400" and proc.returncode == 0 and time.monotonic() - t0 < 20


def test_engine_drops_a_broken_grammar_row_and_finishes_the_rest(tok):
    """One rank, the real engine on the tiny preset: the request whose grammar breaks is reported failed (and
    aborted) while the batch's other grammar requests finish with valid outputs."""
    from splash.distributed import SingleRankCommunicator
    from splash.engine.llm import LLM

    llm = LLM(preset="tiny-mla", comm=SingleRankCommunicator())
    vocab = llm.cfg.vocab_size
    grammar = GrammarCompiler(tok, vocab).compile_sync(GrammarSpec("grammar", choice_ebnf(["yes", "no"]), "x"))
    eng = llm.engine
    for rid in ("a", "bad", "b"):
        eng.add_request([1, 2, 3], SamplingParams(max_tokens=8, temperature=1.0, seed=5, grammar=grammar), rid)

    class Broken:
        def fill_next_token_bitmask(self, *_):
            raise RuntimeError("matcher exploded")

    eng.sampler.grammars.matchers["bad"] = Broken()
    out: dict[str, list[int]] = {"a": [], "b": [], "bad": []}
    finish, failed = {}, []
    while eng.has_work():
        for ev in eng.step():
            out[ev.req_id].append(ev.token)
            if ev.finish_reason:
                finish[ev.req_id] = ev.finish_reason
        failed += eng.take_failures()
    eng.stop()
    assert [f.req_id for f in failed] == ["bad"] and out["bad"] == []
    assert type(failed[0]) is RequestFailure and isinstance(failed[0].error, Exception)
    for rid in ("a", "b"):
        assert finish[rid] == "stop" and tok.decode(out[rid]) in ("yes", "no"), out[rid]


def test_min_tokens_past_the_grammars_end_ends_at_the_grammars_end(compiler):
    """The sampler lets a grammar row end (EOS) before min_tokens, but the scheduler held the request open: its
    matcher, terminated, then failed the next token, and the server answered a 500 internal_error
    (``{"structured_outputs": {"regex": "ab"}, "min_tokens": 50}``). The grammar says where its output ends."""
    from splash.distributed import SingleRankCommunicator
    from splash.engine.llm import LLM
    llm = LLM(preset="tiny-mla", comm=SingleRankCommunicator(), num_kv_blocks=64)
    done = compiler.compile_sync(GrammarSpec("regex", "ab", "x"))
    out = llm.generate([[1, 2, 3]], SamplingParams(max_tokens=60, min_tokens=50, grammar=done, temperature=0))[0]
    assert out.outputs[0].token_ids[:2] == [ord("a"), ord("b")] and out.finish_reason == "stop"
    assert not llm.engine.take_failures()
