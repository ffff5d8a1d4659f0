"""TP: head-sharded Q-B/KV-B/O; every rank holds every request's whole latent history; all-reduce after O."""
from __future__ import annotations

import torch

from splash.attention import mla
from splash.attention.batch import StepBatch
from splash.attention.context import RankContext


def attend_stored_rows(r: RankContext, meta, layer: int, x: torch.Tensor, cos: torch.Tensor,
                       sin: torch.Tensor) -> torch.Tensor:
    """Rows x whose KV this rank stores, every one of them (`meta.write_rows` is 0..n-1 in order: TP's every row,
    DP-attn's rows of the requests it owns) -> this rank's O output of them over its heads. DSA / KPool: the rank
    stores their indexer vectors and selects for them (under TP every rank the same top-k: same inputs, same math)."""
    cfg, w = r.cfg, r.weights.layers[layer].attn
    q, c, kpe, qa = mla.query_and_latent(cfg, r.rope, w, x, cos, sin)
    cl = mla.store_and_select(r, layer, meta, c, kpe, (x, cos, sin), (x, qa, cos, sin))
    o, _ = mla.attend(r.attn, cl, q, r.cache, cfg.kv_lora_rank)
    return mla.out_projection(w, o)


class TPAttention:
    def __init__(self, ctx: RankContext):
        self.r = ctx  # this rank's state (splash.attention.context)

    def prepare(self, batch: StepBatch) -> None:
        self.meta = self.r.plan_step(batch.reqs)

    def attention(self, layer: int, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        return mla.sum_over_ranks(self.r.comm, attend_stored_rows(self.r, self.meta, layer, x, cos, sin))
