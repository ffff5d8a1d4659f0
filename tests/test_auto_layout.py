"""The auto-layout controller's policy (pure; a stand-in cost model whose costs the tests set)."""
from __future__ import annotations

import subprocess
import sys
import math
from dataclasses import replace
from types import SimpleNamespace

import pytest

from splash.engine.layout_policy.auto import AutoLayout, ReqView
from splash.engine.layout_policy.correction import mix_distance, stage_mix
from splash.engine.messages import StepItem

LAYOUTS = ("tp", "dp_attn", "cp", "dop")


class LinearCost:
    """seconds = fixed[layout] + per_kv[layout] * Σ context + per_row[layout] * rows; switch = `switch_s`."""

    def __init__(self, fixed=None, per_kv=None, per_row=None, switch_s=0.0):
        self.fixed = fixed or dict.fromkeys(LAYOUTS, 1e-3)
        self.per_kv = per_kv or dict.fromkeys(LAYOUTS, 1e-7)
        self.per_row = per_row or dict.fromkeys(LAYOUTS, 1e-5)
        self.switch_s = switch_s
        self.calls = 0

    def step(self, layout, rows):
        self.calls += 1
        ctx = sum(c + n for n, c, _ in rows)
        return SimpleNamespace(seconds=self.fixed[layout] + self.per_kv[layout] * ctx
                               + self.per_row[layout] * len(rows))

    def switch(self, manifest, mode, step_seconds=None):
        return SimpleNamespace(exposed_seconds=self.switch_s)


def make(model, margin=0.10, caps=None, world=2, max_num_seqs=64, **kw):
    return AutoLayout(model, LAYOUTS, margin, block_size=16, world=world,
                      capacity_blocks=caps or dict.fromkeys(LAYOUTS, 10_000), max_num_seqs=max_num_seqs,
                      max_num_batched_tokens=2048, row=lambda n, c, o: (n, c, o), **kw)


def pieces(rows):
    """Rows (new tokens, context, owner) as the executed step's pieces `AutoLayout.observe` gets."""
    return [StepItem(f"r{i}", c, (0,) * n, True, o) for i, (n, c, o) in enumerate(rows)]


def decode_batch(n, ctx, remaining=100):
    return [ReqView(f"r{i}", ctx, 1, remaining, i % 2) for i in range(n)]


def usage(reqs, world=2):
    return dict.fromkeys(LAYOUTS, [0] * world)


def test_picks_the_fastest_and_stays_when_current_is_fastest():
    m = LinearCost(fixed={"tp": 1e-3, "dp_attn": 3e-3, "cp": 3e-3, "dop": 2e-3})
    a = make(m)
    reqs = decode_batch(4, 100)
    assert a.propose(0, "tp", reqs, usage(reqs)).verdict == "stay"
    d = a.propose(0, "dop", reqs, usage(reqs))
    assert (d.verdict, d.target) == ("switch", "tp")
    assert d.payoff_s > 0 and d.seconds_per_token["tp"] < d.seconds_per_token["dop"]


def test_margin_prevents_flapping_at_a_crossover():
    # TP's step grows faster with context than DOP's: they cross where the 4 rows' contexts sum to 4200 (ctx ≈ 1000)
    m = LinearCost(fixed={"tp": 1e-3, "dp_attn": 1.0, "cp": 1.0, "dop": 1.2e-3},
                   per_kv={"tp": 1e-7 + 0.2e-3 / 4200, "dp_attn": 1e-7, "cp": 1e-7, "dop": 1e-7})
    a = make(m, margin=0.10)
    cur, switches = "tp", 0
    # contexts oscillating around the crossover, as a batch's growth and churn would
    for step, ctx in enumerate([900, 1000, 1100, 950, 1050, 1000, 980, 1020] * 4):
        reqs = decode_batch(4, ctx)
        d = a.propose(step, cur, reqs, usage(reqs))
        if d.verdict == "switch":
            d = a.vet(d, manifest=None)
        if d.verdict == "switch":
            cur, switches = d.target, switches + 1
    assert switches == 0
    # with no margin the same sequence flaps
    a0, cur, flaps = make(m, margin=0.0), "tp", 0
    for step, ctx in enumerate([900, 1100] * 4):
        reqs = decode_batch(4, ctx)
        d = a0.propose(step, cur, reqs, usage(reqs))
        if d.verdict == "switch":
            cur, flaps = d.target, flaps + 1
    assert flaps >= 4


def test_a_switch_costing_more_than_its_payoff_is_not_taken():
    m = LinearCost(fixed={"tp": 1e-3, "dp_attn": 2e-3, "cp": 2e-3, "dop": 2e-3}, switch_s=10.0)
    a = make(m)
    reqs = decode_batch(4, 100, remaining=8)
    d = a.propose(0, "dop", reqs, usage(reqs))
    assert d.verdict == "switch"
    v = a.vet(d, manifest=None)
    assert v.verdict == "not_worth_it" and v.switch_raw_s == 10.0 and "switch cost" in v.reason
    assert v.switch_s >= 10.0                       # corrected: no switch observed yet, a conservative ratio
    m.switch_s = 1e-6
    long = decode_batch(4, 100, remaining=1000)
    assert a.vet(a.propose(1, "dop", long, usage(long)), manifest=None).verdict == "switch"


def test_an_infeasible_layout_is_never_chosen():
    m = LinearCost(fixed={"tp": 1e-4, "dp_attn": 5e-3, "cp": 5e-3, "dop": 2e-3})
    a = make(m, caps={"tp": 10, "dp_attn": 100, "cp": 100, "dop": 100})
    reqs = decode_batch(4, 100)
    use = {"tp": [20, 20], "dp_attn": [10, 10], "cp": [10, 10], "dop": [10, 10]}
    d = a.propose(0, "dp_attn", reqs, use)
    assert "tp" in d.infeasible and d.target == "dop" and d.verdict == "switch"
    assert "tp" not in d.seconds_per_token


def test_joint_admission_prefers_the_layout_that_admits_blocked_requests():
    # DP-attn is a little faster per row, but its pool admits only 2 of the 8 waiting requests while DOP's
    # larger pool admits all of them: per output token DOP wins once the fixed cost is shared by more rows
    m = LinearCost(fixed={"tp": 1.0, "dp_attn": 5e-3, "cp": 1.0, "dop": 5e-3},
                   per_row={"tp": 1.0, "dp_attn": 1.0e-4, "cp": 1.0, "dop": 1.1e-4}, per_kv=dict.fromkeys(LAYOUTS, 0))
    a = make(m, caps={"tp": 8, "dp_attn": 8, "cp": 8, "dop": 40})
    waiting = [ReqView(f"w{i}", 0, 64, 30, None, running=False) for i in range(8)]
    use = dict.fromkeys(LAYOUTS, [0, 0])
    d = a.propose(0, "dp_attn", waiting, use)
    assert d.admitted["dp_attn"] == 2 and d.admitted["dop"] == 8     # 93 tokens at the end: 1 per rank vs all
    assert (d.verdict, d.target) == ("switch", "dop")
    # when everything fits both, DP-attn's faster rows keep it
    a2 = make(m, caps=dict.fromkeys(LAYOUTS, 1000))
    assert a2.propose(0, "dp_attn", waiting, use).verdict in ("stay", "below_margin")


