"""What one rank builds of a model before it serves (`RankModel`, handed to the runner whole): the dense families
here, a hybrid family by splash.engine.hybrid_setup; either takes this rank's heads and KV dtype from a `LayoutState`.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from splash.attention.context import LayoutState
from splash.kv.paged_cache import PagedLatentCache
from splash.models.build import build_weights, on_device
from splash.models.config import ModelConfig
from splash.models.family import ModelFamily
from splash.models.deepseek import DeepseekV3Model


@dataclass(frozen=True)
class RankModel:
    weights: Any                 # ModelWeights / HybridWeights of this rank
    model: Any                   # the step model: forward(batch, executor, before_layer), logits(hidden), rope
    cache: PagedLatentCache      # one pool layer per KV-holding model layer
    weight_quant: str | None     # "fp8"/"int8": attention projections stored quantised; None: plain
    states: Any = None           # splash.kv.recurrent.RecurrentStates (hybrid), else None


def rank_weights(cfg: ModelConfig, family: ModelFamily, get, comm, state: LayoutState, device: torch.device):
    """This rank's weights in `state`'s layout: its attention heads (a hybrid's linear heads too), its FFN slice."""
    get = on_device(get, device)   # each tensor moves to the device as it is read
    if family.recurrent:
        from splash.models.glm5_next import build_hybrid_weights
        return build_hybrid_weights(cfg, get, state.heads, state.linear_heads, comm.rank, comm.size)
    return build_weights(cfg, get, state.heads, comm.rank, comm.size)


def build_dense(cfg: ModelConfig, family: ModelFamily, get, comm, state: LayoutState, num_blocks: int,
                block_size: int, device: torch.device, rope_fp8: bool = False) -> RankModel:
    """A dense-attention family (every layer MLA, with or without a DSA indexer) on this rank; `rope_fp8`: an fp8 pool
    stores the rope key in e4m3 too (splash.attention.kernels.kv_rope_fp8)."""
    weights = rank_weights(cfg, family, get, comm, state, device)
    q_b = weights.layers[0].attn.q_b if weights.layers else None
    indexed = [i for i in range(cfg.num_hidden_layers) if cfg.has_indexer(i)]
    cache = PagedLatentCache(family.num_pool_layers, num_blocks, block_size, cfg.kv_lora_rank, cfg.qk_rope_head_dim,
                             state.kv_dtype, index_dim=cfg.index_head_dim, index_layers=indexed, device=device,
                             rope_fp8=rope_fp8)
    return RankModel(weights, DeepseekV3Model(cfg, weights, comm, device), cache, getattr(q_b, "fmt", None))
