"""The DCU scenario of the paper's App. B.1: the longest nominal input at which B requests fit a per-rank budget
for attention weights and latent KV, per layout. Pure, no torch.

What the summary states: B = 16, T = 8, 52.8 GiB per rank for attention weights + latent KV, a separate 1 GiB
transient reserve (outside that budget). What splash-sim adds, from the ownership model: the MLA projections
(Q-B, KV-B, O) are sharded in TP/DOP and replicated in DP-attn/CP (splash.layouts.memory), the latent KV of a
request is replicated in TP, on its owner in DP-attn/DOP and position-sharded in CP, so a rank holds B tokens per
input token in TP and ⌈B / T⌉ in the other three; KV bytes per token are the model's own (its KV dtype).

No accounting of that kind reproduces the paper's four limits, whatever the bytes: ``fingerprint`` computes what
four limits say about the accounting behind them, and for any ownership accounting (one per-token size, weights
equal in TP and DOP and equal in DP-attn and CP) TP's limit is DOP's × ⌈B/T⌉/B and CP's equals DP-attn's.
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


def fingerprint(limits: dict[str, float], batch: int = SCENARIO["batch"],
                world: int = SCENARIO["world"]) -> dict[str, float]:
    """What four nominal-input limits (layout -> tokens) say about the per-rank accounting behind them, whatever
    its bytes. Write a layout's budget as fixed(layout) + k(layout) × limit × b(layout), with k the KV tokens a
    rank holds per input token (``kv_tokens_per_input_token``) and b the bytes of one request-token:

    - ``tp_vs_dop``: b(TP) / b(DOP) when TP and DOP hold the same weights (both shard the projections). 1 in
      every ownership accounting;
    - ``cp_vs_dp``: b(CP) / b(DP-attn) when CP and DP-attn hold the same weights (both replicate them). 1 in every
      ownership accounting;
    - ``gap_tokens``: what DP-attn's replicas take beyond DOP's shards, in request-tokens (b(DOP) = b(DP-attn));
    - ``replicated_share``: the share of the budget the replicated layout-dependent weights W take if the budget
      holds nothing else than them and KV (W / T in TP/DOP): from DOP = W/T + k n_dop b and DP-attn = W + k n_dp b.
    """
    k_own = kv_tokens_per_input_token("dop", batch, world)
    n = {lay: float(limits[lay]) for lay in ("tp", "dp_attn", "cp", "dop")}
    gap = n["dop"] - n["dp_attn"]
    if gap <= 0:
        raise ValueError(f"DOP's limit ({n['dop']}) must exceed DP-attn's ({n['dp_attn']}): DOP shards what "
                         "DP-attn replicates")
    return {
        "tp_vs_dop": k_own * n["dop"] / (kv_tokens_per_input_token("tp", batch, world) * n["tp"]),
        "cp_vs_dp": n["dp_attn"] / n["cp"],
        "gap_tokens": k_own * gap,
        "replicated_share": world / (1.0 + (world - 1) * n["dop"] / gap),
    }
