"""Decode step time per layout over a grid of (batch size × context length), side by side in one run.

    mpiexec -n 4 .venv/bin/python benchmarks/bench_layouts.py [--preset small-mla] [--batches 1,4,16]
        [--contexts 256,1024,4096] [--steps 8]

Every layout runs the same decode batch on the same weights with the KV already resident (written straight
into each rank's pool where the layout places it); rank 0 prints the median step time (max over ranks) per
layout and the leader per point."""
from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from decode_state import DecodeState  # noqa: E402

from splash.distributed import init_dist  # noqa: E402

LAYOUTS = ("tp", "dp_attn", "cp", "dop")


def measure(comm, preset, layout, batch, ctx, steps) -> float:
    st = DecodeState(comm, preset, layout, batch, ctx)
    for _ in range(2):
        st.step()
    return statistics.median(st.step() for _ in range(steps))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="small-mla")
    ap.add_argument("--batches", default="1,4,16")
    ap.add_argument("--contexts", default="256,1024,4096")
    ap.add_argument("--steps", type=int, default=8)
    a = ap.parse_args()
    comm = init_dist().comm
    rows = []
    for b in map(int, a.batches.split(",")):
        for c in map(int, a.contexts.split(",")):
            times = {lay: measure(comm, a.preset, lay, b, c, a.steps) for lay in LAYOUTS}
            rows.append((b, c, times))
            if comm.rank == 0:
                print(f"B={b} L={c} " + " ".join(f"{k}={v * 1e3:.2f}ms" for k, v in times.items()), flush=True)
    if comm.rank == 0:
        print_table(rows, comm.size, a.preset)


def print_table(rows, world, preset) -> None:
    from rich.console import Console
    from rich.table import Table

    t = Table(title=f"decode step time (ms, median, max over ranks) — {preset}, {world} ranks on CPU")
    for col in ("batch", "context", *LAYOUTS, "leader", "leader vs TP"):
        t.add_column(col, justify="right")
    for b, c, times in rows:
        lead = min(times, key=times.get)
        t.add_row(str(b), str(c), *(f"{times[x] * 1e3:.2f}" for x in LAYOUTS), lead,
                  f"{times['tp'] / times[lead]:.2f}x")
    Console(width=140).print(t)


if __name__ == "__main__":
    main()
