"""Latency of the CPU (mpi4py) collectives.

    .venv/bin/mpiexec -n 2 .venv/bin/python benchmarks/bench_collectives.py [--iters 200]

Sizes are bytes each rank contributes (bf16 rows of 1 KiB). Reported time is the mean per call,
taken as the max over ranks. Time at 2 ranks; label any 4-rank figures (oversubscribed here).
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch

from splash.distributed import Communicator, init_dist

ROW = 512  # bf16 elements per row = 1 KiB


def time_op(comm: Communicator, op: Callable[[], object], iters: int) -> float:
    """Mean seconds per call, max over ranks."""
    for _ in range(max(3, iters // 10)):
        op()
    comm.barrier()
    t0 = time.perf_counter()
    for _ in range(iters):
        op()
    mean = (time.perf_counter() - t0) / iters
    return max(comm.all_gather_obj(mean))


def cases(comm: Communicator, nbytes: int) -> dict[str, Callable[[], object]]:
    n = comm.size
    rows = nbytes // (ROW * 2)
    x = torch.randn(rows, ROW).to(torch.bfloat16)
    # Uneven gatherv: rank r gives ~2 * rows * (r + 1) / (n + 1) rows, so the mean is ~rows.
    gv = x[: max(1, rows * 2 * (comm.rank + 1) // (n + 1))]
    gv_counts = comm.gather_counts(gv.shape[0])
    send = [rows // n + (1 if d < rows % n else 0) for d in range(n)]
    recv = comm.exchange_counts(send)
    return {
        "all_reduce": lambda: comm.all_reduce(x),
        "all_gatherv": lambda: comm.all_gatherv(gv, gv_counts),
        "all_to_allv": lambda: comm.all_to_allv(x, send, recv),
        "iall_reduce+wait": lambda: comm.iall_reduce(x).wait(),
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--iters", type=int, default=200)
    ap.add_argument("--sizes", type=int, nargs="+", default=[32 << 10, 1 << 20])
    args = ap.parse_args()
    torch.set_num_threads(1)
    ctx = init_dist()
    rows = []
    for nbytes in args.sizes:
        iters = args.iters if nbytes <= (64 << 10) else max(10, args.iters // 8)
        for name, op in cases(ctx.comm, nbytes).items():
            rows.append((name, nbytes, time_op(ctx.comm, op, iters)))
    if ctx.rank == 0:
        from rich.console import Console
        from rich.table import Table

        table = Table(title=f"CPU collectives, {ctx.world_size} ranks (bf16)")
        for col in ("op", "bytes/rank", "µs/call", "GB/s (bytes/rank ÷ time)"):
            table.add_column(col, justify="right")
        for name, nbytes, sec in rows:
            table.add_row(name, f"{nbytes >> 10} KiB", f"{sec * 1e6:.1f}", f"{nbytes / sec / 1e9:.2f}")
        Console().print(table)


if __name__ == "__main__":
    main()
