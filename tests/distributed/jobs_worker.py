"""Several workers' jobs in one launch (rank start-up once, not per worker): argv `worker.py arg ... :: worker.py
arg ...`; each job runs its worker's `main()` with that argv, in turn, in this process (mpi_util.run_jobs).

A job that fails aborts the whole launch (run_worker), so every test of that launch fails with its output; a
worker's `main()` that returns non-zero fails the same way."""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent)]
from mpi_util import REPO_ROOT, run_worker, split_jobs  # noqa: E402


def run_job(script: str, *args: str) -> None:
    path = REPO_ROOT / script
    spec = importlib.util.spec_from_file_location(f"job_{path.stem}", path)   # not __main__: its own launch code
    mod = importlib.util.module_from_spec(spec)                                # stays out
    spec.loader.exec_module(mod)
    sys.argv = [str(path), *args]
    rc = mod.main()
    if rc:
        raise SystemExit(f"{script}: main() returned {rc}")


def main() -> None:
    for job in split_jobs(sys.argv[1:]):
        run_job(*job)


if __name__ == "__main__":
    run_worker(main)
