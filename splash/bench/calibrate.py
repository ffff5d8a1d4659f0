"""`splash-bench calibrate`: measure this machine and write a hardware profile for the cost model.

    OMP_NUM_THREADS=1 .venv/bin/mpiexec -n 2 .venv/bin/python -m splash.bench.calibrate --preset small-mla --out configs/hardware/cpu.yaml

Run under mpiexec at the world size the profile is for (collective α/β depend on it). Measures, with the
project's own code paths: GEMM rate over the shapes of the model's layers (float32 and bfloat16), weight
streaming bandwidth (the same GEMMs at decode row counts over more weights than the caches hold), the per-op
host overhead (the real model's one-rank B=1 decode step minus its predicted compute, per counted eager op),
MLA attention (paged-cache read + `attend_latent`) fitted as KV bytes + FLOPs, the per-step
attention plan (`build_attn_plan`) per request and per block, and α + bytes/β of all-reduce, all-gather(v),
all-to-all(v) and broadcast through the MPI communicator. Every rank measures; rank 0 writes the median of
the ranks. About a minute on 2 ranks here.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from datetime import datetime, timezone

import numpy as np


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--preset", default="small-mla", help="model preset whose shapes are measured")
    parser.add_argument("--out", default=None, help="profile YAML to write (default: print it)")
    parser.add_argument("--name", default="cpu", help="profile name written into the file")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--quick", action="store_true", help="fewer repetitions (tests)")
    parser.add_argument("--stat", choices=("median", "min"), default="median",
                        help="statistic of the repetitions (min: robust to other processes on a shared host)")


STAT = {"fn": statistics.median}


def _timeit(fn, reps: int, warm: int = 2, pre=None) -> float:
    for _ in range(warm):
        fn()
    ts = []
    for _ in range(reps):
        if pre is not None:
            pre()
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return STAT["fn"](ts)


def op_overhead(reps: int) -> float:
    import torch
    x = torch.ones(1, 16)
    n = 200

    def run():
        for _ in range(n):
            x.add(1.0)
    return _timeit(run, reps) / n


def gemm_rates(cfg, reps: int) -> dict[str, float]:
    import torch
    shapes = _model_shapes(cfg)
    out = {}
    for name, dt in (("float32", torch.float32), ("bfloat16", torch.bfloat16)):
        rates = []
        for k, n in shapes:
            x, w = torch.randn(1024, k, dtype=dt), torch.randn(n, k, dtype=dt)
            t = _timeit(lambda: x @ w.T, reps)
            rates.append(2.0 * 1024 * k * n / t)
        out[name] = statistics.median(rates)
    return out


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
    rank's step streams, so caches help exactly as much as they do in a step): bytes / (time - op cost)."""
    import torch
    shapes = _model_shapes(cfg)
    ws, size = [], 0
    while size < total_bytes:
        k, n = shapes[len(ws) % len(shapes)]
        ws.append(torch.randn(n, k))
        size += ws[-1].numel() * 4
    xs = {k: torch.randn(4, k) for k, _ in shapes}

    def run():
        for w in ws:
            xs[w.shape[1]] @ w.T
    t = _timeit(run, max(2, reps // 2), warm=1)
    return size / max(t - len(ws) * overhead, t * 0.1)


ALLOC_THRESHOLD = 32 << 20  # glibc's largest dynamic mmap threshold on 64-bit: bigger blocks are always mmap'd


def alloc_rate(reps: int) -> float:
    """Bytes/s of writing a fresh temporary above the mmap threshold, beyond what a reused one costs."""
    import torch
    big, small = 128 << 20, 8 << 20
    t_big = _timeit(lambda: torch.empty(big // 4).fill_(1.0), reps) / big
    t_small = _timeit(lambda: torch.empty(small // 4).fill_(1.0), reps) / small
    return 1.0 / max(t_big - t_small, t_big * 0.05)


def _attention_call(cfg, block_size: int, b: int, s: int, h: int):
    """A callable running this checkout's attention for B decode rows over ``s`` resident keys with ``h`` heads,
    and the kernel's scratch bound (0: the gather-based path, whose temporaries are unbounded)."""
    import torch
    dc, dr = cfg.kv_lora_rank, cfg.qk_rope_head_dim
    nb = -(-s // block_size)
    from splash.kv.paged_cache import PagedLatentCache
    cache = PagedLatentCache(1, b * nb + 1, block_size, dc, dr, "float32")
    q = torch.randn(b, h, dc + dr)
    try:
        from splash.attention.kernels import make_kernel  # paged attention, reads the cache in place
    except ImportError:
        from splash.attention.mla import attend_latent
        slots = torch.arange(b * nb * block_size).view(b, nb * block_size)[:, :s]
        valid = torch.ones(b, 1, s, dtype=torch.bool)

        def gather_run():
            c, kpe = cache.read(0, slots)
            attend_latent(q, c, kpe, valid, 0.1)
        return gather_run, 0
    from splash.attention.batch import StepRequest
    from splash.attention.kernels import torch_mla
    from splash.attention.metadata import build_metadata
    from splash.kv.page_table import PageTable
    tables = PageTable(block_size)
    for i in range(b):
        tables.append(f"r{i}", [(j, i * nb + j) for j in range(nb)])
    kernel = make_kernel("torch", 0.1)
    kernel.plan(build_metadata([StepRequest(f"r{i}", s - 1, 1, 0) for i in range(b)], tables))
    return (lambda: kernel.run(0, q[..., :dc], q[..., dc:], cache)), torch_mla.SCRATCH_BYTES


def attention_fit(cfg, alloc: float, block_size: int, reps: int) -> tuple[float, float, float, int, float, dict]:
    """Time this checkout's attention over shapes; nonnegative least squares (weighted) of
    t = kv_bytes/BW + flops/R + big-temporary bytes/alloc rate + per-call seconds. Returns (BW, R, per-call,
    the kernel's scratch bound, alloc rate (the probe's ``alloc`` when the fit drops that term), notes)."""
    from splash.costmodel.work import _attn_temps
    dc, dr, H = cfg.kv_lora_rank, cfg.qk_rope_head_dim, cfg.num_attention_heads
    points = [(b, s, h) for b in (1, 4, 16, 32) for s in (256, 1024, 4096) for h in (max(1, H // 2), H)
              if b * s <= 65536]
    rows, ys, scratch = [], [], 0
    for b, s, h in points:
        run, scratch = _attention_call(cfg, block_size, b, s, h)
        t = _timeit(run, reps if b * s < 32768 else 3)
        big = 0.0 if scratch else sum(x for x in _attn_temps(b, 1, s, h, dc, dr) if x >= ALLOC_THRESHOLD)
        rows.append([b * s * (dc + dr) * 4.0, 2.0 * b * h * s * (2 * dc + dr), big, 1.0])
        ys.append(max(t, 1e-7))
    a, y = np.array(rows), np.array(ys)
    sol = nonneg_rel_lstsq(a, y)  # fresh-page cost fitted with the rest: its own probe is noisy under load
    err = float(np.median(np.abs(a @ sol - y) / y))
    inv_bw, inv_r, inv_alloc, call = (float(v) for v in sol)
    if inv_alloc > 0:
        alloc = 1.0 / inv_alloc
    return (1.0 / inv_bw if inv_bw > 0 else 1e15, 1.0 / inv_r if inv_r > 0 else 1e15, call, scratch, alloc,
            {"attention_fit_median_rel_err": round(err, 4)})


def nonneg_rel_lstsq(a: np.ndarray, y: np.ndarray) -> np.ndarray:
    """min Σ (a·x - y)² / y with x >= 0 (between absolute and relative error, so neither the cache-resident
    small shapes nor the largest alone decide): least squares, dropping columns that go negative."""
    keep = list(range(a.shape[1]))
    x = np.zeros(a.shape[1])
    sw = np.sqrt(y)
    while keep:
        sol, *_ = np.linalg.lstsq(a[:, keep] / sw[:, None], y / sw, rcond=None)
        if (sol >= 0).all():
            x[keep] = sol
            return x
        keep = [k for k, v in zip(keep, sol) if v > 0] if (sol > 0).any() else []
    return x


def plan_fit(cfg, block_size: int, reps: int) -> tuple[float, float]:
    """build_attn_plan (decode) over B requests × nb blocks: t = B·per_request + B·nb·per_block. A checkout with
    paged-attention metadata (built in O(requests)) has no per-block plan: (0, 0), its cost is in the ops."""
    try:
        from splash.attention.batch import StepRequest, build_attn_plan
    except ImportError:
        return 0.0, 0.0
    rows, ys = [], []
    for b, nb in ((1, 16), (4, 64), (16, 64), (16, 256), (32, 128)):
        tables = {f"r{i}": {j: i * nb + j for j in range(nb + 1)} for i in range(b)}
        reqs = [StepRequest(f"r{i}", nb * block_size - 1, 1) for i in range(b)]
        t = _timeit(lambda: build_attn_plan(reqs, tables.__getitem__, block_size, lambda q, x: True), reps)
        rows.append([b, b * nb])
        ys.append(t)
    a, y = np.array(rows, dtype=float), np.array(ys)
    sol = nonneg_rel_lstsq(a, y)
    return float(sol[0]), float(sol[1])


def collective_fits(comm, reps: int) -> dict[str, dict[str, float]]:
    """α, β per collective at this world size; bytes as the cost model counts them (see profile.Collective)."""
    import torch
    T = comm.size
    sizes = [1 << 10, 1 << 14, 1 << 17, 1 << 20, 1 << 22]
    out = {}
    for kind in ("all_reduce", "all_gather", "all_to_all", "broadcast"):
        xs, ys = [], []
        for nbytes in sizes:
            n = max(T, nbytes // 4 // T * T)
            if kind == "all_reduce":
                t_in, f, counted = torch.ones(n), comm.all_reduce, n * 4
            elif kind == "all_gather":
                t_in, f, counted = torch.ones(n // T), comm.all_gatherv, n * 4
            elif kind == "all_to_all":
                t_in = torch.ones(n, 1)
                f, counted = (lambda x: comm.all_to_allv(x, [n // T] * T, [n // T] * T)), n * 4
            else:
                t_in, f, counted = torch.ones(n), comm.broadcast, n * 4

            ts = [_timeit(lambda: f(t_in), reps, warm=1, pre=comm.barrier)]
            xs.append(counted)
            ys.append(max(comm.all_gather_obj(ts[0])))
        slope, alpha = np.polyfit(np.array(xs, dtype=float), np.array(ys), 1, w=1.0 / np.array(ys))
        out[kind] = {"alpha_s": max(float(alpha), 0.0), "bytes_per_s": 1.0 / max(float(slope), 1e-15)}
    return out


def model_step_seconds(preset: str, batch: int, context: int, block_size: int, reps: int) -> float:
    """Median decode step of the real model code on one rank (no collectives): B requests at ``context``."""
    from splash.attention.batch import StepBatch, StepRequest
    from splash.distributed.communicator import SingleRankCommunicator
    from splash.engine.runner import ModelRunner
    from splash.models.presets import preset_config, preset_getter
    cfg = preset_config(preset)
    nb = -(-(context + 64) // block_size)
    r = ModelRunner(cfg, preset_getter(preset), SingleRankCommunicator(), "tp", "float32", block_size,
                    batch * nb + 8)
    pre = [StepRequest(f"r{i}", 0, context, 0) for i in range(batch)]
    r.step(StepBatch.build(pre, [[7] * context for _ in pre], [True] * batch))
    pos = [context]

    def one():
        reqs = [StepRequest(f"r{i}", pos[0], 1, 0) for i in range(batch)]
        r.step(StepBatch.build(reqs, [[7] for _ in reqs], [True] * batch))
        pos[0] += 1
    return _timeit(one, reps)


def fixed_cost_fit(preset: str, partial: dict, block_size: int, reps: int) -> float:
    """Per-op host overhead: the real layer code's decode step at B=1 (one rank, short context), minus what the
    cost model predicts for it with zero op overhead, divided by the eager ops the model counts for it."""
    from splash.costmodel.profile import profile_from_dict
    from splash.costmodel.step_cost import CostModel, RowLoad
    from splash.models.presets import preset_config
    cfg = preset_config(preset)
    meas = model_step_seconds(preset, 1, 64, block_size, reps)
    prof = profile_from_dict({**partial, "op_overhead_s": 0.0, "attention_call_s": 0.0}, "calibrate (partial)")
    pred = CostModel(cfg, 1, prof, "float32", "float32", block_size).step("tp", [RowLoad(1, 64 + reps, 0)])
    ops = sum(w["ops"] + w.get("expert_ops", 0.0) + 14 * w.get("attn_calls", 0.0) for w in pred.work.values())
    return max(meas - pred.seconds, 0.0) / ops


def measure(comm, args) -> dict:
    from splash.models.presets import preset_config
    cfg = preset_config(args.preset)
    reps = 3 if args.quick else 9
    ov = op_overhead(reps)
    gemm = gemm_rates(cfg, reps)
    bw = stream_bandwidth(cfg, ov, reps, model_weight_bytes(cfg, args.world))
    alloc = alloc_rate(reps)
    kv_bw, attn_rate, call, scratch, alloc, fit = attention_fit(cfg, alloc, args.block_size, reps)
    per_req, per_block = plan_fit(cfg, args.block_size, reps)
    return {"op": ov, "gemm": gemm, "bw": bw, "kv_bw": kv_bw, "alloc": alloc, "call": call, "scratch": scratch,
            "attn": attn_rate,
            "fit": fit,
            "plan_request": per_req, "plan_block": per_block}


def _median_over_ranks(comm, local: dict) -> dict:
    every = comm.all_gather_obj(local)
    med = lambda key: statistics.median(e[key] for e in every)  # noqa: E731
    out = {k: med(k) for k in ("op", "bw", "kv_bw", "attn", "plan_request", "plan_block", "alloc", "call", "scratch")}
    out["gemm"] = {d: statistics.median(e["gemm"][d] for e in every) for d in every[0]["gemm"]}
    out["fit"] = every[0]["fit"]
    return out


def build_profile(comm, args) -> dict:
    import os
    args.world = comm.size
    local = measure(comm, args)
    m = _median_over_ranks(comm, local)
    colls = collective_fits(comm, 3 if args.quick else 7)
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    stamp = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    raw = {
        "name": args.name,
        "source": (f"splash-bench calibrate, {comm.size} ranks, preset {args.preset}, {args.stat}, {stamp}, "
                   f"load average {load:.2f} at the end"),
        "gemm_flops_per_s": {k: float(f"{v:.4g}") for k, v in m["gemm"].items()},
        "memory_bytes_per_s": float(f"{m['bw']:.4g}"),
        "attention_flops_per_s": float(f"{m['attn']:.4g}"),
        "kv_read_bytes_per_s": float(f"{m['kv_bw']:.4g}"),
        "collectives": {k: {"alpha_s": float(f"{v['alpha_s']:.4g}"), "bytes_per_s": float(f"{v['bytes_per_s']:.4g}")}
                        for k, v in colls.items()},
        "attention_combine": "sum",
        "overlap_fraction": 0.0,
        "op_overhead_s": float(f"{m['op']:.4g}"),
        "plan_block_s": float(f"{m['plan_block']:.4g}"),
        "plan_request_s": float(f"{m['plan_request']:.4g}"),
        "step_overhead_s": 0.0,
        "memory_bytes": 0.0,
        "ops_scale": 1.0,
        "attention_scratch_bytes": float(m["scratch"]),
        "alloc_threshold_bytes": float(ALLOC_THRESHOLD),
        "alloc_bytes_per_s": float(f"{m['alloc']:.4g}"),
        "extra": {"world": comm.size, "tiny_op_s": float(f"{m['op']:.4g}"),
                  "attention_fit_call_s": float(f"{m['call']:.4g}"), **m["fit"]},
    }
    # the per-op overhead that matters is the real layer code's: fit it on a one-rank B=1 decode step
    op = statistics.median(comm.all_gather_obj(fixed_cost_fit(args.preset, raw, args.block_size,
                                                               3 if args.quick else 9)))
    op = max(op, m["op"])  # no eager op is cheaper than the trivial one (a noisy residual can undershoot)
    raw["op_overhead_s"], raw["attention_call_s"] = float(f"{op:.4g}"), 0.0
    return raw


HEADER = """# CPU hardware profile, measured by `splash-bench calibrate` (see the source line below for when/where):
#   OMP_NUM_THREADS=1 .venv/bin/mpiexec -n 2 .venv/bin/python -m splash.bench.calibrate --preset small-mla --out configs/hardware/cpu.yaml
# attention_combine: sum — the torch reference gathers the paged KV into a copy, then runs the bmm's.
# overlap_fraction: 0 — on this machine nonblocking MPI does not progress during compute (docs/benchmarks.md,
# switch overhead), so no exchange hides behind attention.
# alloc_*: temporaries of 32 MiB or more (glibc's largest mmap threshold) are fresh pages on every call; their
# first touch is measured separately and charged to the attention gathers that large.
"""


def run(args) -> int:
    import yaml

    from splash.costmodel.profile import profile_from_dict, save_profile
    from splash.distributed import init_dist

    STAT["fn"] = min if args.stat == "min" else statistics.median
    comm = init_dist().comm
    raw = build_profile(comm, args)
    if comm.rank == 0:
        prof = profile_from_dict(raw, "calibrate output")
        if args.out:
            save_profile(prof, args.out, HEADER)
            print(f"wrote {args.out}", flush=True)
        else:
            print(HEADER + yaml.safe_dump(prof.to_dict(), sort_keys=False), flush=True)
    comm.barrier()
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="splash-bench calibrate", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(ap)
    return run(ap.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
