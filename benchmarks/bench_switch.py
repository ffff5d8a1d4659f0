"""Added time of a live and of a blocking layout switch over a ready destination step, per direction.

    mpiexec -n 2 .venv/bin/python benchmarks/bench_switch.py [--preset small-mla] [--batch 8] [--context 1024]
        [--trials 8]

For each of the 12 directions: B requests of L tokens are resident in the source layout; a decode step that
carries the switch (live: the step runs in the destination layout while layer l+1's state moves behind layer
l; blocking: all state moves, then the step runs) is timed, followed by ready destination steps; the added
time is switch step − median ready step. The state is switched back (blocking, untimed) between trials.
Rank 0 prints p50/p95 of the added time per mode, as % of the ready destination step, and live/blocking."""
from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from decode_state import DecodeState  # noqa: E402

from splash.distributed import init_dist  # noqa: E402
from splash.switching.executor import SwitchExecutor  # noqa: E402
from splash.switching.manifest import ReqState, plan_switch  # noqa: E402

LAYOUTS = ("tp", "dp_attn", "cp", "dop")


def switch_to(st: DecodeState, dst: str, mode: str) -> SwitchExecutor:
    r = st.runner
    reqs = {rid: ReqState(st.pos[rid], st.owners[rid], None) for rid in st.owners}
    m = plan_switch(r.layout, dst, r.cfg, st.comm.size, reqs, r.block_size, 4, r.kv_dtype)
    st.owners.update(m.owners)
    st.last_recv_mb = max(m.total_recv_bytes) / 2**20
    return SwitchExecutor(r, m, mode)


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, round(q * (len(xs) - 1)))]


def direction(comm, a, src: str, dst: str) -> dict:
    st = DecodeState(comm, a.preset, src, a.batch, a.context)
    st.step()
    res = {"live": [], "blocking": [], "ready": [], "mb": 0.0}
    for t in range(a.trials):
        for mode in ("live", "blocking"):
            t_sw = st.step(switch_to(st, dst, mode))
            res["mb"] = st.last_recv_mb
            ready = statistics.median(st.step() for _ in range(3))
            res[mode].append(t_sw - ready)
            res["ready"].append(ready)
            st.step(switch_to(st, src, "blocking"))
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="small-mla")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--trials", type=int, default=8)
    a = ap.parse_args()
    comm = init_dist().comm
    rows = []
    for src in LAYOUTS:
        for dst in LAYOUTS:
            if src != dst:
                rows.append((src, dst, direction(comm, a, src, dst)))
    if comm.rank == 0:
        table(rows, comm.size, a)


def table(rows, world, a) -> None:
    from rich.console import Console
    from rich.table import Table

    t = Table(title=f"switch added time over a ready destination step — {a.preset}, B={a.batch}, "
                    f"L={a.context}, {world} ranks on CPU, {a.trials} trials")
    for col in ("direction", "MiB in (max rank)", "ready ms", "live p50 ms", "live p95 ms", "live p50 %", "blocking p50 ms",
                "blocking p95 ms", "live/blocking p50"):
        t.add_column(col, justify="right")
    for src, dst, r in rows:
        ready = statistics.median(r["ready"])
        lp50, bp50 = pct(r["live"], 0.5), pct(r["blocking"], 0.5)
        ratio = f"{lp50 / bp50:.2f}" if bp50 > 0 else "n/a"
        t.add_row(f"{src}->{dst}", f"{r['mb']:.1f}", f"{ready * 1e3:.2f}", f"{lp50 * 1e3:.2f}", f"{pct(r['live'], 0.95) * 1e3:.2f}",
                  f"{100 * lp50 / ready:.1f}%", f"{bp50 * 1e3:.2f}", f"{pct(r['blocking'], 0.95) * 1e3:.2f}", ratio)
    Console(width=160).print(t)


if __name__ == "__main__":
    main()
