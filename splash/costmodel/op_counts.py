"""Eager ops per layer and stage that the cost model charges the per-op host overhead for, counted from the code.

`EAGER`: the torch paths (splash/attention/mla.py, the executors, splash/models/ffn.py), keyed by `Layout` where each
layout's executor runs its own ops. `FUSED` (the profile's `fused_kernels`; off in the shipped cpu profile, where it
predicted no better, docs/benchmarks.md): where SPLASH's CPU kernels run, each layout's MLA projections, W_UV, a MoE
layer's four steps and a dense MLP are one call each; stages the kernels do not change keep the eager count. No torch.
"""
from __future__ import annotations

from splash.layouts.layout import Layout

EAGER = {
    "qkv_a": {Layout.TP: 12, Layout.DP_ATTN: 15, Layout.CP: 14, Layout.DOP: 17},
    "uv_o": {Layout.TP: 7, Layout.DP_ATTN: 7, Layout.CP: 7, Layout.DOP: 9},
    "exchange": {Layout.TP: 1, Layout.DP_ATTN: 4, Layout.CP: 12, Layout.DOP: 14},
    "q_b_absorb": 16, "attention": 22, "ffn_dense": 6, "moe_fixed": 40, "moe_per_expert": 2, "other": 20,
    "indexer": 12,
}

FUSED = {**EAGER,  # qkv_a: Q-B and the absorb are in the same call
         "qkv_a": {Layout.TP: 5, Layout.DP_ATTN: 8, Layout.CP: 8, Layout.DOP: 11},
         "uv_o": {Layout.TP: 4, Layout.DP_ATTN: 4, Layout.CP: 4, Layout.DOP: 6},
         "q_b_absorb": 0, "ffn_dense": 2, "moe_fixed": 14, "moe_per_expert": 0}


def ops(fused: bool, stage: str, layout: Layout | None = None) -> int:
    """The ops of `stage` (under `layout` where they differ by layout), for the fused kernels or the eager path."""
    n = (FUSED if fused else EAGER)[stage]
    return n[layout] if isinstance(n, dict) else n
