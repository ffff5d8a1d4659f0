"""One typed record per engine boundary (splash.engine.messages): the API hands the engine an `EngineRequest`, the
scheduler's plan is the `StepMessage` every rank receives (immutable, nothing copied field by field; its prefix-cache
fields are `BlockHash` and `CacheHit` records), each rank hands its `StepItem`s to the step batch as they are, a
switch carries `ReqState`s, and the engine hands back `TokenEvent`s."""
from __future__ import annotations

import dataclasses
import pickle

import pytest

from splash.engine.ledger import KVLedger
from splash.engine.messages import (BlockHash, CacheHit, EngineRequest, StepItem, StepMessage, SwitchPlan,
                                   TokenEvent)
from splash.engine.sampling import SamplingParams
from splash.engine.scheduler import Request, Scheduler
from splash.switching.manifest import ReqState


def test_an_engine_request_is_frozen_and_owns_its_prompt():
    prompt = [1, 2, 3]
    req = EngineRequest("r", prompt, SamplingParams(max_tokens=2))
    prompt.append(4)   # the caller's list changing later does not change what the engine was handed
    assert req.prompt == (1, 2, 3)
    with pytest.raises(dataclasses.FrozenInstanceError):
        req.req_id = "other"


def test_the_schedulers_plan_is_the_broadcast_message():
    """`schedule` returns the StepMessage itself, all of it immutable tuples (a rank can neither see a list rank 0
    mutates later nor get a different shape), and it pickles as the broadcast does."""
    s = Scheduler(KVLedger(2, 8, 4, "dp_attn"), max_num_seqs=4, max_num_batched_tokens=16)
    for rid in "ab":
        s.add(Request(rid, list(range(6)), 3))
    plan = s.schedule()
    assert type(plan) is StepMessage and [it.req_id for it in plan.items] == ["a", "b"]
    for f in dataclasses.fields(StepMessage):
        v = getattr(plan, f.name)
        assert v is None or isinstance(v, tuple), f.name
        assert all(not isinstance(x, list) for x in (v or ())), f.name
    msg = dataclasses.replace(plan, switch=SwitchPlan("tp", "live", {"a": ReqState(6, 0, None)}))
    assert pickle.loads(pickle.dumps(msg)) == msg
    done = s.update(msg, {it.req_id: 9 for it in msg.items if it.sample})
    assert done == [] and all(s.requests[r].output == [9] for r in "ab")


def test_the_engine_takes_engine_requests_and_hands_back_token_events():
    from splash.distributed import SingleRankCommunicator
    from splash.engine.llm import LLM

    eng = LLM(preset="tiny-mla", comm=SingleRankCommunicator(), num_kv_blocks=16).engine
    assert eng.add(EngineRequest("x", [5, 6, 7], SamplingParams(max_tokens=2, temperature=0, ignore_eos=True,
                                                                prompt_logprobs=1))) == "x"
    events = []
    while eng.has_work():
        events += eng.step()
    assert [type(e) for e in events] == [TokenEvent, TokenEvent] and [e.req_id for e in events] == ["x", "x"]
    assert events[-1].finish_reason == "length" and len(events[0].prompt_logprobs) == 2
    with pytest.raises(ValueError, match="prompt"):
        eng.add(EngineRequest("y", [], SamplingParams()))


def test_the_prefix_cache_travels_as_typed_records():
    """Registrations and hits in the step message are named records (what a rank reads by field), and pickle."""
    s = Scheduler(KVLedger(2, 16, 4, "tp", prefix=True), max_num_seqs=4, max_num_batched_tokens=64)
    s.add(Request("a", list(range(10)), 2))
    plans = []
    for rid in ("b", None, None):
        plans.append(s.schedule())
        s.update(plans[-1], {it.req_id: 9 for it in plans[-1].items if it.sample})
        if rid:
            s.add(Request(rid, list(range(10)), 2))
    register = [r for p in plans for r in p.register]
    attach = [a for p in plans for a in p.attach]
    assert register and all(type(r) is BlockHash for r in register)
    assert [(r.req_id, r.block) for r in register[:2]] == [("a", 0), ("a", 1)]
    assert [type(a) for a in attach] == [CacheHit] and attach[0].req_id == "b"
    assert attach[0].hashes == tuple(r.hash for r in register[:2])
    assert pickle.loads(pickle.dumps(plans[1])) == plans[1]


def test_each_rank_hands_the_message_items_to_the_step_batch():
    """The attention executors read the step message's own items (splash.attention.batch.StepPiece): no copy."""
    from splash.distributed import SingleRankCommunicator
    from splash.engine.llm import LLM

    eng = LLM(preset="tiny-mla", comm=SingleRankCommunicator(), num_kv_blocks=16).engine
    runner, batches = eng.runner, []
    step = runner.step
    runner.step = lambda batch, switch: (batches.append(batch), step(batch, switch))[1]
    eng.add(EngineRequest("x", [5, 6, 7], SamplingParams(max_tokens=2, temperature=0, ignore_eos=True)))
    while eng.has_work():
        eng.step()
    assert [[type(q) for q in b.reqs] for b in batches] == [[StepItem], [StepItem], []]   # the last: a release
    assert [(q.start_pos, q.num_new, q.end_pos) for b in batches for q in b.reqs] == [(0, 3, 3), (3, 1, 4)]
