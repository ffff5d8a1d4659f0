"""Latency of the collectives: the MPI communicator (mpi4py) and/or the torch.distributed one (gloo on CPU).

    .venv/bin/mpiexec -n 2 .venv/bin/python benchmarks/bench_collectives.py [--iters 200] \
        [--communicator mpi|torch|both] [--profile cpu] [--sizes 1048576 4194304 16777216 67108864]

`both` times each case on MPI, then on gloo, in one job, so the two see about the same machine load;
`--rounds R` repeats that R times (alternating) and keeps each one's best round.

Sizes are bytes each rank contributes (bf16 rows of 1 KiB). Reported time is the mean per call,
taken as the max over ranks. Time at 2 ranks; label any 4-rank figures (oversubscribed here).
`--profile` adds the cost model's prediction of the blocking calls (splash.costmodel.profile
`collective_seconds`: α + bytes/β, plus first-touching a result of at least alloc_threshold_bytes).
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch

from splash.distributed import Communicator, init_dist, make_communicator

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


def counted_bytes(comm: Communicator, nbytes: int) -> dict[str, tuple[str, float]]:
    """Per blocking case: the profile's collective kind and the bytes the cost model counts for it (the buffer;
    all_gather's gathered result; all_to_all's larger of one rank's send and receive)."""
    rows = nbytes // (ROW * 2)
    gathered = sum(comm.gather_counts(max(1, rows * 2 * (comm.rank + 1) // (comm.size + 1)))) * ROW * 2
    return {"all_reduce": ("all_reduce", rows * ROW * 2.0), "all_gatherv": ("all_gather", float(gathered)),
            "all_to_allv": ("all_to_all", rows * ROW * 2.0)}


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
        "iall_to_allv+wait": lambda: comm.iall_to_allv(x, send, recv).wait(),
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--iters", type=int, default=200)
    ap.add_argument("--sizes", type=int, nargs="+", default=[32 << 10, 1 << 20])
    ap.add_argument("--rounds", type=int, default=1, help="time each case this many times; report the best")
    ap.add_argument("--communicator", choices=("mpi", "torch", "both"), default="mpi",
                    help="torch = torch.distributed with gloo (the CPU backend); both = side by side")
    ap.add_argument("--profile", default=None, help="hardware profile (name or YAML) whose predictions to print")
    args = ap.parse_args()
    prof = None
    if args.profile:
        from splash.costmodel.profile import load_profile
        prof = load_profile(args.profile)
    torch.set_num_threads(1)
    ctx = init_dist()
    kinds = ("mpi", "torch") if args.communicator == "both" else (args.communicator,)
    comms = {k: make_communicator(k, ctx) for k in kinds}
    rows = []
    for nbytes in args.sizes:
        iters = args.iters if nbytes <= (64 << 10) else max(10, args.iters // 8)
        ops = {k: cases(c, nbytes) for k, c in comms.items()}
        counted = counted_bytes(comms[kinds[0]], nbytes)
        for name in ops[kinds[0]]:
            best = {k: float("inf") for k in kinds}
            for _ in range(args.rounds):  # kinds alternate round by round, so load drifts hit both alike
                for k in kinds:
                    best[k] = min(best[k], time_op(comms[k], ops[k][name], iters))
            kind, b = counted.get(name, (None, 0.0))
            pred = prof.collective_seconds(kind, b) if prof is not None and kind else None
            rows.append((name, nbytes, best, pred))
    if ctx.rank == 0:
        from rich.console import Console
        from rich.table import Table

        names = {"mpi": "MPI", "torch": "gloo"}
        table = Table(title=f"CPU collectives, {ctx.world_size} ranks (bf16), best of {args.rounds} round(s)")
        for col in ("op", "bytes/rank", *(f"{names[k]} µs/call" for k in kinds),
                    *(f"{names[k]} GB/s" for k in kinds), *(["gloo/MPI time"] if len(kinds) == 2 else []),
                    *([f"predicted µs ({prof.name})", "measured/predicted"] if prof is not None else [])):
            table.add_column(col, justify="right")
        for name, nbytes, sec, pred in rows:
            ratio = [f"{sec['torch'] / sec['mpi']:.2f}x"] if len(kinds) == 2 else []
            if prof is not None:
                ratio += [f"{pred * 1e6:.1f}", f"{sec[kinds[0]] / pred:.2f}"] if pred else ["", ""]
            table.add_row(name, f"{nbytes >> 10} KiB", *(f"{sec[k] * 1e6:.1f}" for k in kinds),
                          *(f"{nbytes / sec[k] / 1e9:.2f}" for k in kinds), *ratio)
        Console(width=160).print(table)


if __name__ == "__main__":
    main()
