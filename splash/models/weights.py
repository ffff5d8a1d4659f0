"""Per-rank weight containers for the DeepSeek-V3 family and how a rank takes its shard.

Attention projections (Q-B, KV-B, O) are held for a range of heads (all heads when replicated); KV-B is kept
split into W_UK [H, d_nope, d_c] and W_UV [H, d_v, d_c] for the absorbed MLA form. FFN/MoE weights are
TP-sharded over the group along the intermediate dimension, identically in every layout.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from splash.models.config import ModelConfig


@dataclass
class AttnWeights:
    q_a: torch.Tensor | None       # [q_lora, hidden] (None when q_lora_rank is None)
    q_a_norm: torch.Tensor | None  # [q_lora]
    q_b: torch.Tensor              # [H_l * qk_head_dim, q_lora or hidden]  (local heads)
    kv_a: torch.Tensor             # [d_c + d_r, hidden]
    kv_a_norm: torch.Tensor        # [d_c]
    w_uk: torch.Tensor             # [H_l, d_nope, d_c]
    w_uv: torch.Tensor             # [H_l, d_v, d_c]
    o: torch.Tensor                # [hidden, H_l * d_v]
    heads: range
    # [Q-A ; KV-A] stacked [q_lora + d_c + d_r, hidden] for one GEMM (q_a / kv_a are views into it when built by
    # attention_from_full); None -> built on first use (e.g. AttnWeights rebuilt by a layout switch)
    qkv_a: torch.Tensor | None = field(default=None, repr=False, compare=False)


@dataclass
class MLPWeights:
    gate: torch.Tensor  # [I_l, hidden]
    up: torch.Tensor    # [I_l, hidden]
    down: torch.Tensor  # [hidden, I_l]
    # [gate ; up] stacked [2 * I_l, hidden] for one GEMM (gate / up are views into it); None -> built on first use
    gate_up: torch.Tensor | None = field(default=None, repr=False, compare=False)


@dataclass
class MoEWeights:
    router: torch.Tensor       # [E, hidden] fp32
    bias: torch.Tensor         # [E] fp32 e_score_correction_bias
    gate_up: torch.Tensor      # [E, 2 * I_l, hidden]
    down: torch.Tensor         # [E, hidden, I_l]
    shared: MLPWeights | None


@dataclass
class LayerWeights:
    input_norm: torch.Tensor
    post_norm: torch.Tensor
    attn: AttnWeights
    ffn: MLPWeights | MoEWeights


@dataclass
class ModelWeights:
    embed: torch.Tensor    # [V, hidden]
    norm: torch.Tensor     # [hidden]
    lm_head: torch.Tensor  # [V, hidden]
    layers: list[LayerWeights]


def shard_rows(w: torch.Tensor, shard: int, shards: int) -> torch.Tensor:
    n = w.shape[0] // shards
    return w[shard * n:(shard + 1) * n].contiguous()


def shard_cols(w: torch.Tensor, shard: int, shards: int) -> torch.Tensor:
    n = w.shape[-1] // shards
    return w[..., shard * n:(shard + 1) * n].contiguous()


def attention_from_full(cfg: ModelConfig, get, prefix: str, heads: range) -> AttnWeights:
    """Build a rank's attention weights for `heads` from a tensor getter `get(name) -> full tensor`."""
    H, dn, dv, dc = cfg.num_attention_heads, cfg.qk_nope_head_dim, cfg.v_head_dim, cfg.kv_lora_rank
    qh = cfg.qk_head_dim
    h0, h1 = heads.start, heads.stop
    kv_a, qkv_a = get(prefix + "kv_a_proj_with_mqa.weight"), None
    if cfg.q_lora_rank is None:
        q_a, q_a_norm, q_b = None, None, get(prefix + "q_proj.weight")
    else:
        q_a, q_a_norm = get(prefix + "q_a_proj.weight"), get(prefix + "q_a_layernorm.weight")
        q_b = get(prefix + "q_b_proj.weight")
        if q_a.dtype == kv_a.dtype:  # one [Q-A ; KV-A] weight; the split weights are row views of it (no copy)
            qkv_a = torch.cat([q_a, kv_a], dim=0)
            q_a, kv_a = qkv_a[:q_a.shape[0]], qkv_a[q_a.shape[0]:]
    kv_b = get(prefix + "kv_b_proj.weight").view(H, dn + dv, dc)
    o = get(prefix + "o_proj.weight").view(cfg.hidden_size, H, dv)
    return AttnWeights(
        q_a=q_a, q_a_norm=q_a_norm, q_b=q_b.view(H, qh, -1)[h0:h1].reshape((h1 - h0) * qh, -1).contiguous(),
        kv_a=kv_a, kv_a_norm=get(prefix + "kv_a_layernorm.weight"),
        w_uk=kv_b[h0:h1, :dn].contiguous(), w_uv=kv_b[h0:h1, dn:].contiguous(),
        o=o[:, h0:h1].reshape(cfg.hidden_size, (h1 - h0) * dv).contiguous(), heads=heads, qkv_a=qkv_a)


