"""TP: head-sharded Q-B/KV-B/O; every rank holds every request's whole latent history; all-reduce after O."""
from __future__ import annotations

import torch

from splash.attention import dsa, mla
from splash.attention.batch import StepBatch
from splash.attention.context import RankContext
from splash.attention.metadata import build_metadata


class TPAttention:
    def __init__(self, ctx: RankContext):
        self.r = ctx  # this rank's state (splash.attention.context)

    def prepare(self, batch: StepBatch) -> None:
        r = self.r
        r.ensure_step_blocks(batch.reqs)
        self.meta = build_metadata(batch.reqs, r.tables)
        r.attn.plan(self.meta)

    def attention(self, layer: int, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        r, cfg = self.r, self.r.cfg
        w = r.weights.layers[layer].attn
        q, c, kpe, *qa = mla.query_and_latent(cfg, r.rope, w, x, cos, sin, want_qa=cfg.has_dsa)
        # TP stores every row's KV (write_rows is 0..n-1 in order): no gather needed
        r.cache.write(layer, self.meta.write_slots, c, kpe)
        if cfg.has_dsa:  # every rank stores every indexer key and selects the same top-k
            dsa.select_layer(r, layer, self.meta, (x, cos, sin), (x, *qa, cos, sin))
        o, _ = mla.attend(r.attn, layer, q, r.cache, cfg.kv_lora_rank)
        return mla.sum_over_ranks(r.comm, mla.out_projection(w, o))
