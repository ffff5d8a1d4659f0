"""The `layout: auto` scheduler's forecast (splash.engine.auto_batch): which requests each layout serves and when,
and the chunked prefill steps it predicts (pure; the stand-in cost model of test_auto_layout)."""
from __future__ import annotations

from test_auto_layout import LAYOUTS, LinearCost, make

from splash.engine.auto_layout import AutoLayout, ReqView


def test_layouts_are_compared_on_the_same_requests_whatever_their_pools_admit_now():
    """DP-attn and DOP cost the same per step; DP-attn's pool admits only the four prefill-heavy requests at the
    head of the queue (one output token each), DOP's all eight. Per output token of the admitted batch alone DOP
    looked twice as fast; charged for the same eight requests (DP-attn's second wave after its first) the two
    differ by a few steps' fixed cost, below the margin: no switch."""
    m = LinearCost(fixed={"tp": 1.0, "dp_attn": 1e-3, "cp": 1.0, "dop": 1e-3})
    a = make(m, caps={"tp": 66, "dp_attn": 66, "cp": 66, "dop": 10_000})
    waiting = ([ReqView(f"p{i}", 0, 512, 1, None, running=False) for i in range(4)]
               + [ReqView(f"o{i}", 0, 64, 200, None, running=False) for i in range(4)])
    d = a.propose(0, "dp_attn", waiting, dict.fromkeys(LAYOUTS, [0, 0]))
    assert d.admitted["dp_attn"] == 4 and d.admitted["dop"] == 8
    assert d.seconds_per_token["dp_attn"] < 1.1 * d.seconds_per_token["dop"]
    assert d.verdict in ("stay", "below_margin"), d.reason
    fc = a.forecast.waves("dp_attn", waiting, 66)
    assert (fc.admitted, fc.served, fc.work) == (4, 8, 4 + 800)
    # a request that does not fit even an empty pool is left out, not waited for
    huge = waiting + [ReqView("h", 0, 4096, 10, None, running=False)]
    assert a.forecast.waves("dp_attn", huge, 66).served == 8


def test_prefill_is_predicted_as_the_chunked_steps_the_scheduler_runs():
    """A 5000-token prompt with a 2048-token budget is three steps (each paying its fixed cost), running decoders
    add a row to every step, and a waiting request is placed on the least loaded rank."""
    a = make(LinearCost())
    reqs = [ReqView("d0", 3000, 1, 10, 0), ReqView("p", 0, 5000, 10, None, running=False)]
    owners = a.forecast.place(reqs)
    assert owners == {"d0": 0, "p": 1}
    steps, made = a.forecast.prefill_plan(reqs, owners)
    assert len(steps) == 3 and all(sum(n for n, _, _ in rows) <= 2048 for rows in steps)
    assert sum(n for rows in steps for n, _, o in rows if o == 1) == 5000
    assert [rows[0] for rows in steps] == [(1, 3000, 0), (1, 3001, 0), (1, 3002, 0)]
    assert made == {"d0": 3, "p": 1}
    fixed = LinearCost(fixed=dict.fromkeys(LAYOUTS, 1.0), per_kv=dict.fromkeys(LAYOUTS, 0.0),
                       per_row=dict.fromkeys(LAYOUTS, 0.0))
    fc = make(fixed).forecast.waves("dp_attn", reqs, 10_000)
    assert (fc.prefill_s, fc.decode_s, fc.first_step_s) == (3, 9, 1.0)   # 3 prefill steps, then the 9 decode
    # steps left of each request


def test_prefill_plan_is_bounded_when_decode_rows_fill_the_budget():
    a = AutoLayout(LinearCost(), LAYOUTS, 0.1, block_size=16, world=2, capacity_blocks=dict.fromkeys(LAYOUTS, 10**6),
                   max_num_seqs=64, max_num_batched_tokens=8, row=lambda n, c, o: (n, c, o))
    reqs = [ReqView(f"d{i}", 100, 1, 10**6, i % 2) for i in range(16)] + [ReqView("p", 0, 100_000, 4, None, False)]
    steps, made = a.forecast.prefill_plan(reqs, a.forecast.place(reqs))
    assert len(steps) == 4097 and all(len(rows) == 17 for rows in steps[:-1])   # 16 decode rows + 1 prompt token
    assert sum(n for rows in steps for n, _, _ in rows) - 16 * 4096 == 100_000      # every prompt token once
    assert made["p"] == 1 and made["d0"] == 4096


