"""TP: head-sharded Q-B/KV-B/O; every rank holds every request's whole latent history; all-reduce after O."""
from __future__ import annotations

import torch

from splash.attention import mla
from splash.attention.batch import StepBatch, attend_plan, build_attn_plan


class TPAttention:
    def __init__(self, runner):
        self.r = runner

    def prepare(self, batch: StepBatch) -> None:
        r = self.r
        for q in batch.reqs:
            r.bm.ensure(q.req_id, r.new_logical_blocks(q))
        self.plan = build_attn_plan(batch.reqs, r.bm.table, r.block_size, lambda q, b: True)

    def attention(self, layer: int, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        r, cfg = self.r, self.r.cfg
        w = r.weights.layers[layer].attn
        q, c, kpe = mla.query_and_latent(cfg, r.model.rope, w, x, cos, sin)
        p = self.plan
        # TP stores every row's KV (write_rows is 0..n-1 in order): no gather needed
        r.cache.write(layer, p.write_slots, c, kpe)
        o, _ = attend_plan(r.cache, layer, p, q, cfg.kv_lora_rank, cfg.softmax_scale)
        out = mla.out_projection(w, o)
        return r.comm.all_reduce(out) if r.comm.size > 1 else out
