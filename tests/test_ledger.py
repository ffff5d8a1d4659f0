"""Rank 0's ledger counts blocks per rank in closed form (no per-step work proportional to context): equal to
walking every block through the ownership model, for every layout, world size, anchor and block range; and the
scheduler slices a request's tokens without rebuilding its whole history."""
from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from splash.engine.ledger import KVLedger
from splash.engine.scheduler import Request
from splash.layouts.ownership import kv_holders


@settings(max_examples=300, deadline=None)
@given(st.sampled_from(["tp", "dp_attn", "cp", "dop"]), st.integers(1, 8), st.data())
def test_need_closed_form_matches_walk(layout, world, data):
    """The ledger's per-rank count equals walking every block through the ownership model's per-block holders
    (`kv_holders`, an independent statement of the same rule), and its `holders` agrees block by block."""
    led = KVLedger(world, 10, 4, layout)
    owner = data.draw(st.integers(0, world - 1))
    b0 = data.draw(st.integers(0, 50))
    b1 = data.draw(st.integers(b0 - 3, b0 + 60))
    walk = [0] * world
    per_block = kv_holders(layout, max(b0, b1), owner, world)
    for b in range(b0, b1):
        assert sorted(led.holders(b, owner)) == sorted(per_block[b])
        for r in per_block[b]:
            walk[r] += 1
    assert led.blocks_needed(owner, b0, b1) == walk


def test_token_slice():
    req = Request("a", [1, 2, 3], 10, output=[4, 5])
    for a in range(6):
        for b in range(a, 6):
            assert req.token_slice(a, b) == tuple((req.prompt + req.output)[a:b])
    assert req.num_tokens == 5



def test_preemption_frees_the_rank_that_lacks_room():
    """DP-attn on 2 ranks, 4 blocks of 4 tokens per rank. a and b live on owner 0, c on owner 1, and c is the
    newest running request. When owner 0 fills, the victim is b — the newest on the rank lacking room — not c,
    whose blocks on owner 1 would not let a grow (the newest request anywhere was preempted before)."""
    from splash.engine.scheduler import Scheduler
    led = KVLedger(2, 4, 4, "dp_attn")
    s = Scheduler(led, max_num_seqs=8, max_num_batched_tokens=64)
    for rid in "acb":
        s.add(Request(rid, [1, 2, 3, 4], 100))
    s.schedule()
    assert {rid: led.owner(rid) for rid in "abc"} == {"a": 0, "b": 0, "c": 1}   # least-loaded placement
    s.running = [s.requests[rid] for rid in "abc"]                                # c the newest
    while not s.num_preemptions:
        plan = s.schedule()
        s.update(plan, {it.req_id: 7 for it in plan.items if it.sample})
    assert [r.req_id for r in s.waiting] == ["b"] and led.owner("c") == 1 and led.used[1] > 0   # c alone on 1


def test_a_waiting_request_joins_only_when_its_whole_prompt_fits_beside_the_running_ones():
    """One rank, 8 blocks of 4 tokens, an 8-token budget. a runs with 20 tokens (5 blocks). b's 16-token prompt
    needs 4 blocks: its first 8-token chunk would fit (7 of 8 blocks) but its whole prompt with a spare block for
    a does not, so b waits — rather than take a chunk to be preempted and recomputed when a next grows. Once a
    finishes, b joins."""
    from splash.engine.scheduler import Scheduler
    led = KVLedger(1, 8, 4, "tp")
    s = Scheduler(led, max_num_seqs=8, max_num_batched_tokens=8)
    a = Request("a", list(range(20)), 2)
    s.add(a)
    for _ in range(3):                                   # 20 tokens in 8-token chunks: 3 steps
        plan = s.schedule()
        s.update(plan, {it.req_id: 7 for it in plan.items if it.sample})
    assert a.num_cached == 20 and led.used == [5]
    s.add(Request("b", list(range(16)), 4))
    plan = s.schedule()
    assert [it.req_id for it in plan.items] == ["a"] and [r.req_id for r in s.waiting] == ["b"]
    s.update(plan, {"a": 7})                             # a's second token: it finishes
    plan = s.schedule()
    assert [it.req_id for it in plan.items] == ["b"] and s.num_preemptions == 0


def test_owners_balance_what_requests_will_hold_at_their_end():
    """Two requests with the same 64-token prompt: one may grow to 3,000 tokens, the other to 80. Balancing the
    blocks held now would put the next long request beside the first (rank 0 then holds 4 blocks against rank 1's
    5); balancing their ends puts it on rank 1."""
    led = KVLedger(2, 1000, 16, "dop")
    led.grow("long", 64, 0, final=3000)
    led.grow("short", 80, 1, final=80)
    assert led.used == [4, 5] and led.pick_owner() == 1
    led.release("long")
    assert [e.final for e in led.reqs.values()] == [80] and led.pick_owner() == 0
