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


def ffn_from_full(cfg: ModelConfig, get: Getter, prefix: str, layer: int, shard: int, shards: int):
    """Layer `layer`'s MLP or MoE (`prefix` its ``mlp.``), FFN slice `shard` of `shards`."""
    if cfg.is_moe_layer(layer):
        return moe_from_full(cfg, get, prefix, shard, shards)
    return mlp_from_full(get, prefix, shard, shards)


def model_weights(cfg: ModelConfig, get: Getter, prefix: str, layers: list) -> ModelWeights:
    """`layers` with the embedding and final norm under `prefix` (``model.``) and the LM head."""
    embed = get(prefix + "embed_tokens.weight")
    lm_head = embed if cfg.tie_word_embeddings else pack_linear(get("lm_head.weight"))
    return ModelWeights(embed=embed, norm=get(prefix + "norm.weight"), lm_head=lm_head, layers=layers)


def build_weights(cfg: ModelConfig, get: Getter, heads: range, shard: int, shards: int) -> ModelWeights:
    """Weights for one rank: attention projections for `heads`, FFN slice `shard` of `shards`."""
    check_ffn_shardable(cfg, shards)
    layers = []
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}."
        idx = (load_indexer(get, p + "self_attn.indexer.", cfg.index_n_heads, cfg.index_head_dim,
                            cfg.qk_rope_head_dim, cfg.index_rope_interleave) if cfg.has_indexer(i) else None)
        layers.append(LayerWeights(input_norm=get(p + "input_layernorm.weight"),
                                   post_norm=get(p + "post_attention_layernorm.weight"),
                                   attn=attention_from_full(cfg, get, p + "self_attn.", heads),
                                   ffn=ffn_from_full(cfg, get, p + "mlp.", i, shard, shards), indexer=idx))
    return model_weights(cfg, get, "model.", layers)
