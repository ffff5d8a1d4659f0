"""Sampling parameters, logprobs and prompt logprobs on 2 real ranks through live layout switches equal
transformers (reference sampler) and one unswitched rank (worker: sampling_worker.py)."""
from __future__ import annotations


def launch_jobs(nprocs: int, tmp_path_factory, tiny_ckpt) -> list[tuple[str, ...]]:
    """This file's worker job, run in tests/distributed/conftest.py's shared 2-rank launch."""
    return [("tests/distributed/sampling_worker.py", str(tiny_ckpt("dense")))] if nprocs == 2 else []


def test_sampling_through_live_switches(shared_launches):
    res = shared_launches(2)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert "rank 0: sampling OK" in res.stdout and "rank 1: sampling OK" in res.stdout, res.stdout
