"""A layout switch under the prefix cache (pure): a block k running requests share moves once per receiving rank, not
k times, in every direction; idle cached blocks are kept (where they lie, or moved when the cost verdict allows) within
the destination's room, or dropped; blocks kept across a switch give hits after it."""
from __future__ import annotations

import pytest

from splash.costmodel import CostModel, load_profile
from splash.costmodel.step_cost import cached_moves_pay
from splash.engine.layout_policy.control import LayoutController
from splash.engine.ledger import KVLedger
from splash.engine.scheduler import Request, Scheduler
from splash.models.config import model_config_from_dict
from splash.switching.block_plan import CachedBlock
from splash.switching.manifest import ReqState, plan_switch

LAYOUTS = ("tp", "dp_attn", "cp", "dop")
DIRECTIONS = [(s, d) for s in LAYOUTS for d in LAYOUTS if s != d]
BS = 16
CFG = model_config_from_dict(dict(
    model_type="deepseek_v3", vocab_size=1000, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
    num_attention_heads=8, kv_lora_rank=128, q_lora_rank=64, qk_rope_head_dim=32, qk_nope_head_dim=64,
    v_head_dim=64), allow_planned=True)
H = tuple(range(101, 105))   # prefix hashes of 4 shared blocks


def sharers(k: int, prefix_blocks: int, tail: int = 0, owner: int = 1, dst_owner: int | None = None):
    """k requests on one owner starting on the same `prefix_blocks` cached blocks, each with `tail` private tokens."""
    return {f"s{i}": ReqState(prefix_blocks * BS + tail, owner, dst_owner, H[:prefix_blocks]) for i in range(k)}


def plan(src, dst, reqs, world=4, **kw):
    return plan_switch(src, dst, CFG, world, reqs, BS, 2, "bfloat16", **kw)


@pytest.mark.parametrize("src,dst", DIRECTIONS)
def test_k_sharers_move_one_block(src, dst):
    """8 requests sharing one block (and nothing else), kept together (one destination owner / CP anchor): each rank
    receives one block's bytes at most — what one request's block costs — where planning per request (no hashes)
    receives 8."""
    k = 8
    shared = plan(src, dst, sharers(k, 1, dst_owner=1))
    alone = plan(src, dst, sharers(1, 1, dst_owner=1))
    per_request = plan(src, dst, {q: ReqState(s.num_tokens, s.src_owner, s.dst_owner)
                                  for q, s in sharers(k, 1, dst_owner=1).items()})
    blk = shared.kv_block_bytes_total
    assert shared.kv_recv_total == alone.kv_recv_total
    assert all(b in (0, blk) for b in shared.kv_recv_total)
    assert per_request.kv_recv_total == tuple(k * b for b in alone.kv_recv_total)
    for r in range(4):   # every receiving rank names the block once and all k requests reference it
        if shared.kv_recv_total[r]:
            assert shared.named[r] == (H[0],) and len(shared.attach[r]) == k


def test_dop_to_tp_k_sharers_plus_private_tails():
    """DOP -> TP, 4 requests on owner 1 sharing 3 blocks, each with 2 private blocks: every other rank receives
    3 + 4 x 2 blocks (the shared ones once), not 4 x 5."""
    m = plan("dop", "tp", sharers(4, 3, tail=2 * BS))
    blk = m.kv_block_bytes_total
    assert m.kv_recv_total == (11 * blk, 0, 11 * blk, 11 * blk)
    assert m.shared_moves == 3 * 3 and m.logical_blocks == 3 + 4 * 2
    assert m.dst_in_use == (11,) * 4


