"""The `splash-bench` commands that run the engine on real ranks, each at its smallest setting (tiny-mla, a few
requests or steps, seconds): `switch` (live and blocking switches per direction), `calibrate` (a hardware
profile the cost model loads) and `workload` (auto and a fixed layout, each served by a real splash-serve under
mpiexec). What they write is checked, not only that they exit 0."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))
from mpi_util import mpiexec_path, run_mpi  # noqa: E402

from splash.bench import cli  # noqa: E402
from splash.bench import results as R  # noqa: E402

pytestmark = pytest.mark.skipif(mpiexec_path() is None, reason="mpiexec not found")

CLI = "splash/bench/cli.py"
LAYOUTS = ("tp", "dp_attn", "cp", "dop")


def test_switch_command_times_both_directions_and_dedupes_a_shared_prefix(tmp_path):
    out_json, md = tmp_path / "switch.json", tmp_path / "switch.md"
    res = run_mpi(2, CLI, "switch", "--preset", "tiny-mla", "--layouts", "tp,dop", "--batch", "2", "--context", "40",
                  "--trials", "2", "--shared-prefix", "32", "--json", str(out_json), "--markdown", str(md),
                  timeout=180)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    doc = R.read_json(out_json)
    assert doc["kind"] == "switch" and doc["complete"] and doc["config"]["shared_prefix"] == 32
    by = {(p["src"], p["dst"]): p for p in doc["points"]}
    assert set(by) == {("tp", "dop"), ("dop", "tp")}
    for p in by.values():
        assert len(p["live_s"]) == len(p["blocking_s"]) == len(p["per_request_s"]) == 2
        assert len(p["ready_s"]) == 4 and all(r > 0 for r in p["ready_s"])
    # DOP -> TP gathers every request's blocks on every rank: the shared prefix's blocks arrive once per receiving
    # rank, and once per request when the plan ignores their sharing
    back = by[("dop", "tp")]
    assert 0 < back["recv_mib"] < back["per_request_recv_mib"]
    assert "switch added time over a ready destination step" in res.stdout and "dop->tp" in res.stdout
    table = md.read_text()
    assert "live / blocking p50" in table and "per request: MiB in" in table and "| tp->dop |" in table


def _calibrate(*args: str) -> str:
    res = run_mpi(2, CLI, "calibrate", "--preset", "tiny-mla", "--quick", *args, timeout=240)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-3000:]
    return res.stdout


def test_calibrate_writes_a_profile_the_cost_model_uses(tmp_path):
    from splash.costmodel import RowLoad, load_profile
    from splash.costmodel.step_cost import CostModel
    from splash.models.presets import preset_config

    out = tmp_path / "hw" / "cpu-test.yaml"
    text = _calibrate("--prefill-factors", "--clock", "cpu", "--stat", "min", "--name", "cpu-test",
                      "--out", str(out))
    assert f"wrote {out}" in text
    prof = load_profile(str(out))   # validated as every shipped profile is
    assert prof.name == "cpu-test" and "2 ranks, preset tiny-mla, min" in prof.source
    assert out.read_text().startswith("# CPU hardware profile, measured by `splash-bench calibrate`")
    # the header names the command that ran (not a fixed example), and the source line its clock
    command = out.read_text().splitlines()[1]
    assert "mpiexec -n 2 splash-bench calibrate" in command and "--clock cpu --stat min" in command, command
    assert "min, clock cpu," in prof.source
    assert all(v > 0 for v in prof.gemm_flops_per_s.values())
    assert prof.memory_bytes_per_s > 0 and prof.kv_read_bytes_per_s > 0 and prof.op_overhead_s > 0
    assert all(c.alpha_s >= 0 and c.bytes_per_s > 0 for c in prof.collectives.values())
    assert set(prof.step_overhead_layout_s) == set(LAYOUTS) == set(prof.prefill_attention_factor)
    assert all(f > 0 for f in prof.prefill_attention_factor.values())
    assert sorted(prof.gemm_rows_flops_per_s["float32"]) == [1, 4, 16, 64, 256, 1024, 2048]
    assert prof.collective_sync_s >= 0 and prof.collective_wait_fraction == 0.0   # the residual fit, not timed
    # every number it wrote says where it comes from (as the shipped cpu profile's do)
    from splash.bench.calib_provenance import calibrated_provenance
    written = yaml.safe_load(out.read_text())
    assert prof.provenance == calibrated_provenance(written, prefill_factors=True)
    assert prof.provenance["prefill_attention_factor"].startswith("measured")
    cm = CostModel(preset_config("tiny-mla"), 2, prof, "float32", "float32", 16)
    assert all(cm.step(lay, [RowLoad(1, 64, 0), RowLoad(1, 64, 1)]).seconds > 0 for lay in LAYOUTS)


def test_calibrate_times_collectives_inside_steps_and_prints_the_profile():
    from splash.costmodel.profile import profile_from_dict

    text = _calibrate("--in-step-collectives")
    prof = profile_from_dict(yaml.safe_load(text), "printed profile")
    # timed inside real steps: every collective of 2 shapes x 4 layouts x the repetitions (the default fit times
    # none). The wait itself is a share of the time outside collectives (above 1 on a loaded host) and 0 when the
    # slowest rank arrives last at every collective, so only its sign is fixed (split_wait: tests/test_costmodel.py)
    assert prof.extra["in_step_collectives_timed"] >= 8 and prof.collective_wait_fraction >= 0
    assert prof.collective_sync_s >= 0
    assert prof.prefill_attention_factor == {}      # measured only with --prefill-factors
    assert prof.provenance["collective_wait_fraction"].startswith("measured")


WORKLOAD = """groups:
  - {at_s: 0.0, count: 2, input_len: 16, output_len: 4}
  - {at_s: 0.2, count: 2, prefix_len: 8, input_len: 12, output_len: 3, turns: 2}
