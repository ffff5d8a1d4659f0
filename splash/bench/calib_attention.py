"""`splash-bench calibrate`'s attention measurements: this checkout's MLA attention kernel on isolated calls
(decode and prefill shapes) and inside real one-rank decode steps, fitted on the features the cost model itself
counts (splash.costmodel.work: KV bytes, FLOPs, the split-KV kernel's spilled chunk bytes and merge traffic)."""
from __future__ import annotations


import numpy as np

from splash.bench.calib_timing import STAT, nonneg_rel_lstsq, partial_model, timeit


def attention_call(cfg, block_size: int, b: int, s: int, h: int, q: int = 1, layers: int = 2):
    """A callable running the `torch` paged attention kernel (it reads the cache in place) for B requests with
    ``q`` query rows each (1: decode; more: a prefill chunk ending at position ``s``) over ``s`` resident keys
    with ``h`` heads, over ``layers`` layers (distinct caches, as a step walks them)."""
    import torch

    from splash.attention.batch import StepRequest
    from splash.attention.kernels import make_kernel
    from splash.attention.metadata import build_metadata
    from splash.kv.page_table import PageTable
    from splash.kv.paged_cache import PagedLatentCache
    dc, dr = cfg.kv_lora_rank, cfg.qk_rope_head_dim
    nb = -(-s // block_size)
    cache = PagedLatentCache(layers, b * nb + 1, block_size, dc, dr, "float32")
    for layer in range(layers):
        cache.ckv[layer].normal_()
        cache.kpe[layer].normal_()
    qs = torch.randn(b * q, h, dc + dr)
    tables = PageTable(block_size)
    for i in range(b):
        tables.append(f"r{i}", [(j, i * nb + j) for j in range(nb)])
    kernel = make_kernel("torch", 0.1)
    meta = build_metadata([StepRequest(f"r{i}", s - q, q, 0) for i in range(b)], tables)

    def run():
        kernel.plan(meta)
        for layer in range(layers):
            kernel.run(layer, qs[..., :dc], qs[..., dc:], cache)
    return run


def cache_share_bytes(world: int) -> float:
    """The last-level cache of this CPU (sysfs) divided among the ``world`` ranks that share it (one host)."""
    from pathlib import Path
    best = 0
    for d in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*"):
        try:
            size = (d / "size").read_text().strip()
            level = int((d / "level").read_text())
        except (OSError, ValueError):
            continue
        mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(size[-1:], 1)
        n = int(size.rstrip("KMG")) * mult
        if level >= 3 or best == 0:
            best = max(best, n) if level >= 3 else n
    return float(best) / max(1, world)


ATTN_POINTS = ([(b, s, 1) for b in (1, 4, 16, 32) for s in (256, 1024, 2048, 4096) if b * s <= 65536]
               + [(1, s, q) for q in (128, 512) for s in (1024, 2048) if q < s])


def row_kernel() -> bool:
    """The `torch` attention backend runs every fp32 row in SPLASH's C kernel here (splash.native enabled): the
    profile's attention_row_kernel."""
    from splash import native
    return bool(native.enabled())


def attention_features(cfg, block_size: int, scratch: float, cache: float, b: int, s: int, q: int, h: int):
    """What the cost model counts for this attention call (splash.costmodel.work): [KV bytes, FLOPs, spilled
    re-read bytes, multi-chunk merge bytes, ops] for the layers timed together."""
    from splash.costmodel.work import Piece, Shapes, Work, attention_work
    s_ = Shapes(cfg, 1, 4.0, 4.0, (cfg.kv_lora_rank + cfg.qk_rope_head_dim) * 4.0, 0.0, block_size, scratch, cache,
                row_kernel=row_kernel())
    w = Work()
    nb = -(-s // block_size)
    attention_work(s_, w, [(Piece(q, s - q, 0), s, nb) for _ in range(b)], h)
    return [w.kv_bytes, w.attn_flops, w.attn_spill_bytes, w.attn_merge_bytes, w.ops]


def attention_fit(cfg, block_size: int, reps: int, world: int, op_s: float
                  ) -> tuple[float, float, float, int, dict]:
    """Time this checkout's attention over decode and prefill shapes (2 layers a call, plan included); fit
    t − ops × op cost = kv_bytes/BW + flops/R + spilled bytes/spill rate + merge bytes/merge rate + per call
    (nonnegative, weighted least squares), the features counted by the cost model itself. Returns (BW, R,
    per-call, the kernel's scratch bound, notes with the spill and merge rates and cache share)."""
    from splash.attention.kernels.torch_mla import SCRATCH_BYTES
    H, layers = cfg.num_attention_heads, 2
    cache = cache_share_bytes(world)
    rows, ys = [], []
    for b, s, q in ATTN_POINTS:
        for h in (max(1, H // 2), H):
            t = timeit(attention_call(cfg, block_size, b, s, h, q, layers), reps if b * s * q < 32768 else 3, warm=1)
            kv, fl, spill, merge, ops = attention_features(cfg, block_size, SCRATCH_BYTES, cache, b, s, q, h)
            rows.append([layers * kv, layers * fl, layers * spill, layers * merge, 1.0])
            ys.append(max(t - layers * ops * op_s, 1e-7))
    sol, err = nonneg_rel_lstsq(np.array(rows), np.array(ys))
    inv_bw, inv_r, inv_spill, inv_merge, call = (float(v) for v in sol)
    rate = lambda inv: 1.0 / inv if inv > 0 else 1e15  # noqa: E731  (a term the fit drops costs nothing)
    notes = {"attention_fit_median_rel_err": round(err, 4), "spill": rate(inv_spill), "merge": rate(inv_merge),
             "cache": cache, "rows": [list(map(float, r[:4])) + [float(v)] for r, v in zip(rows, ys)]}
    return rate(inv_bw), rate(inv_r), call, SCRATCH_BYTES, notes


STEP_POINTS = ((1, 1024), (1, 4096), (4, 1024), (4, 4096), (8, 1024), (8, 2048), (16, 1024), (16, 2048),
               (16, 4096), (32, 1024), (32, 2048))  # (B, context) of the in-step attention fit: both kernel modes


def attention_step_rows(preset: str, partial: dict, block_size: int, reps: int) -> list[list[float]]:
    """The attention as the real decode step runs it (one rank, all heads, KV resident; every rank measures at
    once, as a step's ranks do): per point the step's measured time minus the cost model's prediction of all
    its other stages, with the attention features the model counts — [KV bytes, FLOPs, spill, merge, seconds,
    the step's seconds]. The residual is not clamped: `refit_attention` drops the points where it says nothing."""
    from splash.bench.decode_state import DecodeState
    from splash.costmodel import RowLoad
    from splash.distributed.communicator import SingleRankCommunicator
    cm = partial_model(preset, 1, partial, block_size)
    cfg, prof = cm.cfg, cm.profile
    out = []
    for b, ctx in STEP_POINTS:
        st = DecodeState(SingleRankCommunicator(), preset, "tp", b, ctx, block_size)
        for _ in range(2):
            st.step(clock=STAT["clock"])
        t = STAT["fn"]([st.step(clock=STAT["clock"]) for _ in range(reps)])
        p = cm.step("tp", [RowLoad(1, ctx + 2 + reps // 2, 0) for _ in range(b)])
        other = p.seconds - p.stages["attention"]
        w = p.work["attention"]
        L = cfg.num_hidden_layers
        kv, fl, spill, merge = attention_features(cfg, block_size, prof.attention_scratch_bytes,
                                                  prof.attention_cache_bytes, b, ctx + 2 + reps // 2, 1,
                                                  cfg.num_attention_heads)[:4]
        ops_s = (w["ops"] + 14 * w["attn_calls"]) * prof.op_overhead_s
        out.append([L * kv, L * fl, L * spill, L * merge, t - other - ops_s, t])
    return out


MIN_STEP_SHARE = 0.03   # an in-step residual below this share of its step is noise, not attention
MAX_REFIT_ERR = 0.5     # a refit worse than this (median relative error) is not used


def refit_attention(raw: dict, rows: list[list[float]]) -> dict:
    """KV rate, FLOP rate, spill and merge rates from the isolated kernel calls ([features ×4, seconds]) and the
    in-step points ([features ×4, residual seconds, step seconds]) together. An in-step point whose residual is
    not positive, or under MIN_STEP_SHARE of its step, is dropped: the fit weighs rows by 1 / seconds, so one
    such point would decide it (fitted rates of 1e12-1e15: docs/benchmarks.md, "Round 8 (lead): the attention
    refit no longer degenerates"). A refit whose median error
    exceeds MAX_REFIT_ERR is not used: the isolated fit's rates stay, and `extra` says why."""
    kept = [r for r in rows if r[4] > 0 and (len(r) < 6 or r[4] >= MIN_STEP_SHARE * r[5])]
    sol, err = nonneg_rel_lstsq(np.array([r[:4] + [1.0] for r in kept]), np.array([r[4] for r in kept]))
    rate = lambda inv: float(f"{1.0 / inv:.4g}") if inv > 0 else 1e15  # noqa: E731
    raw = dict(raw)
    extra = {**raw["extra"], "attention_fit_points": len(kept), "attention_fit_dropped": len(rows) - len(kept)}
    if err > MAX_REFIT_ERR or sol[0] <= 0 and sol[1] <= 0:
        raw["extra"] = {**extra, "attention_refit": f"not used (median error {err:.2f}); isolated calls' fit kept"}
        return raw
    raw["kv_read_bytes_per_s"], raw["attention_flops_per_s"] = rate(sol[0]), rate(sol[1])
    raw["attention_spill_bytes_per_s"], raw["attention_merge_bytes_per_s"] = rate(sol[2]), rate(sol[3])
    raw["extra"] = {**extra, "attention_fit_call_s": float(f"{sol[4]:.4g}"),
                    "attention_fit_median_rel_err": round(err, 4)}
    return raw
