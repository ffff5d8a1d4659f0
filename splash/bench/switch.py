"""Added time of a live and of a blocking layout switch over a ready destination step, per direction (mpirun):

    mpiexec -n 2 splash-bench switch [--preset small-mla] [--batch 8] [--context 1024] [--trials 8]
        [--shared-prefix P] [--json FILE]

For each of the 12 directions: B requests of L tokens are resident in the source layout; a decode step that
carries the switch (live: the step runs in the destination layout while layer l+1's state moves behind layer
l; blocking: all state moves, then the step runs) is timed, followed by ready destination steps; the added
time is switch step - median ready step. The state is switched back (blocking, untimed) between trials.
Rank 0 prints p50/p95 of the added time per mode, as % of the ready destination step, and live/blocking.
With ``--shared-prefix P`` every request starts on the same P-token cached prefix (decode_state.DecodeState); the
switch then plans its movement per physical block (a shared block moves once per receiving rank), and after the
timed trials each direction is also switched ``--trials`` times blocking with the plan made per request (the
blocks' sharing ignored: a shared block moves once per request, as before the prefix cache survived switches) —
"per request" columns: MiB received and blocking added time.
"""
from __future__ import annotations

import argparse
import statistics

from splash.bench import results as R
from splash.bench.results import pct
from splash.cli.args import layout_list
from splash.layouts.layout import LAYOUT_NAMES


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--preset", default="small-mla")
    p.add_argument("--layouts", type=layout_list, default=LAYOUT_NAMES, help="every direction between these")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--context", type=int, default=1024)
    p.add_argument("--trials", type=int, default=8)
    p.add_argument("--shared-prefix", type=int, default=0, metavar="P",
                   help="every request starts on one P-token cached prefix (whole blocks)")
    p.add_argument("--json", metavar="FILE", help="write the result (kind 'switch') here")
    p.add_argument("--markdown", metavar="FILE", help="also write the table as markdown")


def switch_to(st, dst: str, mode: str, dedupe: bool = True):
    from splash.switching.executor import SwitchExecutor
    from splash.switching.manifest import ReqState, plan_switch

    r = st.runner
    hashes = st.hashes if dedupe else ()
    reqs = {rid: ReqState(st.pos[rid], st.owners[rid], None, hashes) for rid in st.owners}
    m = plan_switch(r.layout, dst, r.cfg, st.comm.size, reqs, r.block_size, 4, r.kv_dtype, rope_fp8=r.rope_fp8)
    st.owners.update(m.owners)
    st.last_recv_mb = max(m.total_recv_bytes) / 2**20
    return SwitchExecutor(r.ctx, m, mode, r.streams)


def direction(comm, a, src: str, dst: str) -> dict:
    from splash.bench.decode_state import DecodeState

    st = DecodeState(comm, a.preset, src, a.batch, a.context, shared_prefix=a.shared_prefix)
    st.step()
    res = {"src": src, "dst": dst, "live_s": [], "blocking_s": [], "ready_s": [], "recv_mib": 0.0}
    for _ in range(a.trials):
        for mode in ("live", "blocking"):
            t_sw = st.step(switch_to(st, dst, mode))
            res["recv_mib"] = st.last_recv_mb
            ready = statistics.median(st.step() for _ in range(3))
            res[f"{mode}_s"].append(t_sw - ready)
            res["ready_s"].append(ready)
            st.step(switch_to(st, src, "blocking"))
    if st.hashes:   # last: a per-request switch un-shares the blocks it moves (they arrive as private copies)
        res["per_request_s"], res["per_request_recv_mib"] = [], 0.0
        for _ in range(a.trials):
            t_sw = st.step(switch_to(st, dst, "blocking", dedupe=False))
            res["per_request_recv_mib"] = st.last_recv_mb
            res["per_request_s"].append(t_sw - statistics.median(st.step() for _ in range(3)))
            st.step(switch_to(st, src, "blocking", dedupe=False))
    return res


def switch_table(doc: dict):
    from splash.bench.show import subtitle
    from splash.bench.tables import TableSpec

    c = doc["config"]
    shared = c.get("shared_prefix", 0)
    t = TableSpec(f"switch added time over a ready destination step — B={c['batch']}, L={c['context']}, "
                  + (f"shared prefix {shared} tokens, " if shared else "")
                  + f"{c['trials']} trials, {subtitle(doc)}",
                  ["direction", "MiB in (max rank)", "ready ms", "live p50 ms", "live p95 ms", "live p50 / step",
                   "blocking p50 ms", "blocking p95 ms", "live / blocking p50"]
                  + (["per request: MiB in", "per request: blocking p50 ms"] if shared else []))
    for r in doc["points"]:
        ready = statistics.median(r["ready_s"])
        lp50, bp50 = pct(r["live_s"], 50), pct(r["blocking_s"], 50)
        ratio = f"{lp50 / bp50:.2f}" if bp50 > 0 else "n/a"
        t.add_row([f"{r['src']}->{r['dst']}", f"{r['recv_mib']:.1f}", f"{ready * 1e3:.2f}", f"{lp50 * 1e3:.2f}",
                   f"{pct(r['live_s'], 95) * 1e3:.2f}", f"{100 * lp50 / ready:.1f}%", f"{bp50 * 1e3:.2f}",
                   f"{pct(r['blocking_s'], 95) * 1e3:.2f}", ratio]
                  + ([f"{r['per_request_recv_mib']:.1f}", f"{pct(r['per_request_s'], 50) * 1e3:.2f}"]
                     if "per_request_s" in r else []))
    return t


def run(args) -> int:
    model = {"name": args.preset, "dtype": "float32", "kv_cache_dtype": "float32"}
    config = {"layouts": args.layouts, "batch": args.batch, "context": args.context, "trials": args.trials,
              "shared_prefix": args.shared_prefix}
    points = [(args, src, dst) for src in args.layouts for dst in args.layouts if src != dst]
    comm, doc = R.mpi_result(args, "switch", model, config)
    return R.measure_points(args, comm, doc, points, direction, lambda d: [switch_table(d)])
