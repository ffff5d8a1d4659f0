"""Eager ops per layer and stage that the cost model charges the per-op host overhead for, counted from the code.

`EAGER`: the torch paths (splash/attention/mla.py, the executors, splash/models/ffn.py). `FUSED` (the profile's
`fused_kernels`; off in the shipped cpu profile, where it predicted no better, docs/benchmarks.md): where SPLASH's
CPU kernels run, each layout's MLA projections, W_UV, a MoE layer's four steps and a dense MLP are one call each;
stages the kernels do not change keep the eager count. Pure Python, no torch.
"""
from __future__ import annotations

EAGER = {
    "qkv_a": {"tp": 12, "dp_attn": 15, "cp": 14, "dop": 17},
    "q_b_absorb": {"tp": 16, "dp_attn": 16, "cp": 16, "dop": 16},
    "attention": {"tp": 22, "dp_attn": 22, "cp": 22, "dop": 22},
    "uv_o": {"tp": 7, "dp_attn": 7, "cp": 7, "dop": 9},
    "exchange": {"tp": 1, "dp_attn": 4, "cp": 12, "dop": 14},
    "ffn_dense": 6, "moe_fixed": 40, "moe_per_expert": 2, "other": 20, "indexer": 12,
}

FUSED = {**EAGER,
         "qkv_a": {"tp": 5, "dp_attn": 8, "cp": 8, "dop": 11},   # Q-B and the absorb are in the same call
         "q_b_absorb": {"tp": 0, "dp_attn": 0, "cp": 0, "dop": 0},
         "uv_o": {"tp": 4, "dp_attn": 4, "cp": 4, "dop": 6},
         "ffn_dense": 2, "moe_fixed": 14, "moe_per_expert": 0}


def ops(fused: bool, stage: str, layout: str | None = None) -> int:
    """The ops of `stage` (per layout where they differ), for the fused kernels or the eager path."""
    n = (FUSED if fused else EAGER)[stage]
    return n[layout] if isinstance(n, dict) else n
