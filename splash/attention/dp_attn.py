"""DP-attn: replicated projections; each rank attends only the requests it owns, on its own cache, with all
heads; a variable-size all-gather brings every rank's output rows back to all ranks."""
from __future__ import annotations

import torch

from splash.attention import dsa, mla
from splash.attention.grouping import OwnedAttention


class DPAttention(OwnedAttention):
    def attention(self, layer: int, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        r, cfg, g, p = self.r, self.r.cfg, self.g, self.meta
        w = r.weights.layers[layer].attn
        rows = g.rows_mine
        xm, cm, sm = x[rows], cos[rows], sin[rows]
        q, c, kpe, *qa = mla.query_and_latent(cfg, r.rope, w, xm, cm, sm, want_qa=cfg.has_dsa)
        r.cache.write(layer, p.write_slots, c, kpe)  # every row of this rank's requests is stored here
        if cfg.has_dsa:  # the owner stores its requests' indexer keys and selects for their rows
            dsa.select_layer(r, layer, p, (xm, cm, sm), (xm, *qa, cm, sm))
        o, _ = mla.attend(r.attn, layer, q, r.cache, cfg.kv_lora_rank)
        return g.gather(r.comm, mla.out_projection(w, o))
