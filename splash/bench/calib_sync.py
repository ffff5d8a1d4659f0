"""`splash-bench calibrate`'s terms measured in real multi-rank steps (DecodeState) of every layout: the in-step
collective terms, each layout's fixed cost per step and (--prefill-factors) its measured / predicted attention of a
prefill chunk. Steps are measured as bench_costmodel measures them (--clock cpu: median over repetitions of the
least-preempted of 3), at shapes that are not its grid points.

By default (``collective_sync``) collective_sync_s is the per-collective residual of those steps. With
``--in-step-collectives`` (``collective_in_step``) every collective of the step is timed on every rank: a
collective's own time is its time on the last rank to arrive (it waited for nobody); beyond the isolated
α + bytes/β that is ``collective_sync_s`` (the call's host work, cold buffers). The rest of the slowest rank's
collective time is waiting for its peer, which follows the ranks' drift while they compute, not the number of
collectives (DOP's 16 collectives per step wait as long as DP-attn's 8: docs/benchmarks.md, cost model round 6):
``collective_wait_fraction`` of the slowest rank's time outside collectives."""
from __future__ import annotations

import statistics
import time

from splash.bench.calib_timing import STAT, partial_model
from splash.layouts.layout import LAYOUT_NAMES

SYNC_POINTS = ((8, 512), (24, 128))   # (batch, context): between the grid's shapes, none of them
COLLECTIVES = ("all_reduce", "all_gather", "all_gatherv", "all_to_allv")


class CollectiveTimer:
    """Times every tensor collective of ``comm`` (an instance-level wrapper, removed by ``close``)."""

    def __init__(self, comm, clock):
        self.comm, self.clock, self.seq = comm, clock, []
        for name in COLLECTIVES:
            setattr(comm, name, self._wrap(getattr(comm, name)))

    def _wrap(self, fn):
        def timed(*a, **k):
            t0 = self.clock()
            try:
                return fn(*a, **k)
            finally:
                self.seq.append(self.clock() - t0)
        return timed

    def close(self) -> None:
        for name in COLLECTIVES:
            self.comm.__dict__.pop(name, None)


def split_wait(ranks: list[dict]) -> dict[str, float]:
    """One step's ``{"total", "seq"}`` of every rank -> the slowest rank's total, the collectives' own time
    (each at its minimum over ranks), the slowest rank's wait beyond that and its time outside collectives."""
    slow = max(ranks, key=lambda x: x["total"])
    own = sum(min(ts) for ts in zip(*(x["seq"] for x in ranks)))
    return {"total": slow["total"], "own": own, "wait": sum(slow["seq"]) - own,
            "outside": slow["total"] - sum(slow["seq"]), "count": len(slow["seq"])}


def timed_steps(st, timer: CollectiveTimer, reps: int) -> list[dict]:
    """``reps`` times the least-preempted of 3 steps (as bench_costmodel --clock cpu --stat min), split."""
    out = []
    st.step(clock=timer.clock)
    for _ in range(reps):
        steps = []
        for _ in range(3):
            timer.seq.clear()
            total = st.local_step(clock=timer.clock)
            steps.append(st.comm.all_gather_obj({"total": total, "seq": list(timer.seq)}))
        out.append(split_wait(min(steps, key=lambda ranks: max(x["total"] for x in ranks))))
    return out


def isolated_collective_seconds(cm, lay: str, rows) -> float:
    """The step's collectives at the profile's isolated α + bytes/β alone (the step minus the same step with free
    collectives, both without the in-step terms)."""
    import dataclasses

    from splash.costmodel.profile import Collective
    from splash.costmodel.step_cost import CostModel
    bare = dataclasses.replace(cm.profile, collective_sync_s=0.0, collective_wait_fraction=0.0)
    free = dataclasses.replace(bare, collectives={k: Collective(0.0, 1e30) for k in bare.collectives})
    mk = lambda p: CostModel(cm.cfg, cm.world, p, cm.weight_dtype, "float32", cm.block_size)  # noqa: E731
    return mk(bare).step(lay, rows).seconds - mk(free).step(lay, rows).seconds


