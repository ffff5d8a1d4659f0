"""`splash-sim paper`: the table's computation (errors, tolerances, splits, the leader share, the JSON), on made-up
values — not the values splash-sim gives (docs/benchmarks.md reports those)."""
import json

import pytest

from splash.sim import paper
from splash.sim.paper_data import FIGURES, KINDS, SETUPS, SPLITS, Figure
from splash.sim.serving import burst, wave_completions


def fig(key, kind, value, hw="b200", probe=("tps", "dop", 16, 1000), setup=""):
    return Figure(key, hw, "§x", key, value, kind, probe, setup=setup)


@pytest.mark.parametrize("kind,paper_v,sim,err,ok", [
    ("capacity", 100.0, 101.9, 0.019, True), ("capacity", 100.0, 97.9, -0.021, False),
    ("tokens_per_s", 1000.0, 1240.0, 0.24, True), ("tokens_per_s", 1000.0, 740.0, -0.26, False),
    ("primitive_ms", 4.0, 3.1, -0.225, True), ("latency_s", 500.0, 380.0, -0.24, True),
    ("latency_s", 500.0, 300.0, -0.4, False),
    ("ratio", 1.05, 1.2, 0.1429, True), ("ratio", 1.05, 0.99, -0.0571, False),   # wrong side of 1: DOP trails
    ("ratio", 0.578, 0.794, 0.3737, False),
    ("switch_ms", 10.0, 19.9, 0.99, True), ("switch_ms", 10.0, 4.9, -0.51, False), ("switch_ms", 1.0, 0.0, -1.0, False),
    ("bound_max", 0.0051, 0.005, -0.0196, True), ("bound_max", 0.0051, 0.0052, 0.0196, False),
    ("count", 12, 8, -4.0, False), ("count", 4, 4, 0.0, True),
])
def test_judge_tolerances(kind, paper_v, sim, err, ok):
    e, w = paper.judge(kind, paper_v, sim)
    assert e == pytest.approx(err, abs=1e-3) and w is ok


def test_judge_leader_and_missing():
    assert paper.judge("leader", "dop", "dop") == (None, True)
    assert paper.judge("leader", "dop", "cp") == (None, False)
    assert paper.judge("tokens_per_s", 1.0, None) == (None, False)   # not expressible: never within
    with pytest.raises(ValueError):
        paper.judge("nope", 1.0, 1.0)


def test_table_leader_share_split_and_keys():
    leaders = [fig(f"l{i}", "leader", "dop", probe=("leader", 16, 1000)) for i in range(5)]
    share = fig("share", "leader_share", 5, probe=("leaders", [f.key for f in leaders]))
    held = fig("h", "tokens_per_s", 100.0, hw="h200")
    values = {"l0": "dop", "l1": "dop", "l2": "dop", "l3": "dop", "l4": "cp", "h": 130.0}
    rows = paper.table([*leaders, share, held], values)
    assert [set(r) for r in rows] == [{"figure", "paper", "sim", "error", "split", "within"}] * 7
    assert rows[5]["sim"] == 4 and rows[5]["within"] is True          # 4 of 5 = 80%
    rows = paper.table([*leaders, share], {**values, "l3": "tp"})
    assert rows[5]["sim"] == 3 and rows[5]["within"] is False         # 60%
    rows = paper.table([held], values)
    assert rows[0]["split"] == "held_out" and rows[0]["within"] is False and rows[0]["error"] == pytest.approx(0.3)
    assert paper.table([fig("c", "capacity", 4.0, setup="bw1000_colocated")], {"c": 4.0})[0]["split"] == "held_out"
    assert paper.summary(paper.table([*leaders, held], values)) == {"fitted": (4, 5), "held_out": (0, 1)}


def test_figures_are_well_formed():
    """Every figure has a known kind and probe; B200's are the fitted ones, H200's and DCU's held out; the
    leader shares name leader rows that exist."""
    keys = {f.key for f in FIGURES}
    assert len(keys) == len(FIGURES)
    for f in FIGURES:
        assert f.kind in KINDS and (f.setup or f.hardware) in SETUPS
        assert SETUPS[f.setup or f.hardware].split == ("fitted" if f.hardware == "b200" else "held_out")
        if f.kind == "leader_share":   # counted from rows judged before it
            before = {g.key for g in FIGURES[:FIGURES.index(f)]}
            assert set(f.probe[1]) <= before
            named = [g for g in FIGURES if g.key in f.probe[1]]
            assert len(named) == f.paper and all(g.kind == "leader" and g.hardware == f.hardware for g in named)
    assert {s.split for s in SETUPS.values()} == set(SPLITS)
    assert {f.hardware for f in FIGURES} == {"b200", "h200", "bw1000"}


