"""splash-bench without ranks: the result schema, compare's exit codes and messages, tables, plots, the CLI's
subcommand table (a module that does not import is left out of --help)."""
from __future__ import annotations

import copy
import json

import pytest

from splash.bench import cli
from splash.bench import results as R
from splash.bench.show import sweep_tables
from splash.bench.tables import leader_table, to_markdown


def _point(layout, n, b, tps, out=4):
    reps = [{"wall_s": b * out / tps, "output_tokens_per_s": tps, "total_tokens_per_s": tps * (n + out) / out}]
    return {"layout": layout, "input_len": n, "batch_size": b, "output_len": out, "repeats": reps,
            "output_tokens_per_s": tps, "total_tokens_per_s": tps * (n + out) / out, "wall_s": b * out / tps}


def _sweep(scale=1.0, ranks=2):
    env = R.environment(backend="cpu", ranks=ranks, model={"name": "tiny-mla", "dtype": "float32",
                                                           "kv_cache_dtype": "float32"})
    doc = R.new_result("sweep", env, {"layouts": ["tp", "dop"], "output_len": 4, "repeats": 1}, ["sweep"])
    doc["points"] = [_point(lay, n, b, scale * (100 + 10 * i)) for i, (lay, n, b) in enumerate(
        (lay, n, b) for lay in ("tp", "dop") for n in (16, 64) for b in (1, 4))]
    doc["complete"] = True
    return doc


def _write(tmp_path, name, doc):
    p = tmp_path / name
    R.write_json(p, doc)
    return str(p)


def test_environment_and_schema_round_trip(tmp_path):
    doc = _sweep()
    env = doc["environment"]
    assert env["backend"] == "cpu" and env["ranks"] == 2
    assert env["hardware"]["description"].startswith("CPU:") and env["hardware"]["cpu_cores"] >= 1
    assert env["versions"]["python"] and env["versions"]["torch"]
    assert len(env["git"]["revision"] or "") == 40
    back = R.read_json(_write(tmp_path, "a.json", doc))
    assert back == json.loads(json.dumps(doc))
    assert not list(tmp_path.glob(".*tmp*")), "atomic write left a temp file"


@pytest.mark.parametrize("breakage,message", [
    (lambda d: d.update(schema="other/9"), "schema"),
    (lambda d: d.pop("environment"), "environment"),
    (lambda d: d["points"][0].pop("batch_size"), "batch_size"),
    (lambda d: d["points"][0].update(output_tokens_per_s="fast"), "output_tokens_per_s"),
    (lambda d: d["points"][1].update(repeats=[]), "repeats"),
    (lambda d: (d.pop("points"), d.pop("runs", None)), "neither"),
    (lambda d: d.pop("kind"), "no 'kind'"),
    (lambda d: d.update(points={}), "'points' is not a list"),
    (lambda d: d["points"].__setitem__(0, 5), r"points\[0\] is not an object"),
    (lambda d: d.update(runs=[{"output_tokens_per_s": 1.0}]), r"runs\[0\] must be an object with a 'mode'"),
    (lambda d: d.update(runs=[{"mode": "tp", "output_tokens_per_s": "1"}]), "output_tokens_per_s must be a number"),
    (lambda d: d.update(runs=[{"mode": "tp", "output_tokens_per_s": 1.0, "timeline": [{"t_s": 0}]}]),
     r"runs\[0\].timeline\[0\] needs t_s, step, layout, tokens_per_s"),
])
def test_schema_rejects_bad_documents(breakage, message):
    doc = _sweep()
    breakage(doc)
    with pytest.raises(R.ResultError, match=message):
        R.validate(doc, "x.json")


def test_a_result_must_be_an_object(tmp_path):
    p = tmp_path / "list.json"
    p.write_text("[1, 2]")
    with pytest.raises(R.ResultError, match="list.json: not a JSON object"):
        R.read_json(p)


def test_compare_no_regression_and_faster_exit_0(tmp_path, capsys):
    old = _write(tmp_path, "old.json", _sweep())
    assert cli.main(["compare", old, _write(tmp_path, "same.json", _sweep(0.97))]) == 0  # within 5%
    assert cli.main(["compare", old, _write(tmp_path, "fast.json", _sweep(1.5))]) == 0
    out = capsys.readouterr().out
    assert "8 points compared: 0 regressed" in out and "faster" in out


