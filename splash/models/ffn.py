"""Dense MLP and DeepSeek MoE (sigmoid scores, e_score_correction_bias, group-limited top-k), TP-sharded.

Each rank holds a slice of every expert's intermediate dimension, so a rank's output is a partial sum; the
caller all-reduces it (FFN/MoE parallelism is independent of the attention layout)."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from splash.models.config import ModelConfig
from splash.models.linear import grouped_linear, linear
from splash.models.weights import MLPWeights, MoEWeights
from splash.native import fast_path


@fast_path("swiglu")
def _swiglu(h: torch.Tensor, inter: int, limit: float | None) -> torch.Tensor:
    """silu(gate) * up of a [gate | up] row block; `limit` (GLM-5.3-Flash swiglu_limit) clamps gate from above
    and up to [-limit, limit] first."""
    gate, up = h[:, :inter], h[:, inter:]
    if limit is not None:
        gate, up = gate.clamp(max=limit), up.clamp(-limit, limit)
    return F.silu(gate).mul_(up)


@fast_path("mlp_packed")
def mlp(w: MLPWeights, x: torch.Tensor, limit: float | None = None) -> torch.Tensor:
    """silu(x Gᵀ) * (x Uᵀ) then Dᵀ, with gate and up as one GEMM on [G ; U]."""
    inter = w.gate.shape[0] if w.gate is not None else w.gate_up.shape[0] // 2   # None: packed (splash.native.packed)
    h = linear(x, w.gate_up)
    return linear(_swiglu(h, inter, limit), w.down)


def route(cfg: ModelConfig, w: MoEWeights, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """-> (top-k expert ids [n, k], weights [n, k]) exactly as DeepSeek-V3 routes."""
    scores = (x.float() @ w.router.T).sigmoid()
    return _select(scores, w.bias, cfg.n_group, cfg.topk_group, cfg.num_experts_per_tok, cfg.norm_topk_prob,
                   cfg.routed_scaling_factor)


@fast_path("moe_route")
def _select(scores: torch.Tensor, bias: torch.Tensor, g: int, topk_group: int, k: int, norm: bool,
            scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Sigmoid scores [n, E] -> group-limited top-k (ids, weights)."""
    choice = scores + bias
    n, E = choice.shape
    group_scores = choice.view(n, g, E // g).topk(min(2, E // g), dim=-1)[0].sum(-1)
    group_idx = group_scores.topk(topk_group, dim=-1, sorted=False)[1]
    group_mask = torch.zeros_like(group_scores).scatter_(1, group_idx, 1.0)
    mask = group_mask[:, :, None].expand(n, g, E // g).reshape(n, E).bool()
    idx = choice.masked_fill(~mask, float("-inf")).topk(k, dim=-1, sorted=False)[1]
    weights = scores.gather(1, idx)
    if norm:
        weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
    return idx, weights * scale


@fast_path("moe_sort")
def sort_rows(idx: torch.Tensor, weights: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, ...]:
    """(rows per expert, token of each row sorted by expert — tokens ascending within one —, its weight)."""
    flat = idx.reshape(-1)
    order = flat.argsort(stable=True)
    counts = torch.bincount(flat, minlength=num_experts)
    return counts, order // idx.shape[1], weights.reshape(-1).index_select(0, order)


@fast_path("moe_experts")
def _routed(x: torch.Tensor, w: MoEWeights, counts: torch.Tensor, tok: torch.Tensor, wsort: torch.Tensor,
            limit: float | None) -> torch.Tensor:
    """The routed experts call by call: gather, two grouped GEMMs, SwiGLU, the weighted sum back per token."""
    act = _swiglu(grouped_linear(x.index_select(0, tok), w.gate_up, counts), w.down.shape[-1], limit)
    ys = grouped_linear(act, w.down, counts)
    ys.mul_(wsort[:, None].to(ys.dtype))
    return torch.zeros_like(x).index_add_(0, tok, ys)


def moe(cfg: ModelConfig, w: MoEWeights, x: torch.Tensor, limit: float | None = None) -> torch.Tensor:
    """Token rows are sorted by expert once; the experts' two GEMMs each run as one grouped call over the sorted
    rows (`grouped_linear`: experts without rows skipped), the activation runs once over all rows, and one
    weighted scatter (index_add) sums the results back per token."""
    counts, tok, wsort = sort_rows(*route(cfg, w, x), cfg.n_routed_experts)
    out = _routed(x, w, counts, tok, wsort, limit)
    if w.shared is not None:
        out = out + mlp(w.shared, x, limit)
    return out
