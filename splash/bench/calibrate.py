"""`splash-bench calibrate`: measure this machine and write a hardware profile for the cost model.

    OMP_NUM_THREADS=1 .venv/bin/mpiexec -n 2 .venv/bin/python -m splash.bench.calibrate --preset small-mla --out configs/hardware/cpu.yaml

Run under mpiexec at the world size the profile is for (collective α/β depend on it). Measures, with the
project's own code paths: GEMM rate over the shapes of the model's layers (float32 and bfloat16; each weight
held and multiplied as the engine does: FFN weights packed for SPLASH's CPU GEMM when it runs), weight
streaming bandwidth (the same GEMMs at decode row counts over more weights than the caches hold), the per-op
host overhead (the real model's one-rank B=1 decode step minus its predicted compute, per counted eager op),
MLA attention fitted as KV bytes + FLOPs (+ for the split-KV `torch` kernel: the multi-chunk merge traffic and
the chunk bytes beyond this rank's last-level-cache share, on isolated kernel calls and inside real one-rank
decode steps), the GEMM rate at the row counts steps run, α + bytes/β of all-reduce, all-gather(v), all-to-all(v)
and broadcast through the MPI communicator, and each layout's fixed cost per step (a real decode step at this
world size minus its prediction). Every rank measures; rank 0 writes the median of the ranks. `--clock cpu` for a
loaded host.
About 1 minute on 2 quiet ranks here, 4–5 minutes at load 7–10.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from datetime import datetime, timezone

import numpy as np

from splash.bench.calib_attention import attention_fit, attention_step_rows, refit_attention, row_kernel
from splash.bench.calib_sync import collective_in_step, collective_sync, layout_overheads, prefill_attention_factors
from splash.bench.calib_timing import ALLOC_THRESHOLD, STAT, partial_model, timeit


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--preset", default="small-mla", help="model preset whose shapes are measured")
    parser.add_argument("--out", default=None, help="profile YAML to write (default: print it)")
    parser.add_argument("--name", default="cpu", help="profile name written into the file")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--quick", action="store_true", help="fewer repetitions (tests)")
    parser.add_argument("--stat", choices=("median", "min"), default="median",
                        help="statistic of the repetitions (min: robust to other processes on a shared host)")
    parser.add_argument("--in-step-collectives", action="store_true",
                        help="time every collective inside real decode steps: collective_sync_s = its own time "
                             "beyond the isolated fit, collective_wait_fraction = the wait for the slower peer per "
                             "step (default: collective_sync_s as the per-collective residual of real steps, "
                             "which also carries that wait, in proportion to the collective count)")
    parser.add_argument("--prefill-factors", action="store_true",
                        help="also measure prefill_attention_factor per layout (a real step carrying a 512-token "
                             "chunk, its attention over the prediction); off by default: with it the shifting "
                             "workload's auto ran worse here (docs/benchmarks.md, cost model round 7)")
    parser.add_argument("--clock", choices=("cpu", "wall"), default="wall",
                        help="clock of the one-rank microbenchmarks (GEMM, bandwidth, attention, ops): cpu = the "
                             "thread's CPU time, which time spent descheduled by other processes does not inflate "
                             "(a loaded shared host); collectives are always timed by the wall clock")


def op_overhead(reps: int) -> float:
    import torch
    x = torch.ones(1, 16)
    n = 200

    def run():
        for _ in range(n):
            x.add(1.0)
    return timeit(run, reps) / n


def alloc_rate(reps: int) -> float:
    """Bytes/s of writing a fresh temporary above the mmap threshold, beyond what a reused one costs."""
    import torch
    big, small = 128 << 20, 8 << 20
    t_big = timeit(lambda: torch.empty(big // 4).fill_(1.0), reps) / big
    t_small = timeit(lambda: torch.empty(small // 4).fill_(1.0), reps) / small
    return 1.0 / max(t_big - t_small, t_big * 0.05)


# ---- GEMMs: every weight held and multiplied as the engine does (`_engine_weights`) ----
def _engine_weights(cfg, dtype=None) -> list[tuple[int, int, object]]:
    """(in, out, weight) of `_model_shapes`, each held as the engine holds it: packed for SPLASH's CPU GEMM where
    the engine packs it at load (splash.native.packed: fp32, native kernels on, whole strips — the FFN / MoE
    weights, and the attention projections when a head's Q-B rows and Q-A / KV-A split on strips), else plain
    (torch's GEMM). Run them with `linear`, the engine's own call."""
    import torch

    from splash.native.packed import pack_linear
    dtype = dtype or torch.float32
    out = []
    for i, (k, n) in enumerate(_model_shapes(cfg)):
        w = torch.randn(n, k, dtype=dtype)
        packs = i >= FFN_SHAPES or (i == 1 and cfg.qk_head_dim % 16 == 0) or i == 2 or (
            i == 0 and cfg.q_lora_rank is not None and cfg.q_lora_rank % 16 == 0)
        out.append((k, n, pack_linear(w) if packs else w))
    return out


def _gemm_rate(weights, rows: int, reps: int, dtype=None, inner: int = 1) -> float:
    """One layer's GEMMs at ``rows`` rows, each run ``inner`` times a timing: total FLOPs over total time (a step's
    GEMM time is their sum)."""
    import torch

    from splash.models.linear import linear
    flops = secs = 0.0
    for k, n, w in weights:
        x = torch.randn(rows, k, dtype=dtype)

        def run():
            for _ in range(inner):
                linear(x, w)
        secs += timeit(run, reps)
        flops += 2.0 * rows * k * n * inner
    return flops / secs


def gemm_rates(cfg, reps: int) -> dict[str, float]:
    import torch
    return {name: _gemm_rate(_engine_weights(cfg, dt), 1024, reps, dt)
            for name, dt in (("float32", torch.float32), ("bfloat16", torch.bfloat16))}


GEMM_ROWS = (1, 4, 16, 64, 256, 1024, 2048)  # decode batches and prefill chunk sizes a step runs


def gemm_row_rates(cfg, reps: int) -> dict[str, dict[int, float]]:
    """float32 GEMM rate per row count (decode steps run B rows, prefill steps a chunk's); the weights stay hot
    here, so this is the compute side of the roofline. Enough runs per timing (2048 rows) for the clock."""
    weights = _engine_weights(cfg)
    return {"float32": {rows: _gemm_rate(weights, rows, reps, inner=max(1, 2048 // rows)) for rows in GEMM_ROWS}}


FFN_SHAPES = 3   # _model_shapes: the first three are attention projections, the rest the FFN's


def _model_shapes(cfg) -> list[tuple[int, int]]:
    """(in, out) of the model's GEMMs per rank-independent layer: fused Q-A/KV-A, Q-B, O, FFN gate/up/down."""
    hid, H = cfg.hidden_size, cfg.num_attention_heads
    q_in = cfg.q_lora_rank or hid
    return [(hid, q_in + cfg.kv_lora_rank + cfg.qk_rope_head_dim), (q_in, H * cfg.qk_head_dim),
            (H * cfg.v_head_dim, hid), (hid, 2 * cfg.moe_intermediate_size or 2 * cfg.intermediate_size),
            (cfg.moe_intermediate_size or cfg.intermediate_size, hid)]


def model_weight_bytes(cfg, world: int) -> float:
    """fp32 weight bytes one rank streams per decode step (splash.layouts.memory's counts, sharded layout)."""
    from splash.layouts.memory import common_params, projection_bytes_per_rank
    return common_params(cfg, world) * 4 + projection_bytes_per_rank(cfg, "tp", world, 4)


def stream_bandwidth(cfg, overhead: float, reps: int, total_bytes: float) -> float:
    """Decode GEMMs (4 rows) over distinct weights of the model's shapes totalling ``total_bytes`` (what one
    rank's step streams, so caches help exactly as much as they do in a step), each held and run as the engine
    does (`_engine_weights`): bytes / (time - op cost)."""
    import torch

    from splash.models.linear import linear
    ws, size = [], 0
    while size < total_bytes:
        ws += [(k, w) for k, _, w in _engine_weights(cfg)]
        size += sum(k * n * 4 for k, n in _model_shapes(cfg))
    xs = {k: torch.randn(4, k) for k, _ in _model_shapes(cfg)}

    def run():
        for k, w in ws:
            linear(xs[k], w)
    t = timeit(run, max(2, reps // 2), warm=1)
    return size / max(t - len(ws) * overhead, t * 0.1)


def collective_fits(comm, reps: int, coll_stat=None) -> dict[str, dict[str, float]]:
    """α, β per collective at this world size; bytes as the cost model counts them (see profile.Collective).
    Wall clock (a collective waits for its peers); ``coll_stat`` of the repetitions (default: ``--stat``'s)."""
    import torch
    T = comm.size
    # kind -> (the input of n counted elements, the call); every kind counts n * 4 bytes
    calls = {"all_reduce": lambda n: (torch.ones(n), comm.all_reduce),
             "all_gather": lambda n: (torch.ones(n // T), comm.all_gatherv),
             "all_to_all": lambda n: (torch.ones(n, 1), lambda x: comm.all_to_allv(x, [n // T] * T, [n // T] * T)),
             "broadcast": lambda n: (torch.ones(n), comm.broadcast)}
    out = {}
    for kind, call in calls.items():
        xs, ys = [], []
        for nbytes in (1 << 10, 1 << 14, 1 << 17, 1 << 20, 1 << 22):
            n = max(T, nbytes // 4 // T * T)
            t_in, f = call(n)
            t = timeit(lambda: f(t_in), reps, warm=1, pre=comm.barrier, clock=time.perf_counter, stat=coll_stat)
            xs.append(n * 4)
            ys.append(max(comm.all_gather_obj(t)))
        slope, alpha = np.polyfit(np.array(xs, dtype=float), np.array(ys), 1, w=1.0 / np.array(ys))
        out[kind] = {"alpha_s": max(float(alpha), 0.0), "bytes_per_s": 1.0 / max(float(slope), 1e-15)}
    return out


def fixed_cost_fit(preset: str, partial: dict, block_size: int, reps: int) -> float:
    """Per-op host overhead: the real layer code's decode step at B=1 (one rank, 64 tokens resident), minus what
    the cost model predicts for it with zero op overhead, divided by the eager ops the model counts for it."""
    from splash.bench.decode_state import DecodeState
    from splash.costmodel import RowLoad
    from splash.distributed.communicator import SingleRankCommunicator
    meas = timeit(DecodeState(SingleRankCommunicator(), preset, "tp", 1, 64, block_size).local_step, reps)
    cm = partial_model(preset, 1, {**partial, "op_overhead_s": 0.0, "attention_call_s": 0.0}, block_size)
    pred = cm.step("tp", [RowLoad(1, 64 + reps, 0)])
    ops = sum(w["ops"] + w.get("expert_ops", 0.0) + 14 * w.get("attn_calls", 0.0) for w in pred.work.values())
    return max(meas - pred.seconds, 0.0) / ops


def measure(args, world: int, reps: int) -> dict:
    from splash.models.presets import preset_config
    cfg = preset_config(args.preset)
    ov = op_overhead(reps)
    m = {"op": ov, "gemm": gemm_rates(cfg, reps), "gemm_rows": gemm_row_rates(cfg, reps),
         "bw": stream_bandwidth(cfg, ov, reps, model_weight_bytes(cfg, world)), "alloc": alloc_rate(reps)}
    kv_bw, attn_rate, call, scratch, fit = attention_fit(cfg, args.block_size, reps, world, ov)
    return {**m, "kv_bw": kv_bw, "attn": attn_rate, "call": call, "scratch": scratch,
            "fit": {"attention_fit_median_rel_err": fit["attention_fit_median_rel_err"]},
            "spill": fit["spill"], "merge": fit["merge"], "cache": fit["cache"], "attn_rows": fit["rows"]}


def _median(values: list):
    """The median over ranks of equally shaped measurements (numbers, or dicts and lists of them)."""
    if isinstance(values[0], dict):
        return {k: _median([v[k] for v in values]) for k in values[0]}
    if isinstance(values[0], list):
        return [_median([v[i] for v in values]) for i in range(len(values[0]))]
    return statistics.median(values)


def _4g(v):
    """A measured value (or a dict of them) as the profile keeps it: 4 significant digits."""
    return {k: _4g(x) for k, x in v.items()} if isinstance(v, dict) else float(f"{v:.4g}")


def build_profile(comm, args) -> dict:
    import os
    reps, few = (3, 3) if args.quick else (9, 5)
    every = comm.all_gather_obj(measure(args, comm.size, reps))
    m = {**_median(every), "fit": every[0]["fit"]}   # the first fit's error, as measured
    # on a loaded host (--clock cpu) the least-preempted repetition is the collective's own time: take the min
    colls = collective_fits(comm, reps, min if args.clock == "cpu" else None)
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    stamp = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    raw = {
        "name": args.name,
        "source": (f"splash-bench calibrate, {comm.size} ranks, preset {args.preset}, {args.stat}, "
                   f"clock {args.clock}, {stamp}, load average {load:.2f} at the end"),
        "gemm_flops_per_s": _4g(m["gemm"]),
        "memory_bytes_per_s": _4g(m["bw"]),
        "attention_flops_per_s": _4g(m["attn"]),
        "kv_read_bytes_per_s": _4g(m["kv_bw"]),
        "collectives": _4g(colls),
        "attention_combine": "sum",
        "overlap_fraction": 0.0,
        "op_overhead_s": _4g(m["op"]),
        "plan_block_s": 0.0,     # paged-attention metadata is built per request: its cost is in the ops
        "plan_request_s": 0.0,
        "step_overhead_s": 0.0,
        "memory_bytes": 0.0,
        "ops_scale": 1.0,
        "attention_row_kernel": row_kernel(),
        "attention_scratch_bytes": float(m["scratch"]),
        "alloc_threshold_bytes": float(ALLOC_THRESHOLD),
        "alloc_bytes_per_s": _4g(m["alloc"]),
        "attention_merge_bytes_per_s": _4g(m["merge"]),
        "attention_cache_bytes": float(m["cache"]),
        "attention_spill_bytes_per_s": _4g(m["spill"]),
        "gemm_rows_flops_per_s": _4g(m["gemm_rows"]),
        "extra": {"world": comm.size, "tiny_op_s": _4g(m["op"]),
                  "attention_fit_call_s": _4g(m["call"]), **m["fit"]},
    }
    # the per-op overhead that matters is the real layer code's: fit it on a one-rank B=1 decode step
    op = _median(comm.all_gather_obj(fixed_cost_fit(args.preset, raw, args.block_size, reps)))
    op = max(op, m["op"])  # no eager op is cheaper than the trivial one (a noisy residual can undershoot)
    raw["op_overhead_s"], raw["attention_call_s"] = _4g(op), 0.0
    # the split-KV kernel: refit its rates with the attention inside real steps
    step_rows = attention_step_rows(args.preset, raw, args.block_size, few)
    raw = refit_attention(raw, m["attn_rows"] + _median(comm.all_gather_obj(step_rows)))
    if args.in_step_collectives:
        # measured directly (calib_sync), before the per-layout fixed costs, which are then what a real step takes
        # beyond everything else the model predicts (the in-step collective terms included)
        sync, wait, timed = collective_in_step(comm, args.preset, raw, args.block_size, few)
        raw["collective_sync_s"], raw["collective_wait_fraction"] = _4g(sync), _4g(wait)
        raw["extra"]["in_step_collectives_timed"] = timed
    raw["step_overhead_layout_s"] = _4g(layout_overheads(comm, args.preset, raw, args.block_size, reps))
    if args.prefill_factors:
        raw["prefill_attention_factor"] = _4g(prefill_attention_factors(comm, args.preset, raw, args.block_size, few))
    if not args.in_step_collectives:
        raw["collective_sync_s"] = _4g(collective_sync(comm, args.preset, raw, args.block_size, 3))
    return raw


HEADER = """# CPU hardware profile, measured by `splash-bench calibrate` (see the source line below for when/where):
#   {command}
# --clock cpu: the one-rank microbenchmarks are timed by the thread's CPU time (the host is shared by other
# jobs); collectives by the wall clock, their least-preempted (min) repetition; the per-layout step overheads
# and collective_sync_s (real 2-rank steps, same clock) as bench_costmodel measures: median over repetitions of
# the least-preempted of 3 steps.
# fused_kernels: false (true: count ops as splash/costmodel/op_counts.py FUSED). Measured no better on two decode
# grids (docs/benchmarks.md, cost model round 9), as moe_grouped before it.
# attention_row_kernel: true when SPLASH's C kernel runs every fp32 row (one intra-op thread, AVX2): each row
# walks its own visible keys, one call a layer; the split-KV terms below then describe only quantised pools.
# attention_combine: sum — the torch kernel gathers each chunk of pages into a copy, then runs the bmm's.
# attention_merge/cache/spill: the split-KV kernel's per-chunk fold of the running output and the part of a
# chunk's working set beyond this rank's share of the last-level cache (sysfs size / ranks), fitted on isolated
# kernel calls and on the attention inside real one-rank decode steps together.
# gemm_rows_flops_per_s: float32 GEMM rate at the row counts steps run (decode B rows, prefill chunks).
# step_overhead_layout_s: a real 2-rank decode step (1 request per rank, 64 tokens) minus its prediction.
# (--prefill-factors: prefill_attention_factor, the attention of a real 2-rank step carrying one 512-token
# prefill chunk over its prediction; it scales the prefill pieces' attention work, not decode rows'.)
# collective_sync_s: per collective, what real decode steps of every layout (B=8 x 512, B=24 x 128) take beyond
# the prediction (least squares on each step's collective count): the wait for the slower peer inside a step.
# (--in-step-collectives: collective_sync_s and collective_wait_fraction timed inside those steps instead, see
# splash/bench/calib_sync.py.)
# overlap_fraction: 0 — on this machine nonblocking MPI does not progress during compute (docs/benchmarks.md,
# switch overhead), so no exchange hides behind attention.
"""


def command_line(args, world: int) -> str:
    """The command that measured a profile, as its header records it (the one run, not a fixed example)."""
    import os
    import shlex

    argv = getattr(args, "argv", None) or ["calibrate"]
    threads = os.environ.get("OMP_NUM_THREADS")
    return (f"OMP_NUM_THREADS={threads} " if threads else "") + f"mpiexec -n {world} splash-bench {shlex.join(argv)}"


def run(args) -> int:
    import dataclasses

    import yaml

    from splash.bench.calib_provenance import calibrated_provenance
    from splash.costmodel.profile import profile_from_dict, save_profile
    from splash.distributed import init_dist

    STAT["fn"] = min if args.stat == "min" else statistics.median
    STAT["clock"] = time.thread_time if args.clock == "cpu" else time.perf_counter
    comm = init_dist().comm
    raw = build_profile(comm, args)
    if comm.rank == 0:
        prof = profile_from_dict(raw, "calibrate output")
        prof = dataclasses.replace(prof, provenance=calibrated_provenance(
            prof.to_dict(), getattr(args, "in_step_collectives", False), getattr(args, "prefill_factors", False)))
        header = HEADER.format(command=command_line(args, comm.size))
        if args.out:
            save_profile(prof, args.out, header)
            print(f"wrote {args.out}", flush=True)
        else:
            print(header + yaml.safe_dump(prof.to_dict(), sort_keys=False), flush=True)
    comm.barrier()
    return 0


if __name__ == "__main__":
    from splash.bench.cli import main
    sys.exit(main(["calibrate", *sys.argv[1:]]))
