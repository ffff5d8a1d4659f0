"""The prefix cache's bookkeeping (pure): rank 0's scheduler and ledger decide every hit, registration and eviction,
and each rank's block manager, doing only what the step plans say, always agrees — the blocks a plan attaches are
cached where it says, no rank runs out of blocks, a block is never freed while a request holds it, and what the
ranks hold is within what the ledger counts. The distributed tests (tests/distributed/test_prefix_dist.py) check
the tokens."""
from __future__ import annotations

import random

from hypothesis import given, settings
from hypothesis import strategies as st

from splash.engine.layout_policy.control import LayoutController
from splash.engine.ledger import KVLedger
from splash.engine.scheduler import Request, Scheduler
from splash.kv.block_manager import BlockManager
from splash.layouts.ownership import block_holders
from splash.models.config import model_config_from_dict
from splash.switching.handoff_blocks import begin_blocks

LAYOUTS = ("tp", "dp_attn", "cp", "dop")
# a tiny MLA config whose 12 heads shard over 1, 2 and 3 ranks (the manifest planner needs one)
CFG = model_config_from_dict(dict(
    model_type="deepseek_v3", vocab_size=64, hidden_size=64, intermediate_size=64, num_hidden_layers=2,
    num_attention_heads=12, kv_lora_rank=16, q_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8,
    v_head_dim=8), allow_planned=True)


