"""KDA state snapshots of the prefix cache (pure: rank 0's record, splash.engine.state_snapshots): a hit ends at a
block boundary that has a snapshot on the ranks that will run the request, a snapshot goes with its cached block,
never more are kept than the bound, and a hit never resumes from a snapshot of other tokens. The tokens are checked on
real ranks (tests/distributed/test_prefix_dist.py, glm5_next)."""
from __future__ import annotations

from types import SimpleNamespace

from splash.engine.ledger import KVLedger
from splash.engine.messages import StepItem
from splash.engine.scheduler import Request, Scheduler
from splash.engine.state_snapshots import StateSnapshots, state_holders

BS = 4


def ledger(world: int = 1, layout: str = "tp", slots: int = 8, blocks: int = 64) -> KVLedger:
    led = KVLedger(world, blocks, BS, layout, prefix=True)
    led.snapshots = StateSnapshots(world, BS, layout, slots)
    return led


def cached_request(led: KVLedger, req: str, hashes: list[int], owner: int = 0) -> None:
    """`req` computed len(hashes) full blocks, all registered."""
    led.grow(req, len(hashes) * BS, owner)
    for b, h in enumerate(hashes):
        assert led.register(req, b, h)


def test_holders_follow_where_the_state_lives():
    assert state_holders("tp", 1, 4) == state_holders("dop", 1, 4) == [0, 1, 2, 3]   # a head slice on each
    assert state_holders("dp_attn", 1, 4) == state_holders("cp", 1, 4) == [1]         # whole, on the owner
    assert StateSnapshots(4, BS, "tp", 6).per_rank == 6
    assert StateSnapshots(4, BS, "dp_attn", 6).per_rank == 2


def test_points_are_the_prompt_boundary_and_the_latest_full_block():
    s = StateSnapshots(1, BS, "tp", 8)
    # a 10-token prompt: a repeat resumes at 8 (block 1 ends there); its prefill piece also fills nothing past it
    assert s.points(0, 10, 10) == [1]
    assert s.points(0, 6, 10) == []            # a chunk that stops before the boundary
    assert s.points(6, 10, 10) == [1]
    assert s.points(10, 11, 10) == []          # decode inside block 2
    assert s.points(11, 12, 10) == [2]         # decode fills block 2
    assert s.points(0, 12, 12) == [1, 2]       # the prompt ends on a boundary: both


def test_a_hit_ends_at_a_block_with_a_snapshot():
    led = ledger()
    cached_request(led, "a", [10, 11, 12])
    assert led.lookup([10, 11, 12], 0)[0] == 0          # blocks cached, but no state to resume from
    snaps = led.snapshots
    assert snaps.take("a", 11, 0, latest=False)
    assert led.lookup([10, 11, 12], 0)[0] == 0          # taken in the step being run: not yet usable
    snaps.settle(led.cached_anywhere, led.reqs)
    assert led.lookup([10, 11, 12], 0)[0] == 2          # cut back to block 1's end
    assert led.lookup([10, 11], 0)[0] == 2


def test_a_snapshot_goes_with_its_block():
    led = ledger()
    cached_request(led, "a", [10, 11, 12])
    snaps = led.snapshots
    snaps.take("a", 11, 0, latest=False)
    snaps.take("a", 12, 0, latest=False)
    snaps.settle(led.cached_anywhere, led.reqs)
    led.release("a")                                   # evictable now, oldest first: 10, 11, 12
    snaps.take_drops()
    led.capacity["tp"] = 2                              # room for two blocks: the oldest goes
    assert led.evictions() == [[10]]
    assert snaps.take_drops() == [[]] and 11 in snaps.held[0]   # block 11 is still cached: its snapshot stays
    led.capacity["tp"] = 1
    assert led.evictions() == [[11]]
    assert snaps.take_drops() == [[11]] and 11 not in snaps.held[0]
    assert led.evict_unused() == [[12]]
    assert snaps.take_drops() == [[12]] and not snaps.held[0]


def test_a_snapshot_of_a_block_never_cached_is_dropped():
    led = ledger()
    led.grow("a", 8, 0)
    snaps = led.snapshots
    assert snaps.take("a", 21, 0, latest=False)        # its block's registration did not happen (e.g. a gap)
    snaps.settle(led.cached_anywhere, led.reqs)
    assert snaps.take_drops() == [[21]] and not snaps.held[0]