def test_online_factor_learns_measured_over_predicted():
    m = LinearCost()
    a = make(m, observe_every=1)
    rows = [(1, 100, 0)] * 4
    pred = m.step("tp", rows).seconds
    for _ in range(40):
        a.observe("tp", pieces(rows), 2.0 * pred)
    assert abs(a.factor("tp") - 2.0) < 0.01
    assert a.stats["tp"].median_error is not None and a.stats["tp"].median_error < 0.05
    # a layout not visited yet takes the visited layouts' correction: it is not made to look cheaper
    assert abs(a.factor("dop") - 2.0) < 0.01
    for _ in range(40):
        a.observe("dop", pieces(rows), 4.0 * pred)           # DOP is slower still: its own residual learns that
    assert abs(a.factor("dop") - 4.0) < 0.01 and abs(a.factor("tp") - 2.0) < 0.01
    assert abs(a.factor("cp") - 8 ** 0.5) < 0.05     # geometric mean of the visited ones
    before = a.factor("cp")
    a.observe("cp", pieces(rows), 50.0, switched=True)       # a switch step records, does not train
    assert a.factor("cp") == before and len(a.switches) == 1


def test_prefill_and_decode_steps_train_separate_factors():
    m = LinearCost()
    a = make(m, observe_every=1)
    dec, pre = [(1, 100, 0)] * 4, [(512, 0, 0), (1, 100, 1)]
    assert a.factor("tp", "prefill") == 1.0                        # nothing seen: no correction
    for _ in range(40):
        a.observe("tp", pieces(dec), 1.5 * m.step("tp", dec).seconds)
    assert abs(a.factor("tp", "prefill") - 1.5) < 0.01             # no prefill step yet: borrows decode's
    for _ in range(40):
        a.observe("tp", pieces(pre), 3.0 * m.step("tp", pre).seconds)
    assert abs(a.factor("tp", "prefill") - 3.0) < 0.01 and abs(a.factor("tp") - 1.5) < 0.01
    assert abs(a.factor("dop", "prefill") - 3.0) < 0.01            # unvisited: the visited prefill mean
    # the prediction of a batch with a pending prompt charges its prefill steps at the prefill factor
    waiting = [ReqView("w", 0, 512, 4, None, running=False)]
    use = dict.fromkeys(LAYOUTS, [0, 0])
    d = a.propose(0, "tp", waiting, use)
    fc = a.forecast.waves("tp", waiting, 10_000)
    p, dcd = fc.prefill_s, fc.decode_s
    assert abs(d.batch_seconds["tp"] - (a.factor("tp", "prefill") * p + a.factor("tp") * dcd)) < 1e-12


def test_reevaluation_only_when_the_batch_changes_or_periodically():
    a = make(LinearCost())
    reqs = decode_batch(3, 10)
    assert a.due(0, reqs) and not a.due(1, reqs)
    assert not a.due(2, reqs[:2])                    # changed, but within the minimum interval
    assert a.due(a.min_interval, reqs[:2])           # changed, interval passed
    assert not a.due(a.min_interval + 1, reqs[:2])
    assert a.due(a.min_interval + a.reeval_steps, reqs[:2])       # periodic: contexts grow
    waiting = [ReqView("w", 0, 8, 8, None, running=False)]
    assert a.due(a.min_interval + a.reeval_steps + 1, waiting)  # idle boundary: at once


def test_predictions_stay_within_the_overhead_budget_of_the_steps_time():
    clock = [0.0]

    class SlowCost(LinearCost):   # every prediction takes 1 ms on the scheduler's timer
        def step(self, layout, rows):
            clock[0] += 1e-3
            return super().step(layout, rows)

    m = SlowCost()
    a = make(m, timer=lambda: clock[0], overhead_budget=0.02)
    reqs = decode_batch(2, 10)
    assert a.due(0, reqs)
    a.record(a.propose(0, "tp", reqs, usage(reqs)))
    spent = a.summary()["overhead"]["predict_s"]
    assert m.calls >= 4 and abs(spent - m.calls * 1e-3) < 1e-9
    steps = 0
    while not a.due(a.reeval_steps + steps, reqs) and steps < 10_000:   # periodic re-evaluation waits for credit
        a.observe("tp", pieces([(1, 10, 0), (1, 10, 1)]), 5e-3)      # 5 ms steps (every 8th observation predicts)
        steps += 1
    o = a.summary()["overhead"]
    assert o["share"] <= 0.02 and spent / 0.02 / 5e-3 - 1 <= steps < 10_000
    assert a.stats["tp"].n > 0 and o["observe_s"] > 0         # observations: not budgeted, never wait
    assert steps > a.reeval_steps                             # without the budget it would have come at 16
    idle = [ReqView("w", 0, 8, 8, None, running=False)]
    b = make(SlowCost(), timer=lambda: clock[0])
    b.observe("tp", pieces([(1, 10, 0)]), 1e-3)
    b.overhead.spent_s = 1.0                                        # far over budget
    assert not b.due(b.reeval_steps, reqs)
    assert b.due(b.reeval_steps + 1, idle)                    # an idle boundary never waits for credit


def test_observe_reads_the_steps_pieces_and_makes_rows_only_for_the_steps_that_train():
    """`observe` gets the executed step's pieces as the step message carried them (the engine copies nothing per
    step); the cost model's rows are made only for the steps that train (every observe_every-th decode step, every
    prefill step)."""
    made = []
    a = AutoLayout(LinearCost(), LAYOUTS, 0.1, block_size=16, world=2, capacity_blocks=dict.fromkeys(LAYOUTS, 10_000),
                   max_num_seqs=64, max_num_batched_tokens=2048,
                   row=lambda n, c, o: made.append((n, c, o)) or (n, c, o))
    step = pieces([(1, 100 + i, i % 2) for i in range(34)])
    for _ in range(1 + a.observe_every):           # the first step warms up
        a.observe("tp", step, 1e-2)
    assert made == [(1, 100 + i, i % 2) for i in range(34)] and a.stats["tp"].n == 1
    a.observe("tp", pieces([(64, 0, 0)]), 1e-2)
    assert made[-1] == (64, 0, 0) and a.prefill_stats["tp"].n == 1


