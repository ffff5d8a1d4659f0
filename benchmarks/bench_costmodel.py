"""Cost-model accuracy: measured vs predicted decode step time per layout over `splash-bench grid`'s points.

    OMP_NUM_THREADS=1 .venv/bin/mpiexec -n 2 .venv/bin/python benchmarks/bench_costmodel.py \
        [--profile cpu] [--batches 1,4,16,32] [--contexts 256,1024,2048,4096] [--steps 6] [--json out.json]
    .venv/bin/python benchmarks/bench_costmodel.py --from-json out.json[,out2.json] [--profile other.yaml]  # re-predict
    ... bench_costmodel.py --prefill 2048 --batches 0,4,16 --contexts 1024  # steps that also carry a prefill chunk

Measurement is `splash-bench grid`'s decode step (same DecodeState, max over ranks), the four layouts'
states side by side and timed in turn in each of --reps repetitions (the point's time: the median over them); the
prediction is splash.costmodel.CostModel.step for the same rows (B decode rows at the mean context of the
timed steps, owners / CP anchors round-robin as DecodeState places them; with --prefill C, plus the step's C-token
chunk from position 0, owner / anchor rank 0). Rank 0 prints per point measured and
predicted ms per layout, both leaders, then leader agreement (strict: every point) and the median absolute error
of the predicted step time over all (point, layout) pairs, then the measurement's own stability (leader of the
even vs the odd repetitions) and, secondary, the agreement at points whose runner-up is behind in every repetition.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

LAYOUTS = ("tp", "dp_attn", "cp", "dop")


def predict(points: list[dict], world: int, preset: str, profile: str) -> None:
    from splash.costmodel import CostModel, RowLoad, load_profile
    from splash.models.preset_configs import preset_config

    cm = CostModel(preset_config(preset), world, load_profile(profile), "float32", "float32", 16)
    for p in points:
        ctx = p.get("mean_context", p["context"] + 2 + p["steps"] // 2)  # mean position over the timed steps
        rows = [RowLoad(1, ctx, i % world) for i in range(p["batch"])]
        if p.get("prefill"):
            rows.append(RowLoad(p["prefill"], 0, 0))
        p["predicted"] = {lay: cm.step(lay, rows).seconds for lay in LAYOUTS}


def merge_runs(runs: list[list[dict]]) -> list[dict]:
    """Points of several runs of one grid as one: their repetitions pooled, the median over all of them."""
    if len(runs) == 1:
        return runs[0]
    out = []
    for same in zip(*runs):
        if len({(p["batch"], p["context"]) for p in same}) != 1 or not all("reps" in p for p in same):
            raise SystemExit("--from-json with several files needs runs of one grid, each with repetitions")
        reps = {k: [t for p in same for t in p["reps"][k]] for k in LAYOUTS}
        out.append({**same[0], "reps": reps, "measured": {k: statistics.median(v) for k, v in reps.items()},
                    "mean_context": round(statistics.mean(p["mean_context"] for p in same))})
    return out


def _leader(times: dict) -> str:
    return min(times, key=times.get)


def summarise(points: list[dict]) -> dict:
    """Leader agreement as specified (strict, every point), the median |error|, and the measurement's own
    stability: the leader of the even repetitions against the odd ones' (each half's median), and the points
    it resolves — the measured runner-up's fastest repetition slower than the leader's slowest."""
    agree = [_leader(p["measured"]) == _leader(p["predicted"]) for p in points]
    errs = [abs(p["predicted"][k] - p["measured"][k]) / p["measured"][k] for p in points for k in LAYOUTS]
    out = {"leader_agreement": sum(agree) / len(points), "median_abs_error": statistics.median(errs)}
    with_reps = [p for p in points if len(next(iter(p.get("reps", {"": []}).values()))) >= 2]
    if with_reps:
        half = [[_leader({k: statistics.median(v[i::2]) for k, v in p["reps"].items()}) for i in (0, 1)]
                for p in with_reps]
        out["self_agreement"] = sum(a == b for a, b in half) / len(with_reps)
        res = [(p, ok) for p, ok in zip(points, agree) if p in with_reps and _resolved(p)]
        out["resolved_points"] = len(res)
        out["resolved_agreement"] = sum(ok for _, ok in res) / len(res) if res else None
    return out


def _resolved(p: dict) -> bool:
    lead, second = sorted(p["measured"], key=p["measured"].get)[:2]
    return min(p["reps"][second]) > max(p["reps"][lead])


def print_table(points: list[dict], world: int, meta: str) -> None:
    from splash.bench.tables import TableSpec, print_tables

    chunk = points[0].get("prefill") if points else 0
    what = f"step of B decode rows + a {chunk}-token prefill chunk" if chunk else "decode step"
    t = TableSpec(f"cost model vs measured {what} (ms) — {meta}",
                  ["B", "ctx", *[f"{k} meas/pred" for k in LAYOUTS], "leader meas", "leader pred"])
    for p in points:
        m, q = p["measured"], p["predicted"]
        lm, lq = min(m, key=m.get), min(q, key=q.get)
        t.add_row([str(p["batch"]), str(p["context"]), *(f"{m[k] * 1e3:.2f}/{q[k] * 1e3:.2f}" for k in LAYOUTS),
                   lm, lq if lq == lm else f"[bold red]{lq}[/]"])
    print_tables([t])
    sm = summarise(points)
    print(f"leader agreement {sm['leader_agreement']:.0%} ({len(points)} points; strict); median |error| "
          f"{sm['median_abs_error']:.1%} over {len(points) * len(LAYOUTS)} (point, layout) pairs; {world} ranks")
    if "self_agreement" in sm:
        ra = sm["resolved_agreement"]
        print(f"measurement stability: leader of the even vs the odd repetitions agree at {sm['self_agreement']:.0%}"
              f" of points; secondary (not the target): at the {sm['resolved_points']} points whose measured "
              f"runner-up is behind the leader in every repetition, leader agreement "
              f"{'n/a' if ra is None else f'{ra:.0%}'}")


def measure_point(comm, a, b: int, c: int) -> dict:
    """One grid point: the four layouts' states built side by side, then ``--reps`` repetitions, each timing
    every layout in turn (order rotated per repetition: 1 warm-up step after the switch of state, then
    ``--steps`` timed, reduced by ``--stat``). The point's measurement is the median over repetitions."""
    from splash.bench.decode_state import DecodeState
    clock = time.thread_time if a.clock == "cpu" else time.perf_counter
    states = {lay: DecodeState(comm, a.preset, lay, b, c, prefill=a.prefill) for lay in LAYOUTS}
    for st in states.values():
        for _ in range(2):
            st.step(clock=clock)
    reps = {lay: [] for lay in LAYOUTS}
    reduce = min if a.stat == "min" else statistics.median
    for r in range(a.reps):
        for lay in LAYOUTS[r % len(LAYOUTS):] + LAYOUTS[:r % len(LAYOUTS)]:
            states[lay].step(clock=clock)
            reps[lay].append(reduce([states[lay].step(clock=clock) for _ in range(a.steps)]))
    return {"batch": b, "context": c, "prefill": a.prefill, "steps": a.steps,
            "mean_context": c + 2 + (a.reps * (a.steps + 1)) // 2,
            "reps": reps, "measured": {lay: statistics.median(v) for lay, v in reps.items()}}


