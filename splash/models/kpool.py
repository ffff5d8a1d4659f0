"""GLM-5.3-Flash's DSA indexer with KPool selection, and sparse latent attention over the selection.

Indexer keys per token (stored beside the latent KV, same slots): k = LayerNorm(x W_kᵀ) [d_I] and the pool
gate logits x W_gateᵀ [d_I]. Pool j holds positions [jP, (j+1)P) (P = index_kpool); a complete pool's key is
Σ_t softmax_t(gate_t + ape_t) · k_t (per channel). A query at position p scores each complete pool ending at or
before p: Σ_heads w_h · relu(q_h · key_j / √d_I), with q_h from Q-A (``wq_b``) and w = x W_wᵀ / √H_I, and keeps
the best ``index_topk // P`` pools; its own incomplete pool (the tail, positions p+1−((p+1) mod P) … p) is always
added. The selection depends only on the positions ≤ p, so it is the same whatever the chunking.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from splash.models.linear import linear


@dataclass
class IndexerWeights:
    wq_b: torch.Tensor      # [H_I * d_I, q_lora]
    wk: torch.Tensor        # [d_I, hidden]
    k_norm_w: torch.Tensor  # [d_I]
    k_norm_b: torch.Tensor  # [d_I]
    weights: torch.Tensor   # [H_I, hidden]
    ape: torch.Tensor       # [P, d_I]
    gate: torch.Tensor      # [d_I, hidden]


def indexer_from_full(get, prefix: str) -> IndexerWeights:
    p = prefix + "indexer."
    return IndexerWeights(wq_b=get(p + "wq_b.weight"), wk=get(p + "wk.weight"), k_norm_w=get(p + "k_norm.weight"),
                          k_norm_b=get(p + "k_norm.bias"), weights=get(p + "weights_proj.weight"),
                          ape=get(p + "index_kpool_compress_ape"), gate=get(p + "index_kpool_compress_gate"))


def indexer_keys(w: IndexerWeights, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [n, hidden] -> (keys [n, d_I], pool gate logits [n, d_I]) to store at the tokens' slots."""
    k = F.layer_norm(linear(x, w.wk), (w.wk.shape[0],), w.k_norm_w, w.k_norm_b, 1e-6)
    return k, linear(x, w.gate)


def indexer_queries(w: IndexerWeights, x: torch.Tensor, q_resid: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """-> (queries [n, H_I, d_I] fp32, head weights [n, H_I] fp32)."""
    n, heads = x.shape[0], w.weights.shape[0]
    q = linear(q_resid, w.wq_b).float().view(n, heads, -1)
    return q, linear(x, w.weights).float() * heads ** -0.5


def select(q: torch.Tensor, hw: torch.Tensor, pos: torch.Tensor, keys: torch.Tensor, gates: torch.Tensor,
           ape: torch.Tensor, topk: int, tail: bool) -> torch.Tensor:
    """One request's selection. q [n, H_I, d_I], hw [n, H_I], pos [n] query positions; keys / gates [T, d_I] of
    positions 0..T−1 (T > max(pos)) -> visible mask [n, T] bool."""
    P, T = ape.shape[0], keys.shape[0]
    npool = T // P
    mask = torch.zeros(q.shape[0], T, dtype=torch.bool, device=q.device)
    if npool:
        k = keys[:npool * P].float().view(npool, P, -1)
        prob = (gates[:npool * P].float().view(npool, P, -1) + ape.float()).softmax(dim=1)
        pool_keys = (prob * k).sum(1)                                            # [npool, d_I]
        scores = F.relu(torch.einsum("nhd,pd->nhp", q, pool_keys) * q.shape[-1] ** -0.5)
        idx = torch.einsum("nh,nhp->np", hw, scores)
        valid = (torch.arange(npool, device=q.device) + 1)[None, :] * P - 1 <= pos[:, None]
        idx = idx.masked_fill(~valid, torch.finfo(idx.dtype).min)
        k_sel = min(topk // P, npool)
        chosen = idx.topk(k_sel, dim=-1).indices                                # [n, k_sel]
        ok = valid.gather(1, chosen)
        pool_mask = torch.zeros(q.shape[0], npool, dtype=torch.bool, device=q.device)
        pool_mask.scatter_(1, chosen, ok)
        mask[:, :npool * P] = pool_mask.repeat_interleave(P, dim=1)
    if tail:
        t = torch.arange(T, device=q.device)[None, :]
        start = pos[:, None] + 1 - (pos[:, None] + 1) % P
        mask |= (t >= start) & (t <= pos[:, None])
    return mask


def sparse_latent_attention(q: torch.Tensor, c_kv: torch.Tensor, mask: torch.Tensor,
                            scale: float) -> torch.Tensor:
    """Absorbed NoPE MLA over selected positions: q̃ [n, H, d_c], c_kv [T, d_c], mask [n, T] -> õ [n, H, d_c]."""
    s = torch.einsum("nhc,tc->nht", q.float(), c_kv.float()) * scale
    s = s.masked_fill(~mask[:, None, :], float("-inf"))
    return torch.einsum("nht,tc->nhc", s.softmax(-1), c_kv.float())
