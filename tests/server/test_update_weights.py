"""SGLang's POST /update_weights_from_disk, in process on one rank: the server then generates the new checkpoint's
greedy tokens; a bad path or body is a 400 naming `model_path` with the old weights still served; requests admitted
before it finish on the old weights and later ones run on the new; a second update meanwhile is a 409; it is an
admin route (the admin token, where one is configured)."""
from __future__ import annotations

import json

import pytest

from server_util import in_process, save_preset

GREEDY = {"prompt": [5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21], "max_tokens": 6,
          "temperature": 0, "ignore_eos": True, "return_token_ids": True}


@pytest.fixture
def engine():
    from splash.distributed import SingleRankCommunicator
    from splash.engine.llm import LLM
    return LLM(preset="tiny-mla", comm=SingleRankCommunicator(), num_kv_blocks=64).engine


@pytest.fixture(scope="module")
def new_weights(tmp_path_factory):
    """A tiny-mla checkpoint with other weights, and its greedy tokens for GREEDY's prompt on one rank."""
    from splash.distributed import SingleRankCommunicator
    from splash.engine.llm import LLM
    from splash.engine.sampling import SamplingParams
    d = save_preset("tiny-mla", tmp_path_factory.mktemp("weights") / "b", seed=7)
    out = LLM(model=str(d), comm=SingleRankCommunicator(), num_kv_blocks=64).generate(
        [GREEDY["prompt"]], SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))
    return str(d), out[0].token_ids


def _ids(r) -> list[int]:
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["token_ids"]


def test_the_server_generates_the_new_weights_tokens(engine, new_weights):
    path, want = new_weights

    async def checks(c, _):
        before = _ids(await c.post("/v1/completions", json=GREEDY))
        again = _ids(await c.post("/v1/completions", json=GREEDY))   # its prompt's blocks are cached now
        bad = [await c.post("/update_weights_from_disk", json=body)
               for body in ({"model_path": path + "-missing"}, {"model_path": ""}, {}, {"model_path": 3})]
        still = _ids(await c.post("/v1/completions", json=GREEDY))
        ok = await c.post("/update_weights_from_disk", json={"model_path": path})
        after = _ids(await c.post("/v1/completions", json=GREEDY))
        return before, again, bad, still, ok, after

    said: list[str] = []
    before, again, bad, still, ok, after = in_process(engine, checks, say=said.append)
    assert before == again == still and before != want
    assert bad[0].status_code == 400 and bad[0].json()["error"]["code"] == "update_failed", bad[0].text
    assert all(r.status_code == 400 and r.json()["error"]["param"] == "model_path" for r in bad), [r.text for r in bad]
    assert ok.status_code == 200 and ok.json()["success"] and ok.json()["evicted_blocks"] >= 1, ok.text
    assert after == want
    # the console's lines: each update a body named announced, the failed one with why, the good one with its time
    assert sum("updating the weights from" in m for m in said) == 2 and "failed, nothing changed" in said[1]
    assert said[-1].startswith(f"splash-serve: weights updated from {path} in ")


def test_a_busy_engine_is_a_409(engine, new_weights, monkeypatch):
    """A refusal (EngineBusy: another update is already waiting for the running requests, as the test below makes
    one) is answered 409 + Retry-After."""
    from splash.errors import EngineBusy

    def busy(path):
        raise EngineBusy("1 request(s) are running or waiting: weights are updated on an idle engine")
    monkeypatch.setattr(engine, "update_weights", busy)

    async def checks(c, _):
        return await c.post("/update_weights_from_disk", json={"model_path": new_weights[0]})

    r = in_process(engine, checks)
    assert r.status_code == 409 and r.json()["error"]["code"] == "engine_busy", r.text
    assert r.headers["retry-after"] == "1"


def test_it_is_an_admin_route(engine, new_weights):
    path, _ = new_weights

    async def checks(c, _):
        body = json.dumps({"model_path": path})
        return [(await c.post("/update_weights_from_disk", content=body, headers=h)).status_code
                for h in ({}, {"Authorization": "Bearer nope"}, {"Authorization": "Bearer adm"})]

    assert in_process(engine, checks, admin_token="adm") == [401, 401, 200]


