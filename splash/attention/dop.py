"""DOP: head-sharded projections (as TP) with request-owned KV (as DP-attn).

Each rank computes absorbed queries for its heads on all rows; a variable all-to-all sends each owner the rows
of its requests (ranks with no rows still join); the owner attends all heads over its own cache; the reverse
all-to-all returns per-head latent outputs to the head-shard ranks; O on local heads, then all-reduce. The
exchange is one row per request in decode — it scales with queries, never with context."""
from __future__ import annotations

import torch

from splash.attention import dsa, mla
from splash.attention.grouping import OwnedAttention


class DOPAttention(OwnedAttention):
    def attention(self, layer: int, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        r, cfg, g, p = self.r, self.r.cfg, self.g, self.meta
        T, dc = r.comm.size, cfg.kv_lora_rank
        w = r.weights.layers[layer].attn
        q, qa = mla.latent_query(cfg, r.rope, w, x, cos, sin, want_qa=True)  # [N, H_l, D]
        rows = g.rows_mine
        xm, cm, sm = x[rows], cos[rows], sin[rows]
        c, kpe = mla.new_latent_kv(cfg, r.rope, w, xm, cm, sm)
        r.cache.write(layer, p.write_slots, c, kpe)  # every row of this rank's requests is stored here
        if cfg.has_dsa:  # the owner stores its requests' indexer keys and selects for their rows (all heads)
            dsa.select_layer(r, layer, p, (xm, cm, sm), (xm, qa[rows], cm, sm))
        n, hl, d = len(rows), q.shape[1], q.shape[2]
        if T == 1:
            o_local, _ = mla.attend(r.attn, layer, q, r.cache, dc)
            return mla.out_projection(w, o_local)
        send = q[g.by_owner].reshape(-1, hl * d).contiguous()
        recv = r.comm.all_to_allv(send, g.counts, [n] * T)               # [T * n, H_l * D], by source rank
        q_own = recv.view(T, n, hl, d).permute(1, 0, 2, 3).reshape(n, T * hl, d)
        o, _ = mla.attend(r.attn, layer, q_own, r.cache, dc)  # [n, H, dc]
        back = o.view(n, T, hl, dc).permute(1, 0, 2, 3).reshape(T * n, hl * dc).contiguous()
        o_local = r.comm.all_to_allv(back, [n] * T, g.counts).view(-1, hl, dc)  # rows grouped by owner
        out = mla.out_projection(w, g.to_step_order(o_local))
        return r.comm.all_reduce(out)
