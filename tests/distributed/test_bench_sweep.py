"""`splash-bench sweep` on 2 real ranks (tiny-mla, a few tokens per point, seconds): the JSON it writes is a
valid result with every point and repeat, the tables and plots render from it, a killed sweep keeps the points
it had measured and --resume measures only the rest."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from mpi_util import REPO_ROOT, mpiexec_path, run_mpi  # noqa: E402

from splash.bench import cli  # noqa: E402
from splash.bench import results as R  # noqa: E402

CLI = "splash/bench/cli.py"
TINY = ["--input-lens", "8,24", "--batch-sizes", "1,3", "--output-len", "2", "--warmup", "0"]


def _sweep(*args: str, timeout: float = 240):
    res = run_mpi(2, CLI, "sweep", *args, timeout=timeout)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    return res.stdout


def test_tiny_sweep_json_tables_plots_and_resume(tmp_path):
    out_json = tmp_path / "sweep.json"
    out = _sweep(*TINY, "--layouts", "tp,dop", "--repeats", "2", "--json", str(out_json))
    doc = R.read_json(out_json)
    assert doc["complete"] and doc["kind"] == "sweep"
    assert doc["environment"]["ranks"] == 2 and doc["environment"]["backend"] == "cpu"
    assert doc["environment"]["model"]["name"] == "tiny-mla"
    assert sorted(R.sweep_key(p) for p in doc["points"]) == sorted(
        (lay, n, b, 2) for lay in ("tp", "dop") for n in (8, 24) for b in (1, 3))
    for p in doc["points"]:
        assert len(p["repeats"]) == 2
        assert all(r["output_tokens"] == p["batch_size"] * 2 for r in p["repeats"])
        lo, hi = sorted(r["output_tokens_per_s"] for r in p["repeats"])
        assert lo <= p["output_tokens_per_s"] <= hi
    assert "vs input length" in out and "vs batch size" in out and "lead" in out
    assert cli.main(["compare", str(out_json), str(out_json)]) == 0
    assert cli.main(["plot", str(out_json), "--out", str(tmp_path / "figs")]) == 0
    assert (tmp_path / "figs" / "throughput_vs_input_len.png").stat().st_size > 1000


def test_killed_sweep_keeps_points_and_resumes(tmp_path):
    out_json = tmp_path / "killed.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join(p for p in (str(REPO_ROOT), os.environ.get("PYTHONPATH", "")) if p)}
    args = ["sweep", "--input-lens", "8,16,24,32", "--batch-sizes", "1,2", "--layouts", "tp,dop", "--output-len", "2",
            "--warmup", "0", "--repeats", "1", "--json", str(out_json)]
    proc = subprocess.Popen([mpiexec_path(), "-n", "2", sys.executable, str(REPO_ROOT / CLI), *args], env=env,
                            cwd=REPO_ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    try:
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline and proc.poll() is None:
            if out_json.exists() and len(json.loads(out_json.read_text())["points"]) >= 3:
                break
            time.sleep(0.05)
        else:
            pytest.fail("the sweep wrote no points in time or finished before it could be killed")
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    kept = R.read_json(out_json)            # the file is whole: written atomically after every point
    assert not kept["complete"] and 3 <= len(kept["points"]) < 16
    res = run_mpi(2, CLI, *args, "--resume", timeout=300)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    done = R.read_json(out_json)
    assert done["complete"] and len(done["points"]) == 16
    assert len({R.sweep_key(p) for p in done["points"]}) == 16
    assert done["points"][:len(kept["points"])] == kept["points"]


def test_grid_subcommand_writes_a_comparable_result(tmp_path):
    """The layout grid (a former script) on the shared result format: valid JSON that compare reads."""
    out_json = tmp_path / "grid.json"
    res = run_mpi(2, CLI, "grid", "--preset", "tiny-mla", "--layouts", "tp,dop", "--batches", "2", "--contexts",
                  "16", "--steps", "1", "--json", str(out_json), timeout=180)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    doc = R.read_json(out_json)
    assert doc["kind"] == "grid" and doc["complete"] and len(doc["points"]) == 2
    assert all(p["step_ms"] > 0 for p in doc["points"]) and "decode step ms" in res.stdout
    assert cli.main(["compare", str(out_json), str(out_json)]) == 0


def test_sweep_refuses_to_overwrite_or_to_resume_a_different_sweep(tmp_path):
    """Every rank stops with the same error (exit 2, said once) before the model loads, here a --resume of a sweep
    whose settings differ; an existing --json without --resume or --force, and bad counts, are refused alike."""
    import argparse

    from splash.bench import sweep

    out_json = tmp_path / "other.json"
    doc = R.new_result("sweep", R.environment(backend="cpu", ranks=2, model={"name": "tiny-mla"}),
                       {"layouts": ["tp"], "input_lens": [8], "batch_sizes": [1], "output_len": 7}, ["sweep"])
    R.write_json(out_json, doc)
    res = run_mpi(2, CLI, "sweep", *TINY, "--layouts", "tp", "--json", str(out_json), "--resume", timeout=120)
    assert res.returncode == 2, res.stdout[-2000:] + res.stderr[-2000:]
    assert res.stderr.count("cannot resume, this sweep differs in output_len") == 1, res.stderr[-2000:]
    assert R.read_json(out_json) == doc      # left as it was
    p = argparse.ArgumentParser()
    sweep.add_arguments(p)
    for extra, message in ((["--json", str(out_json)], "exists: pass --resume to continue that sweep or --force"),
                           (["--resume"], "--resume needs --json FILE"),
                           (["--repeats", "0"], "--output-len and --repeats must be >= 1")):
        with pytest.raises(ValueError, match=message):
            sweep._check_args(p.parse_args([*TINY, *extra]))
    sweep._check_args(p.parse_args([*TINY, "--json", str(out_json), "--force"]))
