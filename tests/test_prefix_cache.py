"""The prefix cache's bookkeeping (pure): rank 0's scheduler and ledger decide every hit, registration and eviction,
and each rank's block manager, doing only what the step plans say, always agrees — the blocks a plan attaches are
cached where it says, no rank runs out of blocks, a block is never freed while a request holds it, and what the
ranks hold is within what the ledger counts. The distributed tests (tests/distributed/test_prefix_dist.py) check
the tokens."""
from __future__ import annotations

import random

import pytest

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
        led.relayout(d.dst, d.manifest.owners, d.manifest.cached_kept)
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
    assert (it.start_pos, it.owner) == (12, owner_a) and plan.attach == (("b", 0, tuple(led.shared["b"][:3])),)
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


def _run_to_end(sched: Scheduler, sample) -> list:
    """Schedule and update until nothing is left; -> the step plans."""
    plans = []
    while sched.has_work() and len(plans) < 500:
        plan = sched.schedule()
        plans.append(plan)
        sched.update(plan, {it.req_id: sample(it.req_id, len(plans)) for it in plan.items if it.sample})
    return plans


def _prompt_tokens_computed(plans, prompt_len: int) -> int:
    """Prompt positions the steps computed, over all requests (decode positions not counted)."""
    return sum(max(0, min(it.start_pos + len(it.tokens), prompt_len) - it.start_pos)
               for plan in plans for it in plan.items)


def test_n_samples_sent_together_compute_their_prompt_once():
    """Eight samples of a 37-token prompt sent together under TP and CP (CP: a cached prefix decides the anchor, as
    no anchor carries more load), a budget that would admit them all in one step: the first computes the prompt, the
    other seven wait for its blocks (not computing them again beside it) and compute only the block of their last
    token (block size 4: 1 token each). With the cache off, eight prompts."""
    prompt = [(7 * j) % 50 + 1 for j in range(37)]
    for lay, on in (("tp", True), ("tp", False), ("cp", True), ("cp", False)):
        led = KVLedger(2, 200, 4, lay, prefix=on)
        sched = Scheduler(led, max_num_seqs=16, max_num_batched_tokens=512)
        for j in range(8):
            sched.add(Request(f"s{j}", list(prompt), 5))
        plans = _run_to_end(sched, lambda rid, step: hash((rid, step)) % 50)
        computed = _prompt_tokens_computed(plans, len(prompt))
        assert computed == (37 + 7 * 1 if on else 8 * 37), (lay, on, computed)
        assert [len(p.attach) for p in plans[:2]] == ([0, 7] if on else [0, 0])
        assert sched.prefix_hits == (7 * 36 if on else 0)


def test_samples_wait_for_a_long_prompt_computed_in_chunks():
    """A 100-token prompt x 4 with a 24-token budget: the prompt takes five chunked steps (24 tokens each, then 4),
    registering its blocks chunk by chunk; its siblings start on all 24 of them in the fifth, beside its last chunk —
    the blocks in flight are let go as they are cached (a sibling waiting for one never cached would never start)."""
    prompt = list(range(1, 101))
    led = KVLedger(1, 200, 4, "tp", prefix=True)
    sched = Scheduler(led, max_num_seqs=8, max_num_batched_tokens=24)
    for j in range(4):
        sched.add(Request(f"s{j}", list(prompt), 3))
    plans = _run_to_end(sched, lambda rid, step: 1)
    assert _prompt_tokens_computed(plans, 100) == 100 + 3 * 4
    first_attach = next(i for i, p in enumerate(plans) if p.attach)
    assert first_attach == 4 and {len(h) for _, _, h in plans[first_attach].attach} == {24}


@pytest.mark.parametrize("lay", ["dop", "dp_attn"])
def test_samples_wait_only_for_blocks_computed_where_they_would_hold_them(lay):
    """Owner-local caches (DP-attn/DOP): 8 samples sent together compute the prompt at most once per owner (the owner rule may place samples on another
    owner when the load there outweighs the saving); a sample placed elsewhere does not wait for blocks it could not
    use."""
    prompt = list(range(1, 41))
    led = KVLedger(2, 200, 4, lay, prefix=True)
    sched = Scheduler(led, max_num_seqs=8, max_num_batched_tokens=512)
    for j in range(8):
        sched.add(Request(f"s{j}", list(prompt), 60))
    plans = _run_to_end(sched, lambda rid, step: hash((rid, step)) % 50)
    by_owner = {}
    for plan in plans:
        for it in plan.items:
            if it.start_pos == 0:
                by_owner[it.owner] = by_owner.get(it.owner, 0) + 1
    assert set(by_owner.values()) == {1}, by_owner
    assert _prompt_tokens_computed(plans, 40) == len(by_owner) * 40 + (8 - len(by_owner)) * 4


def test_a_preemption_victim_must_free_blocks_on_the_full_rank():
    """CP, 2 ranks (block b of an anchor-0 request on rank b % 2), 4 blocks per rank. P computed a 16-token prompt
    and cached its 4 blocks; S (newest) started on P's first 3 and computed block 3 (rank 1) itself; B holds one
    block of its own on rank 0; A (oldest) needs its block 2, on rank 0, which is full. S holds blocks on rank 0, but
    all of them shared with P: preempting it would free nothing there (nor would P, whose rank-0 blocks S shares).
    The victim is B, the newest request whose release frees a rank-0 block."""
    led = KVLedger(2, 4, 4, "cp", prefix=True)
    sched = Scheduler(led, max_num_seqs=8, max_num_batched_tokens=64)
    reqs = {"A": Request("A", list(range(100, 109)), 20), "B": Request("B", list(range(200, 205)), 20),
            "P": Request("P", list(range(16)), 20), "S": Request("S", list(range(16)), 20)}
    reqs["A"].num_cached, reqs["B"].num_cached, reqs["P"].num_cached = 8, 4, 16
    led.grow("A", 8, 0)
    led.grow("B", 4, 0)
    led.grow("P", 16, 0)
    hashes = [reqs["P"].block_hash(i, 4) for i in range(4)]
    assert all(led.register("P", i, h) for i, h in enumerate(hashes))
    led.attach("S", 0, hashes[:3])
    led.grow("S", 16, 0)
    reqs["S"].num_cached = 16
    for rid in "ABPS":
        sched.requests[rid] = reqs[rid]
        sched.running.append(reqs[rid])
    assert led.used == [4, 4] and led.short_ranks("A", 9, 0) == [0]
    assert led.frees("S") == [0, 1] and led.frees("P") == [0, 1] and led.frees("B") == [1, 0]
    assert sched._victim(reqs["A"], 64) is reqs["B"]
    led.release("B")
    assert not led.short_ranks("A", 9, 0)   # ... and its release is what A needed


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
