"""The DCU scenario of the paper's App. B.1: the longest nominal input at which B requests fit a per-rank budget,
per layout. Pure, no torch.

What the summary states: B = 16, T = 8, "52.8 GiB per rank for attention weights and latent KV, and a separate
1 GiB transient reserve"; the figure models GLM-5.3-Flash INT8 on BW1000. The KV dtype is not stated.

The accounting (docs/benchmarks.md, "DCU rows"): the 52.8 GiB holds everything a rank keeps resident
(``resident_fixed_bytes``) — the INT8 model as splash.layouts.memory counts it (FFN/MoE sharded over the group,
embeddings, norms, and the attention projections of all layers, MLA and KDA, sharded in TP/DOP and replicated in
DP-attn/CP), the BF16 W_UK / W_UV copies of KV-B the SGLang deployment keeps (splash.sim.storage), and the 1 GiB
transient reserve — and the rest is latent KV of the MLA layers in BF16 (BW1000 has no FP8 units, configs/hardware/
bw1000.yaml). A rank holds B tokens per input token in TP (a replicated latent) and ⌈B / T⌉ in the other three.
The summary's words name only attention weights and KV in the budget; read that way (the MLA projections and FP8
KV alone) the limits come out 7-15x the paper's, and no reading of those words comes within 25% (1,024 such
accountings, docs/benchmarks.md). Nothing here is fitted to the four limits.

The request-owned layouts (DP-attn, DOP) still come out ~17% above the paper's: ``owner_factor`` and
``implied_fixed_bytes`` below test what that needs.
"""
from __future__ import annotations

from splash.layouts.layout import KV_ALL, kv_ownership_of, parse_layout
from splash.layouts.memory import common_bytes, kv_block_bytes, projection_bytes_per_rank
from splash.sim.paper_data import SCENARIO
from splash.sim.storage import absorb_copy_bytes

GIB = float(1 << 30)
SCENARIO_KV_DTYPE = "bfloat16"   # BW1000 has no FP8 (configs/hardware/bw1000.yaml); the summary names no KV dtype


def kv_tokens_per_input_token(layout: str, batch: int, world: int) -> int:
    """KV tokens one rank holds per input token of each of ``batch`` balanced requests."""
    return batch if kv_ownership_of(layout) == KV_ALL else -(-batch // world)


def resident_fixed_bytes(model, layout: str, world: int = SCENARIO["world"],
                         reserve_gib: float = SCENARIO["reserve_gib"]) -> float:
    """Bytes a rank keeps besides KV in ``layout``: the whole stored model (attention projections of every layer
    sharded or replicated by layout), SGLang's BF16 W_UK / W_UV copies (placed as the projections are), and the
    transient reserve."""
    from splash.sim.serving import stored_weights
    elem, quant = stored_weights(model.weight_dtype)
    absorb = absorb_copy_bytes(model.cfg) * model.cfg.num_hidden_layers
    return (common_bytes(model.full, world, elem, quant)
            + projection_bytes_per_rank(model.full, layout, world, elem, quant)
            + (absorb / world if parse_layout(layout).shards_projections else absorb)
            + reserve_gib * GIB)


def scenario_limit(model, layout: str, batch: int = SCENARIO["batch"], world: int = SCENARIO["world"],
                   budget_gib: float = SCENARIO["budget_gib"], kv_dtype: str = SCENARIO_KV_DTYPE) -> float:
    """Longest nominal input (tokens) of ``batch`` balanced requests under the budget in ``layout`` (0 if none
    fits)."""
    room = budget_gib * GIB - resident_fixed_bytes(model, layout, world)
    per_token = kv_block_bytes(model.cfg, kv_dtype, 1)
    return max(0.0, room / (per_token * kv_tokens_per_input_token(layout, batch, world)))


# ---- readings of the scenario tested against the paper's four limits (docs/benchmarks.md) ----
def owner_factor(lengths: list[float], world: int) -> float:
    """How much more the fullest owner holds than the mean rank when requests of ``lengths`` are placed on owners
    round-robin (request j on owner j % world): a request-owned layout (DP-attn, DOP) is bound by its fullest
    owner, TP and CP (every rank a copy or a position share of every request) by the mean. 1 for equal lengths."""
    if not lengths or world < 1:
        raise ValueError(f"need requests and a positive world, got {len(lengths)} requests, world {world}")
    per_owner = [0.0] * world
    for j, n in enumerate(lengths):
        per_owner[j % world] += n
    return max(per_owner) / (sum(lengths) / world)


def sampled_owner_factor(batch: int, world: int, spread: float, samples: int = 4000, seed: int = 0) -> float:
    """Mean ``owner_factor`` of ``batch`` request lengths drawn uniformly within ±``spread`` of the nominal one
    (the "sampled nominal-input" reading of App. B.1; the summary gives no distribution)."""
    import random
    if not 0.0 <= spread < 1.0:
        raise ValueError(f"spread must be in [0, 1), got {spread}")
    rng = random.Random(seed)
    return sum(owner_factor([1.0 + spread * (2.0 * rng.random() - 1.0) for _ in range(batch)], world)
               for _ in range(samples)) / samples


def implied_fixed_bytes(limits: dict[str, float], per_token_bytes: float, budget_bytes: float,
                        owner: float = 1.0, batch: int = SCENARIO["batch"],
                        world: int = SCENARIO["world"]) -> dict[str, float]:
    """What a rank must hold besides KV, per layout, for ``limits`` (layout -> nominal input) to fill
    ``budget_bytes`` at ``per_token_bytes`` of KV a token, request-owned layouts holding ``owner`` × their
    balanced share (``owner_factor``)."""
    out = {}
    for lay, n in limits.items():
        k = kv_tokens_per_input_token(lay, batch, world) * (owner if parse_layout(lay).owner_based else 1.0)
        out[lay] = budget_bytes - k * n * per_token_bytes
    return out
