"""One launch per rank count that several files share (rank start-up once, not per file)."""
from __future__ import annotations

import importlib

import pytest
from mpi_util import run_jobs

# the files whose launches share one per rank count, in launch order; each has `launch_jobs(nprocs,
# tmp_path_factory, tiny_ckpt) -> [(worker script, *args), ...]` (its references built once, by the first call).
# test_sampling_dist last: its followers finish before rank 0 (rank 0 then checks alone).
SHARING = ("test_collectives", "test_device_plumbing", "test_quant_dist", "test_prefix_dist", "test_reload_dist",
           "test_auto_switch", "test_sampling_dist")


@pytest.fixture(scope="session")
def shared_launches(request, tiny_ckpt, tmp_path_factory):
    """`shared_launches(nprocs) -> CompletedProcess`: one launch per rank count (2, 4) runs every SHARING file's
    jobs of that rank count in turn (tests/distributed/jobs_worker.py). Each test asserts its own OK lines (they
    name their worker's job) and the launch's exit status; a failing job aborts the launch, so every test of it
    then fails with its output (the first traceback names the job). Only the SHARING files this session collected
    take part: one file run alone launches its own jobs only."""
    runs: dict[int, object] = {}
    collected = {m.__name__ for m in (getattr(item, "module", None) for item in request.session.items) if m}

    def get(nprocs: int):
        if nprocs not in runs:
            jobs = [job for name in SHARING if name in collected
                    for job in importlib.import_module(name).launch_jobs(nprocs, tmp_path_factory, tiny_ckpt)]
            runs[nprocs] = run_jobs(nprocs, jobs, timeout=280)   # under pytest-timeout's 300 s
        return runs[nprocs]
    return get
