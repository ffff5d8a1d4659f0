"""The scheduler under model error (splash/sim/model_error.py): the truth charges steps and switches, auto plans
with the nominal model and learns from what it was charged, the oracle plans with the truth. Small workloads."""
import json
import re

import pytest

from splash.costmodel import load_profile
from splash.costmodel.step_cost import LAYOUTS, CostModel, RowLoad
from splash.sim import model_error
from splash.sim.paper import label
from splash.sim.paper_data import FIGURES
from splash.sim.presets import load_sim_model
from splash.sim.serving import SimSetup, capacities, step_seconds
from splash.sim.trace import Req, replay
from splash.sim.workloads import agentic, builtin, rl_rollout


@pytest.fixture(scope="module")
def sim():
    m = load_sim_model("glm-5.3")
    s = SimSetup(m, load_profile("b200"), 8)
    return CostModel(m.cfg, 8, s.profile, m.weight_dtype, m.kv_dtype, s.block_size), s, capacities(s)


def _work():
    return [Req(f"a{i}", 0.0, 2000, 24) for i in range(6)] + [Req(f"b{i}", 0.5, 30_000, 16) for i in range(3)]


def test_residuals_are_the_held_out_rates_and_primitives():
    by = {f.key: f for f in FIGURES}
    rows = [{"figure": label(by["h200.tps.dop.long.min"]), "split": "held_out", "error": 0.1},
            {"figure": label(by["h200.prim.kv.min"]), "split": "held_out", "error": -0.2},
            {"figure": label(by["b200.prim.kv.min"]), "split": "fitted", "error": 0.3},      # fitted: not used
            {"figure": label(by["h200.ratio.dop_cp.long.min"]), "split": "held_out", "error": 0.4},  # a ratio
            {"figure": label(by["h200.leader.64K.B16"]), "split": "held_out", "error": None}]
    assert model_error.held_out_residuals(rows) == [0.1, -0.2]
    with pytest.raises(ValueError):
        model_error.held_out_residuals(rows[2:])


def test_truth_scales_each_layouts_stages(sim):
    cm, s, _ = sim
    truth = model_error.draw_truth(cm, [0.5], seed=3)
    assert set(truth.step_factor.values()) <= {0.5, 1.5} and len(set(truth.step_factor.values())) == 2
    rows = [RowLoad(1, 4000, i % 8) for i in range(8)]
    for lay in LAYOUTS:
        p = cm.step(lay, rows)
        want = sum(v * truth.step_factor[(lay, k)] for k, v in p.stages.items())
        assert truth.step(lay, rows).seconds == pytest.approx(want)
        assert step_seconds(truth, s.model, lay, rows) == pytest.approx(want)   # the replay charges this
    assert model_error.draw_truth(cm, [0.5], 3).step_factor == truth.step_factor   # seeded


def test_replay_charges_the_truth_and_auto_learns(sim):
    cm, s, caps = sim
    slow = model_error.TruthModel(cm, {(lay, st): 2.0 for lay in LAYOUTS for st in
                                       (*model_error.STAGES, *model_error.EXTRA_STAGES)})
    at_once = [Req(r.rid, 0.0, r.input_len, r.output_len) for r in _work()]   # no idle time to leave unscaled
    for lay in ("tp", "dp_attn"):
        nominal = replay(cm, s, caps, at_once, lay)
        charged = replay(cm, s, caps, at_once, lay, truth=slow)
        assert charged.total_s == pytest.approx(2 * nominal.total_s, rel=0.02)
    auto = replay(cm, s, caps, _work(), "auto", truth=slow)
    assert auto.output_tokens == 6 * 24 + 3 * 16 and auto.total_s > 0
    # DP-attn alone twice as slow as the model says: the oracle (planning with the truth) never runs in it
    skew = model_error.TruthModel(cm, {("dp_attn", st): 2.0 for st in model_error.STAGES})
    oracle = replay(cm, s, caps, _work(), "auto", truth=skew, plan=skew)
    assert not any("→dp_attn" in what for _, what, _ in oracle.timeline)


def test_experiment_reports_auto_fixed_and_oracle(sim):
    cm, s, caps = sim
    rows = model_error.experiment(cm, s, caps, lambda seed: _work(), [0.1, -0.3], [1, 2])
    assert [r["seed"] for r in rows] == [1, 2]
    for r in rows:
        v = r["tokens_per_s"]
        assert set(v) == {"auto", *LAYOUTS, "oracle"}
        best = max(v[k] for k in LAYOUTS if v[k])
        assert v[r["best_fixed"]] == best
        assert r["auto_vs_best"] == pytest.approx(v["auto"] / best)
        assert r["oracle_vs_best"] == pytest.approx(v["oracle"] / best)


