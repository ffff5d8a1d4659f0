"""GLM-5.3-Flash attention blocks in each layout: KDA linear-attention layers and NoPE MLA-DSA (KPool) layers.

KDA state is per request and its recurrence sequential in positions. TP and DOP shard projections by head, so rank r
runs KDA heads H_r of every row and holds those heads' state (O is a partial sum, all-reduced). DP-attn and CP
replicate projections, so the request's owner (CP: its anchor) runs all heads and holds the whole state, outputs
returning by a variable all-gather: a recurrence has no per-position history for CP to shard (its state already
summarises every past position), and splitting the scan over ranks would serialise them.

The MLA-DSA layers run in the layout's MLA executor, placed like DSA layers (splash.attention.dsa), with a rope width
of 0; they select pools with splash.attention.kpool.
"""
from __future__ import annotations

import torch

from splash.attention import mla
from splash.attention.batch import StepBatch, row_ranges
from splash.attention.context import LayoutState
from splash.attention.grouping import OwnerGroups
from splash.layouts.layout import KV_POSITION, parse_layout
from splash.models.kda import kda_forward


class HybridAttention:
    """Wraps the MLA executor of a layout (its block allocation, metadata and MLA layers) and runs the KDA layers."""

    def __init__(self, state: LayoutState, base):
        # base.r: this rank's state (splash.attention.context); state.linear_heads: the KDA heads held here
        self.layout, self.base, self.r = parse_layout(state.layout), base, base.r
        self.linear_heads = state.linear_heads
        P, bs = self.r.cfg.hybrid.index_kpool, self.r.block_size
        if self.layout.kv_ownership == KV_POSITION and bs % P:
            raise ValueError(f"glm5_next under CP needs index_kpool ({P}) to divide block_size ({bs}): each rank "
                             "scores the KPool pools of the blocks it holds")

    # ---- step set-up ---------------------------------------------------------------------------------------
    def prepare(self, batch: StepBatch) -> None:
        r = self.r
        self.base.prepare(batch)
        self.g = OwnerGroups.build(batch, r.comm.size, r.comm.rank)
        sharded = self.layout.shards_projections
        reqs = batch.reqs if sharded else self.g.mine
        self.reqs, self.spans = reqs, row_ranges(reqs)
        # prefix-cache snapshots this rank takes (its KDA rows cross a planned block boundary)
        self.snap_at = [r.states.boundaries(q.req_id, q.start_pos, q.start_pos + q.num_new) for q in reqs]
        self.rows = None if sharded else self.g.rows_mine
        self.states_ready = False

    def _ensure_states(self) -> None:
        """New requests get a zero state; the others must hold theirs. Checked at the first KDA layer, not in
        prepare: during a live handoff the state lands just before that layer runs."""
        r = self.r
        for q in self.reqs:
            if q.start_pos == 0 and q.num_new:
                r.states.create(q.req_id, len(self.linear_heads))
            elif not r.states.has(q.req_id):
                raise RuntimeError(f"request {q.req_id!r} at position {q.start_pos} has no KDA state on rank "
                                   f"{r.comm.rank} in layout {self.layout}")
        self.states_ready = True

    def attention(self, layer: int, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        if self.r.family.is_recurrent(layer):
            return self._kda(layer, x)
        return self.base.attention(layer, x, cos, sin)   # NoPE MLA-DSA: cos / sin are [n, 0]

    # ---- KDA -------------------------------------------------------------------------------------------------
    def _kda(self, layer: int, x: torch.Tensor) -> torch.Tensor:
        r, cfg = self.r, self.r.cfg
        li = r.family.state_row(layer)
        if not self.states_ready:
            self._ensure_states()
        xs = x if self.rows is None else x[self.rows]
        states = [r.states.get(q.req_id)[li] for q in self.reqs]
        out, new, taken = kda_forward(r.weights.layers[layer].attn, xs, self.spans, states, cfg.rms_norm_eps,
                                      cfg.hybrid.linear_lower_bound, [[b.offset for b in bs] for bs in self.snap_at])
        for st, s in zip(states, new):
            st.copy_(s)
        for points, got in zip(self.snap_at, taken):
            for b, s in zip(points, got):
                r.states.keep(b.hash, li, s)
        return mla.sum_over_ranks(r.comm, out) if self.rows is None else self.g.gather(r.comm, out)
