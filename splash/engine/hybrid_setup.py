"""Build one rank of a hybrid (glm5_next) model: weights, MLA + indexer pools, per-request KDA state.

Only MLA layers own paged KV (NoPE: no rope key; layers with a full indexer also keep the KPool vectors, indexer key
+ pool gate logits, ``index_parts`` = 2); KDA layers keep per-request state (splash.kv.recurrent).
"""
from __future__ import annotations

from splash.attention.context import LayoutState
from splash.engine.rank_model import RankModel, rank_weights
from splash.kv.paged_cache import PagedLatentCache
from splash.kv.recurrent import RecurrentStates
from splash.models.family import ModelFamily
from splash.models.glm5_next import Glm5NextModel
from splash.models.kda import state_width


def build_hybrid(cfg, family: ModelFamily, get, comm, state: LayoutState, num_blocks: int, block_size: int,
                 device, rope_fp8: bool = False) -> RankModel:
    """(`rope_fp8` is moot: the hybrid's MLA layers are NoPE, their pool holds no rope key.)"""
    hy = cfg.hybrid
    weights = rank_weights(cfg, family, get, comm, state, device)
    mla = [lw.attn for i, lw in enumerate(weights.layers) if not cfg.is_linear_layer(i)]
    weight_quant = getattr(mla[0].q_b, "fmt", None) if mla else None  # "fp8"/"int8": stored quantised
    indexed = [j for layer, j in family.pool_layers.items() if hy.indexer_types[layer] == "full"]
    cache = PagedLatentCache(family.num_pool_layers, num_blocks, block_size, cfg.kv_lora_rank, 0, state.kv_dtype,
                             device=device, index_dim=cfg.index_head_dim, index_layers=indexed, index_parts=2)
    states = RecurrentStates(len(family.state_rows), state_width(hy.linear_head_dim, hy.linear_conv_kernel_dim), device)
    return RankModel(weights, Glm5NextModel(cfg, weights, comm), cache, weight_quant, states)