def test_summary_is_made_once_per_change():
    """The server publishes `summary()` after every step: the last decision's dict and the factors' view are made
    once per decision and per trained step, not once per call, and show the new values once those change."""
    a = make(LinearCost(), observe_every=1)
    reqs = decode_batch(2, 10)
    a.record(a.propose(0, "tp", reqs, usage(reqs)))
    s1, s2 = a.summary(), a.summary()
    assert s1["last_decision"] is s2["last_decision"] and s1["model"] is s2["model"]
    for _ in range(2):                            # the first observed step warms up and trains nothing
        a.observe("tp", pieces([(1, 10, 0)]), 1.0)
    s3 = a.summary()
    assert s3["model"] is not s1["model"] and s3["model"]["tp"]["last_measured_s"] == 1.0
    assert s3["model"]["tp"]["factor"] == round(a.factor("tp"), 4) != s1["model"]["tp"]["factor"]
    a.record(a.propose(1, "tp", reqs, usage(reqs)))
    assert a.summary()["last_decision"]["step"] == 1 and s3["last_decision"]["step"] == 0


def test_observe_feeds_every_nth_step():
    m = LinearCost()
    a = make(m)
    for _ in range(8):
        a.observe("tp", pieces([(1, 10, 0)]), 1.0)
    assert len(a.stats["tp"].errors) == 8 // a.observe_every