def test_admitted_requests_finish_on_the_old_weights_and_later_ones_run_on_the_new(engine, new_weights, tmp_path):
    """SGLang's order: an update asked for while a request runs waits for it (its tokens are the old weights'); a
    request that arrives meanwhile waits for the update (its tokens are the new weights'); a second update asked
    for meanwhile is refused."""
    import threading

    from splash.engine.messages import EngineRequest
    from splash.engine.sampling import SamplingParams
    from splash.errors import EngineBusy
    from splash.server.engine_loop import EngineLoop

    path, want = new_weights
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    got: dict[str, list[int]] = {"old": [], "new": []}
    done = {k: threading.Event() for k in got}

    def sink(name):
        def take(events):
            for ev in events:
                got[name].append(ev.token)
                if ev.finish_reason is not None:
                    done[name].set()
        return take

    loop = EngineLoop(engine, lambda fn: fn()).start()
    try:
        loop.add([EngineRequest("old", tuple(GREEDY["prompt"]), params)], sink("old"))
        update = loop.update_weights(path)
        second = loop.update_weights(path)
        loop.add([EngineRequest("new", tuple(GREEDY["prompt"]), params)], sink("new"))
        assert update.result(timeout=60) >= 1 and done["old"].wait(60) and done["new"].wait(60)
        with pytest.raises(EngineBusy):
            second.result(timeout=10)
    finally:
        loop.stop()
    assert got["new"] == want and got["old"] != want and len(got["old"]) == 6


def test_requests_held_for_an_update_can_be_aborted_and_are_failed_at_shutdown(engine, new_weights):
    """A held request its client gave up on never runs and stops counting; at shutdown a waiting update and the
    requests held for it get EngineStopped, and nothing stays counted."""
    from splash.engine.messages import EngineRequest
    from splash.engine.sampling import SamplingParams
    from splash.server.engine_loop import EngineLoop, EngineStopped

    long = SamplingParams(max_tokens=400, temperature=0, ignore_eos=True)
    short = SamplingParams(max_tokens=2, temperature=0, ignore_eos=True)
    seen: dict[str, list] = {"gone": [], "held": []}
    loop = EngineLoop(engine, lambda fn: fn())
    loop.add([EngineRequest("long", (1, 2, 3), long)], lambda ev: None)   # queued before the thread starts
    update = loop.update_weights(new_weights[0])
    loop.add([EngineRequest("gone", (4, 5), short)], seen["gone"].extend)
    loop.add([EngineRequest("held", (6, 7), short)], seen["held"].extend)
    loop.abort(["gone"])
    loop.start()
    loop.stop(timeout=60)
    with pytest.raises(EngineStopped):
        update.result(timeout=10)
    assert seen["gone"] == [] and len(seen["held"]) == 1 and isinstance(seen["held"][0], EngineStopped)
    assert loop.outstanding == 0


def test_requests_held_for_an_update_count_as_waiting(engine, new_weights):
    """splash_requests_waiting (and the console) count the sequences held for a pending update (they counted 0
    while a queue built up behind it)."""
    import time

    from splash.engine.messages import EngineRequest
    from splash.engine.sampling import SamplingParams
    from splash.server.engine_loop import EngineLoop

    long = SamplingParams(max_tokens=400, temperature=0, ignore_eos=True)
    short = SamplingParams(max_tokens=2, temperature=0, ignore_eos=True)
    loop = EngineLoop(engine, lambda fn: fn())
    loop.add([EngineRequest("long", (1, 2, 3), long)], lambda ev: None)
    update = loop.update_weights(new_weights[0])
    loop.add([EngineRequest(f"held-{i}", (4, 5), short) for i in range(2)], lambda ev: None)
    loop.start()
    try:
        deadline = time.monotonic() + 30
        while loop.snapshot.steps < 3 and time.monotonic() < deadline:
            time.sleep(0.01)
        snap = loop.snapshot
        assert not update.done() and snap.running == 1 and snap.waiting == 2, snap
        assert update.result(timeout=60) >= 0
    finally:
        loop.stop(timeout=60)
