"""The `layout: auto` scheduler's forecast (splash.engine.layout_policy.forecast) replays the engine's own scheduler: the same
admissions, owners, preemptions and finishes, step by step, as the engine's `Scheduler` run one step at a time;
what each layout's pool then costs (pure; the stand-in cost model of test_auto_layout)."""
from __future__ import annotations

from unittest import mock

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from test_auto_layout import LAYOUTS, LinearCost, make

import splash.engine.layout_policy.forecast as forecast_mod
from splash.engine.layout_policy.forecast import BatchForecast, clone_requests, replay
from splash.engine.layout_policy.auto import ReqView
from splash.engine.ledger import KVLedger
from splash.engine.scheduler import Request, Scheduler


def step_by_step(sched: Scheduler, max_steps: int = 20_000, tokens=None):
    """The engine's loop without the model: schedule, sample a non-stop token for each sampled item (-1, or the
    next of `tokens`), update."""
    events, work, step = [], 0, 0
    led = sched.ledger
    while (sched.running or sched.waiting) and step < max_steps:
        before, preempted = {r.req_id for r in sched.running}, sched.num_preemptions
        plan = sched.schedule()
        step += 1
        now = {r.req_id for r in sched.running}
        if sched.num_preemptions != preempted:
            events += [(step, "preempt", rid, None) for rid in sorted(before - now)]
        events += [(step, "admit", rid, led.owner(rid)) for rid in sorted(now - before)]
        sampled = {it.req_id: -1 if tokens is None else next(tokens) for it in plan.items if it.sample}
        work += len(sampled)
        events += [(step, "finish", r.req_id, None) for r in sched.update(plan, sampled)]
    return events, work, step