def test_bounded_least_recently_used_and_never_one_of_this_step():
    led = ledger(slots=2)
    cached_request(led, "a", [1, 2, 3, 4])
    s = led.snapshots
    assert s.take("x", 1, 0, latest=False) and s.take("y", 2, 0, latest=False)
    assert not s.take("z", 3, 0, latest=False)          # both slots hold this step's snapshots
    s.settle(led.cached_anywhere, led.reqs)
    s.touch(1, 0)                                      # a hit on 1: 2 is now the least recently used
    assert s.take("z", 3, 0, latest=False)
    assert list(s.held[0]) == [1, 3] and s.take_drops() == [[2]]


def test_a_request_keeps_only_its_latest_past_prompt_snapshot():
    led = ledger()
    cached_request(led, "a", [1, 2, 3])
    s = led.snapshots
    s.take("a", 1, 0, latest=False)                   # its prompt's boundary: stays
    s.take("a", 2, 0, latest=True)
    s.settle(led.cached_anywhere, led.reqs)
    s.take("a", 3, 0, latest=True)                    # replaces 2
    s.settle(led.cached_anywhere, led.reqs)
    assert list(s.held[0]) == [1, 3] and s.take_drops() == [[2]]


def test_owner_run_layouts_resume_only_on_the_owner_holding_the_snapshot():
    led = ledger(world=2, layout="dp_attn")
    cached_request(led, "a", [7, 8], owner=1)
    led.snapshots.take("a", 8, 1, latest=False)
    led.snapshots.settle(led.cached_anywhere, led.reqs)
    assert led.snapshots.held == [{}, {8: None}]
    assert led.lookup([7, 8], 1)[0] == 2 and led.lookup([7, 8], 0)[0] == 0


def test_a_switch_forgets_every_snapshot():
    led = ledger(world=2, layout="tp")
    cached_request(led, "a", [7, 8])
    led.snapshots.take("a", 8, 0, latest=False)
    led.snapshots.settle(led.cached_anywhere, led.reqs)
    led.relayout("dop")
    assert led.snapshots.held == [{}, {}] and led.lookup([7, 8], 0)[0] == 0


def _run(sched: Scheduler, led: KVLedger, steps: int = 40) -> list:
    """Drive the scheduler as Engine.step does (plan, snapshots, update with token 5, settle); -> the attaches."""
    attached = []
    for _ in range(steps):
        plan = sched.schedule()
        reqs = sched.requests
        led.snapshots.plan(plan.items, reqs)
        attached += plan.attach
        sched.update(plan, {it.req_id: 5 for it in plan.items if it.sample})
        led.snapshots.settle(led.cached_anywhere, led.reqs)
        if not sched.has_work():
            break
    return attached


def test_a_hit_never_resumes_from_a_snapshot_of_other_tokens():
    led = ledger()
    sched = Scheduler(led, 8, 64)
    a = list(range(1, 11))                              # 10 tokens: snapshot at the end of block 1 (token 8)
    sched.add(Request("a", a, 2))
    _run(sched, led)
    # b shares a's first block only: blocks cached for its block 0, but the one snapshot is of a's first 8 tokens
    sched.add(Request("b", a[:4] + [99, 98, 97, 96, 95, 94], 2))
    assert _run(sched, led) == []
    # c repeats a's first 8 tokens: it resumes from exactly that snapshot, named by the hash of those 8 tokens
    sched.add(Request("c", a[:8] + [50, 51], 2))
    (rid, owner, hashes), = _run(sched, led)
    ref = Request("ref", a[:8], 0)
    assert rid == "c" and list(hashes) == [ref.block_hash(0, BS), ref.block_hash(1, BS)]
    assert hashes[-1] in led.snapshots.held[0]


def test_a_prompt_parting_from_cached_ones_is_snapshotted_where_it_parts():
    s = StateSnapshots(1, BS, "tp", 8)
    cached = {100, 101, 102}.__contains__             # blocks 0-2 of a shared system prompt are cached
    hash_of = {0: 100, 1: 101, 2: 102, 3: 203, 4: 204, 5: 205}.__getitem__
    assert s.junction(0, 23, 23, hash_of, cached) == 2
    assert s.junction(0, 8, 23, hash_of, cached) is None      # the run goes on past this chunk
    assert s.junction(8, 23, 23, hash_of, cached) == 2
    assert s.junction(12, 23, 23, hash_of, cached) is None    # started past it (a hit)
    req = SimpleNamespace(prompt=[0] * 23, block_hash=lambda b, bs: hash_of(b))
    assert [t.block for t in s.plan([StepItem("a", 0, (0,) * 23, True, 0)], {"a": req}, cached)] == [2, 4]
