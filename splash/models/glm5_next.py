"""GLM-5.3-Flash (``glm5_next`` text model): weights of one rank and the forward pass over one step batch.

Layers alternate KDA linear attention (splash.models.kda) and NoPE MLA with the KPool DSA indexer
(splash.models.kpool); every block sits inside mHC residual streams: the hidden state of a token is
``hc_mult`` streams; before a block they are collapsed with weights ``pre``, the block's output is expanded with
``post`` and added to the streams mixed by a doubly-stochastic ``comb`` (Sinkhorn). All of that is per token
and common state (replicated), so only the attention block depends on the layout (splash.attention.hybrid).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from splash.models.build import check_ffn_shardable, ffn_from_full, model_weights
from splash.models.config import ModelConfig
from splash.models.deepseek import DeepseekV3Model
from splash.models.kda import KDAWeights, kda_from_full
from splash.models.kpool import IndexerWeights, indexer_from_full
from splash.models.norm import rms_norm
from splash.models.weights import AttnWeights, MLPWeights, ModelWeights, MoEWeights, attention_from_full

if TYPE_CHECKING:   # the engine hands the model a batch; the model never builds one
    from splash.attention.batch import StepBatch


@dataclass
class HyperWeights:
    fn: torch.Tensor     # [(2 + N) N, N · hidden] fp32
    base: torch.Tensor   # [(2 + N) N] fp32
    scale: torch.Tensor  # [3] fp32


@dataclass
class HybridLayerWeights:
    input_norm: torch.Tensor
    post_norm: torch.Tensor
    attn: AttnWeights | KDAWeights            # head-shardable part (layout-dependent)
    ffn: MLPWeights | MoEWeights
    hc_attn: HyperWeights
    hc_ffn: HyperWeights
    indexer: IndexerWeights | None = None     # full indexer layers only


def text_prefix(get) -> str:
    """Disk prefix of the text model: ``model.language_model.`` (Glm5NextForConditionalGeneration) or ``model.``."""
    try:
        get("model.language_model.norm.weight")
        return "model.language_model."
    except (KeyError, ValueError):
        return "model."


def build_hybrid_weights(cfg: ModelConfig, get, heads: range, linear_heads: range, shard: int,
                         shards: int) -> ModelWeights:
    """One rank's weights: MLA projections for `heads`, KDA projections for `linear_heads`, FFN slice `shard`.
    Quantised (FP8/INT8) weights stay in stored form (splash.models.qweight.quantized_at_load says which)."""
    check_ffn_shardable(cfg, shards)
    hy, pre = cfg.hybrid, text_prefix(get)
    layers = []
    for i in range(cfg.num_hidden_layers):
        p = f"{pre}layers.{i}."
        a = p + "self_attn."
        if cfg.is_linear_layer(i):
            attn, idx = kda_from_full(get, a, linear_heads, hy.linear_head_dim), None
        else:
            attn = attention_from_full(cfg, get, a, heads)
            idx = indexer_from_full(get, a) if hy.indexer_types[i] == "full" else None
        f = ffn_from_full(cfg, get, p + "mlp.", i, shard, shards)
        hc = [HyperWeights(get(p + f"hc_{k}_fn").float(), get(p + f"hc_{k}_base").float(),
                           get(p + f"hc_{k}_scale").float()) for k in ("attn", "ffn")]
        layers.append(HybridLayerWeights(get(p + "input_layernorm.weight"), get(p + "post_attention_layernorm.weight"),
                                         attn, f, hc[0], hc[1], idx))
    return model_weights(cfg, get, pre, layers)


def hyper_weights(cfg: ModelConfig, w: HyperWeights, streams: torch.Tensor):
    """mHC routing of streams [n, N, hidden] -> (post [n, N], comb [n, N, N], collapsed block input [n, hidden])."""
    hy, n = cfg.hybrid, streams.shape[0]
    N = hy.hc_mult
    flat = streams.reshape(n, -1).float()
    flat = flat * torch.rsqrt(flat.square().mean(-1, keepdim=True) + cfg.rms_norm_eps)
    mixed = F.linear(flat, w.fn)
    pre_w, post_w, comb_w = mixed.split([N, N, N * N], dim=-1)
    pre_b, post_b, comb_b = w.base.split([N, N, N * N])
    pre = torch.sigmoid(pre_w * w.scale[0] + pre_b) + hy.hc_eps
    post = 2 * torch.sigmoid(post_w * w.scale[1] + post_b)
    comb = torch.softmax(comb_w.view(n, N, N) * w.scale[2] + comb_b.view(N, N), dim=-1) + hy.hc_eps
    comb = comb / (comb.sum(dim=-2, keepdim=True) + hy.hc_eps)
    for _ in range(hy.hc_sinkhorn_iters - 1):
        comb = comb / (comb.sum(dim=-1, keepdim=True) + hy.hc_eps)
        comb = comb / (comb.sum(dim=-2, keepdim=True) + hy.hc_eps)
    collapsed = (pre.unsqueeze(-1) * streams).sum(dim=1).to(streams.dtype)
    return post, comb, collapsed


def hyper_merge(post: torch.Tensor, comb: torch.Tensor, out: torch.Tensor, streams: torch.Tensor) -> torch.Tensor:
    """New streams: post ⊗ block output + combᵀ · old streams."""
    dt = streams.dtype
    return post.to(dt).unsqueeze(-1) * out.unsqueeze(-2) + torch.matmul(comb.to(dt).transpose(-1, -2), streams)


class Glm5NextModel(DeepseekV3Model):
    def __init__(self, cfg: ModelConfig, weights: ModelWeights, comm):   # layers: HybridLayerWeights
        super().__init__(cfg, weights, comm)   # NoPE (qk_rope_head_dim 0): the rope's cos / sin are [n, 0]
        self.swiglu_limit = cfg.hybrid.swiglu_limit

    def forward(self, batch: StepBatch, attn, before_layer=None) -> torch.Tensor:
        """Every layer over the step's rows; -> final-normed hidden states of `batch.sample_rows` [S, hidden]."""
        cfg = self.cfg
        x = self.w.embed[batch.token_ids]
        streams = x.unsqueeze(1).expand(-1, cfg.hybrid.hc_mult, -1).contiguous()
        cos, sin = self.rope.cos_sin(batch.positions)
        for i, lw in enumerate(self.w.layers):
            if before_layer is not None:
                before_layer(i)
            post, comb, h = hyper_weights(cfg, lw.hc_attn, streams)
            out = attn.attention(i, rms_norm(h, lw.input_norm, cfg.rms_norm_eps), cos, sin)
            streams = hyper_merge(post, comb, out, streams)
            post, comb, h = hyper_weights(cfg, lw.hc_ffn, streams)
            streams = hyper_merge(post, comb, self._ffn(i, rms_norm(h, lw.post_norm, cfg.rms_norm_eps)), streams)
        rows = torch.tensor(batch.sample_rows, dtype=torch.long, device=x.device)
        return rms_norm(streams[rows].mean(dim=1), self.w.norm, cfg.rms_norm_eps)