@st.composite
def request_sets(draw):
    world = draw(st.integers(1, 4))
    bs = draw(st.sampled_from([2, 4, 8]))
    cap = draw(st.integers(16, 64))               # blocks per rank
    lay = draw(st.sampled_from(LAYOUTS))
    fits = cap * bs // 2 if lay != "cp" else cap * bs * world // 2   # a request alone always fits an empty pool
    reqs = []
    for i in range(draw(st.integers(0, 5))):      # running: decoding, or part way through a chunked prompt
        cached = draw(st.integers(1, fits // 3))
        pending = draw(st.sampled_from([1, 1, draw(st.integers(1, fits // 3))]))
        left = draw(st.integers(1, max(1, fits - cached - pending)))
        reqs.append(ReqView(f"r{i}", cached, pending, left, draw(st.integers(0, world - 1))))
    for i in range(draw(st.integers(0, 8))):
        prompt = draw(st.integers(1, fits // 2))
        reqs.append(ReqView(f"w{i}", 0, prompt, draw(st.integers(1, max(1, fits - prompt))), None, running=False))
    led = KVLedger(world, cap, bs, lay)
    used = [0] * world
    for r in reqs:   # the running requests must fit the pool now (a layout they overflow is infeasible)
        if r.running:
            for k, n in enumerate(led.blocks_needed(r.owner, 0, -(-r.cached // bs))):
                used[k] += n
    if any(u > cap for u in used):
        reqs = [r for r in reqs if not r.running]
    chunked = draw(st.booleans())
    budget = draw(st.sampled_from([8, 64, 512]))
    policy = dict(max_num_seqs=draw(st.integers(1, 8)),   # unchunked, the budget holds any context (as the config
                  max_num_batched_tokens=budget if chunked else max(budget, fits),   # requires)
                  preemption_mode=draw(st.sampled_from(["recompute", "queue"])))
    return world, bs, cap, lay, reqs, policy, chunked


@settings(max_examples=150, deadline=None)
@given(request_sets())
def test_the_forecast_makes_the_engine_schedulers_decisions_step_by_step(case):
    """Random request sets through the engine's `Scheduler` one step at a time and through the forecast's replay
    (which applies steady decode runs at once): the same admissions with the same owners, the same preemptions and
    finishes at the same steps, the same output tokens."""
    world, bs, cap, lay, reqs, policy, chunked = case
    scheds = []
    for _ in range(2):
        led = KVLedger(world, cap, bs, lay)
        s = Scheduler(led, **policy)
        s.chunked_prefill = chunked
        clone_requests(reqs, led, s)
        scheds.append(s)
    events, work, steps = step_by_step(scheds[0])
    rp = replay(scheds[1], max_steps=20_000, trace=True)
    assert rp.events == events
    assert rp.work == work
    assert sum(seg.count for seg in rp.segments) <= steps


def test_steady_decode_runs_are_applied_at_once():
    """64 requests decoding 3,000 tokens each with room to spare: a handful of segments, not 3,000 steps."""
    sched = Scheduler(KVLedger(2, 100_000, 16, "dop"), 64, 2048)
    clone_requests([ReqView(f"r{i}", 100, 1, 3000, i % 2) for i in range(64)], sched.ledger, sched)
    rp = replay(sched)
    assert rp.work == 64 * 3000 and len(rp.segments) <= 4


def test_layouts_are_compared_on_the_same_requests_whatever_their_pools_admit_now():
    """DP-attn and DOP cost the same per step; DP-attn's pool holds four of the 512-token prompts, DOP's far more.
    Both are charged for the same eight requests as the scheduler would run them in each (the four prompts fill the
    first step's token budget and end, then the four decoders run): the same time, below the margin, no switch."""
    m = LinearCost(fixed={"tp": 1.0, "dp_attn": 1e-3, "cp": 1.0, "dop": 1e-3})
    a = make(m, caps={"tp": 66, "dp_attn": 66, "cp": 66, "dop": 10_000})
    waiting = ([ReqView(f"p{i}", 0, 512, 1, None, running=False) for i in range(4)]
               + [ReqView(f"o{i}", 0, 64, 200, None, running=False) for i in range(4)])
    d = a.propose(0, "dp_attn", waiting, dict.fromkeys(LAYOUTS, [0, 0]))
    assert d.admitted["dp_attn"] == d.admitted["dop"] == 4
    assert d.seconds_per_token["dp_attn"] == d.seconds_per_token["dop"]
    assert d.verdict in ("stay", "below_margin"), d.reason
    fc = a.forecast.waves("dp_attn", waiting, 66)
    assert (fc.admitted, fc.served, fc.work) == (4, 8, 4 + 800)
    # a request that does not fit even an empty pool is left out, not waited for
    huge = waiting + [ReqView("h", 0, 4096, 10, None, running=False)]
    assert a.forecast.waves("dp_attn", huge, 66).served == 8


def test_prefill_is_charged_as_the_chunked_steps_the_scheduler_runs():
    """A 5000-token prompt with a 2048-token budget is three steps (each paying its fixed cost) with the running
    decoder's row in each, on the least loaded rank; then the 9 decode steps the prompt's request has left."""
    a = make(LinearCost())
    reqs = [ReqView("d0", 3000, 1, 10, 0), ReqView("p", 0, 5000, 10, None, running=False)]
    rp = a.forecast.replay("dp_attn", reqs, 10_000, trace=True)
    pre = [seg.rows for seg in rp.segments if seg.prefill]
    assert len(pre) == 3 and all(sum(n for n, _, _ in rows) <= 2048 for rows in pre)
    assert sum(n for rows in pre for n, _, o in rows if o == 1) == 5000
    assert [rows[0] for rows in pre] == [(1, 3000, 0), (1, 3001, 0), (1, 3002, 0)]
    assert ("admit", "p", 1) in [e[1:] for e in rp.events]
    fixed = LinearCost(fixed=dict.fromkeys(LAYOUTS, 1.0), per_kv=dict.fromkeys(LAYOUTS, 0.0),
                       per_row=dict.fromkeys(LAYOUTS, 0.0))
    fc = make(fixed).forecast.waves("dp_attn", reqs, 10_000)
    assert (fc.prefill_s, fc.decode_s, fc.first_step_s) == (3, 9, 1.0)


def test_a_pool_that_cannot_carry_the_rollout_pays_for_its_preemptions():
    """An RL rollout's long requests: eight 512-token prompts that each grow to 3,584 tokens (224 blocks). Their
    prompts fit every pool at once; their ends do not fit TP's 910 blocks on every rank, nor DP-attn's 732 per owner
    (3 per owner), while DOP's 910 per owner carry four each. The engine's scheduler admits them all and preempts
    the newest as the pool fills (recomputed later); the forecast charges exactly that, so TP and DP-attn pay for
    recomputed prefill and more steps, DOP for neither."""
    per_step = LinearCost(fixed=dict.fromkeys(LAYOUTS, 1.0), per_kv=dict.fromkeys(LAYOUTS, 0.0),
                          per_row=dict.fromkeys(LAYOUTS, 0.0))
    a = make(per_step)
    longs = [ReqView(f"l{i}", 0, 512, 3072, None, running=False) for i in range(8)]
    preempts = {lay: sum(e[1] == "preempt" for e in a.forecast.replay(lay, longs, cap, trace=True).events)
                for lay, cap in (("tp", 910), ("dp_attn", 732), ("dop", 910))}
    assert preempts["dop"] == 0 and preempts["tp"] > 0 and preempts["dp_attn"] > 0
    fc = {lay: a.forecast.waves(lay, longs, cap) for lay, cap in (("tp", 910), ("dp_attn", 732), ("dop", 910))}
    assert all(f.work == 8 * 3072 and f.served == 8 for f in fc.values())
    assert fc["dop"].prefill_s + fc["dop"].decode_s < min(f.prefill_s + f.decode_s for f in (fc["tp"], fc["dp_attn"]))


def test_pricing_is_bounded_and_exact_where_priced():
    """Thirty requests finishing at thirty different lengths: at most MAX_DECODE_PRICED decode runs are priced, and a
    per-row model charges every row of every step once (the runs' middle context is exact for a per-row cost)."""
    from splash.engine.layout_policy import forecast as auto_batch
    calls = []

    class Counting(LinearCost):
        def step(self, layout, rows):
            calls.append(len(rows))
            return super().step(layout, rows)

    per_row = Counting(fixed=dict.fromkeys(LAYOUTS, 0.0), per_kv=dict.fromkeys(LAYOUTS, 0.0),
                       per_row=dict.fromkeys(LAYOUTS, 1e-3))
    reqs = [ReqView(f"s{i}", 600, 1, 50 + 40 * i, i % 2) for i in range(30)]
    fc = make(per_row).forecast.waves("dop", reqs, 10_000)
    rows = sum(50 + 40 * i for i in range(30))
    assert fc.work == rows
    assert len(calls) <= auto_batch.MAX_DECODE_PRICED + auto_batch.MAX_PREFILL_PRICED
    assert abs(fc.decode_s - rows * 1e-3) / (rows * 1e-3) < 0.2   # unpriced runs borrow a neighbour's row count


@st.composite
def live_engines_with_shared_prefixes(draw):
    """A scheduler with the prefix cache on, part way through requests that share prefixes (a common stem, n
    samples of one prompt sent together, a conversation's next turn), and the layout a forecast is asked about
    (the engine's, or another: a switch there forgets or keeps the cache as `KVLedger.relayout` does)."""
    world = draw(st.integers(1, 3))
    bs = draw(st.sampled_from([2, 4]))
    cap = draw(st.integers(24, 64))
    lay = draw(st.sampled_from(LAYOUTS))
    dst = draw(st.sampled_from([lay, lay, *LAYOUTS]))
    fits = cap * bs // 3     # a request's whole context fits any layout's empty pool with room to spare
    stems = [[draw(st.integers(1, 40)) for _ in range(draw(st.integers(1, fits // 3)))] for _ in range(2)]
    groups = []
    for _ in range(draw(st.integers(1, 5))):
        stem = draw(st.sampled_from(stems))
        tail = [draw(st.integers(1, 40)) for _ in range(draw(st.integers(0, 5)))]
        out = draw(st.integers(1, max(1, fits - len(stem) - len(tail))))
        groups.append((stem + tail, out, draw(st.sampled_from([1, 1, 2, 4]))))
    warm = draw(st.integers(0, 12))
    policy = dict(max_num_seqs=draw(st.integers(1, 8)), max_num_batched_tokens=draw(st.sampled_from([8, 24, 512])),
                  preemption_mode=draw(st.sampled_from(["recompute", "queue"])))
    return world, bs, cap, lay, dst, groups, warm, policy


def _all_views(sched: Scheduler) -> list[ReqView]:
    led = sched.ledger
    left = lambda r: min(r.max_tokens - len(r.output), r.max_len - r.num_tokens)   # noqa: E731
    return ([ReqView(r.req_id, r.num_cached, r.pending, left(r), led.owner(r.req_id)) for r in sched.running]
            + [ReqView(r.req_id, 0, r.pending, left(r), None, running=False) for r in sched.waiting])


@settings(max_examples=120, deadline=None)
@given(live_engines_with_shared_prefixes())
def test_the_forecast_sees_the_engines_prefix_cache_step_by_step(case):
    """With the prefix cache on, the forecast replays from the engine's own ledger and cache (forked, switched to the
    forecast layout as a switch would) and its clones carry the requests' block hashes: the same hits, waits for
    blocks in flight, admissions, owners, preemptions and finishes as the engine's scheduler continuing step by
    step (each request sampling tokens no other makes, as the clones' made-up output blocks are their own)."""
    world, bs, cap, lay, dst, groups, warm, policy = case
    led = KVLedger(world, cap, bs, lay, prefix=True)
    live = Scheduler(led, **policy)
    for g, (prompt, out, n) in enumerate(groups):
        for j in range(n):
            live.add(Request(f"g{g}s{j}", list(prompt), out))
    fresh = iter(range(1000, 1 << 30))
    for _ in range(warm):
        if not (live.running or live.waiting):
            break
        plan = live.schedule()
        live.update(plan, {it.req_id: next(fresh) for it in plan.items if it.sample})
    views = _all_views(live)
    forecast = BatchForecast(LinearCost(), None, world=world, block_size=bs, scheduler=live)
    rp = forecast.replay(dst, views, cap, trace=True)
    if dst != lay:
        led.relayout(dst, kept=[()] * world if led.prefix else None)   # a switch keeping no idle block
    events, work, steps = step_by_step(live, tokens=fresh)
    assert rp.events == events
    assert rp.work == work
    assert sum(seg.count for seg in rp.segments) <= steps


def test_a_forecast_charges_a_cached_prefix_only_its_new_tokens():
    """Eight samples of a 96-token prompt waiting, its blocks cached by a finished request: the forecast's prefill
    rows carry only each sample's last block (the engine's cache forked), not 8 x 96 tokens as without the cache."""
    led = KVLedger(2, 400, 16, "tp", prefix=True)
    live = Scheduler(led, max_num_seqs=16, max_num_batched_tokens=2048)
    prompt = list(range(1, 97))
    live.add(Request("first", list(prompt), 1))
    while live.running or live.waiting:
        plan = live.schedule()
        live.update(plan, {it.req_id: 7 for it in plan.items if it.sample})
    live.schedule()   # releases it: its 6 blocks stay cached
    for j in range(8):
        live.add(Request(f"s{j}", list(prompt), 4))
    forecast = BatchForecast(LinearCost(), None, world=2, block_size=16, scheduler=live)
    rp = forecast.replay("tp", _all_views(live), 400)
    assert sum(n for seg in rp.segments if seg.prefill for n, _, _ in seg.rows) == 8 * 16
    led_off = KVLedger(2, 400, 16, "tp")
    cold = BatchForecast(LinearCost(), None, world=2, block_size=16, scheduler=Scheduler(led_off, 16, 2048))
    rp = cold.replay("tp", _all_views(live), 400)
    assert sum(n for seg in rp.segments if seg.prefill for n, _, _ in seg.rows) == 8 * 96


def _decoding(world: int = 2, prefix: bool = False) -> Scheduler:
    """An engine's scheduler with five requests past their prompts, decoding, each with a different output left."""
    live = Scheduler(KVLedger(world, 400, 16, "tp", prefix=prefix), max_num_seqs=16, max_num_batched_tokens=2048)
    for i in range(5):
        live.add(Request(f"r{i}", list(range(1, 40 + 7 * i)), 100 + 45 * i))
    while any(r.pending != 1 for r in live.running) or live.waiting:
        plan = live.schedule()
        live.update(plan, {it.req_id: 7 for it in plan.items if it.sample})
    return live


def _advance(live: Scheduler, steps: int) -> None:
    for _ in range(steps):
        plan = live.schedule()
        live.update(plan, {it.req_id: 7 for it in plan.items if it.sample})


def _count_replays(monkeypatch) -> list:
    from splash.engine.layout_policy import forecast as fc_mod
    replays, real = [], fc_mod.replay
    monkeypatch.setattr(fc_mod, "replay", lambda *a, **k: replays.append(1) or real(*a, **k))
    return replays


@pytest.mark.parametrize("prefix", [False, True])
def test_a_forecast_the_engine_followed_is_not_replayed(monkeypatch, prefix):
    """Every request decoding, none waiting: the engine then runs the steps the forecast replayed, so a forecast
    asked k steps later — the same requests each k tokens further, less those that made their last token — is the
    kept one past its first k steps: the same figures as a fresh replay (a per-context cost checks the cut run's
    middle context) with no scheduler replayed. A request arriving, or one stopping early, is a change: replayed."""
    replays = _count_replays(monkeypatch)
    row = lambda n, c, o: (n, c, o)  # noqa: E731
    live = _decoding(prefix=prefix)
    forecast = BatchForecast(LinearCost(), row, world=2, block_size=16, scheduler=live)
    for lay in LAYOUTS:
        forecast.waves(lay, _all_views(live), 400)
    assert len(replays) == len(LAYOUTS)
    for k in (5, 30, 60, 10, 47):   # within the first steady run, past the first finish, past the second
        _advance(live, k)
        views = _all_views(live)
        for lay in LAYOUTS:
            n = len(replays)
            got = forecast.waves(lay, views, 400)
            assert len(replays) == n, (k, lay)
            fresh = BatchForecast(LinearCost(), row, world=2, block_size=16, scheduler=live).waves(lay, views, 400)
            assert got.work == fresh.work and got.admitted == fresh.admitted and got.served == fresh.served
            assert (got.prefill_s, got.decode_s, got.first_step_s) == pytest.approx(
                (fresh.prefill_s, fresh.decode_s, fresh.first_step_s), rel=1e-12)
    assert len(live.running) == 3   # two made their last token on the way
    _advance(live, 1)
    live.add(Request("late", list(range(1, 20)), 5))
    n = len(replays)
    forecast.waves("tp", _all_views(live), 400)
    assert len(replays) == n + 1
    _advance(live, 3)   # the late one decoding too; then one request stops early (a stop token)
    forecast.waves("tp", _all_views(live), 400)
    live.running[0].max_tokens = len(live.running[0].output) + 1
    n = len(replays)
    forecast.waves("tp", _all_views(live), 400)
    assert len(replays) == n + 1


def test_auto_replays_no_forecast_while_nothing_changes(monkeypatch):
    """`AutoLayout.advise` on an engine whose requests only decode: the periodic re-evaluations (contexts grow) are
    answered from the first evaluation's forecasts — one replay per layout in all, not one per re-evaluation."""
    import math
    replays = _count_replays(monkeypatch)
    live = _decoding(prefix=True)
    a = make(LinearCost(), scheduler=live, overhead_budget=math.inf)
    for step in range(64):
        a.advise(step, "tp", live, live.ledger)
        _advance(live, 1)
    assert a.verdicts.get("stay", 0) >= 4
    assert len(replays) == len(LAYOUTS)


def test_an_evaluation_counts_all_its_time_against_the_default_overhead_budget():
    """By default the engine's evaluations take at most 1% of its steps' measured time (half of the 2% auto may cost
    where it never switches; one evaluation may overshoot it before the next waits), and all of an evaluation counts:
    the request views and each layout's usage it builds before predicting, not only the predictions."""
    clock = [0.0]
    live = _decoding()
    led, usage = live.ledger, live.ledger.usage_under

    def slow_usage(*args, **kw):   # 2 ms per layout on the scheduler's timer: here the evaluations' whole cost
        clock[0] += 2e-3
        return usage(*args, **kw)
    led.usage_under = slow_usage
    a = make(LinearCost(), 0.95, scheduler=live, timer=lambda: clock[0])   # a margin it stays within
    for step in range(200):
        a.advise(step, "tp", live, led)
        plan = live.schedule()
        a.observe("tp", plan.items, 20e-3)   # 20 ms steps
        live.update(plan, {it.req_id: 7 for it in plan.items if it.sample})
    evaluations, o = sum(a.verdicts.values()), a.overhead
    assert evaluations >= 3 and o.spent_s == pytest.approx(evaluations * len(LAYOUTS) * 2e-3)
    assert o.spent_s <= 0.01 * o.ran_s + len(LAYOUTS) * 2e-3


def test_auto_describes_the_requests_only_when_an_evaluation_is_due(monkeypatch):
    """The engine asks `AutoLayout.advise` at every step boundary; at one where no evaluation is due (most of them)
    it describes no request: the request views are built once per evaluation, not once per step."""
    import math
    from splash.engine.layout_policy import auto as auto_mod
    built, real = [], auto_mod.request_views
    monkeypatch.setattr(auto_mod, "request_views", lambda *a: built.append(1) or real(*a))
    live = _decoding(prefix=True)
    a = make(LinearCost(), scheduler=live, overhead_budget=math.inf)
    for step in range(64):
        a.advise(step, "tp", live, live.ledger)
        _advance(live, 1)
    assert sum(a.verdicts.values()) >= 4 and len(built) == sum(a.verdicts.values())


@settings(max_examples=120, deadline=None)
@given(live_engines_with_shared_prefixes(), st.integers(1, 24))
def test_a_followed_forecast_is_the_fresh_one(case, k):
    """Random engines with the prefix cache on, part way through requests that share prefixes: a forecast kept at one
    boundary and asked again k steps later is answered from the kept one whenever the engine's requests are where
    its replay had them (always, for the engine's own layout, requests waiting or not) — with a fresh replay's
    figures."""
    # Every segment priced: pricing samples at most MAX_*_PRICED segments and fills the rest from the nearest, and
    # a kept replay cut at a later boundary samples a different subset than a fresh replay of that tail; what is
    # checked here is that the kept steps are the fresh ones, not that two samplings agree.
    with mock.patch.object(forecast_mod, "MAX_PREFILL_PRICED", 10 ** 9), \
            mock.patch.object(forecast_mod, "MAX_DECODE_PRICED", 10 ** 9):
        _check_followed_is_fresh(case, k)


@settings(max_examples=120, deadline=None)
@given(live_engines_with_shared_prefixes(), st.integers(1, 24))
def test_a_followed_forecast_with_requests_waiting_is_priced_as_the_fresh_one(case, k):
    """The same, with pricing sampled as it is served: a forecast followed while requests wait is priced as a fresh
    replay of its steps samples them, and kept as a fresh replay from there would be kept, so its figures — and the
    decisions made on them — are the fresh one's, then and later. (Two priced per kind: sampling bites more often.)"""
    with mock.patch.object(forecast_mod, "MAX_PREFILL_PRICED", 2), \
            mock.patch.object(forecast_mod, "MAX_DECODE_PRICED", 2):
        _check_followed_is_fresh(case, k, only_waiting=True)


@pytest.mark.parametrize("case, k", [
    ((2, 2, 54, "cp", "dp_attn", [([1] * 12, 1, 1), ([1] * 12, 16, 2), ([1] * 15, 1, 2), ([1] * 12, 16, 4)], 2,
      dict(max_num_seqs=7, max_num_batched_tokens=24, preemption_mode="recompute")), 1),
    ((3, 4, 41, "dop", "tp", [([3, 1, 2, 1, 3, 2, 3, 3, 2], 3, 2), ([3, 1, 3, 1, 1], 32, 4),
                              ([3, 1, 2, 1, 3, 2, 3, 1, 1], 22, 1), ([3, 1, 2, 1, 3, 2, 2], 29, 1),
                              ([3, 1, 2, 1, 3, 2, 2, 2, 1], 28, 1)], 7,
      dict(max_num_seqs=7, max_num_batched_tokens=8, preemption_mode="queue")), 15),
])
def test_another_layouts_followed_forecast_that_readmits_a_preempted_request_is_replayed(case, k):
    """The first: the engine in CP with the prefix cache on; DP-attn's forecast, kept while a 15-token prompt waits,
    has it prefilled on rank 1 and finished, and later preempts a request there that is taken back in the same step,
    on the finished prompt's idle blocks (their hashes lead its prompt's). Asked again one step on (none waiting), a
    fresh replay forks the engine's ledger, whose switch drops idle blocks: the request recomputes all 27 tokens in
    two chunks, where the kept replay found 12 cached. (A saved hypothesis example of the property tests above; the
    second, a DOP engine and TP's forecast with `preemption_mode: queue`, one a random search found.)"""
    with mock.patch.object(forecast_mod, "MAX_PREFILL_PRICED", 10 ** 9), \
            mock.patch.object(forecast_mod, "MAX_DECODE_PRICED", 10 ** 9):
        _check_followed_is_fresh(case, k)


def test_a_forecast_followed_while_requests_wait_is_kept_as_a_fresh_one(monkeypatch):
    """Requests queued behind max_num_seqs, prompts in many chunks (more prefill steps than are priced): a forecast
    for the engine's layout asked again while requests still wait is not replayed, and its figures are a fresh
    replay's; asked again once none waits, it answers as a fresh replay made at the first would from itself."""
    replays = _count_replays(monkeypatch)
    row = lambda n, c, o: (n, c, o)  # noqa: E731
    live = Scheduler(KVLedger(2, 400, 16, "tp", prefix=True), max_num_seqs=3, max_num_batched_tokens=48)
    for i in range(9):
        live.add(Request(f"r{i}", list(range(100 * i, 100 * i + 90 + 9 * i)), 20 + 5 * i))
    forecast = BatchForecast(LinearCost(), row, world=2, block_size=16, scheduler=live)
    forecast.waves("tp", _all_views(live), 400)
    ref = None
    for steps in (5, 0):
        _advance(live, steps)
        while not steps and live.waiting:   # the second time once none waits: followed as before, from what the
            _advance(live, 1)               # first kept
        views = _all_views(live)
        assert all(v.running for v in views) == (not steps)
        n = len(replays)
        got = forecast.waves("tp", views, 400)
        assert len(replays) == n
        ref = ref or BatchForecast(LinearCost(), row, world=2, block_size=16, scheduler=live)
        want = ref.waves("tp", views, 400)
        assert (got.work, got.admitted, got.served) == (want.work, want.admitted, want.served)
        assert (got.prefill_s, got.decode_s, got.first_step_s) == pytest.approx(
            (want.prefill_s, want.decode_s, want.first_step_s), rel=1e-12)
    assert forecast.followed == 2


def _check_followed_is_fresh(case, k, only_waiting: bool = False) -> None:
    """Asked at a boundary, then k steps later, then k // 2 + 1 steps after that: each answer is what a fresh replay
    gives — at the second boundary against one replayed there, at the third against that one asked again (what it
    would have kept: the engine replayed afresh at every boundary where a request waited). `only_waiting` (pricing
    sampled): only where the earlier boundary had a request waiting (a forecast followed with none waiting keeps
    its own sample of prices)."""
    world, bs, cap, lay, dst, groups, warm, policy = case
    live = Scheduler(KVLedger(world, cap, bs, lay, prefix=True), **policy)
    for g, (prompt, out, n) in enumerate(groups):
        for j in range(n):
            live.add(Request(f"g{g}s{j}", list(prompt), out))
    fresh_tokens = iter(range(1000, 1 << 30))
    _advance_with(live, warm, fresh_tokens)
    row = lambda n, c, o: (n, c, o)  # noqa: E731
    forecast = BatchForecast(LinearCost(), row, world=world, block_size=bs, scheduler=live)
    if not (live.running or live.waiting) or forecast.waves(dst, _all_views(live), cap) is None:
        return
    ref, waited = None, False
    for rnd, steps in enumerate((k, k // 2 + 1), start=1):
        _advance_with(live, steps, fresh_tokens)
        views = _all_views(live)
        if not views:
            return
        got = forecast.waves(dst, views, cap)
        if ref is None:
            ref = BatchForecast(LinearCost(), row, world=world, block_size=bs, scheduler=live)
        want = ref.waves(dst, views, cap)
        waits = not all(v.running for v in views)
        if dst == lay:
            assert forecast.followed == rnd
        if not only_waiting or (waits if rnd == 1 else waited):
            assert (got is None) == (want is None)
            if got is not None:
                assert (got.work, got.admitted, got.served) == (want.work, want.admitted, want.served)
                assert (got.prefill_s, got.decode_s, got.first_step_s) == pytest.approx(
                    (want.prefill_s, want.decode_s, want.first_step_s), rel=1e-12)
        if got is None:
            return
        waited = waits


def _advance_with(live: Scheduler, steps: int, tokens) -> None:
    for _ in range(steps):
        if not (live.running or live.waiting):
            return
        plan = live.schedule()
        live.update(plan, {it.req_id: next(tokens) for it in plan.items if it.sample})


def test_a_clones_made_up_block_hashes_do_not_depend_on_the_process_hash_seed():
    """The ledger breaks eviction ties by block hash; a clone's blocks past its original's tokens must hash the same
    in every process, or a forecast (auto's decisions, splash-sim's replays) differs with PYTHONHASHSEED."""
    import os
    import subprocess
    import sys
    code = ("from splash.engine.layout_policy.forecast import _Clone\n"
            "c = _Clone('req-7', range(40), 8)\n"
            "print([c.block_hash(i, 16) for i in range(4)])")
    outs = {subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                           env={**os.environ, "PYTHONHASHSEED": seed}).stdout for seed in ("1", "2", "3")}
    assert len(outs) == 1, outs
