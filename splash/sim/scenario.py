"""The DCU scenario of the paper's App. B.1: the longest nominal input at which B requests fit a per-rank budget
for attention weights and latent KV, per layout. Pure, no torch.

What the summary states: B = 16, T = 8, 52.8 GiB per rank for attention weights + latent KV, a separate 1 GiB
transient reserve (outside that budget). What splash-sim adds, from the ownership model: the MLA projections
(Q-B, KV-B, O) are sharded in TP/DOP and replicated in DP-attn/CP (splash.layouts.memory), the latent KV of a
request is replicated in TP, on its owner in DP-attn/DOP and position-sharded in CP, so a rank holds B tokens per
input token in TP and ⌈B / T⌉ in the other three; KV bytes per token are the model's own (its KV dtype).

No accounting of that kind reproduces the paper's four limits, whatever the bytes (docs/benchmarks.md; the
``fingerprint`` of tests/test_sim_mechanisms.py): in any ownership accounting TP's limit is DOP's × ⌈B/T⌉/B and
CP's equals DP-attn's.
"""
from __future__ import annotations

from splash.layouts.layout import KV_ALL, kv_ownership_of
from splash.layouts.memory import kv_bytes_per_token_layer, projection_bytes_per_rank
from splash.sim.paper_data import SCENARIO

GIB = float(1 << 30)


def kv_tokens_per_input_token(layout: str, batch: int, world: int) -> int:
    """KV tokens one rank holds per input token of each of ``batch`` balanced requests."""
    return batch if kv_ownership_of(layout) == KV_ALL else -(-batch // world)


def scenario_limit(model, layout: str, batch: int = SCENARIO["batch"], world: int = SCENARIO["world"],
                   budget_gib: float = SCENARIO["budget_gib"]) -> float:
    """Longest nominal input (tokens) of ``batch`` requests under the budget in ``layout`` (0 if none fits)."""
    from splash.sim.serving import stored_weights
    cfg = model.cfg
    elem, quant = stored_weights(model.weight_dtype)
    weights = projection_bytes_per_rank(cfg, layout, world, elem, quant)
    room = budget_gib * GIB - weights
    per_token = kv_bytes_per_token_layer(cfg, model.kv_dtype) * cfg.num_hidden_layers
    return max(0.0, room / (per_token * kv_tokens_per_input_token(layout, batch, world)))