def collective_in_step(comm, preset: str, partial: dict, block_size: int,
                       reps: int) -> tuple[float, float, int]:
    """(collective_sync_s, collective_wait_fraction, collectives timed): the two terms are medians over SYNC_POINTS
    × every layout × repetitions; the count says how many collective calls they were measured on. The fraction may
    be 0 when the slowest rank arrives last at every collective (it waits for nobody)."""
    from splash.bench.decode_state import DecodeState
    from splash.costmodel import RowLoad
    cm = partial_model(preset, comm.size, partial, block_size)
    timer = CollectiveTimer(comm, STAT["clock"])
    own, frac, timed = [], [], 0
    try:
        for b, ctx in SYNC_POINTS:
            for lay in LAYOUT_NAMES:
                st = DecodeState(comm, preset, lay, b, ctx, block_size)
                got = timed_steps(st, timer, reps)
                iso = isolated_collective_seconds(cm, lay, [RowLoad(1, ctx + 2 + reps * 3 // 2, i % comm.size)
                                                            for i in range(b)])
                own += [(g["own"] - iso) / g["count"] for g in got if g["count"]]
                frac += [g["wait"] / g["outside"] for g in got if g["count"] and g["outside"] > 0]
                timed += sum(g["count"] for g in got)
                del st
    finally:
        timer.close()
    return max(0.0, statistics.median(own)), max(0.0, statistics.median(frac)), timed


def collective_sync(comm, preset: str, partial: dict, block_size: int, reps: int) -> float:
    """The default ``collective_sync_s``: seconds per collective as the least squares of measured − predicted step
    time (the profile so far, per-layout fixed costs included) on the collective count of each step, over every
    layout and SYNC_POINTS; never below 0. It carries whatever the model leaves unexplained there in proportion
    to the collective count (the wait for the peer included: see collective_in_step for the two measured apart)."""
    from splash.bench.decode_state import DecodeState
    from splash.costmodel import RowLoad
    cm = partial_model(preset, comm.size, partial, block_size)
    num = den = 0.0
    for b, ctx in SYNC_POINTS:
        for lay in LAYOUT_NAMES:
            st = DecodeState(comm, preset, lay, b, ctx, block_size)
            t = step_time(st, reps)
            pred = cm.step(lay, [RowLoad(1, ctx + 2 + reps * 3 // 2, i % comm.size) for i in range(b)])
            n = sum(w["collectives"] for w in pred.work.values())
            num, den = num + (t - pred.seconds) * n, den + n * n
            del st
    return max(0.0, num / den) if den else 0.0


def step_time(st, reps: int) -> float:
    """A DecodeState's step, measured as bench_costmodel does: on the CPU clock the median over ``reps`` groups of
    the least-preempted of 3 steps; on the wall clock the median of ``reps`` steps."""
    group = 3 if STAT["clock"] is time.thread_time else 1
    for _ in range(2):
        st.step(clock=STAT["clock"])
    return statistics.median(min(st.step(clock=STAT["clock"]) for _ in range(group)) for _ in range(reps))


def layout_overheads(comm, preset: str, partial: dict, block_size: int, reps: int) -> dict[str, float]:
    """Fixed cost per step of each layout at this world size: a real decode step of one request per rank at a
    short context (64 tokens) minus what the cost model predicts for it without this term (never below 0)."""
    from splash.bench.decode_state import DecodeState
    from splash.costmodel import RowLoad
    cm = partial_model(preset, comm.size, partial, block_size)
    out = {}
    for lay in LAYOUT_NAMES:
        st = DecodeState(comm, preset, lay, comm.size, 64, block_size)
        t = step_time(st, max(3, reps // 3))
        pred = cm.step(lay, [RowLoad(1, 64 + 2 + reps // 2, i) for i in range(comm.size)]).seconds
        out[lay] = max(0.0, t - pred)
    return out


PREFILL_CHUNK = 512


def prefill_attention_factors(comm, preset: str, partial: dict, block_size: int, reps: int) -> dict[str, float]:
    """Per layout: the attention (`splash.attention.mla.attend`, the kernel calls of every layer) of a real step
    that carries one PREFILL_CHUNK-token chunk from position 0, on the slowest rank (median over repetitions of
    the least-preempted of 3 steps, thread CPU time), over what the cost model predicts for that stage."""
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