def measure_grid(a) -> tuple[list[dict], int, str]:
    import os

    from splash.distributed import init_dist
    comm = init_dist().comm
    load0 = os.getloadavg()[0]
    points = []
    for b in map(int, a.batches.split(",")):
        for c in map(int, a.contexts.split(",")):
            p = measure_point(comm, a, b, c)
            points.append(p)
            if comm.rank == 0:
                print(f"B={b} L={c} " + " ".join(f"{k}={v * 1e3:.2f}ms" for k, v in p["measured"].items()), flush=True)
    meta = (f"{a.preset}, {comm.size} ranks on CPU, median over {a.reps} interleaved repetitions of the {a.stat} of "
            f"{a.steps} steps ({a.clock} clock), load average {load0:.2f} before / {os.getloadavg()[0]:.2f} after")
    return (points if comm.rank == 0 else []), comm.size, meta


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="small-mla")
    ap.add_argument("--profile", default="cpu", help="hardware profile name or YAML path")
    ap.add_argument("--batches", default="1,4,16,32")
    ap.add_argument("--contexts", default="256,1024,2048,4096")
    ap.add_argument("--steps", type=int, default=6, help="timed steps per layout per repetition")
    ap.add_argument("--prefill", type=int, default=0, metavar="C",
                    help="each step also carries a C-token prefill chunk from position 0 (0: decode steps only)")
    ap.add_argument("--reps", type=int, default=4,
                    help="repetitions per point, layouts interleaved in each (the measurement: their median)")
    ap.add_argument("--stat", choices=("median", "min"), default="median",
                    help="statistic of the timed steps (median: splash-bench grid's; min: robust to a loaded host)")
    ap.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                    help="step time by the wall clock (splash-bench grid's) or each rank's CPU time (max over ranks; "
                         "not inflated by time spent descheduled on a loaded host)")
    ap.add_argument("--json", default=None, help="write the points (measured and predicted) here")
    ap.add_argument("--from-json", default=None, help="skip measuring: re-predict the points of this file "
                    "(FILE1,FILE2,...: runs of one grid, repetitions pooled)")
    a = ap.parse_args()
    if a.from_json:
        runs = [json.loads(Path(f).read_text()) for f in a.from_json.split(",")]
        points, world = merge_runs([r["points"] for r in runs]), runs[0]["world"]
        meta = " + ".join(r["meta"] for r in runs) + f" (re-predicted, {a.profile})"
    else:
        points, world, meta = measure_grid(a)
        if not points:
            return
    predict(points, world, a.preset, a.profile)
    print_table(points, world, meta)
    if a.json:
        Path(a.json).write_text(json.dumps({"world": world, "meta": meta, "profile": a.profile,
                                            **summarise(points), "points": points}, indent=1))


if __name__ == "__main__":
    main()