def test_compare_regression_exit_1_and_tolerance(tmp_path, capsys):
    old = _write(tmp_path, "old.json", _sweep())
    new = _sweep()
    new["points"][3]["output_tokens_per_s"] *= 0.9
    newp = _write(tmp_path, "new.json", new)
    assert cli.main(["compare", old, newp]) == 1
    out = capsys.readouterr().out
    assert "REGRESSION" in out and "1 regressed beyond 5%" in out
    assert cli.main(["compare", old, newp, "--tolerance", "0.15"]) == 0


def test_compare_mismatched_points_and_environments(tmp_path, capsys):
    old = _sweep()
    part = _sweep(ranks=4)
    part["points"] = [p for p in part["points"] if p["input_len"] == 16]
    part["points"].append(_point("cp", 16, 1, 50.0))
    a, b = _write(tmp_path, "old.json", old), _write(tmp_path, "part.json", part)
    assert cli.main(["compare", a, b]) == 0              # matched points fine; the rest is listed
    out = capsys.readouterr().out
    assert "environments differ: ranks: 2 -> 4" in out
    assert "only in " + a in out and "TP in=64 B=1 out=4" in out and "only in " + b in out
    assert cli.main(["compare", a, b, "--require-all"]) == 1
    none = _sweep()
    for p in none["points"]:
        p["output_len"] = 99
    capsys.readouterr()
    assert cli.main(["compare", a, _write(tmp_path, "none.json", none)]) == 2
    assert "no point" in capsys.readouterr().err


def test_compare_bad_input_exit_2(tmp_path, capsys):
    good = _write(tmp_path, "good.json", _sweep())
    (tmp_path / "bad.json").write_text("{not json")
    (tmp_path / "alien.json").write_text(json.dumps({"hello": 1}))
    for other in (str(tmp_path / "missing.json"), str(tmp_path / "bad.json"), str(tmp_path / "alien.json")):
        assert cli.main(["compare", good, other]) == 2
        assert other in capsys.readouterr().err
    runs = {**_sweep(), "kind": "workload", "points": None, "runs": [{"mode": "auto", "output_tokens_per_s": 1.0}]}
    assert cli.main(["compare", good, _write(tmp_path, "w.json", runs)]) == 2
    assert "cannot compare" in capsys.readouterr().err


def test_compare_serving_runs_by_mode(tmp_path):
    def doc(auto):
        d = {**_sweep(), "kind": "workload", "points": None}
        d["runs"] = [{"mode": "auto", "output_tokens_per_s": auto}, {"mode": "tp", "output_tokens_per_s": 50.0}]
        return d
    a = _write(tmp_path, "a.json", doc(100.0))
    assert cli.main(["compare", a, _write(tmp_path, "b.json", doc(101.0))]) == 0
    assert cli.main(["compare", a, _write(tmp_path, "c.json", doc(80.0))]) == 1


def test_leader_table_bolds_best_and_states_lead():
    spec = leader_table("t", ["k"], [(["a"], {"tp": 100.0, "dop": 125.0, "cp": None})], ["tp", "cp", "dop"])
    row = spec.rows[0]
    assert row == ["a", "100.0", "n/a", "125.0", "DOP", "+25.0%"]
    assert (0, 3) in spec.bold and (0, 1) not in spec.bold
    assert "| a | 100.0 | n/a | **125.0** | **DOP** | +25.0% |" in to_markdown(spec)


def test_sweep_tables_one_per_axis():
    specs = sweep_tables(_sweep())
    titles = [s.title.split(" — ")[0] for s in specs]
    assert titles == ["total tokens/s vs input length", "total tokens/s vs batch size"]
    one = _sweep()
    one["points"] = [p for p in one["points"] if p["batch_size"] == 1]
    assert len(sweep_tables(one)) == 1


