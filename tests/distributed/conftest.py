"""The launch that test_collectives, test_auto_switch and test_sampling_dist share at each rank count."""
from __future__ import annotations

import pytest
from mpi_util import run_jobs


@pytest.fixture(scope="session")
def shared_launches(tiny_ckpt, tmp_path_factory):
    """`shared_launches(nprocs) -> CompletedProcess`: one launch per rank count (2, 4) runs the collectives
    worker (its communicator kinds of that rank count), the auto-layout worker and (2 ranks) the sampling worker in
    turn: three files' launches share one rank start-up. Each test asserts its own OK lines (they name the
    worker) and the launch's exit status; a failing job aborts the launch, so every test of it fails."""
    from test_auto_switch import auto_job
    from test_collectives import collectives_job
    from test_sampling_dist import sampling_job

    runs: dict[int, object] = {}
    auto: list[tuple[str, ...]] = []

    def get(nprocs: int):
        if nprocs not in runs:
            if not auto:
                auto.append(auto_job(tmp_path_factory))
            jobs = [collectives_job(nprocs), auto[0], *([sampling_job(tiny_ckpt)] if nprocs == 2 else [])]
            runs[nprocs] = run_jobs(nprocs, jobs, timeout=280)   # under pytest-timeout's 300 s
        return runs[nprocs]
    return get
