"""Build one rank of a hybrid (glm5_next) model: weights, MLA + indexer pools, per-request KDA state.

Only MLA layers own paged KV: one pool layer per MLA layer (``mla_index`` maps a model layer to it) holding the
latent (no rope key: NoPE) and, in layers with a full indexer, the KPool vectors per token (indexer key + pool
gate logits, ``index_parts`` = 2), all in the layout's KV dtype form (FP8/INT8 + an fp32 scale per 128 under a
quantised KV dtype, as DSA's indexer keys); KDA layers keep per-request state (``linear_index`` maps a model
layer to its row in splash.kv.recurrent.RecurrentStates).
"""
from __future__ import annotations

from splash.attention.context import LayoutState
from splash.engine.rank_model import RankModel
from splash.kv.paged_cache import PagedLatentCache
from splash.kv.recurrent import RecurrentStates
from splash.models.glm5_next import Glm5NextModel, build_hybrid_weights
from splash.models.kda import state_width


def layer_maps(cfg) -> tuple[dict[int, int], dict[int, int]]:
    """(model layer -> MLA pool layer, model layer -> KDA state row)."""
    mla = [i for i in range(cfg.num_hidden_layers) if not cfg.is_linear_layer(i)]
    lin = [i for i in range(cfg.num_hidden_layers) if cfg.is_linear_layer(i)]
    return {l: j for j, l in enumerate(mla)}, {l: j for j, l in enumerate(lin)}


def build_hybrid(cfg, get, comm, state: LayoutState, num_blocks: int, block_size: int, device) -> RankModel:
    hy = cfg.hybrid
    weights = build_hybrid_weights(cfg, get, state.heads, state.linear_heads, comm.rank, comm.size)
    mla = [lw.attn for i, lw in enumerate(weights.layers) if not cfg.is_linear_layer(i)]
    weight_quant = getattr(mla[0].q_b, "fmt", None) if mla else None  # "fp8"/"int8": stored quantised
    mla_index, linear_index = layer_maps(cfg)
    indexed = [j for layer, j in mla_index.items() if hy.indexer_types[layer] == "full"]
    cache = PagedLatentCache(len(mla_index), num_blocks, block_size, cfg.kv_lora_rank, 0, state.kv_dtype,
                             device=device, index_dim=cfg.index_head_dim, index_layers=indexed, index_parts=2)
    states = RecurrentStates(len(linear_index), state_width(hy.linear_head_dim, hy.linear_conv_kernel_dim), device)
    return RankModel(weights, Glm5NextModel(cfg, weights, comm), cache, weight_quant, states, mla_index, linear_index)