def test_sharers_on_two_owners_reshare_without_moving():
    """DP-attn -> TP: two owners each cache the prefix for their own requests; TP needs it on both and both have it,
    so nothing moves for it: the requests from the other owner take the local copy by reference."""
    reqs = {**sharers(2, 2, owner=0), **{f"t{i}": ReqState(2 * BS, 1, None, H[:2]) for i in range(2)}}
    m = plan("dp_attn", "tp", reqs, world=2)
    assert not m.moves and m.kv_recv_total == (0, 0)
    assert sorted(m.attach[0]) == [("t0", 0, 101), ("t0", 1, 102), ("t1", 0, 101), ("t1", 1, 102)]


IDLE = (CachedBlock(201, 0, 0), CachedBlock(202, 1, 0), CachedBlock(301, 0, 1))   # oldest first


def test_idle_cached_blocks_stay_where_they_lie_for_free():
    """DP-attn -> DOP: an owner's cached blocks are where DOP looks them up: all kept, nothing moves."""
    m = plan("dp_attn", "dop", {}, world=2, cached=IDLE, cached_cap=[10, 10])
    assert m.cached_kept == ((201, 202), (301,)) and not m.moves and not any(m.dropped)


def test_idle_cached_blocks_move_only_when_the_cost_allows():
    """DP-attn -> TP needs every cached block on every rank: sent when the verdict allows, else dropped."""
    moved = plan("dp_attn", "tp", {}, world=2, cached=IDLE, cached_cap=[10, 10], move_cached=True)
    assert moved.cached_kept == ((201, 202, 301),) * 2 and sum(mv.req == "" for mv in moved.moves) == 3
    blk = moved.kv_block_bytes_total
    assert moved.kv_recv_total == (blk, 2 * blk)
    dropped = plan("dp_attn", "tp", {}, world=2, cached=IDLE, cached_cap=[10, 10], move_cached=False)
    assert dropped.cached_kept == ((), ()) and not dropped.moves and dropped.dropped == ((201, 202), (301,))


def test_idle_cached_blocks_fit_the_room_newest_first():
    """The destination keeps idle blocks only in the room its running requests leave (under the cap): newest first."""
    reqs = {"a": ReqState(8 * BS, 0)}
    m = plan("dp_attn", "dop", reqs, world=2, cached=IDLE, cached_cap=[9, 0])
    assert m.cached_kept == ((202,), ()) and m.dropped == ((201,), (301,))


def test_cost_rule_prices_transfer_against_expected_recompute():
    """The verdict: a block's transfer against its recompute at the cache's hit rate; no hits so far, no moves."""
    model = CostModel(CFG, 2, load_profile("h200"), "bfloat16", "bfloat16", BS)
    assert cached_moves_pay(model, "tp", 0.5, 2048)
    assert not cached_moves_pay(model, "tp", 0.0, 2048)
    assert not cached_moves_pay(model, "tp", 1e-9, 2048)


def test_cached_blocks_kept_across_a_switch_give_hits_after_it():
    """A finished request's cached blocks survive a DP-attn -> DOP switch (rank 0's mirror keeps them) and a repeat
    of its prompt after the switch starts on them; planned against a ledger that forgets (no manifest), it misses."""
    hits = {}
    for keep in (True, False):
        led = KVLedger(2, 40, 4, "dp_attn", prefix=True)
        sched = Scheduler(led, max_num_seqs=4, max_num_batched_tokens=64)
        prompt = list(range(1, 15))
        sched.add(Request("a", prompt, 2))
        while sched.has_work():
            p = sched.schedule()
            sched.update(p, {it.req_id: 9 for it in p.items if it.sample})
        assert led.cached_blocks() == [3, 0]
        ctl = LayoutController(CFG, 2, 4, 2, "bfloat16")
        ctl.request("dop")
        d = ctl.decide("dp_attn", led, {}, 0)
        assert d.manifest.cached_kept == ((*led.shared.get("a", ()),) or tuple(led.lru[0]), ())
        led.relayout("dop", d.manifest.owners, d.manifest.cached_kept if keep else None)
        sched.add(Request("b", prompt + [7], 2))
        p = sched.schedule()
        hits[keep] = sched.prefix_hits
    assert hits == {True: 12, False: 0}