def test_admission_holds_each_request_to_its_end_not_its_prompt():
    """An RL rollout's long requests: eight 512-token prompts that each grow to 3,584 tokens. Their prompts fit
    every pool at once; their ends fit only a pool of 4 x 224 blocks per owner. The forecast admits in each layout
    what it can carry to the end (TP, every rank holding every request: 4; DP-attn's 732 blocks per owner: 3 per
    owner; DOP's 910: all 8), while short requests that finish before the long ones peak do not count at that
    peak."""
    a = make(LinearCost())
    longs = [ReqView(f"l{i}", 0, 512, 3072, None, running=False) for i in range(8)]
    assert a.forecast.waves("tp", longs, 910).admitted == 4
    assert a.forecast.waves("dp_attn", longs, 732).admitted == 6
    assert a.forecast.waves("dop", longs, 910).admitted == 8
    assert all(a.forecast.waves(lay, longs, cap).served == 8 for lay, cap in (("tp", 910), ("dp_attn", 732)))
    shorts = [ReqView(f"s{i}", 0, 512, 64, None, running=False) for i in range(24)]
    assert a.forecast.waves("dop", shorts + longs, 910).admitted == 32   # 24 x 36 blocks fit beside the starts
    assert a.forecast.waves("dop", shorts + longs, 910).served == 32


def test_running_requests_the_pool_cannot_carry_are_shed_newest_first_on_the_full_rank():
    """Four running requests on owner 0 that will grow to 3,584 tokens (224 blocks each) in a 700-block pool:
    the newest on that rank is shed to the queue to recompute its 1,000 cached tokens (charged as prefill), and
    re-admitted on owner 1, where it fits, as the ledger would place it; owner 1's request is untouched. In a
    1,000-block pool nothing is shed."""
    a = make(LinearCost())
    run = [ReqView(f"r{i}", 1000, 1, 2584, 0) for i in range(4)] + [ReqView("x", 1000, 1, 2584, 1)]
    kept, queue = a.forecast._shed("dop", run, [], 700)
    assert [r.req_id for r in kept] == ["r0", "r1", "r2", "x"]
    assert [(r.req_id, r.cached, r.pending, r.owner, r.running) for r in queue] == [("r3", 0, 1001, None, False)]
    assert a.forecast._shed("dop", run, [], 1000) == (run, [])
    fc = a.forecast.waves("dop", run, 700)
    assert fc.admitted == 5 and fc.served == 5 and fc.prefill_s > 0


def test_a_rounds_decode_is_charged_as_its_requests_finish():
    """One round, no queue: 30 requests that finish after 64 tokens, 2 after 100 and 1 that runs 3,000. Per-row
    steps (1 ms a row, nothing else): 30 x 64 + 2 x 100 + 3,000 rows — 5.12 s. Cutting the decode only at the first
    finisher charged the 2 for the long one's whole round (10.9 s); the cuts fall where requests finish."""
    from splash.engine.auto_batch import decode_cuts
    per_row = LinearCost(fixed=dict.fromkeys(LAYOUTS, 0.0), per_kv=dict.fromkeys(LAYOUTS, 0.0),
                         per_row=dict.fromkeys(LAYOUTS, 1e-3))
    reqs = ([ReqView(f"s{i}", 600, 1, 64, i % 2) for i in range(30)] + [ReqView("i0", 60, 1, 100, 0),
            ReqView("i1", 60, 1, 100, 1), ReqView("l", 600, 1, 3000, 0)])
    fc = make(per_row).forecast.waves("dop", reqs, 10_000)
    assert abs(fc.decode_s - (30 * 64 + 2 * 100 + 3000) * 1e-3) < 1e-9 and fc.work == 30 * 64 + 2 * 100 + 3000
    assert decode_cuts([64] * 30 + [100] * 2 + [3000], 3000) == [64, 100, 3000]
    # after chunked prefill a rollout's short requests finish a few tokens apart, its long ones too: the cuts end
    # the clusters (at most DECODE_PIECES of them, at the widest gaps)
    assert decode_cuts([56, 57, 58, 59, 60, 61, 62, 63, 3064, 3066, 3071], 3071) == [63, 3064, 3066, 3071]
