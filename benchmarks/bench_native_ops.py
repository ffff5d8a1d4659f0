"""Each of SPLASH's CPU kernels against the torch path it stands for, at the call site, in one process.

    .venv/bin/python benchmarks/bench_native_ops.py [NAME ...] [--reps 15] [--rows 32]

NAME: routes of splash.native.ops (default: all timed here). Each call site of bench_decode_vs_hf's model (hidden
256, 8 heads, kv_lora 128, q_lora 192, rope 32, 16 experts top-4, moe_inter 128; `--rows` rows, one thread) is
timed with the route on (the kernel) and off (the route returns None, so the decorated torch function runs), the
two alternating in order, 50 calls each, on the process CPU clock. The packed GEMMs are timed against what torch
would run without packing: a plain weight's matmul (linear_packed) and `torch._grouped_mm` on the plain stack
(grouped_gemm); `mlp_packed` against the unfused MLP (two packed GEMMs and SwiGLU, each its own kernel). Prints µs
per call, medians, and the median of the per-rep ratios torch / kernel (> 1: the kernel is faster).
"""
from __future__ import annotations

import argparse
import statistics
import time
import types

import torch

from splash.attention import mla
from splash.models import ffn, norm
from splash.models.config import model_config_from_dict
from splash.models.rope import Rope, rotate
from splash.models.weights import MLPWeights, MoEWeights, attention_from_full, expected_shapes
from splash.native import ops, packed

MODEL = dict(model_type="deepseek_v3", vocab_size=1024, hidden_size=256, intermediate_size=512, num_hidden_layers=1,
             num_attention_heads=8, kv_lora_rank=128, q_lora_rank=192, qk_rope_head_dim=32, qk_nope_head_dim=32,
             v_head_dim=32, rope_interleave=True)


def cases(n: int = 32) -> dict:
    cfg = model_config_from_dict(MODEL)
    g = torch.Generator().manual_seed(1)
    r = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    sd = {k: r(*s) * 0.2 if len(s) == 2 else torch.rand(s, generator=g) + 0.5
          for k, s in sorted(expected_shapes(cfg).items())}
    w = attention_from_full(cfg, sd.__getitem__, "model.layers.0.self_attn.", range(8))   # packed where it runs
    rope, x = Rope(cfg), r(n, 256)
    cos, sin = rope.cos_sin(torch.arange(n) + 40)
    E, inter = 16, 128
    mcfg = types.SimpleNamespace(n_group=4, topk_group=2, num_experts_per_tok=4, norm_topk_prob=True,
                                 routed_scaling_factor=2.5, n_routed_experts=E)
    shared = MLPWeights(gate=None, up=None, down=packed.pack_linear(r(256, inter)),
                        gate_up=packed.pack_linear(r(2 * inter, 256)))
    mw = MoEWeights(router=r(E, 256), bias=r(E) * 0.1, gate_up=packed.pack_experts(r(E, 2 * inter, 256)),
                    down=packed.pack_experts(r(E, 256, inter)), shared=shared)
    idx, wt = ffn.route(mcfg, mw, x)
    counts, tok, ws = ffn.sort_rows(idx, wt, E)
    h, ol, qa, q_pe, nw = r(n, 2 * inter), r(n, 8, 128), r(n, 192), r(n, 8, 32), torch.rand(256, generator=g)
    lm, stack = r(1024, 256), r(E, 2 * inter, 256)   # the LM head; the experts' gate_up
    lm_p, stack_p, rows = packed.pack_linear(lm.clone()), packed.pack_experts(stack.clone()), x.repeat(4, 1)
    offs = counts.cumsum(0).to(torch.int32)
    return {
        "rms_norm": lambda: norm.rms_norm(x, nw, 1e-6),
        "rope": lambda: rotate(q_pe, cos, sin, rope.interleave),
        "swiglu": lambda: ffn._swiglu(h, inter, None),
        "moe_route": lambda: ffn.route(mcfg, mw, x),
        "moe_sort": lambda: ffn.sort_rows(idx, wt, E),
        "absorb_rope": lambda: mla._absorb(cfg, rope, w, qa, cos, sin),
        "uv_heads": lambda: mla.out_projection(w, ol),
        "mla_project": lambda: mla.query_and_latent(cfg, rope, w, x, cos, sin),
        "linear_packed": (lambda: packed.packed_linear(x, lm_p), lambda: x @ lm.T),
        "grouped_gemm": (lambda: ffn.grouped_linear(rows, stack_p, counts),
                         lambda: torch._grouped_mm(rows, stack.transpose(1, 2), offs=offs)),
        "moe_experts": lambda: ffn.moe(mcfg, mw, x),
        "mlp_packed": lambda: ffn.mlp(shared, x),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("names", nargs="*")
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--rows", type=int, default=32, help="rows of every call (1: one sequence's decode step)")
    args = ap.parse_args()
    torch.set_num_threads(1)
    fns = cases(args.rows)
    names = args.names or list(fns)
    res = {k: ([], []) for k in names}
    for rep in range(args.reps):
        for k in names:
            for off in ((0, 1) if rep % 2 else (1, 0)):
                fn, saved = fns[k], getattr(ops, k)
                if isinstance(fn, tuple):
                    fn = fn[off]
                elif off:
                    setattr(ops, k, lambda *a, **kw: None)
                try:
                    fn()
                    t = time.process_time()
                    for _ in range(50):
                        fn()
                    res[k][off].append((time.process_time() - t) / 50 * 1e6)
                finally:
                    setattr(ops, k, saved)
    print(f"{'route':14} {'kernel µs':>10} {'torch µs':>10} {'torch/kernel':>13}")
    for k, (on, off) in res.items():
        ratio = statistics.median(b / a for a, b in zip(on, off))
        print(f"{k:14} {statistics.median(on):10.1f} {statistics.median(off):10.1f} {ratio:13.2f}")


if __name__ == "__main__":
    main()
