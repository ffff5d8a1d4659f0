"""`splash-bench calibrate`'s GEMM measurements: the rate over the model's layer shapes (a prefill chunk's rows
and each decode row count) and the weight-streaming bandwidth of decode GEMMs over a step's worth of distinct
weights, every weight held and multiplied as the engine does (`_engine_weights`)."""
from __future__ import annotations

from splash.bench.calib_timing import timeit


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


def _rate(flops: list[float], seconds: list[float]) -> float:
    """One layer's GEMMs run once each: total FLOPs over total time (a step's GEMM time is their sum)."""
    return sum(flops) / sum(seconds)


def gemm_rates(cfg, reps: int) -> dict[str, float]:
    import torch

    from splash.models.linear import linear
    out = {}
    for name, dt in (("float32", torch.float32), ("bfloat16", torch.bfloat16)):
        flops, secs = [], []
        for k, n, w in _engine_weights(cfg, dt):
            x = torch.randn(1024, k, dtype=dt)
            secs.append(timeit(lambda: linear(x, w), reps))
            flops.append(2.0 * 1024 * k * n)
        out[name] = _rate(flops, secs)
    return out


GEMM_ROWS = (1, 4, 16, 64, 256, 1024, 2048)  # decode batches and prefill chunk sizes a step runs


def gemm_row_rates(cfg, reps: int) -> dict[str, dict[int, float]]:
    """float32 GEMM rate per row count over the model's shapes, run as the engine runs them (`_engine_weights`):
    decode steps run B rows, prefill steps a chunk's; the weights stay hot here, so this is the compute side of
    the roofline."""
    import torch

    from splash.models.linear import linear
    weights = _engine_weights(cfg)
    out = {}
    for rows in GEMM_ROWS:
        flops, secs = [], []
        for k, n, w in weights:
            x = torch.randn(rows, k)
            inner = max(1, 2048 // rows)   # enough work per timing for the clock

            def run():
                for _ in range(inner):
                    linear(x, w)
            secs.append(timeit(run, reps))
            flops.append(2.0 * rows * k * n * inner)
        out[rows] = _rate(flops, secs)
    return {"float32": out}


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
