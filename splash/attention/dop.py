"""DOP: head-sharded projections (as TP) with request-owned KV (as DP-attn).

Each rank computes absorbed queries for its heads on all rows; the owner of each request attends its rows with
all heads over its own cache (OwnerGroups.attend_at_owners: two variable all-to-alls, one row per request in
decode — they scale with queries, never with context); O on local heads, then all-reduce."""
from __future__ import annotations

import torch

from splash.attention import mla
from splash.attention.grouping import OwnedAttention


class DOPAttention(OwnedAttention):
    def attention(self, layer: int, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        r, cfg, g, p = self.r, self.r.cfg, self.g, self.meta
        w = r.weights.layers[layer].attn
        q, qa = mla.latent_query(cfg, r.rope, w, x, cos, sin)  # [N, H_l, D]
        rows = g.rows_mine
        xm, cm, sm = x[rows], cos[rows], sin[rows]
        c, kpe = mla.new_latent_kv(cfg, r.rope, w, xm, cm, sm)
        # every row of this rank's requests is stored here; DSA: the owner selects for their rows (all heads)
        cl = mla.store_and_select(r, layer, p, c, kpe, (xm, cm, sm), (xm, qa[rows], cm, sm))
        o = g.attend_at_owners(r.comm, q, lambda qo: mla.attend(r.attn, cl, qo, r.cache, cfg.kv_lora_rank)[0])
        return mla.sum_over_ranks(r.comm, mla.out_projection(w, o))