def test_auto_layout_imports_no_torch():
    code = ("import sys; sys.modules['torch'] = None; import splash.engine.layout_policy.auto as m; "
            "print(m.AutoLayout.__name__)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr


def test_a_failing_cost_model_keeps_the_layout_and_the_requests():
    """The scheduler only advises: a prediction that raises must not fail a step (no request can take the job down)."""
    from splash.distributed import SingleRankCommunicator
    from splash.engine.llm import LLM
    from splash.engine.sampling import SamplingParams

    class Broken:
        def step(self, layout, rows):
            raise RuntimeError("broken cost model")

        def switch(self, manifest, mode, step_seconds=None):
            raise RuntimeError("broken cost model")

    llm = LLM(preset="tiny-mla", comm=SingleRankCommunicator(), layout="auto", num_kv_blocks=64)
    want = LLM(preset="tiny-mla", comm=SingleRankCommunicator(), num_kv_blocks=64).generate(
        [[1, 2, 3], [4, 5]], SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))
    assert llm.engine.auto is not None and llm.engine.layout_mode == "auto"
    llm.engine.auto.model = Broken()
    got = llm.generate([[1, 2, 3], [4, 5]], SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert llm.engine.layout == "tp" and not llm.engine.switch_counts


def _visit(a, m, layout, factor, n=8):
    rows = [(1, 100, 0)] * 4
    for _ in range(n):
        a.observe(layout, pieces(rows), factor * m.step(layout, rows).seconds)


def test_a_layout_on_a_borrowed_factor_is_entered_only_when_its_lead_survives():
    # DOP predicted 15% faster: more than the margin, less than the borrowed factor's uncertainty (x1.28)
    m = LinearCost(fixed={"tp": 1e-3, "dp_attn": 1.0, "cp": 1.0, "dop": 0.85e-3},
                   per_kv=dict.fromkeys(LAYOUTS, 0.0), per_row=dict.fromkeys(LAYOUTS, 0.0))
    a = make(m, observe_every=1)
    _visit(a, m, "tp", 3.0)
    reqs = decode_batch(4, 100)
    d = a.propose(100, "tp", reqs, usage(reqs))
    assert (d.verdict, d.target, d.probe) == ("switch", "dop", True) and d.uncertainty["dop"] > d.uncertainty["tp"]
    # a probe is bounded: its round trip (2 x 0.05 s, the conservative prior) must be within 5% of the work left
    assert a.vet(d, manifest=None).verdict == "not_worth_it"                  # 0.3 s left in TP
    long = decode_batch(4, 100, remaining=10_000)
    v = a.vet(a.propose(100, "tp", long, usage(long)), manifest=None)
    assert v.verdict == "switch" and v.probe and "probe" in v.reason
    a.record(v)                                               # taken: DOP's one probe is spent
    d = a.propose(100, "tp", reqs, usage(reqs))
    assert (d.verdict, d.target, d.probe) == ("uncertain", "dop", False)
    m.fixed["dop"] = 0.6e-3                                   # a lead that survives it: taken
    assert a.propose(101, "tp", reqs, usage(reqs)).verdict == "switch"
    m.fixed["dop"] = 0.85e-3                                  # once DOP has its own measurements, 15% suffices
    _visit(a, m, "dop", 3.0, n=40)
    d = a.propose(102, "tp", reqs, usage(reqs))
    assert d.verdict == "switch" and not d.probe


def test_the_payoff_test_uses_the_learnt_switch_cost():
    m = LinearCost(fixed={"tp": 1e-3, "dp_attn": 2e-3, "cp": 2e-3, "dop": 2e-3}, switch_s=0.02)
    a = make(m, observe_every=1)
    for lay in LAYOUTS:
        _visit(a, m, lay, 1.0)
    reqs = decode_batch(4, 100, remaining=100)           # payoff 100 x 1 ms = 0.1 s
    d = a.vet(a.propose(0, "dop", reqs, usage(reqs)), manifest=None)
    assert d.verdict == "not_worth_it" and d.switch_raw_s == 0.02 and abs(d.switch_s - 0.2) < 1e-9  # prior ratio
    # the dop -> tp switches measured 2x their prediction: 0.04 s against the 0.1 s payoff
    rows = [(1, 100, 0)] * 4
    for _ in range(30):
        a.record(replace(d, verdict="switch"))
        a.observe("tp", pieces(rows), m.step("tp", rows).seconds + 0.04, switched=True)
    assert a.summary()["switch_cost"]["directions"]["dop->tp"]["observed"] == 30
    a._since_switch_s = math.inf
    v = a.vet(a.propose(1, "dop", reqs, usage(reqs)), manifest=None)
    assert v.verdict == "switch" and abs(v.switch_s - 0.04) < 1e-3 and "learnt" in v.reason


def test_no_second_switch_within_the_dwell_after_a_costly_one():
    m = LinearCost(fixed={"tp": 1e-3, "dp_attn": 3e-3, "cp": 3e-3, "dop": 3e-3})
    a = make(m, observe_every=1)
    for lay in LAYOUTS:
        _visit(a, m, lay, 1.0)
    rows = [(1, 100, 0)] * 4
    a.observe("dop", pieces(rows), m.step("dop", rows).seconds + 0.3, switched=True)   # the switch step added 0.3 s
    assert a.summary()["switch_cost"]["dwell_s"] > 2.0                          # 4 x the 0.6 s round trip
    reqs = decode_batch(4, 100)
    d = a.propose(10, "dop", reqs, usage(reqs))
    assert (d.verdict, d.target) == ("dwell", "tp") and "dwell" in d.reason
    for _ in range(10):
        a.observe("dop", pieces(rows), 0.25)                                            # 2.5 s of steps later
    assert a.propose(20, "dop", reqs, usage(reqs)).verdict == "switch"
    # an infeasible current layout is left at once, dwell or not
    a.observe("tp", pieces(rows), 1.0, switched=True)
    use = {**usage(reqs), "tp": [10**6, 10**6]}
    assert a.propose(21, "tp", reqs, use).verdict == "switch"


def test_a_bounded_history_of_decisions_is_kept_for_the_api():
    from splash.server.metrics import _scheduler_metrics

    t = iter(range(1000))
    m = LinearCost(fixed={"tp": 1e-3, "dp_attn": 3e-3, "cp": 3e-3, "dop": 2e-3})
    a = make(m, clock=lambda: float(next(t)))
    reqs = decode_batch(4, 100)
    for step in range(200):
        a.record(a.propose(step, "tp" if step % 2 else "dop", reqs, usage(reqs)))   # alternates: each one logged
    s = a.summary()
    assert len(s["history"]) == 64 and s["history"][-1]["step"] == 199 and s["history"][-1]["t_s"] > 0
    assert s["decisions"] == {"stay": 100, "switch": 100}
    a.observe("tp", pieces([(1, 100, 0)]), 0.5, switched=True)
    names = {mf.name for mf in _scheduler_metrics(a.summary())}
    assert {"splash_switch_measured_seconds", "splash_switch_cost_factor", "splash_cost_model_factor"} <= names


def test_the_steps_after_a_switch_all_train_the_new_layout():
    m = LinearCost()
    a = make(m)
    rows = [(1, 10, 0)]
    a.observe("dop", pieces(rows), 1.0, switched=True)
    for _ in range(16):
        a.observe("dop", pieces(rows), 1.0)
    assert a.stats["dop"].n == 8 + 8 // a.observe_every       # LEARN_AFTER_SWITCH steps, then every 8th


def test_the_engines_first_step_does_not_train():
    a = make(LinearCost(), observe_every=1)
    a.observe("tp", pieces([(64, 0, 0)]), 5.0)          # warm-up: lazy setup, first touches
    assert a.prefill_stats["tp"].n == 0 and a.factor("tp", "prefill") == 1.0
    a.observe("tp", pieces([(64, 0, 0)]), 5.0)
    assert a.prefill_stats["tp"].n == 1


def test_a_measured_layout_leading_on_its_point_prediction_only_is_probed_again():
    # DOP measured twice: uncertainty 0.25 / 3 beyond TP's, below PROBE_MIN_UNCERTAINTY (no probe of a layout not
    # measured takes it), 15% ahead on its point prediction, 7.7% with that uncertainty: the normal rule holds it out,
    # and staying in TP would never shrink it — DOP is probed again
    m = LinearCost(fixed={"tp": 1e-3, "dp_attn": 1.0, "cp": 1.0, "dop": 0.85e-3},
                   per_kv=dict.fromkeys(LAYOUTS, 0.0), per_row=dict.fromkeys(LAYOUTS, 0.0))
    a = make(m, observe_every=1)
    _visit(a, m, "tp", 3.0, n=200)
    _visit(a, m, "dop", 3.0, n=2)
    a.probes["dop/decode"] = 1                 # spent by the probe that measured it: it does not bar this one
    reqs = decode_batch(4, 100, remaining=10_000)
    d = a.propose(0, "tp", reqs, usage(reqs))
    assert 0 < d.uncertainty["dop"] < 0.1 and (d.verdict, d.target, d.probe) == ("switch", "dop", True)
    assert "probe dop again in decode" in d.reason
    v = a.vet(d, manifest=None)
    assert v.verdict == "switch" and "round trip" in v.reason        # vetted as any probe: its round trip
    a.record(v)
    assert a.probes == {"dop/decode": 1, "dop/decode/again": 1}
    rows = [(1, 100, 0)] * 4
    a.observe("dop", pieces(rows), 3.0 * m.step("dop", rows).seconds, switched=True)
    _visit(a, m, "dop", 4.8, n=2)              # DOP runs 1.6x what it was measured at: on 4 steps, not judged
    d = a.propose(1, "dop", reqs, usage(reqs))  # yet (nor TP probed back from within the trip)
    assert not d.probe_return and not d.probe and a._probe_trip is not None
    _visit(a, m, "dop", 4.8, n=1)              # 5 steps: the probe's weigh as much as the earlier ones
    d = a.propose(2, "dop", reqs, usage(reqs))
    assert (d.verdict, d.target, d.probe_return) == ("switch", "tp", True) and "measured dop" in d.reason
    a.record(a.vet(d, manifest=None))
    # its probe spent, DOP leading by the margin on its point prediction again is not probed a second time
    m.fixed["dop"] = 0.88e-3 * a.factor("tp") / a.factor("dop")
    d = a.propose(3, "tp", reqs, usage(reqs))
    assert (d.verdict, d.target, d.probe) == ("uncertain", "dop", False)
    # a measured layout ahead by less than the margin on its point prediction is not probed
    b = make(LinearCost(fixed={"tp": 1e-3, "dp_attn": 1.0, "cp": 1.0, "dop": 0.92e-3},
                        per_kv=dict.fromkeys(LAYOUTS, 0.0), per_row=dict.fromkeys(LAYOUTS, 0.0)), observe_every=1)
    _visit(b, b.model, "tp", 3.0, n=200)
    _visit(b, b.model, "dop", 3.0, n=2)
    assert (b.propose(0, "tp", reqs, usage(reqs)).verdict, b.probes) == ("below_margin", {})
    # nor one held out by the current layout's uncertainty as much as by its own: staying shrinks that (TP measured
    # twice too: 15% ahead, 7.6% with TP's uncertainty alone)
    c = make(m, observe_every=1)
    m.fixed["dop"] = 0.85e-3
    _visit(c, m, "tp", 3.0, n=3)
    _visit(c, m, "dop", 3.0, n=2)
    assert (c.propose(0, "tp", reqs, usage(reqs)).verdict, c.probes) == ("uncertain", {})


def test_a_layout_behind_on_its_point_prediction_is_probed_when_its_uncertainty_could_make_it_lead():
    # DOP predicted 5% slower than TP; not measured, its borrowed factor could make it lead by more than the margin
    m = LinearCost(fixed={"tp": 1e-3, "dp_attn": 1.0, "cp": 1.0, "dop": 1.05e-3},
                   per_kv=dict.fromkeys(LAYOUTS, 0.0), per_row=dict.fromkeys(LAYOUTS, 0.0))
    a = make(m, observe_every=1)
    _visit(a, m, "tp", 3.0)
    reqs = decode_batch(4, 100, remaining=10_000)
    d = a.propose(0, "tp", reqs, usage(reqs))
    assert (d.verdict, d.target, d.probe) == ("switch", "dop", True) and "optimistic" in d.reason
    assert d.seconds_per_token["dop"] > d.seconds_per_token["tp"]
    a.record(a.vet(d, manifest=None))                        # taken: DOP's decode probe is spent
    assert a.probes == {"dop/decode": 1}
    assert a.propose(1, "tp", reqs, usage(reqs)).verdict == "stay"
    # a layout far behind (x1.28 cannot close a 40% gap) is not probed
    b = make(LinearCost(fixed={"tp": 1e-3, "dp_attn": 1.0, "cp": 1.0, "dop": 1.4e-3},
                        per_kv=dict.fromkeys(LAYOUTS, 0.0), per_row=dict.fromkeys(LAYOUTS, 0.0)), observe_every=1)
    _visit(b, b.model, "tp", 3.0)
    assert b.propose(0, "tp", reqs, usage(reqs)).verdict == "stay"


def test_a_probe_that_measured_slower_goes_back_without_the_margin():
    m = LinearCost(fixed={"tp": 1e-3, "dp_attn": 1.0, "cp": 1.0, "dop": 0.97e-3},
                   per_kv=dict.fromkeys(LAYOUTS, 0.0), per_row=dict.fromkeys(LAYOUTS, 0.0))
    a = make(m, observe_every=1)
    _visit(a, m, "tp", 3.0)
    reqs = decode_batch(4, 100, remaining=10_000)
    a.record(a.vet(a.propose(0, "tp", reqs, usage(reqs)), manifest=None))
    assert a.last.probe and a.last.target == "dop"
    a.observe("dop", pieces([(1, 100, 0)] * 4), 3.0 * m.step("dop", [(1, 100, 0)] * 4).seconds, switched=True)
    _visit(a, m, "dop", 3.0 * 1.08, n=1)                     # measured once: not known yet, no verdict on it
    assert not a.propose(1, "dop", reqs, usage(reqs)).probe_return
    _visit(a, m, "dop", 3.0 * 1.08, n=12)                    # DOP runs 8% slower than the model says TP would
    a._since_switch_s = math.inf
    d = a.propose(2, "dop", reqs, usage(reqs))
    assert (d.verdict, d.target, d.probe_return) == ("switch", "tp", True) and "back to tp" in d.reason
    v = a.vet(d, manifest=None)                               # TP leads by 4.6%: below the margin, yet taken
    assert v.verdict == "switch" and v.as_dict()["probe_return"]
    a.record(v)
    assert a.propose(3, "tp", reqs, usage(reqs)).verdict == "stay"          # DOP measured: no second probe
    # a probe that measured faster stays, and the trip ends: no return later
    c = make(m, observe_every=1)
    _visit(c, m, "tp", 3.0)
    c.record(c.vet(c.propose(0, "tp", reqs, usage(reqs)), manifest=None))
    _visit(c, m, "dop", 3.0, n=12)
    c._since_switch_s = math.inf
    assert c.propose(1, "dop", reqs, usage(reqs)).verdict == "stay" and c._probe_trip is None


def test_a_current_layout_on_a_borrowed_factor_is_not_left_on_that_factor_alone():
    # DOP measured; TP (current) not yet: its factor is borrowed from DOP's, so DOP's 15% lead is not known
    m = LinearCost(fixed={"tp": 1e-3, "dp_attn": 1.0, "cp": 1.0, "dop": 0.85e-3},
                   per_kv=dict.fromkeys(LAYOUTS, 0.0), per_row=dict.fromkeys(LAYOUTS, 0.0))
    a = make(m, observe_every=1)
    _visit(a, m, "dop", 1.0, n=40)
    reqs = decode_batch(4, 100, remaining=10_000)
    d = a.propose(0, "tp", reqs, usage(reqs))
    assert (d.verdict, d.target) == ("uncertain", "dop") and d.uncertainty["dop"] > 0.1
    _visit(a, m, "tp", 1.0, n=40)                 # staying measured TP: now the lead is known
    assert a.propose(1, "tp", reqs, usage(reqs)).verdict == "switch"


def _visit_prefill(a, m, layout, factor, n=8):
    rows = [(512, 0, 0)]
    for _ in range(n):
        a.observe(layout, pieces(rows), factor * m.step(layout, rows).seconds)


FLAT = dict(per_kv=dict.fromkeys(LAYOUTS, 0.0), per_row=dict.fromkeys(LAYOUTS, 0.0))


def test_two_layouts_on_the_same_borrowed_factor_are_compared_at_both_uncertainties():
    # TP measured; CP (current) and DP-attn both borrow TP's factor: DP-attn's 15% point lead over CP rests on the
    # model's ratio of two kernels neither was measured on — each may deviate from the mean on its own
    m = LinearCost(fixed={"tp": 1.0, "dp_attn": 0.85e-3, "cp": 1e-3, "dop": 1.0}, **FLAT)
    a = make(m, observe_every=1)
    _visit(a, m, "tp", 1.0, n=40)
    reqs = decode_batch(4, 100, remaining=10_000)
    d = a.propose(0, "cp", reqs, usage(reqs))
    assert (d.verdict, d.target) == ("uncertain", "dp_attn")
    assert abs(d.uncertainty["dp_attn"] - math.hypot(0.25, 0.25)) < 1e-6 and d.uncertainty["cp"] == 0.0
    # staying measures CP; then DP-attn is the one not measured, and it is probed
    _visit(a, m, "cp", 1.0, n=40)
    d = a.propose(1, "cp", reqs, usage(reqs))
    assert (d.verdict, d.target, d.probe) == ("switch", "dp_attn", True)
    # before any step was measured nothing tells the layouts apart: the model is taken as it is
    b = make(m, observe_every=1)
    d = b.propose(0, "cp", reqs, usage(reqs))
    assert (d.verdict, d.target) == ("switch", "dp_attn") and d.uncertainty["dp_attn"] == 0.0


def test_a_probe_measures_the_regime_the_next_steps_run_in_and_ends_on_that_measurement():
    # a prompt is pending, so the next steps carry prefill, while the forecast is decode-dominated: DOP is probed in
    # prefill (its decode steps come only after the prefill backlog, which the probe would run unmeasured)
    m = LinearCost(fixed={"tp": 1e-3, "dp_attn": 1.0, "cp": 1.0, "dop": 1.05e-3}, **FLAT)
    a = make(m, observe_every=1)
    _visit(a, m, "tp", 1.0, n=40)
    _visit_prefill(a, m, "tp", 1.0, n=40)
    reqs = decode_batch(4, 100, remaining=10_000) + [ReqView("p", 0, 512, 10_000, 0)]
    d = a.propose(0, "tp", reqs, usage(reqs))
    assert (d.verdict, d.target, d.probe) == ("switch", "dop", True) and "in prefill" in d.reason
    a.record(a.vet(d, manifest=None))
    assert a.probes == {"dop/prefill": 1}
    # the trip ends on DOP's prefill measurement, even at a boundary whose next steps are decode-only
    dec = decode_batch(4, 100, remaining=10_000)
    assert not a.propose(1, "dop", dec, usage(dec)).probe_return
    _visit_prefill(a, m, "dop", 1.2, n=12)
    d = a.propose(2, "dop", dec, usage(dec))
    assert (d.verdict, d.target, d.probe_return) == ("switch", "tp", True) and "in prefill" in d.reason


def test_the_way_out_of_a_probe_is_not_held_back_by_a_dwell():
    m = LinearCost(fixed={"tp": 1e-3, "dp_attn": 1.0, "cp": 1.0, "dop": 0.97e-3}, **FLAT)
    a = make(m, observe_every=1)
    _visit(a, m, "tp", 1.0, n=40)
    reqs = decode_batch(4, 100, remaining=10_000)
    a.record(a.vet(a.propose(0, "tp", reqs, usage(reqs)), manifest=None))
    assert a.last.probe and a.last.target == "dop"
    rows = [(1, 100, 0)] * 4
    a.observe("dop", pieces(rows), m.step("dop", rows).seconds + 0.3, switched=True)   # the probe's switch added 0.3 s
    assert a.summary()["switch_cost"]["dwell_s"] == 0.0
    _visit(a, m, "dop", 1.5, n=12)                        # DOP measured 45% slower than TP: back at once
    d = a.propose(1, "dop", reqs, usage(reqs))
    assert (d.verdict, d.target) == ("switch", "tp")
    # a switch that is not a probe still sets the dwell
    a.record(a.vet(d, manifest=None))
    a.observe("tp", pieces(rows), m.step("tp", rows).seconds + 0.3, switched=True)
    assert a.summary()["switch_cost"]["dwell_s"] > 2.0


def test_a_probe_returns_when_the_origin_is_faster_on_its_point_prediction():
    # TP measured on one step only (x1.13 uncertain); the DOP probe measured 5% slower than TP's point prediction
    m = LinearCost(fixed={"tp": 1e-3, "dp_attn": 1.0, "cp": 1.0, "dop": 0.97e-3}, **FLAT)
    a = make(m, observe_every=1)
    _visit(a, m, "tp", 1.0, n=2)                           # the first step warms up: one measurement
    reqs = decode_batch(4, 100, remaining=10_000)
    a.record(a.vet(a.propose(0, "tp", reqs, usage(reqs)), manifest=None))
    assert a.last.probe and a.last.target == "dop"
    _visit(a, m, "dop", 1.05 / 0.97, n=40)
    d = a.propose(1, "dop", reqs, usage(reqs))
    assert d.uncertainty["tp"] > 0.1
    assert (d.verdict, d.target, d.probe_return) == ("switch", "tp", True)
    assert a.vet(d, manifest=None).verdict == "switch"


def test_a_probe_is_taken_only_when_its_way_back_fits_in_memory():
    """TP -> DP-attn frees half of each rank's TP blocks, so the probe itself fits; the way back gathers every
    request on both ranks again, with one layer's transfer buffers on top. With a pool of 52 blocks TP holds the
    batch grown by the probe (4 x 12 blocks), but the handoff back (24 resident + 24 incoming + 6 buffers + 2 for
    the step) does not fit: the probe would strand the batch in a layout it may measure slower, so it is not taken
    (and not counted: it may be taken once the batch shrinks). With room for the way back it is taken."""
    from test_manifest import BS, GLM
    from splash.engine.layout_policy.control import LayoutController
    from splash.engine.ledger import KVLedger

    def probe(pool):
        m = LinearCost(fixed={"tp": 1e-3, "dp_attn": 0.97e-3, "cp": 1.0, "dop": 1.0}, **FLAT)
        a = make(m, observe_every=1)
        _visit(a, m, "tp", 3.0)
        ledger = KVLedger(2, pool, BS, "tp")
        reqs = [SimpleNamespace(req_id=f"r{i}", num_cached=160, pending=1, max_tokens=10_000, output=[],
                                max_len=1 << 20, prompt=[0] * 160) for i in range(4)]
        for i, r in enumerate(reqs):
            ledger.grow(r.req_id, 160, owner=i % 2)
        choice = a.advise(0, "tp", SimpleNamespace(running=reqs, waiting=[], max_num_seqs=64), ledger)
        assert choice == "dp_attn" and a._pending.probe
        ctl = LayoutController(GLM, 2, BS, 2, "float32")
        d = ctl.decide("tp", ledger, {r.req_id: 160 for r in reqs}, 2, auto_choice=choice, vet=a.vet_pending)
        assert ctl.last_deferral is None                   # the probe itself always fits
        return a, d

    a, d = probe(52)
    assert d is None and a.last.verdict == "not_worth_it" and a.probes == {}
    assert "way back to tp would not fit" in a.last.reason and "handoff peak 56 blocks" in a.last.reason
    a, d = probe(56)
    assert d is not None and d.dst == "dp_attn" and a.last.verdict == "switch" and a.probes == {"dp_attn/decode": 1}


def _ahead_probe():
    """TP measured in both regimes, DOP in prefill only (20% slower there than the model says); a prompt is
    prefilling, so the next steps carry prefill, while the forecast is decode-dominated: DOP leads TP by 3% on its
    point prediction, on the decode factor it borrows from TP."""
    m = LinearCost(fixed={"tp": 1e-3, "dp_attn": 1.0, "cp": 1.0, "dop": 0.97e-3}, **FLAT)
    a = make(m, observe_every=1)
    _visit(a, m, "tp", 1.0, n=40)
    _visit_prefill(a, m, "tp", 1.0, n=40)
    _visit_prefill(a, m, "dop", 1.2, n=40)
    reqs = decode_batch(4, 100, remaining=10_000) + [ReqView("p", 0, 512, 10_000, 0)]
    return m, a, reqs


def test_a_probe_for_the_regime_after_the_next_steps_is_priced_by_the_steps_before_it():
    m, a, reqs = _ahead_probe()
    d = a.propose(0, "tp", reqs, usage(reqs))
    assert (d.verdict, d.target, d.probe) == ("switch", "dop", True) and "in decode" in d.reason
    # its price: the prefill step before DOP's first decode step at DOP's pessimistic end, less TP's
    u = a.steps.uncertainty("dop", "prefill")
    assert d.probe_lead_s == pytest.approx(0.97e-3 * a.factor("dop", "prefill") * math.exp(u) - 1e-3, rel=1e-6)
    assert d.probe_lead_s > 0
    v = a.vet(d, manifest=None)
    assert v.verdict == "switch" and "before its regime" in v.reason
    # the same probe with more before its regime than the budget leaves (5% of TP's 10 s, less 2 x 0.05 s) is not
    assert a.vet(replace(d, probe_lead_s=0.45), manifest=None).verdict == "not_worth_it"
    a.record(v)
    assert a.probes == {"dop/decode": 1} and a._probe_trip[2] == "decode"
    # paying more than its round trip, a probe needs a point lead, not only an optimistic one: DOP 3% behind TP
    # is not probed ahead of its decode steps
    m2, b, _ = _ahead_probe()
    m2.fixed["dop"] = 1.03e-3
    assert not b.propose(0, "tp", reqs, usage(reqs)).probe



def test_an_ahead_probe_is_priced_beyond_the_same_work_in_the_current_layout():
    # TP's pool is full: the waiting prompt is admitted there only once the running requests finish, so TP's forecast
    # decodes first and prefills later; DOP admits it at once. DOP's prefill step before its first decode step is
    # work TP does too (later, and slower): it is priced beyond what it costs in TP — nothing here — not beyond TP's
    # own time before its first decode step, which is 0 (shared agentic seed 4, docs/benchmarks.md session 21)
    m = LinearCost(fixed={"tp": 1e-3, "dp_attn": 1.0, "cp": 1.0, "dop": 0.9e-3}, **FLAT)
    a = make(m, observe_every=1, caps={**dict.fromkeys(LAYOUTS, 10_000), "tp": 60})
    _visit(a, m, "tp", 1.0, n=40)
    _visit_prefill(a, m, "tp", 1.0, n=40)
    _visit_prefill(a, m, "dop", 1.0, n=40)
    reqs = decode_batch(4, 100, remaining=50) + [ReqView("p", 0, 512, 200, None, running=False)]
    d = a.propose(0, "tp", reqs, usage(reqs))
    assert (d.verdict, d.target, d.probe) == ("switch", "dop", True) and "in decode" in d.reason
    assert d.probe_lead_s == 0.0

def test_a_probe_whose_regime_does_not_come_by_its_deadline_ends_unmeasured():
    m, a, reqs = _ahead_probe()
    a.record(a.vet(a.propose(0, "tp", reqs, usage(reqs)), manifest=None))
    assert a._probe_trip[:3] == ("tp", "dop", "decode")
    _visit_prefill(a, m, "dop", 1.2, n=20)             # prompts keep coming: no decode step yet
    a.propose(1, "dop", reqs, usage(reqs))
    assert a._probe_trip is not None
    # past twice what it was priced for (its lead and 5% of the ~10 s left) it ends: DOP still leads TP on its point
    # prediction, so it stays; it measured nothing, so it is not counted, and DOP is not probed ahead of its decode
    # steps again
    _visit_prefill(a, m, "dop", 1.2, n=1200)
    d = a.propose(2, "dop", reqs, usage(reqs))
    assert not d.probe_return and a._probe_trip is None
    assert a.probes["dop/decode"] == 0 and "dop/decode" in a._unmet
    assert not a.propose(3, "tp", reqs, usage(reqs)).probe
    dec = decode_batch(4, 100, remaining=10_000)          # once decode steps are next, DOP's decode may be probed
    assert a.propose(4, "tp", dec, usage(dec)).probe
    # at its deadline, with TP faster on its point prediction (the stand-in now predicts DOP 5% slower), it returns
    b_m, b, _ = _ahead_probe()
    b.record(b.vet(b.propose(0, "tp", reqs, usage(reqs)), manifest=None))
    _visit_prefill(b, b_m, "dop", 1.2, n=1200)
    b_m.fixed["dop"] = 1.05e-3
    d = b.propose(1, "dop", reqs, usage(reqs))
    assert (d.target, d.probe_return) == ("tp", True) and "did not come" in d.reason


def test_a_layout_measured_once_is_probed_from_one_measured_where_its_uncertainty_could_make_it_lead():
    # TP measured twice in decode (x1.09 uncertain), DOP once (x1.13): DOP is not measured by the standard a probe's
    # trip ends on, and its combined uncertainty (x1.16) could make it lead: it is probed, though it is not 0.1
    # less known than TP
    m = LinearCost(fixed={"tp": 1e-3, "dp_attn": 1.0, "cp": 1.0, "dop": 1.03e-3}, **FLAT)
    a = make(m, observe_every=1)
    _visit(a, m, "tp", 1.0, n=3)                      # the first step warms up: two measurements
    _visit(a, m, "dop", 1.0, n=1)
    assert a.steps.uncertainty("tp") < 0.1 <= a.steps.uncertainty("dop") < a.steps.uncertainty("tp") + 0.1
    reqs = decode_batch(4, 100, remaining=10_000)
    d = a.propose(0, "tp", reqs, usage(reqs))
    assert (d.verdict, d.target, d.probe) == ("switch", "dop", True)


class StagedCost(LinearCost):
    """LinearCost whose prediction says its stages: the fixed part, the attention (per context token) and the FFN
    (per row), as a cost model's StepPrediction.stages does."""

    def step(self, layout, rows):
        self.calls += 1
        ctx = sum(c + n for n, c, _ in rows)
        stages = {"other": self.fixed[layout], "attention": self.per_kv[layout] * ctx,
                  "ffn": self.per_row[layout] * len(rows)}
        return SimpleNamespace(seconds=sum(stages.values()), stages=stages)


def _visit_batch(a, m, layout, reqs, factor, n=40):
    rows = [(1, r.cached, r.owner) for r in reqs]
    for _ in range(n):
        a.observe(layout, pieces(rows), factor * m.step(layout, rows).seconds)


def _tp_measured_short_then_dop_long(tp_per_kv):
    """TP measured on 64 short requests, then DOP on 4 long ones (the batch now): (model, long batch, auto)."""
    m = StagedCost(fixed={"tp": 1e-3, "dp_attn": 1.0, "cp": 1.0, "dop": 1e-3},
                   per_kv={"tp": tp_per_kv, "dp_attn": 1.0, "cp": 1.0, "dop": 1e-7})
    short, long_ = decode_batch(64, 100), decode_batch(4, 100_000, remaining=10_000)
    a = make(m, observe_every=1, caps=dict.fromkeys(LAYOUTS, 100_000))
    _visit_batch(a, m, "tp", short, 1.0)
    _visit_batch(a, m, "dop", long_, 1.0)
    return m, long_, a


def test_a_layout_measured_on_a_batch_of_another_shape_is_probed_again():
    # TP measured on 64 short requests (its steps mostly FFN and fixed costs), then auto moved to DOP; now 4 long
    # requests run (attention-bound), TP 2% ahead on its point prediction: below the margin, and TP's factor was
    # learnt at a stage mix this batch does not have, so its error here is not known — it is probed
    m, long_, a = _tp_measured_short_then_dop_long(0.98e-7)
    assert a.steps.uncertainty("tp") < 0.1                   # measured 39 times: known where it was measured
    d = a.propose(0, "dop", long_, usage(long_))
    assert (d.verdict, d.target, d.probe) == ("switch", "tp", True) and "stage mix" in d.reason
    assert d.seconds_per_token["tp"] < d.seconds_per_token["dop"]
    assert d.uncertainty["tp"] < 0.1    # the normal rule's: the shape widens only what a probe is judged by
    # the same TP measured on this shape of batch: known, and 2% is below the margin
    b = make(m, observe_every=1, caps=dict.fromkeys(LAYOUTS, 100_000))
    _visit_batch(b, m, "tp", long_, 1.0)
    _visit_batch(b, m, "dop", long_, 1.0)
    d = b.propose(0, "dop", long_, usage(long_))
    assert (d.verdict, d.probe) == ("below_margin", False) and d.uncertainty["tp"] < 0.1


def test_a_layout_measured_on_another_shape_is_entered_on_its_measured_lead():
    # as above, but TP now leads DOP by 15% on its point prediction (its own measured factor): the normal rule takes
    # it — the shape's bound is no evidence against that factor, so it does not make the lead "uncertain"
    _, long_, a = _tp_measured_short_then_dop_long(0.85e-7)
    d = a.propose(0, "dop", long_, usage(long_))
    assert (d.verdict, d.target, d.probe) == ("switch", "tp", False)


def _chained_probe(cp_decode_measured: bool):
    """TP measured in both regimes, CP in prefill only. A decode probe TP -> CP is taken; before CP's decode is
    measured, a prompt arrives and DOP's prefill probe qualifies from CP: the chained probe of per_layout agentic
    seed 6 (docs/benchmarks.md, issue 29 session 20)."""
    m = LinearCost(fixed={"tp": 1e-3, "dp_attn": 1.0, "cp": 0.97e-3, "dop": 0.98e-3}, **FLAT)
    a = make(m, observe_every=1)
    _visit(a, m, "tp", 1.0, n=40)
    _visit_prefill(a, m, "tp", 1.0, n=40)
    _visit_prefill(a, m, "cp", 1.0, n=40)
    dec = decode_batch(4, 100, remaining=10_000)
    d = a.propose(0, "tp", dec, usage(dec))
    assert (d.verdict, d.target, d.probe) == ("switch", "cp", True) and "in decode" in d.reason
    a.record(a.vet(d, manifest=None))
    assert a.probes == {"cp/decode": 1}
    if cp_decode_measured:
        _visit(a, m, "cp", 1.0, n=40)
    reqs = dec + [ReqView("p", 0, 512, 10_000, 0)]
    d = a.propose(1, "cp", reqs, usage(reqs))
    assert (d.verdict, d.target, d.probe) == ("switch", "dop", True) and "in prefill" in d.reason
    a.record(a.vet(d, manifest=None))
    return m, a, dec


def test_a_probe_cut_short_by_a_chained_probe_before_it_measured_is_not_counted():
    m, a, dec = _chained_probe(cp_decode_measured=False)
    # CP's decode probe measured nothing: it is not counted, so CP may be probed in decode again
    assert a.probes == {"cp/decode": 0, "dop/prefill": 1}
    _visit_prefill(a, m, "dop", 1.5, n=40)
    a.record(a.vet(a.propose(2, "dop", dec, usage(dec)), manifest=None))    # DOP measured slower: back to CP
    assert a.last.current == "dop" and a.last.target == "cp"
    d = a.propose(3, "tp", dec, usage(dec))
    assert (d.verdict, d.target, d.probe) == ("switch", "cp", True)
    # a probe that measured its regime before the chain is counted as before
    _, b, _ = _chained_probe(cp_decode_measured=True)
    assert b.probes == {"cp/decode": 1, "dop/prefill": 1}


def test_a_decode_factor_borrowed_from_prefill_counts_by_the_overlap_of_the_stage_mixes():
    # No decode step has run (every step carried a prompt chunk, as in agentic): DOP's prefill factor (x0.6) was
    # learnt on attention-bound chunks, CP's (x1.2) on short prompts whose mix is a decode step's. Borrowed whole,
    # DOP's x0.6 would make it the faster decoder; it tells about the decode step's time only where the two mixes
    # overlap, the rest is the layouts' mean, and CP leads (shared agentic seed 11, docs/benchmarks.md session 21)
    m = StagedCost(fixed={"tp": 1.0, "dp_attn": 1.0, "cp": 1e-3, "dop": 1.8e-3},
                   per_kv={"tp": 1.0, "dp_attn": 1.0, "cp": 1e-8, "dop": 1e-8}, per_row=dict.fromkeys(LAYOUTS, 1e-5))
    a = make(m, observe_every=1, caps=dict.fromkeys(LAYOUTS, 100_000))
    for lay, rows, factor in (("dop", [(512, 1_000_000, 0)], 0.6), ("cp", [(64, 0, 0)], 1.2)):
        for _ in range(40):
            a.observe(lay, pieces(rows), factor * m.step(lay, rows).seconds)
    dec = decode_batch(4, 100, remaining=1000)
    d = a.propose(0, "dop", dec, usage(dec))
    assert d.seconds_per_token["cp"] < 0.9 * d.seconds_per_token["dop"]
    pre = {k: a.prefill_stats[k] for k in ("dop", "cp")}
    overlap = 1 - mix_distance(pre["dop"].mix, stage_mix(m.step("dop", [(1, 100, 0)] * 4).stages)) / 2
    mean = (pre["dop"].level + pre["cp"].level) / 2
    assert overlap < 0.3 and math.isclose(a.factor("dop"), math.exp(overlap * pre["dop"].level + (1 - overlap) * mean))
    _visit(a, m, "tp", 1.0)     # a layout measured decode: the others borrow the decode mean, whatever the mix
    a.propose(1, "dop", dec, usage(dec))
    assert a.factor("dop") == a.steps.factor("dop") == a.factor("cp")
