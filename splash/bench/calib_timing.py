"""Timing and fitting helpers shared by `splash-bench calibrate`'s measurements (splash/bench/calibrate.py,
splash/bench/calib_attention.py): the repetition statistic and clock chosen on the command line, and the
nonnegative weighted least squares the fits use."""
from __future__ import annotations

import statistics
import time

import numpy as np

ALLOC_THRESHOLD = 32 << 20  # glibc's largest dynamic mmap threshold on 64-bit: bigger blocks are always mmap'd


STAT = {"fn": statistics.median, "clock": time.perf_counter}


def timeit(fn, reps: int, warm: int = 2, pre=None, clock=None, stat=None) -> float:
    clock, stat = clock or STAT["clock"], stat or STAT["fn"]
    for _ in range(warm):
        fn()
    ts = []
    for _ in range(reps):
        if pre is not None:
            pre()
        t0 = clock()
        fn()
        ts.append(clock() - t0)
    return stat(ts)


def partial_model(preset: str, world: int, partial: dict, block_size: int):
    """The cost model of `preset` at `world` ranks on the profile measured so far (fp32, as calibrate's steps run)."""
    from splash.costmodel import CostModel
    from splash.costmodel.profile import profile_from_dict
    from splash.models.presets import preset_config
    return CostModel(preset_config(preset), world, profile_from_dict(partial, "calibrate (partial)"), "float32",
                     "float32", block_size)


def nonneg_rel_lstsq(a: np.ndarray, y: np.ndarray) -> tuple[np.ndarray, float]:
    """min Σ (a·x - y)² / y with x >= 0 (between absolute and relative error, so neither the cache-resident
    small shapes nor the largest alone decide): least squares, dropping columns that go negative. -> (x, the
    fit's median relative error)."""
    keep = list(range(a.shape[1]))
    x = np.zeros(a.shape[1])
    sw = np.sqrt(y)
    while keep:
        sol, *_ = np.linalg.lstsq(a[:, keep] / sw[:, None], y / sw, rcond=None)
        if (sol >= 0).all():
            x[keep] = sol
            break
        keep = [k for k, v in zip(keep, sol) if v > 0] if (sol > 0).any() else []
    return x, float(np.median(np.abs(a @ x - y) / y))
