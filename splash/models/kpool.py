"""GLM-5.3-Flash's DSA indexer with KPool selection: splash.models.indexer's lightning indexer (NoPE) scoring pools
of P = index_kpool consecutive positions. Per token the cache stores two vectors: the indexer key k and the pool
gate logits x W_gateᵀ. A complete pool's key is Σ_t softmax_t(gate_t + ape_t) · k_t; a query scores the complete
pools ending at or before its position with the indexer's score and keeps the best ``index_topk // P``, plus its own
incomplete pool (the tail), so the selection depends only on positions ≤ p whatever the chunking.
"""
from __future__ import annotations

from dataclasses import dataclass, fields

import torch

from splash.models.indexer import IndexerWeights, indexer_keys, load_indexer
from splash.models.linear import linear


@dataclass
class KPoolWeights(IndexerWeights):
    ape: torch.Tensor   # [P, d_I] per-offset bias of the pool gate logits
    gate: torch.Tensor  # [d_I, hidden] pool gate projection

    @property
    def pool(self) -> int:
        return self.ape.shape[0]


def indexer_from_full(get, prefix: str) -> KPoolWeights:
    """One layer's KPool indexer (``prefix`` = the layer's ``self_attn.``), sizes read from its tensors."""
    p = prefix + "indexer."
    base = load_indexer(get, p, n_heads=get(p + "weights_proj.weight").shape[0],
                        head_dim=get(p + "wk.weight").shape[0], rope_dim=0, interleave=False)
    return KPoolWeights(**{f.name: getattr(base, f.name) for f in fields(IndexerWeights)},
                        ape=get(p + "index_kpool_compress_ape"), gate=get(p + "index_kpool_compress_gate"))


def kpool_keys(w: KPoolWeights, x: torch.Tensor) -> torch.Tensor:
    """x [n, hidden] (the layer's normed input) -> [n, 2 · d_I] fp32: indexer key, then pool gate logits — what
    the cache stores per token (two vectors, splash.kv.paged_cache ``index_parts`` = 2)."""
    return torch.cat([indexer_keys(w, x, None, None), linear(x, w.gate).float()], dim=-1)


def pool_keys(w: KPoolWeights, stored: torch.Tensor) -> torch.Tensor:
    """Stored vectors of whole pools [..., pools, P, 2 · d_I] -> pool keys [..., pools, d_I] fp32."""
    d = w.head_dim
    keys, gates = stored[..., :d].float(), stored[..., d:].float()
    prob = (gates + w.ape.float()).softmax(dim=-2)
    return (prob * keys).sum(dim=-2)
