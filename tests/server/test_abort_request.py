"""SGLang's POST /abort_request (an RL rollout cutting its long tail), in process on one rank: aborted sequences end
at once with what they have (finish_reason "abort") and the rest keep running; bad bodies are 400s naming the field;
it is an admin route."""
from __future__ import annotations

import asyncio
import threading

import pytest

from server_util import in_process
from splash.engine.messages import EngineRequest
from splash.engine.sampling import SamplingParams
from splash.server.engine_loop import Aborted, EngineLoop

LONG = {"prompt": [1, 2, 3], "max_tokens": 400, "temperature": 0, "ignore_eos": True, "return_token_ids": True}


def test_abort_all_ends_running_requests_with_what_they_have(engine):
    async def checks(c, loop):
        running = [asyncio.create_task(c.post("/v1/completions", json=dict(LONG, n=2))) for _ in range(2)]
        while loop.snapshot.running < 4:   # all four sequences admitted and generating
            await asyncio.sleep(0.01)
        aborted = await c.post("/abort_request", json={"abort_all": True})
        done = [await t for t in running]
        after = await c.post("/v1/completions", json=dict(LONG, max_tokens=3))
        bad = [await c.post("/abort_request", json=body) for body in ({}, {"rid": "x", "abort_all": True},
                                                                      {"rid": ""}, {"abort_all": "yes"})]
        return aborted, done, after, bad

    aborted, done, after, bad = in_process(engine, checks)
    assert aborted.json() == {"aborted": 4}
    for r in done:
        for ch in r.json()["choices"]:
            assert ch["finish_reason"] == "abort" and len(ch["token_ids"]) < 400, ch
    assert after.json()["choices"][0]["finish_reason"] == "length"   # the server goes on
    assert [r.status_code for r in bad] == [400] * 4
    assert [r.json()["error"]["param"] for r in bad] == ["abort_all", "rid", "rid", "abort_all"]


def test_a_response_id_aborts_its_sequences_only(engine):
    params = SamplingParams(max_tokens=300, temperature=0, ignore_eos=True)
    got: dict[str, list] = {"cmpl-a": [], "cmpl-b": []}
    done = {k: threading.Event() for k in got}

    def sink(name):
        def take(events):
            got[name].extend(events)
            if any(isinstance(e, Aborted) or e.finish_reason for e in events):
                done[name].set()
        return take

    loop = EngineLoop(engine, lambda fn: fn()).start()
    try:
        loop.add([EngineRequest(f"{k}-0", (1, 2, 3), params) for k in ("cmpl-a",)], sink("cmpl-a"))
        loop.add([EngineRequest(f"{k}-0", (4, 5, 6), params) for k in ("cmpl-b",)], sink("cmpl-b"))
        n = loop.abort_matching(lambda rid: rid.startswith("cmpl-a-")).result(timeout=30)
        assert done["cmpl-a"].wait(30) and done["cmpl-b"].wait(60)
    finally:
        loop.stop()
    assert n == 1 and isinstance(got["cmpl-a"][-1], Aborted)
    tokens_b = [e for e in got["cmpl-b"] if not isinstance(e, Aborted)]
    assert len(tokens_b) == 300 and tokens_b[-1].finish_reason == "length"
    assert loop.outstanding == 0


def test_a_rid_is_a_whole_response_id(engine):
    """'cmpl' (a prefix of every completion's id, not an id) aborts nothing (it aborted every completion); the
    response's own id aborts it."""
    async def checks(c, loop):
        running = asyncio.create_task(c.post("/v1/completions", json=LONG))
        while loop.snapshot.running < 1:
            await asyncio.sleep(0.01)
        rid = next(iter(loop._sinks)).rpartition("-")[0]
        wrong = [(await c.post("/abort_request", json={"rid": r})).json() for r in ("cmpl", rid[:-1], f"{rid}-0")]
        right = (await c.post("/abort_request", json={"rid": rid})).json()
        return wrong, right, (await running).json()["choices"][0]

    wrong, right, choice = in_process(engine, checks)
    assert wrong == [{"aborted": 0}] * 3 and right == {"aborted": 1}
    assert choice["finish_reason"] == "abort" and len(choice["token_ids"]) < 400


def test_it_is_an_admin_route(engine):
    async def checks(c, _):
        return [(await c.post("/abort_request", json={"abort_all": True}, headers=h)).status_code
                for h in ({}, {"Authorization": "Bearer adm"})]
    assert in_process(engine, checks, admin_token="adm") == [401, 200]


@pytest.fixture(scope="module")
def engine():   # its own: the first test needs four sequences to fit at once
    from splash.distributed import SingleRankCommunicator
    from splash.engine.llm import LLM
    return LLM(preset="tiny-mla", comm=SingleRankCommunicator(), num_kv_blocks=256).engine
