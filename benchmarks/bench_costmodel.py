"""Cost-model accuracy: measured vs predicted decode step time per layout over the bench_layouts grid.

    OMP_NUM_THREADS=1 .venv/bin/mpiexec -n 2 .venv/bin/python benchmarks/bench_costmodel.py \
        [--profile cpu] [--batches 1,4,16,32] [--contexts 256,1024,2048,4096] [--steps 6] [--json out.json]
    .venv/bin/python benchmarks/bench_costmodel.py --from-json out.json [--profile other.yaml]   # re-predict only

Measurement is benchmarks/bench_layouts.py's (same DecodeState, same median of steps, max over ranks); the
prediction is splash.costmodel.CostModel.step for the same rows (B decode rows at the mean context of the
timed steps, owners / CP anchors round-robin as DecodeState places them). Rank 0 prints per point measured and
predicted ms per layout, both leaders, then leader agreement and the median absolute error of the predicted
step time over all (point, layout) pairs.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

LAYOUTS = ("tp", "dp_attn", "cp", "dop")


def predict(points: list[dict], world: int, preset: str, profile: str) -> None:
    from splash.costmodel import CostModel, RowLoad, load_profile
    from splash.sim.presets import model_preset

    cm = CostModel(model_preset(preset), world, load_profile(profile), "float32", "float32", 16)
    for p in points:
        ctx = p["context"] + 2 + p["steps"] // 2  # mean position over the timed steps (after 2 warm-ups)
        rows = [RowLoad(1, ctx, i % world) for i in range(p["batch"])]
        p["predicted"] = {lay: cm.step(lay, rows).seconds for lay in LAYOUTS}


def summarise(points: list[dict]) -> tuple[float, float]:
    agree = sum(min(p["measured"], key=p["measured"].get) == min(p["predicted"], key=p["predicted"].get)
                for p in points)
    errs = [abs(p["predicted"][k] - p["measured"][k]) / p["measured"][k] for p in points for k in LAYOUTS]
    return agree / len(points), statistics.median(errs)


def print_table(points: list[dict], world: int, meta: str) -> None:
    from rich.console import Console
    from rich.table import Table

    t = Table(title=f"cost model vs measured decode step (ms) — {meta}")
    for col in ("B", "ctx", *[f"{k} meas/pred" for k in LAYOUTS], "leader meas", "leader pred"):
        t.add_column(col, justify="right")
    for p in points:
        m, q = p["measured"], p["predicted"]
        lm, lq = min(m, key=m.get), min(q, key=q.get)
        t.add_row(str(p["batch"]), str(p["context"]), *(f"{m[k] * 1e3:.2f}/{q[k] * 1e3:.2f}" for k in LAYOUTS),
                  lm, lq if lq == lm else f"[bold red]{lq}[/]")
    Console(width=160).print(t)
    agree, err = summarise(points)
    print(f"leader agreement {agree:.0%} ({len(points)} points); median |error| {err:.1%} over "
          f"{len(points) * len(LAYOUTS)} (point, layout) pairs; {world} ranks")


CLOCK = {"fn": None}


def measure_min(comm, preset, layout, batch, ctx, steps) -> float:
    """bench_layouts.measure with the minimum of the timed steps instead of the median: on a shared host the
    least-preempted step is the closest to the step itself (calibrate --stat min measures the same way)."""
    return min(_steps(comm, preset, layout, batch, ctx, steps))


def _steps(comm, preset, layout, batch, ctx, steps) -> list[float]:
    """bench_layouts' measurement (2 warm-up steps, then ``steps`` timed, max over ranks), by --clock."""
    import time

    from splash.bench.decode_state import DecodeState
    clock = time.thread_time if CLOCK["fn"] == "cpu" else time.perf_counter
    st = DecodeState(comm, preset, layout, batch, ctx)
    for _ in range(2):
        st.step(clock=clock)
    return [st.step(clock=clock) for _ in range(steps)]


def measure_grid(a) -> tuple[list[dict], int, str]:
    import os

    import statistics

    from splash.distributed import init_dist
    def measure_median(comm, preset, layout, b, c, steps):   # splash-bench grid's measurement, its median
        return statistics.median(_steps(comm, preset, layout, b, c, steps))

    measure = measure_min if a.stat == "min" else measure_median
    comm = init_dist().comm
    load0 = os.getloadavg()[0]
    points = []
    for b in map(int, a.batches.split(",")):
        for c in map(int, a.contexts.split(",")):
            times = {lay: measure(comm, a.preset, lay, b, c, a.steps) for lay in LAYOUTS}
            points.append({"batch": b, "context": c, "steps": a.steps, "measured": times})
            if comm.rank == 0:
                print(f"B={b} L={c} " + " ".join(f"{k}={v * 1e3:.2f}ms" for k, v in times.items()), flush=True)
    meta = (f"{a.preset}, {comm.size} ranks on CPU, {a.stat} of {a.steps} steps ({a.clock} clock), load average {load0:.2f} before / "
            f"{os.getloadavg()[0]:.2f} after")
    return (points if comm.rank == 0 else []), comm.size, meta


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="small-mla")
    ap.add_argument("--profile", default="cpu", help="hardware profile name or YAML path")
    ap.add_argument("--batches", default="1,4,16,32")
    ap.add_argument("--contexts", default="256,1024,2048,4096")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--stat", choices=("median", "min"), default="median",
                    help="statistic of the timed steps (median: bench_layouts'; min: robust to a loaded host)")
    ap.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                    help="step time by the wall clock (bench_layouts') or each rank's CPU time (max over ranks; "
                         "not inflated by time spent descheduled on a loaded host)")
    ap.add_argument("--json", default=None, help="write the points (measured and predicted) here")
    ap.add_argument("--from-json", default=None, help="skip measuring: re-predict the points of this file")
    a = ap.parse_args()
    CLOCK["fn"] = a.clock
    if a.from_json:
        saved = json.loads(Path(a.from_json).read_text())
        points, world, meta = saved["points"], saved["world"], saved["meta"] + f" (re-predicted, {a.profile})"
    else:
        points, world, meta = measure_grid(a)
        if not points:
            return
    predict(points, world, a.preset, a.profile)
    print_table(points, world, meta)
    if a.json:
        agree, err = summarise(points)
        Path(a.json).write_text(json.dumps({"world": world, "meta": meta, "profile": a.profile,
                                            "leader_agreement": agree, "median_abs_error": err,
                                            "points": points}, indent=1))


if __name__ == "__main__":
    main()
