"""CP: replicated projections; each request's history is position-sharded block-round-robin over the ranks.
Every rank attends all heads of all rows against its own position shard, giving a partial output and its
log-sum-exp; the partials are merged exactly across ranks (LSE-weighted), then O runs on every rank."""
from __future__ import annotations

import torch

from splash.attention import mla
from splash.attention.batch import StepBatch, StepPiece
from splash.attention.context import RankContext
from splash.layouts.layout import Layout
from splash.layouts.ownership import block_holders


class CPAttention:
    def __init__(self, ctx: RankContext):
        self.r = ctx  # this rank's state (splash.attention.context)

    def _mine(self, q: StepPiece, block: int) -> bool:
        """Block `block` of request `q` lives here: round-robin rotated by the request's anchor rank."""
        return block_holders(Layout.CP, block, q.owner, self.r.comm.size)[0] == self.r.comm.rank

    def prepare(self, batch: StepBatch) -> None:
        self.meta = self.r.plan_step(batch.reqs, keep=self._mine, cp=(self.r.comm.size, self.r.comm.rank))

    def attention(self, layer: int, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        r, cfg, p = self.r, self.r.cfg, self.meta
        w = r.weights.layers[layer].attn
        q, qa = mla.latent_query(cfg, r.rope, w, x, cos, sin)
        wr = p.write_rows
        c, kpe = mla.new_latent_kv(cfg, r.rope, w, x[wr], cos[wr], sin[wr])
        # DSA: keys stored with their positions; global top-k over every rank's candidates
        cl = mla.store_and_select(r, layer, p, c, kpe, (x[wr], cos[wr], sin[wr]), (x, qa, cos, sin), cp_comm=r.comm)
        o, lse = mla.attend(r.attn, cl, q, r.cache, cfg.kv_lora_rank)  # partial over this rank's positions
        return mla.out_projection(w, mla.merge_over_ranks(r.comm, o, lse))