def test_plot_sweep_and_timeline(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    src = _write(tmp_path, "s.json", _sweep())
    assert cli.main(["plot", src, "--out", str(tmp_path / "figs")]) == 0
    for name in ("throughput_vs_input_len.png", "throughput_vs_batch.png"):
        assert (tmp_path / "figs" / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    tl = [{"t_s": 0.1 * i, "step": i, "layout": "tp" if i < 5 else "dop", "tokens_per_s": 100.0 + i}
          for i in range(10)]
    runs = {**_sweep(), "kind": "workload", "points": None, "runs": [
        {"mode": "auto", "output_tokens_per_s": 90.0, "total_s": 1.0, "completed": 8, "lost": 0, "switches": 1,
         "timeline": tl, "switch_events": [{"t_s": 0.5, "src": "tp", "dst": "dop"}]},
        {"mode": "tp", "output_tokens_per_s": 80.0, "total_s": 1.0, "completed": 8, "lost": 0, "switches": 0,
         "timeline": [dict(r, layout="tp") for r in tl], "switch_events": []}]}
    assert cli.main(["plot", _write(tmp_path, "w.json", runs), "--out", str(tmp_path / "tl")]) == 0
    assert sorted(p.name for p in (tmp_path / "tl").iterdir()) == ["timeline_0_auto.png", "timeline_1_tp.png"]
    bad = copy.deepcopy(runs)
    bad["runs"][0]["timeline"][0].pop("layout")
    assert cli.main(["plot", _write(tmp_path, "bad.json", bad), "--out", str(tmp_path / "x")]) == 2


def test_cli_lists_importable_commands_and_skips_missing(monkeypatch, capsys):
    monkeypatch.setitem(cli.SUBCOMMANDS, "nothere", ("splash.bench._no_such_module", "missing"))
    parser, mods = cli.build_parser()
    assert {"sweep", "compare", "plot", "show"} <= set(mods) and "nothere" not in mods
    assert "calibrate" in cli.SUBCOMMANDS and "workload" in cli.SUBCOMMANDS
    with pytest.raises(SystemExit):
        cli.main(["--help"])
    out = capsys.readouterr().out
    assert "compare" in out and "nothere" not in out
    assert cli.main(["nothere"]) == 2
    assert "not available" in capsys.readouterr().err


def _sweep_args(tmp_path, *extra):
    import argparse

    from splash.bench import sweep
    p = argparse.ArgumentParser()
    sweep.add_arguments(p)
    return p.parse_args(["--json", str(tmp_path / "s.json"), *extra])


def test_sweep_refuses_to_overwrite_and_checks_resume_file(tmp_path):
    from splash.bench import sweep

    (tmp_path / "s.json").write_text("{}")
    with pytest.raises(ValueError, match="--resume"):
        sweep._check_args(_sweep_args(tmp_path))
    sweep._check_args(_sweep_args(tmp_path, "--force"))
    args = _sweep_args(tmp_path, "--resume")
    with pytest.raises(R.ResultError, match="schema"):
        sweep.prior_doc(args, {})
    doc = _sweep()
    doc["config"] = {"layouts": ["tp"], "input_lens": [16], "batch_sizes": [1], "output_len": 16, "warmup": 1,
                     "repeats": 3, "seed": 0, "engine": {"preset": "tiny-mla"}, "ranks": 2}
    R.write_json(tmp_path / "s.json", doc)
    grown = {**doc["config"], "layouts": ["tp", "cp"], "input_lens": [16, 64]}
    got = sweep.prior_doc(args, grown)
    assert got["config"]["layouts"] == ["tp", "cp"] and got["config"]["input_lens"] == [16, 64]
    assert not got["complete"] and got["points"] == doc["points"]
    with pytest.raises(R.ResultError, match="differs in output_len"):
        sweep.prior_doc(args, {**grown, "output_len": 8})
    done = {R.sweep_key(p) for p in got["points"]}
    todo = sweep.plan(_sweep_args(tmp_path, "--layouts", "tp,dop", "--input-lens", "16,32", "--batch-sizes", "1",
                                  "--output-len", "4"), done)
    assert todo == [(32, 1, "dop"), (32, 1, "tp")]   # (16, 1) was measured; the order rotates per point


def test_workload_keeps_the_schedulers_decision_lines():
    from splash.bench.workload import decision_log

    text = ('junk\n2026-12-01 10:00:00 splash.layout_policy layout decision {"step": 3, "verdict": "switch"}\n'
            'splash.layout_policy layout decision {"step": 4, "verd\n')         # the last line cut by the log's end
    assert decision_log(text) == [{"step": 3, "verdict": "switch"}]


def test_show_prints_a_sweep_again_and_refuses_other_kinds(tmp_path, capsys):
    src = _write(tmp_path, "s.json", _sweep())
    assert cli.main(["show", src, "--markdown", "--metric", "output_tokens_per_s"]) == 0
    md = capsys.readouterr().out
    assert "output tokens/s vs input length" in md and "output tokens/s vs batch size" in md
    assert md.count("\n| 4 | 64 |") == 1 and "|---|" in md     # batch 4, input 64: one row in the first table
    assert cli.main(["show", src]) == 0 and "total tokens/s vs input length" in capsys.readouterr().out
    runs = {**_sweep(), "kind": "workload", "points": None, "runs": [{"mode": "auto", "output_tokens_per_s": 1.0}]}
    assert cli.main(["show", _write(tmp_path, "w.json", runs)]) == 2
    assert "showing a 'workload' result is not supported" in capsys.readouterr().err


def test_load_client_counts_failed_lost_mismatched_and_ok(monkeypatch):
    """splash-bench load's bookkeeping: an HTTP error or a stream without [DONE] is failed, fewer tokens than asked
    is lost, other tokens than the unswitched reference a mismatch; only the rest is ok."""
    import asyncio
    import random

    from splash.bench import load
    script = iter([("error", []), ("no [DONE]", [1, 2, 3]), ("short", [1, 2]), ("other", [1, 2, 4]), ("ok", [1, 2, 3])])

    async def turn(client, t0, prompt, max_tokens, out):
        kind, ids = next(script)
        out.error = "RuntimeError: HTTP 500" if kind == "error" else None
        out.ok, out.ttft = kind not in ("error", "no [DONE]"), 0.01
        return ids

    monkeypatch.setattr(load, "stream_turn", turn)
    stats = load.Stats()
    asyncio.run(load.client_task(None, [[5, 6]], [[1, 2, 3]], 3, 5, random.Random(0), stats))
    assert (stats.ok, stats.failed, stats.lost, stats.mismatched) == (1, 2, 1, 1)
    assert stats.errors == ["RuntimeError: HTTP 500"] and stats.tokens == 3 + 2 + 3 + 3 and len(stats.ttfts) == 4


def test_load_targets_loopback_only():
    from splash.bench.load import check_loopback
    for url in ("http://127.0.0.1:8000", "http://localhost:8000", "http://[::1]:8000"):
        check_loopback(url)
    for url in ("http://10.0.0.1:8000", "http://example.com"):
        with pytest.raises(SystemExit, match="only targets loopback"):
            check_loopback(url)


def test_sweep_runs_the_engine_its_serving_config_describes():
    """splash-bench sweep builds the engine splash-serve builds from the same config (splash.server.startup.
    engine_args: prefix caching, sequence limit, allowed layouts...), pinned in the layout measured, and records
    those settings in the result as JSON that compares equal on --resume."""
    from types import SimpleNamespace

    from splash.bench.driver import build_llm
    from splash.bench.sweep import sweep_config
    from splash.config.serve_config import ServeConfig, apply_overrides
    from splash.distributed.communicator import SingleRankCommunicator
    from splash.server.startup import engine_args

    cfg = apply_overrides(ServeConfig(), {"enable_prefix_caching": False, "max_num_seqs": 5,
                                          "allowed_layouts": ["tp", "dop"]})
    eng = build_llm(engine_args(cfg), SingleRankCommunicator(), "dop", 64).engine
    assert (eng.layout, eng.ledger.prefix, eng.scheduler.max_num_seqs, eng.auto) == ("dop", False, 5, None)
    with pytest.raises(ValueError):
        eng.request_layout("cp")   # not an allowed layout of this config
    axes = SimpleNamespace(layouts=["dop"], input_lens=[16], batch_sizes=[1], output_len=4, warmup=0, repeats=1,
                           seed=0)
    rec = sweep_config(axes, engine_args(cfg), 1, 1)["engine"]
    assert json.loads(json.dumps(rec)) == rec and rec["enable_prefix_caching"] is False
