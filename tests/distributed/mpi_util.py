"""Launch a script on real ranks with `mpiexec -n N` (shared by the distributed tests)."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]


def mpiexec_path() -> str | None:
    """The venv's mpiexec (next to sys.executable), else the one on PATH."""
    return shutil.which("mpiexec", path=os.path.dirname(sys.executable)) or shutil.which("mpiexec")


def run_mpi(
    nprocs: int,
    script: str | os.PathLike,
    *args: str,
    timeout: float = 120.0,
    env: dict[str, str] | None = None,
) -> subprocess.CompletedProcess:
    """Run `python script *args` on `nprocs` ranks from the repo root; capture text output.

    `script` may be relative to the repo root. `env` entries are added to os.environ; the repo
    root is prepended to PYTHONPATH and OMP_NUM_THREADS defaults to 1. On timeout the whole
    process group is killed and returncode is 124 with a note appended to stderr.
    """
    mpiexec = mpiexec_path()
    if mpiexec is None:
        raise RuntimeError("mpiexec not found next to sys.executable or on PATH")
    full_env = {**os.environ, **(env or {})}
    full_env["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(REPO_ROOT), full_env.get("PYTHONPATH", "")) if p
    )
    full_env.setdefault("OMP_NUM_THREADS", "1")
    cmd = [mpiexec, "-n", str(nprocs), sys.executable, str(REPO_ROOT / script), *map(str, args)]
    proc = subprocess.Popen(
        cmd, cwd=REPO_ROOT, env=full_env, text=True, start_new_session=True,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE,
    )
    try:
        out, err = proc.communicate(timeout=timeout)
        return subprocess.CompletedProcess(cmd, proc.returncode, out, err)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        return subprocess.CompletedProcess(cmd, 124, out, f"{err}\n[run_mpi] timed out after {timeout}s")


def run_jobs(nprocs: int, jobs: list[tuple[str, ...]], timeout: float = 120.0) -> subprocess.CompletedProcess:
    """One launch that runs each `(worker script, *args)` job in turn (tests/distributed/jobs_worker.py): rank
    start-up once for workers of different files at one rank count. Their lines must not collide."""
    args: list[str] = []
    for job in jobs:
        args += [*(["::"] if args else []), *map(str, job)]
    return run_mpi(nprocs, "tests/distributed/jobs_worker.py", *args, timeout=timeout)


def split_jobs(argv: list[str]) -> list[list[str]]:
    """A shared launch's argv (`job args :: job args ...`, as `run_jobs` and test_switching join them) as its jobs."""
    jobs: list[list[str]] = [[]]
    for a in argv:
        if a == "::":
            jobs.append([])
        else:
            jobs[-1].append(a)
    return jobs


def run_worker(main) -> None:
    """Run a worker's `main()` on one rank; on any failure print it and abort the whole MPI job, so the other
    ranks are not left waiting in a collective (the test then fails at once instead of timing out)."""
    try:
        main()
    except BaseException:
        import traceback

        from mpi4py import MPI
        traceback.print_exc()
        sys.stderr.flush()
        MPI.COMM_WORLD.Abort(1)


def comm_from_argv(args: list[str]):
    """A worker's data-plane communicator from an optional argv entry: "mpi" (or nothing) gives None, so each
    LLM builds its own MPI communicator as it does by default; "torch" starts torch.distributed (gloo) once and
    returns its TorchCommunicator, shared by every LLM the worker builds."""
    kind = args[0] if args else "mpi"
    if kind == "mpi":
        return None
    from splash.distributed import TorchCommunicator, init_dist, make_communicator

    comm = make_communicator(kind, init_dist())
    assert isinstance(comm, TorchCommunicator) or comm.size == 1, type(comm).__name__
    return comm
