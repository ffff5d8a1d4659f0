"""`splash-bench calibrate`'s in-step collective wait: inside a real step each collective also waits for the slower
peer (the ranks' compute between two collectives differs by their jitter), which the isolated collective fits —
timed after a barrier — do not see. Measured on real multi-rank decode steps of every layout, at shapes that are
not benchmarks/bench_costmodel.py's grid points, as the per-collective part of what the model leaves unexplained."""
from __future__ import annotations

import statistics
import time

from splash.bench.calib_timing import STAT

SYNC_POINTS = ((8, 512), (24, 128))   # (batch, context): between the grid's shapes, none of them
LAYOUTS = ("tp", "dp_attn", "cp", "dop")


def step_time(st, reps: int) -> float:
    """A DecodeState's step, measured as bench_costmodel does: on the CPU clock the median over ``reps`` groups of
    the least-preempted of 3 steps; on the wall clock the median of ``reps`` steps."""
    cpu = STAT["clock"] is time.thread_time
    for _ in range(2):
        st.step(clock=STAT["clock"])
    if cpu:
        return statistics.median(min(st.step(clock=STAT["clock"]) for _ in range(3)) for _ in range(reps))
    return statistics.median(st.step(clock=STAT["clock"]) for _ in range(reps))


def collective_sync(comm, preset: str, partial: dict, block_size: int, reps: int) -> float:
    """Seconds per collective: least squares of measured − predicted step time (the profile so far, per-layout
    fixed costs included) on the collective count of each step, over every layout and SYNC_POINTS; never below 0."""
    from splash.bench.decode_state import DecodeState
    from splash.costmodel.profile import profile_from_dict
    from splash.costmodel.step_cost import CostModel, RowLoad
    from splash.models.presets import preset_config
    cm = CostModel(preset_config(preset), comm.size, profile_from_dict(partial, "calibrate (partial)"),
                   "float32", "float32", block_size)
    num = den = 0.0
    for b, ctx in SYNC_POINTS:
        for lay in LAYOUTS:
            st = DecodeState(comm, preset, lay, b, ctx, block_size)
            t = step_time(st, reps)
            pred = cm.step(lay, [RowLoad(1, ctx + 2 + reps * 3 // 2, i % comm.size) for i in range(b)])
            n = sum(w["collectives"] for w in pred.work.values())
            num, den = num + (t - pred.seconds) * n, den + n * n
            del st
    return max(0.0, num / den) if den else 0.0