def test_builtin_workloads_are_seeded():
    a, b = rl_rollout(1), rl_rollout(1)
    assert [(r.input_len, r.output_len) for r in a] == [(r.input_len, r.output_len) for r in b]
    assert [r.output_len for r in a] != [r.output_len for r in rl_rollout(2)]
    longs = [r for r in a if r.output_len >= 16_000]
    assert 0 < len(longs) < len(a) // 4          # many short requests that end as a few long ones
    ag = agentic(1)
    assert ag == sorted(ag, key=lambda r: (r.arrive, r.rid)) and max(r.input_len for r in ag) > 80_000
    with pytest.raises(ValueError, match="rl-rollout"):
        builtin("nope", 1)


def test_truth_kernels_common_to_every_layout_share_their_error(sim):
    cm, _, _ = sim
    res = [0.1, 0.2, 0.3, 0.4, 0.5, 0.6, -0.7]
    shared = model_error.draw_truth(cm, res, seed=5)
    apart = model_error.draw_truth(cm, res, seed=5, kernels="per_layout")
    for st in model_error.COMMON_STAGES:          # the FFN is one kernel whatever the attention layout
        assert len({shared.step_factor[(lay, st)] for lay in LAYOUTS}) == 1
    assert any(len({apart.step_factor[(lay, st)] for lay in LAYOUTS}) > 1 for st in model_error.COMMON_STAGES)
    own = [k for k in apart.step_factor if k[1] not in model_error.COMMON_STAGES]   # attention block: per layout
    assert any(len({shared.step_factor[(lay, st)] for lay in LAYOUTS}) > 1 for _, st in own)
    assert all(shared.step_factor[k] == apart.step_factor[k] for k in own)
    with pytest.raises(ValueError, match="per_layout"):
        model_error.draw_truth(cm, res, seed=5, kernels="nope")


TRACE = "groups:\n  - {at_s: 0, count: 3, prefix_len: 1024, input_len: 2000, output_len: 16}\n  - {at_s: 0.5, count: 2, input_len: 30000, output_len: 8}\n"


def _paper_json(tmp_path):
    by = {f.key: f for f in FIGURES}
    rows = [{"figure": label(by["h200.tps.dop.long.min"]), "split": "held_out", "error": 0.2},
            {"figure": label(by["h200.prim.kv.min"]), "split": "held_out", "error": -0.3}]
    path = tmp_path / "paper.json"
    path.write_text(json.dumps({"rows": rows}))
    return path


def test_trace_cli_replays_auto_and_every_layout(tmp_path, capsys):
    """`splash-sim --trace FILE`: auto's timeline and a row per mode, auto compared with each."""
    from splash.sim.cli import main

    wl = tmp_path / "w.yaml"
    wl.write_text(TRACE)
    assert main(["--model", "glm-5.3", "--hardware", "b200", "--trace", str(wl)]) == 0
    out = capsys.readouterr().out
    words = " ".join(out.split())   # a title wraps at its table's width
    assert "auto: layout timeline" in out and "5 requests, prefix cache on, predicted" in words
    for mode in ("auto", *LAYOUTS):   # a row with its tokens/s and the share of prompt tokens found cached
        assert re.search(rf"│\s*{mode} │\s*[\d,.]+ │.*│\s*\d+% │", out), mode
    assert main(["--model", "glm-5.3", "--hardware", "b200", "--trace", str(wl), "--no-enable-prefix-caching"]) == 0
    assert "5 requests, prefix cache off" in " ".join(capsys.readouterr().out.split())
    assert main(["--model", "glm-5.3", "--hardware", "b200", "--trace", str(tmp_path / "none.yaml")]) == 2
    assert "cannot read the workload" in capsys.readouterr().out


def test_truth_error_cli_reports_every_seed(tmp_path, capsys):
    """`splash-sim --trace FILE --truth-error PAPER_JSON`: per seed auto, the fixed layouts and the oracle, all
    charged with that seed's truth; the JSON keeps the residuals and the rows."""
    from splash.sim.cli import main

    wl, out_json = tmp_path / "w.yaml", tmp_path / "err.json"
    wl.write_text(TRACE)
    base = ["--model", "glm-5.3", "--hardware", "b200", "--trace", str(wl), "--truth-error", str(_paper_json(tmp_path))]
    assert main([*base, "--seeds", "1,2", "--truth-kernels", "per_layout", "--json", str(out_json)]) == 0
    out = capsys.readouterr().out
    assert "under model error (2 held-out residuals" in out and "over seeds [1, 2]" in out
    doc = json.loads(out_json.read_text())
    assert doc["kernels"] == "per_layout" and doc["residuals"] == [0.2, -0.3]
    assert [r["seed"] for r in doc["seeds"]] == [1, 2]
    for r in doc["seeds"]:
        v = r["tokens_per_s"]
        assert r["auto_vs_best"] == pytest.approx(v["auto"] / v[r["best_fixed"]])
    assert main([*base, "--seeds", "1,x"]) == 2 and "--seeds: not a comma list" in capsys.readouterr().err
    (tmp_path / "paper.json").write_text('{"rows": []}')
    assert main(base) == 2 and "no held-out" in capsys.readouterr().out


