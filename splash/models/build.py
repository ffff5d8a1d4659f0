"""Assemble a rank's ModelWeights from a tensor getter (checkpoint or preset)."""
from __future__ import annotations

import dataclasses
from typing import Callable

import torch

from splash.models.config import ConfigError, ModelConfig
from splash.models.indexer import load_indexer
from splash.native.packed import pack_linear
from splash.models.qweight import QuantWeight
from splash.models.weights import (LayerWeights, ModelWeights, attention_from_full, mlp_from_full,
                                   moe_from_full)

Getter = Callable[[str], torch.Tensor]


def on_device(get: Getter, device) -> Getter:
    """`get` whose tensors (and quantised weights' data + scales) are moved to `device` as they are read, so
    sharding, stacking and quantised-weight slicing all happen there (one full tensor at a time)."""
    def moved(name: str):
        w = get(name)
        if isinstance(w, torch.Tensor):
            return w.to(device)
        if isinstance(w, QuantWeight):
            return dataclasses.replace(w, data=w.data.to(device), scale=w.scale.to(device))
        return w
    return moved


def check_ffn_shardable(cfg: ModelConfig, shards: int) -> None:
    sizes = {"intermediate_size": cfg.intermediate_size}
    if cfg.n_routed_experts:
        sizes["moe_intermediate_size"] = cfg.moe_intermediate_size
    for name, v in sizes.items():
        if v % shards:
            raise ConfigError(f"config.json: field {name!r} = {v} is not divisible by the world size {shards}")


def build_weights(cfg: ModelConfig, get: Getter, heads: range, shard: int, shards: int) -> ModelWeights:
    """Weights for one rank: attention projections for `heads`, FFN slice `shard` of `shards`."""
    check_ffn_shardable(cfg, shards)
    layers = []
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}."
        ffn = (moe_from_full(cfg, get, p + "mlp.", shard, shards) if cfg.is_moe_layer(i)
               else mlp_from_full(get, p + "mlp.", shard, shards))
        idx = (load_indexer(get, p + "self_attn.indexer.", cfg.index_n_heads, cfg.index_head_dim,
                            cfg.qk_rope_head_dim, cfg.index_rope_interleave) if cfg.has_indexer(i) else None)
        layers.append(LayerWeights(input_norm=get(p + "input_layernorm.weight"),
                                   post_norm=get(p + "post_attention_layernorm.weight"),
                                   attn=attention_from_full(cfg, get, p + "self_attn.", heads), ffn=ffn,
                                   indexer=idx))
    embed = get("model.embed_tokens.weight")
    lm_head = embed if cfg.tie_word_embeddings else pack_linear(get("lm_head.weight"))
    return ModelWeights(embed=embed, norm=get("model.norm.weight"), lm_head=lm_head, layers=layers)
