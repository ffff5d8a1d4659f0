"""Exact stored weight bytes of a hybrid (``glm5_next``) model per rank — pure, no torch.

What splash.models.glm5_next / kda / kpool hold, element by element:
- every layer: two block norms (compute dtype), the mHC weights of both blocks (fp32: fn [(2+N)N, N·hidden],
  base [(2+N)N], scale [3]) and its FFN/MoE shard (as DeepSeek-V3's, splash.layouts.memory._ffn_bytes);
- an MLA layer (common): Q-A + its norm, KV-A (no rope part: NoPE) + its norm, and in a full-indexer layer the
  KPool indexer (wq_b, wk as linear weights; k_norm, its bias and weights_proj in fp32; the pool ape and gate
  in the compute dtype). Its Q-B/KV-B/O are head-sharded like DeepSeek-V3's (memory.projection_shard_bytes);
- a KDA layer: common f_a, g_a and o_norm; per head (the rank's KDA heads: a slice under TP/DOP, all of them
  under DP-attn/CP) q/k/v rows and O columns as linear weights (quantised ones carry the scale blocks their
  range touches), f_b, g_b and b_proj rows, conv taps, dt_bias and A_log in fp32. The gates f_a/f_b/g_a/g_b/b
  are dense (``qweight.KEPT_DENSE``) unless the checkpoint stores them quantised (``HybridConfig.quantized_gates``).
"""
from __future__ import annotations

from splash.layouts import memory as mem
from splash.layouts.ownership import head_range
from splash.models.config import ModelConfig

FP32 = 4


def mhc_params(cfg: ModelConfig) -> int:
    """mHC parameters of one layer (attention + FFN block), all stored in fp32."""
    n = cfg.hybrid.hc_mult
    return 2 * ((2 + n) * n * n * cfg.hidden_size + (2 + n) * n + 3)


def kda_common_params(cfg: ModelConfig) -> int:
    """A KDA layer's weights every rank holds whole: f_a, g_a [d, hidden] and o_norm [d]."""
    d = cfg.hybrid.linear_head_dim
    return 2 * d * cfg.hidden_size + d


def _gate_quant(cfg: ModelConfig, wq: str | None) -> str | None:
    """Storage of KDA's gate projections: dense unless the checkpoint stores them quantised."""
    return wq if cfg.hybrid.quantized_gates else None


def _kda_common_bytes(cfg: ModelConfig, e: float, wq: str | None) -> float:
    d, gq = cfg.hybrid.linear_head_dim, _gate_quant(cfg, wq)
    return 2 * mem.matrix_bytes(d, cfg.hidden_size, e, gq) + d * e


def _indexer_bytes(cfg: ModelConfig, e: float, wq: str | None) -> float:
    h, q_in, ih, idim = cfg.hidden_size, cfg.q_lora_rank, cfg.index_n_heads, cfg.index_head_dim
    kpool = (cfg.hybrid.index_kpool * idim + idim * h) * e
    return (mem.matrix_bytes(ih * idim, q_in, e, wq) + mem.matrix_bytes(idim, h, e, wq) + FP32 * (2 * idim + h * ih)
            + kpool)


def _mla_common_bytes(cfg: ModelConfig, e: float, wq: str | None) -> float:
    h, qa, dc = cfg.hidden_size, cfg.q_lora_rank, cfg.kv_lora_rank
    return (mem.matrix_bytes(qa, h, e, wq) + qa * e
            + mem.matrix_bytes(dc + cfg.qk_rope_head_dim, h, e, wq) + dc * e)


def hybrid_common_bytes(cfg: ModelConfig, rank: int, world: int, e: float, wq: str | None = None) -> float:
    """Exact stored bytes of the layout-independent weights on `rank` (FFN/MoE sharded over `world`)."""
    h = cfg.hidden_size
    emb = cfg.vocab_size * h * e
    total = emb + (0 if cfg.tie_word_embeddings else emb) + h * e
    kda, mla, idx = _kda_common_bytes(cfg, e, wq), _mla_common_bytes(cfg, e, wq), _indexer_bytes(cfg, e, wq)
    for i in range(cfg.num_hidden_layers):
        total += 2 * h * e + FP32 * mhc_params(cfg) + mem._ffn_bytes(cfg, i, rank, world, e, wq)
        if cfg.is_linear_layer(i):
            total += kda
        else:
            total += mla + (idx if mem.layer_has_indexer_keys(cfg, i) else 0)
    return total


def linear_shard_bytes(cfg: ModelConfig, heads: range, e: float, wq: str | None = None) -> float:
    """Stored bytes of one KDA layer's head-shardable weights for a contiguous range of KDA heads."""
    hy, h = cfg.hybrid, cfg.hidden_size
    d, n, gq = hy.linear_head_dim, len(heads), _gate_quant(cfg, wq)
    nd, r0 = n * d, heads.start * d
    gates = 2 * mem.matrix_bytes(nd, d, e, gq, row0=r0) + mem.matrix_bytes(n, h, e, gq, row0=heads.start)
    return (3 * mem.matrix_bytes(nd, h, e, wq, row0=r0) + mem.matrix_bytes(h, nd, e, wq, col0=r0) + gates
            + FP32 * (3 * nd * hy.linear_conv_kernel_dim + nd + n))


def hybrid_projection_bytes(cfg: ModelConfig, layout, world: int, rank: int, e: float,
                            wq: str | None = None) -> float:
    """`rank`'s layout-dependent weights over all layers: Q-B/KV-B/O of its MLA heads × the MLA layers plus its
    KDA heads' projections × the KDA layers."""
    n_lin = len(cfg.hybrid.linear_layers())
    mla = mem.projection_shard_bytes(cfg, head_range(cfg.num_attention_heads, world, rank, layout), e, wq)
    lin = linear_shard_bytes(cfg, head_range(cfg.hybrid.linear_num_heads, world, rank, layout), e, wq)
    return mla * (cfg.num_hidden_layers - n_lin) + lin * n_lin