def _keep_auto(monkeypatch, cls=None):
    """The replay's AutoLayout (as `cls` when given), kept to read after the replay."""
    from splash.sim import trace
    made, build = [], trace._scheduler

    def keep(*a, **kw):
        auto = build(*a, **kw)
        if cls is not None:
            auto.__class__ = cls
        made.append(auto)
        return auto
    monkeypatch.setattr(trace, "_scheduler", keep)
    return made


def test_an_open_probe_is_judged_within_a_steady_decode_run(sim, monkeypatch):
    """A probe taken before a long steady decode run (nothing finishes or arrives in it) returns at the engine's next
    evaluations — the replay stops every run there, as the engine evaluates — instead of being charged the whole run
    in the layout it measured slower."""
    from splash.sim import trace
    cm, s, caps = sim
    slow_dp = model_error.TruthModel(cm, {("dp_attn", st): 2.0 for st in
                                          (*model_error.STAGES, *model_error.EXTRA_STAGES)})

    class Forced(trace.AutoLayout):   # probes DP-attn in decode once, when 5 requests run
        def advise(self, step, current, scheduler, ledger):
            self.running = len(scheduler.running)
            return super().advise(step, current, scheduler, ledger)

        def _probe_target(self, current, per_tok, unc, regime, until=None, left=0.0):
            if regime == "decode" and current == "tp" and not self.probes and self.running == 5:
                return "dp_attn", "forced probe", "decode", 0.0, float("inf")
            return None

    made = _keep_auto(monkeypatch, Forced)
    # finishes every 50 steps, the probe at the fifth, then one run of ~2,700 steps
    work = [Req(f"s{i}", 0.0, 1000, 50 * (i + 1)) for i in range(6)] + [Req(f"l{i}", 0.0, 1000, 3000) for i in range(4)]
    res = replay(cm, s, caps, work, "auto", truth=slow_dp)
    moves = [(t, move) for t, move, _ in res.timeline]
    assert [m for _, m in moves] == ["tp→dp_attn", "dp_attn→tp"], res.timeline
    assert moves[1][0] - moves[0][0] < 0.05 * res.total_s, moves   # back within a hundred or so steps
    # ... at the first re-evaluation after it: each of the probe's steps was observed, so its 16 steps measured it
    auto = made[0]
    switches = [d["step"] for d in auto.history if d["verdict"] == "switch"]
    assert switches[1] - switches[0] == auto.reeval_steps, switches
    from splash.engine.layout_policy.auto import LEARN_AFTER_SWITCH
    assert auto.stats["dp_attn"].n >= LEARN_AFTER_SWITCH   # every step after the switch trained, as in the engine


def test_auto_is_evaluated_at_every_finish_of_a_steady_decode(sim, monkeypatch):
    """The step count auto is asked at counts every step of a steady decode run, as the engine's does: a request
    finishing after a run of 50 steps is evaluated at once, not `min_interval` boundaries (whole runs) later."""
    from splash.sim import trace
    cm, s, caps = sim
    seen = []

    class Spy(trace.AutoLayout):
        def _evaluate(self, step, current, scheduler, ledger):
            seen.append((step, len(scheduler.running)))
            return super()._evaluate(step, current, scheduler, ledger)

    _keep_auto(monkeypatch, Spy)
    work = [Req(f"s{i}", 0.0, 1000, 50 * (i + 1)) for i in range(6)]
    res = replay(cm, s, caps, work, "auto")
    assert res.output_tokens == sum(50 * (i + 1) for i in range(6))
    assert {n for _, n in seen} >= {6, 5, 4, 3, 2, 1}, seen   # each finish changed the set: each was evaluated
    assert max(st for st, _ in seen) >= 250, seen              # the count is in steps, not boundaries


def test_auto_is_asked_at_the_engines_cadence_within_a_steady_decode_run(sim, monkeypatch):
    """Outside a probe too, a steady decode run stops at auto's next re-evaluation — every `reeval_steps` steps while
    the requests stay the same, as the engine's `_due` has it — and each of its steps is observed: a ~3,000-step run
    in which nothing finishes or arrives is re-evaluated about every 16 steps, not once, and auto sees every step."""
    from splash.sim import trace
    cm, s, caps = sim
    seen = []

    class Spy(trace.AutoLayout):
        def _evaluate(self, step, current, scheduler, ledger):
            seen.append(step)
            return super()._evaluate(step, current, scheduler, ledger)

    made = _keep_auto(monkeypatch, Spy)
    work = [Req(f"l{i}", 0.0, 1000, 3000) for i in range(4)]
    truth = model_error.TruthModel(cm, {("tp", "ffn"): 1.1})   # a truth, so that auto observes what it is charged
    res = replay(cm, s, caps, work, "auto", truth=truth)
    auto = made[0]
    gaps = [b - a for a, b in zip(seen, seen[1:])]
    assert len(seen) >= 3000 // auto.reeval_steps and max(gaps) == auto.reeval_steps, seen[:8]
    # every executed step was observed: the prefill step (it samples each request's first token), then each decode step
    assert auto._observed == res.output_tokens // len(work), (auto._observed, res.output_tokens)