class Ranks:
    """What every rank's engine does with a step plan's cache and block instructions (Engine._execute, in its
    order: registrations, releases, a switch's forgetting, evictions, hits, then the step's new blocks)."""

    def __init__(self, world: int, blocks: int, bs: int, layout: str):
        self.world, self.bs, self.layout = world, bs, layout
        self.bms = [BlockManager(blocks, bs) for _ in range(world)]

    def run(self, plan, switch=None):
        """`switch`: the manifest of a switch handed off at this step (every rank applies its block plan)."""
        for rid, b, h in plan.register:
            for bm in self.bms:
                if b in bm.table(rid):
                    assert bm.register(rid, b, h)
        for rid in plan.release:
            for bm in self.bms:
                bm.release(rid)
        if switch is not None:
            for r, bm in enumerate(self.bms):
                hs = begin_blocks(bm, switch, r, set(plan.release))
                bm.free_physical(hs.free_later)   # (no data here: the sends are done at once)
            self.layout = switch.dst.value
        for r, hashes in enumerate(plan.evict):
            self.bms[r].evict(hashes)
        for rid, owner, hashes in plan.attach:
            for i, h in enumerate(hashes):
                for r in block_holders(self.layout, i, owner, self.world):
                    assert self.bms[r].cached(h), f"rank {r} has no cached block for {rid}'s block {i}"
                    self.bms[r].attach(rid, [(i, h)])
        for it in plan.items:
            end = it.start_pos + len(it.tokens)
            first = it.start_pos // self.bs
            if len(it.tokens) == 1 and it.start_pos % self.bs:
                continue
            for b in range(first, (end - 1) // self.bs + 1):
                for r in block_holders(self.layout, b, it.owner, self.world):
                    self.bms[r].ensure(rid_of(it), [b])


def rid_of(it):
    return it.req_id


def physical_in_use(bm: BlockManager) -> int:
    return len({p for rid in bm.requests() for p in bm.table(rid).values()})


@st.composite
def scenarios(draw):
    world = draw(st.integers(1, 3))
    bs = draw(st.sampled_from([2, 4]))
    blocks = draw(st.integers(20, 60))
    lay = draw(st.sampled_from(LAYOUTS))
    stems = [[draw(st.integers(0, 50)) for _ in range(draw(st.integers(1, 12)))] for _ in range(3)]
    reqs = []
    for i in range(draw(st.integers(1, 14))):
        stem = draw(st.sampled_from(stems))
        tail = [draw(st.integers(0, 50)) for _ in range(draw(st.integers(0, 6)))]
        reqs.append((draw(st.integers(0, 40)), stem + tail, draw(st.integers(1, 12))))
    switches = draw(st.lists(st.tuples(st.integers(1, 40), st.sampled_from(LAYOUTS), st.booleans()), max_size=4))
    return world, bs, blocks, lay, sorted(reqs, key=lambda x: x[0]), draw(st.integers(0, 10 ** 6)), dict(
        (at, (dst, move)) for at, dst, move in switches)


def switch_now(ctl, led, sched, dst: str, move: bool):
    """What Engine._switch_decision does for a pinned `dst`: plan against the ledger, then mirror the switch."""
    ctl.request(dst)
    kv = {r.req_id: r.num_cached for r in sched.running if r.num_cached > 0}
    d = ctl.decide(led.layout, led, kv, sched.handoff_reserve_blocks(), move_cached=move)
    if d is not None:
        led.relayout(d.dst, d.manifest.owners, d.manifest)
    return d


@settings(max_examples=200, deadline=None)
@given(scenarios())
def test_ranks_following_the_plans_agree_with_the_ledger(case):
    """... through live layout switches too: shared blocks move once and are re-shared, idle cached blocks are kept or
    dropped as the manifest says, and every rank's cache still matches rank 0's mirror (and the ledger counts exactly
    the blocks each rank's requests hold)."""
    world, bs, blocks, lay, arrivals, seed, switches = case
    rng = random.Random(seed)
    led = KVLedger(world, blocks, bs, lay, prefix=True)
    sched = Scheduler(led, max_num_seqs=6, max_num_batched_tokens=16)
    ranks = Ranks(world, blocks, bs, lay)
    ctl = LayoutController(CFG, world, bs, 4, "float32")
    pending = list(arrivals)
    step = 0
    while (pending or sched.running or sched.waiting) and step < 400:
        while pending and pending[0][0] <= step:
            _, prompt, n = pending.pop(0)
            sched.add(Request(f"q{step}-{len(pending)}", list(prompt), n))
        if sched.running and rng.random() < 0.05:     # an abort now and then
            sched.abort(rng.choice(sched.running).req_id)
        d = None
        if step in switches and switches[step][0] in ctl.allowed and switches[step][0] != led.layout:
            d = switch_now(ctl, led, sched, *switches[step])
        plan = sched.schedule()
        ranks.run(plan, d.manifest if d else None)
        for r, bm in enumerate(ranks.bms):
            held = physical_in_use(bm)
            assert held == led.used[r] <= led.cap()
            assert bm.num_cached == len(led.refs[r])          # the same blocks cached, by count ...
            assert all(bm.cached(h) for h in led.refs[r])     # ... and by name
        sampled = {it.req_id: rng.randrange(50) for it in plan.items if it.sample}
        sched.update(plan, sampled)
        step += 1
    assert step < 400 or not sched.running


def test_a_repeated_prompt_starts_on_its_cached_blocks():
    """A request whose first 3 blocks were computed by a finished request starts at token 12 (block size 4), on the
    same owner (the hit is worth its blocks of load), and the blocks come back from evictable into use."""
    led = KVLedger(2, 40, 4, "dop", prefix=True)
    sched = Scheduler(led, max_num_seqs=4, max_num_batched_tokens=64)
    prompt = list(range(1, 15))   # 14 tokens: 3 full blocks + 2
    sched.add(Request("a", prompt, 2))
    done = False
    while not done:
        plan = sched.schedule()
        done = bool(sched.update(plan, {it.req_id: 99 for it in plan.items if it.sample}))
    sched.schedule()   # releases a: its registered blocks become evictable
    owner_a = 0
    assert led.cached_blocks() == [3, 0] and len(led.lru[owner_a]) == 3   # its 15 computed tokens: 3 full blocks
    sched.add(Request("b", prompt + [7], 2))
    plan = sched.schedule()
    (it,) = plan.items
    assert (it.start_pos, it.owner) == (12, owner_a) and plan.attach == [("b", 0, tuple(led.shared["b"][:3]))]
    assert sched.requests["b"].cached_prompt_tokens == 12 and (sched.prefix_hits, sched.prefix_queries) == (12, 29)


def test_evictions_keep_use_and_cache_within_capacity():
    """A pool of 10 blocks: cached blocks no request uses are evicted oldest first once new requests need the room."""
    led = KVLedger(1, 10, 4, "tp", prefix=True)
    sched = Scheduler(led, max_num_seqs=1, max_num_batched_tokens=64)
    evicted = []
    for k in range(6):
        sched.add(Request(f"r{k}", [k * 100 + j for j in range(9)], 1))   # 2 full blocks each, distinct
        for _ in range(3):
            plan = sched.schedule()
            evicted += [h for per in plan.evict for h in per]
            assert led.used[0] + len(led.lru[0]) <= 10
            sched.update(plan, {it.req_id: 5 for it in plan.items if it.sample})
    assert evicted and len(led.refs[0]) <= 10


def test_reset_then_switch():
    """POST /reset_prefix_cache between two steps, and a switch wanted at the next boundary: the reset's evictions
    (decided in the old layout) are still on their way to the ranks, so the engine holds the switch for one step
    (`Scheduler.pending_evictions`); planned then, the ranks still agree with the ledger and nothing stays cached."""
    led = KVLedger(2, 40, 4, "dp_attn", prefix=True)
    sched = Scheduler(led, max_num_seqs=4, max_num_batched_tokens=64)
    ranks = Ranks(2, 40, 4, "dp_attn")
    sched.add(Request("a", list(range(1, 15)), 2))
    while sched.has_work():
        plan = sched.schedule()
        ranks.run(plan)
        sched.update(plan, {it.req_id: 9 for it in plan.items if it.sample})
    plan = sched.schedule()
    ranks.run(plan)
    assert ranks.bms[0].num_cached == 3 and not sched.pending_evictions()
    assert sched.reset_prefix_cache() == 3 and sched.pending_evictions()
    ranks.run(sched.schedule())        # the step the switch waits for
    assert not sched.pending_evictions()
    d = switch_now(LayoutController(CFG, 2, 4, 4, "float32"), led, sched, "dop", True)
    ranks.run(sched.schedule(), d.manifest)
    assert [bm.num_cached for bm in ranks.bms] == led.cached_blocks() == [0, 0]
    assert all(bm.num_free == 40 for bm in ranks.bms)
