"""Per-layout terms of `splash-bench calibrate` measured in real multi-rank steps (DecodeState, --clock cpu as
bench_costmodel measures): each layout's fixed cost per step, and (--prefill-factors) its measured / predicted
attention of a prefill chunk."""
from __future__ import annotations

import statistics

from splash.bench.calib_timing import partial_model
from splash.layouts.layout import LAYOUT_NAMES


def layout_overheads(comm, preset: str, partial: dict, block_size: int, reps: int) -> dict[str, float]:
    """Fixed cost per step of each layout at this world size: a real decode step of one request per rank at a
    short context (64 tokens) minus what the cost model predicts for it without this term (never below 0)."""
    from splash.bench.calib_sync import step_time
    from splash.bench.decode_state import DecodeState
    from splash.costmodel import RowLoad
    cm = partial_model(preset, comm.size, partial, block_size)
    out = {}
    for lay in LAYOUT_NAMES:
        st = DecodeState(comm, preset, lay, comm.size, 64, block_size)
        # measured as bench_costmodel measures (--clock cpu: median over repetitions of the least-preempted of 3)
        t = step_time(st, max(3, reps // 3))
        pred = cm.step(lay, [RowLoad(1, 64 + 2 + reps // 2, i) for i in range(comm.size)]).seconds
        out[lay] = max(0.0, t - pred)
    return out


PREFILL_CHUNK = 512


def prefill_attention_factors(comm, preset: str, partial: dict, block_size: int, reps: int) -> dict[str, float]:
    """Per layout: the attention (`splash.attention.mla.attend`, the kernel calls of every layer) of a real step
    that carries one PREFILL_CHUNK-token chunk from position 0, on the slowest rank (median over repetitions of
    the least-preempted of 3 steps, thread CPU time), over what the cost model predicts for that stage."""
    import time

    from splash.attention import mla
    from splash.bench.decode_state import DecodeState
    from splash.costmodel import RowLoad
    cm = partial_model(preset, comm.size, partial, block_size)
    spent, attend = [0.0], mla.attend

    def timed(*a, **k):
        t0 = time.thread_time()
        try:
            return attend(*a, **k)
        finally:
            spent[0] += time.thread_time() - t0

    out = {}
    mla.attend = timed
    try:
        for lay in LAYOUT_NAMES:
            st = DecodeState(comm, preset, lay, 0, 64, block_size, prefill=PREFILL_CHUNK)
            st.local_step(clock=time.thread_time)   # warm-up

            def one() -> float:
                spent[0] = 0.0
                st.local_step(clock=time.thread_time)
                return max(comm.all_gather_obj(spent[0]))
            meas = statistics.median(min(one() for _ in range(3)) for _ in range(reps))
            pred = cm.step(lay, [RowLoad(PREFILL_CHUNK, 0, 0)]).stages["attention"]
            out[lay] = min(4.0, max(0.25, meas / pred)) if pred > 0 else 1.0
            del st
    finally:
        mla.attend = attend
    return out