def mlp_from_full(get, prefix: str, shard: int, shards: int) -> MLPWeights:
    gate = shard_rows(get(prefix + "gate_proj.weight"), shard, shards)
    gate_up = torch.cat([gate, shard_rows(get(prefix + "up_proj.weight"), shard, shards)], dim=0)
    return MLPWeights(gate=gate_up[:gate.shape[0]], up=gate_up[gate.shape[0]:],
                      down=shard_cols(get(prefix + "down_proj.weight"), shard, shards), gate_up=gate_up)


def moe_from_full(cfg: ModelConfig, get, prefix: str, shard: int, shards: int) -> MoEWeights:
    gate_up, down = [], []
    for e in range(cfg.n_routed_experts):
        m = mlp_from_full(get, f"{prefix}experts.{e}.", shard, shards)
        gate_up.append(m.gate_up)
        down.append(m.down)
    shared = mlp_from_full(get, prefix + "shared_experts.", shard, shards) if cfg.n_shared_experts else None
    return MoEWeights(router=get(prefix + "gate.weight").float(),
                      bias=get(prefix + "gate.e_score_correction_bias").float(),
                      gate_up=torch.stack(gate_up), down=torch.stack(down), shared=shared)


def expected_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor name the loader reads, with the shape config.json implies."""
    h, H, qh, dc, dr = cfg.hidden_size, cfg.num_attention_heads, cfg.qk_head_dim, cfg.kv_lora_rank, cfg.qk_rope_head_dim
    s: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (cfg.vocab_size, h), "model.norm.weight": (h,)}
    if not cfg.tie_word_embeddings:
        s["lm_head.weight"] = (cfg.vocab_size, h)
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}."
        s[p + "input_layernorm.weight"] = (h,)
        s[p + "post_attention_layernorm.weight"] = (h,)
        a = p + "self_attn."
        if cfg.q_lora_rank is None:
            s[a + "q_proj.weight"] = (H * qh, h)
        else:
            s.update({a + "q_a_proj.weight": (cfg.q_lora_rank, h), a + "q_a_layernorm.weight": (cfg.q_lora_rank,),
                      a + "q_b_proj.weight": (H * qh, cfg.q_lora_rank)})
        s.update({a + "kv_a_proj_with_mqa.weight": (dc + dr, h), a + "kv_a_layernorm.weight": (dc,),
                  a + "kv_b_proj.weight": (H * (cfg.qk_nope_head_dim + cfg.v_head_dim), dc),
                  a + "o_proj.weight": (h, H * cfg.v_head_dim)})
        s.update(_ffn_shapes(cfg, i, p + "mlp."))
    return s


def _ffn_shapes(cfg: ModelConfig, layer: int, p: str) -> dict[str, tuple[int, ...]]:
    h = cfg.hidden_size

    def mlp(prefix: str, inter: int) -> dict[str, tuple[int, ...]]:
        return {prefix + "gate_proj.weight": (inter, h), prefix + "up_proj.weight": (inter, h),
                prefix + "down_proj.weight": (h, inter)}

    if not cfg.is_moe_layer(layer):
        return mlp(p, cfg.intermediate_size)
    s = {p + "gate.weight": (cfg.n_routed_experts, h), p + "gate.e_score_correction_bias": (cfg.n_routed_experts,)}
    for e in range(cfg.n_routed_experts):
        s.update(mlp(f"{p}experts.{e}.", cfg.moe_intermediate_size))
    if cfg.n_shared_experts:
        s.update(mlp(p + "shared_experts.", cfg.moe_intermediate_size * cfg.n_shared_experts))
    return s