"""


def test_workload_command_serves_auto_and_a_fixed_layout(tmp_path, capsys):
    wl, out_json = tmp_path / "w.yaml", tmp_path / "workload.json"
    wl.write_text(WORKLOAD)
    rc = cli.main(["workload", "--np", "2", "--workload", str(wl), "--modes", "auto,tp",
                   "--server-args", "--preset tiny-mla", "--json", str(out_json)])
    out = capsys.readouterr().out
    assert rc == 0, out
    doc = R.read_json(out_json)
    assert doc["kind"] == "workload" and doc["config"]["workload"]["groups"][1]["turns"] == 2
    runs = {r["mode"]: r for r in doc["runs"]}
    assert list(runs) == ["auto", "tp"]
    for r in runs.values():
        assert (r["completed"], r["lost"], r["server_exit"], r["errors"]) == (4, 0, 0, [])
        assert r["same_tokens"] and r["output_tokens_per_s"] > 0 and r["latency_p99_s"] >= r["latency_p50_s"] > 0
        assert r["ttft_p50_later_turns_s"] is not None            # the conversations' second turns
        assert r["prefix_cache_hit_rate"] > 0                     # shared prefix, resent conversation
        assert sum(ph["tokens"] for ph in r["phases"].values()) == 2 * 4 + 2 * 2 * 3   # every token in a phase
        assert r["timeline"] and all(s["layout"] in LAYOUTS for s in r["timeline"])
    # auto logs its decisions (--log-decisions) and keeps its history; a pinned layout decides nothing
    assert runs["auto"]["decision_log"] and all("verdict" in d for d in runs["auto"]["decision_log"])
    assert runs["tp"]["decision_log"] == [] and runs["auto"]["scheduler"]["history"]
    assert set(doc["oracle"]["phase_leaders"].values()) == {"tp"}   # the only fixed layout run
    logs = tmp_path / "workload-logs"
    assert sorted(p.name for p in logs.iterdir()) == ["server-auto.log", "server-tp.log"]
    assert "auto vs best fixed" in out and "tokens = first" in out


@pytest.mark.parametrize("flags, message", [
    (["--modes", "auto,nope"], "--modes: unknown ['nope']"),
    (["--prefix-caching", "maybe"], "--prefix-caching: 'maybe'"),
    (["--workload", "/nonexistent/w.yaml"], "cannot read the workload"),
])
def test_workload_command_refuses_bad_options_before_serving(flags, message, capsys):
    assert cli.main(["workload", *flags]) == 2
    assert message in capsys.readouterr().err