def test_paper_cli_writes_rows(tmp_path, monkeypatch, capsys):
    """The subcommand prints the table and writes {'rows': [...]}; the simulation is replaced by fixed values."""
    from splash.sim.cli import main
    figs = [fig("a", "tokens_per_s", 100.0), fig("b", "leader", "tp", hw="h200", probe=("leader", 1, 1))]
    monkeypatch.setattr(paper, "FIGURES", figs)
    monkeypatch.setattr(paper, "simulate", lambda fs, progress=None, scale=None: {"a": 90.0, "b": "dop"})
    out = tmp_path / "paper.json"
    assert main(["paper", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "fitted: 1 of 1" in text and "held_out: 0 of 1" in text
    rows = json.loads(out.read_text())["rows"]
    assert rows[0] == {"figure": "B200 §x: a", "paper": 100.0, "sim": 90.0, "error": pytest.approx(-0.1),
                       "split": "fitted", "within": True}
    assert rows[1]["within"] is False and rows[1]["error"] is None
    assert main(["paper", "--only", "h200"]) == 0 and "held_out: 0 of 1" in capsys.readouterr().out
    assert main(["paper", "--only", "nope"]) == 2


def test_evaluator_capacity_probes():
    """The cheap probes run through the real model (capacity, resident requests, the scenario)."""
    ev = paper.Evaluator(SETUPS["b200"])
    assert ev.evaluate(("capacity_ratio", "dop", "dp_attn")) > 1.0
    assert ev.evaluate(("resident", "dop", 16, 512_000, 1024)) == 16
    lim = {k: paper.Evaluator(SETUPS["bw1000"]).evaluate(("scenario_limit", k)) for k in ("tp", "dp_attn", "cp", "dop")}
    assert lim["dop"] > lim["cp"] == lim["dp_attn"] > lim["tp"] > 0
    freed = ev.caps["dop"].room_bytes_per_rank - ev.caps["dp_attn"].room_bytes_per_rank
    assert ev.evaluate(("freed_gib", "dop", "dp_attn")) == pytest.approx(freed / (1 << 30)) and freed > 0
    assert ev.evaluate(("leaders",)) is None     # counted over the leader rows by table()


def test_table_cells():
    assert [paper._fmt(v) for v in (None, True, "dp_attn", 1234.4, 42, 0.123456)] == [
        "—", "true", "DP-attn", "1,234", "42", "0.1235"]


def test_wave_completions():
    assert wave_completions([3, 1], [10.0, 5.0]) == [10.0, 10.0, 10.0, 15.0]
    assert wave_completions([], []) == []
    with pytest.raises(ValueError):
        wave_completions([3], [1.0, 2.0])


def test_evaluator_burst_probe():
    """The burst rows: waves of as many requests as the layout admits, each request completing with its wave;
    input tokens/s over the last completion, mean completion over all requests."""
    ev = paper.Evaluator(SETUPS["bw1000_colocated"])
    b, d = (burst(ev.cm, ev.sim, ev.caps, lay, 32, 240_000, 1000) for lay in ("dp_attn", "dop"))
    assert b["waves"] == [24, 8] and d["waves"] == [32]
    w1, w2 = b["wave_s"]
    assert 0 < w2 < w1 and b["makespan_s"] == pytest.approx(w1 + w2)
    assert ev.evaluate(("burst", "dp_attn", 32, 240_000, 1000, "mean_completion_s")) == pytest.approx(
        (24 * w1 + 8 * (w1 + w2)) / 32)
    assert ev.evaluate(("burst", "dp_attn", 32, 240_000, 1000, "input_tokens_per_s")) == pytest.approx(
        32 * 240_000 / (w1 + w2))
    assert ev.evaluate(("burst", "dop", 32, 240_000, 1000, "mean_completion_s")) == pytest.approx(d["makespan_s"])


def test_scale_option():
    assert paper.parse_scale(["attention_flops_per_s=0.5", "link_bytes_per_s=2"]) == {
        "attention_flops_per_s": 0.5, "link_bytes_per_s": 2.0}
    for bad in (["nope=1"], ["attention_flops_per_s"], ["attention_flops_per_s=x"], ["name=2"]):
        with pytest.raises(ValueError):
            paper.parse_scale(bad)
    base = paper.Evaluator(SETUPS["b200"])
    half = paper.Evaluator(SETUPS["b200"], {"memory_bytes": 0.5})
    assert half.profile.memory_bytes == base.profile.memory_bytes / 2
    assert half.evaluate(("capacity", "dop", "distinct")) < base.evaluate(("capacity", "dop", "distinct"))


def test_evaluator_throughput_and_switch_probes_read_the_model():
    """The tokens/s, leader, ratio and switch probes through the real model (H200, one switch table of B=2 x 16K):
    each equals what it is derived from, a range its extreme, an infeasible or missing direction None."""
    ev = paper.Evaluator(SETUPS["h200"])
    pts = [(16, 64_000), (16, 128_000)]
    tps = {(lay, b, n): ev.evaluate(("tps", lay, b, n)) for lay in ("tp", "dp_attn", "cp", "dop") for b, n in pts}
    assert all(v is None or v > 0 for v in tps.values()) and tps[("dop", 16, 64_000)]
    for b, n in pts:
        feasible = {lay: v for (lay, bb, nn), v in tps.items() if (bb, nn) == (b, n) and v}
        assert ev.evaluate(("leader", b, n)) == max(feasible, key=feasible.get)
        assert ev.evaluate(("ratio", "dop", "cp", b, n)) == pytest.approx(tps[("dop", b, n)] / tps[("cp", b, n)])
    assert ev.evaluate(("tps_range", "dop", pts, "min")) == min(tps[("dop", b, n)] for b, n in pts)
    assert ev.evaluate(("ratio_range", "dop", "cp", pts, "max")) == pytest.approx(
        max(tps[("dop", b, n)] / tps[("cp", b, n)] for b, n in pts))
    rows = ev.switches(2, 16_000)
    assert len(rows) == 12 and ev.switches(2, 16_000) is rows          # memoised: one table per (B, context)
    row = next(r for r in rows if (r["src"], r["dst"]) == ("dop", "cp"))
    assert ev.evaluate(("switch", "dop", "cp", "live", 2, 16_000)) == pytest.approx(row["live_s"] * 1e3)
    assert ev.evaluate(("switch", "dop", "dop", "live", 2, 16_000)) is None    # no such direction
    assert ev.evaluate(("primitive_dir", "dop", "cp", "kv", 2, 16_000)) == pytest.approx(row["kv_layer_s"] * 1e3)
    kv = [r["kv_layer_s"] * 1e3 for r in rows if r["kv_layer_s"] > 0]
    assert ev.evaluate(("primitive", "kv", 2, 16_000, "min")) == pytest.approx(min(kv))
    assert ev.evaluate(("switch_range", "blocking", 2, 16_000, "max")) == pytest.approx(
        max(r["blocking_s"] for r in rows) * 1e3)
    assert ev.evaluate(("switch_saving", 2, 16_000, "min")) == pytest.approx(
        min(r["live_s"] / r["blocking_s"] for r in rows if r["recv_bytes"] > 0))
    assert ev.evaluate(("switch_step_share", 2, 16_000)) == pytest.approx(
        max(r["live_s"] / r["dst_step_s"] for r in rows))
    assert paper._extreme([1.0, None], "min") is None and paper._extreme([], "max") is None
    with pytest.raises(ValueError, match="unknown probe"):
        ev.evaluate(("nope",))


def test_simulate_keeps_one_evaluator_per_setup(monkeypatch):
    made = []

    class Counting(paper.Evaluator):
        def __init__(self, setup, scale=None):
            made.append(setup)
            super().__init__(setup, scale)

    monkeypatch.setattr(paper, "Evaluator", Counting)
    figs = [f for f in FIGURES if f.probe[0] in ("capacity", "capacity_ratio") and f.hardware == "b200"]
    seen = []
    values = paper.simulate(figs, progress=seen.append)
    assert len(figs) >= 2 and seen == figs and len(made) == 1
    assert all(values[f.key] > 0 for f in figs)
