"""Sampling parameters, logprobs and prompt logprobs on 2 real ranks through live layout switches equal
transformers (reference sampler) and one unswitched rank (worker: sampling_worker.py)."""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from mpi_util import run_mpi  # noqa: E402


def test_sampling_through_live_switches(tiny_ckpt):
    res = run_mpi(2, "tests/distributed/sampling_worker.py", str(tiny_ckpt("dense")), timeout=300)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert "rank 0: sampling OK" in res.stdout and "rank 1: sampling OK" in res.stdout, res.stdout
