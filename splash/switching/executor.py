"""Apply a switch manifest on this rank: reuse resident state, move the rest, hand off at a step boundary.

Live mode: the step after the boundary already runs in the destination layout; layer l+1's missing state (KV
blocks by nonblocking all-to-all, projections by nonblocking all-gather) is in flight while layer l computes, and
each layer waits only for its own. Blocking mode (the baseline for overhead figures) moves every layer first. On a
GPU each layer's transfer runs on the backend's side stream and ends with an event the compute stream waits on
right before the layer. A layer whose KV dtype changes moves in the source format, then converts.
"""
from __future__ import annotations

import torch

from backends.base import NullStreams
from splash.attention.context import LayoutState, RankContext, layout_state
from splash.switching import weights_transfer as wt
from splash.switching.handoff_blocks import begin_blocks
from splash.switching.manifest import ALL_GATHER, DISCARD, Manifest
from splash.switching.state_transfer import StateHandoff, pack_kda, slice_kda, unpack_kda


class SwitchExecutor:
    """Works on this rank's state `ctx` (splash.attention.context.RankContext): its pool, block manager, page
    table, weights and recurrent state change in place; `begin` returns the destination's LayoutState, which the
    runner adopts before the step runs."""

    def __init__(self, ctx: RankContext, manifest: Manifest, mode: str = "live", streams=None, gone=frozenset()):
        """`gone`: requests released at this boundary, before the switch (their private blocks do not move)."""
        if mode not in ("live", "blocking"):
            raise ValueError(f"switch mode must be 'live' or 'blocking', got {mode!r}")
        self.r, self.m, self.mode = ctx, manifest, mode
        self.handles: dict[int, tuple] = {}
        self.pending_free: list[int] = []
        self.to_convert: set[int] = set(range(manifest.num_layers)) if manifest.converts_kv else set()
        self.held: list[int] = []
        self.streams = streams or NullStreams()
        self.gone, self.dst = frozenset(gone), None

    # ---- set-up at the step boundary ------------------------------------------------------------------
    def begin(self) -> LayoutState:
        """Set up the handoff; -> the destination's LayoutState (idempotent: the engine and the runner both call it)."""
        if self.dst is not None:
            return self.dst
        r, m, me = self.r, self.m, self.r.comm.rank
        bm = r.blocks
        hs = begin_blocks(bm, m, me, self.gone)
        self.send_phys, self.send_counts = hs.send, hs.send_counts
        self.recv_phys, self.recv_counts = hs.recv, hs.recv_counts
        self.pending_free = hs.free_later
        for req in hs.touched:   # the page-table rows follow the kept + received + re-shared blocks
            r.tables.rewrite(req, bm.table(req))
        self.w_action = m.action("proj")
        self.dst = layout_state(m.dst.value, r.family, m.world, me, m.dst_kv_dtype)
        self.state = None
        if r.family.recurrent:  # per-request KDA state: one all-to-all per KDA layer, beside its KV
            self.state = StateHandoff(r, m)
            self.state.begin()
        if self.w_action == DISCARD:
            for i, lw in enumerate(r.weights.layers):
                lw.attn = self._slice(i, lw.attn, self.dst.heads)
        # blocks holding KV after the moves (kept, received, cached): what a dtype conversion carries over
        self.held = sorted({p for req in bm.requests() for p in bm.table(req).values()}
                           | {bm.block_of(h) for h in bm.cached_hashes()})
        if self.mode == "blocking":
            for layer in range(m.num_layers):
                self._start(layer)
                self._finish(layer)
                self._convert(layer)
        return self.dst

    # ---- layer kinds: MLA layers hold KV blocks, KDA layers per-request state ---------------------------------
    def _linear(self, layer: int) -> bool:
        return self.r.family.is_recurrent(layer)

    def _slice(self, layer: int, w, heads: range):
        if self._linear(layer):
            return slice_kda(w, self.dst.linear_heads)
        return wt.slice_heads(w, heads, self.r.cfg.qk_head_dim)

    def _kda_row(self, layer: int) -> int | None:
        """KDA layer `layer`'s row in the per-request state (None: not a KDA layer or no state handoff)."""
        return self.r.family.state_row(layer) if self.state is not None else None

    # ---- per layer ----------------------------------------------------------------------------------------
    def _start(self, layer: int) -> None:
        """Issue `layer`'s transfer on the side stream (packing reads the layer as the compute stream left it)."""
        r = self.r
        kv = w = None
        # the pool layer holding `layer`'s blocks (latent KV, scales and indexer keys alike); None: a KDA layer
        c, cl = r.cache, r.family.pool_layer(layer)
        with self.streams.side():
            if self._kda_row(layer) is not None:  # the layer's KDA state, final since the step boundary
                self.state.start_layer(self._kda_row(layer))
            if cl is not None and (any(self.send_counts) or any(self.recv_counts)):
                data = (c.pack_blocks(cl, self.send_phys) if self.send_phys else
                        torch.empty(0, c.block_bytes(cl), dtype=torch.uint8, device=c.device))
                kv = r.comm.iall_to_allv(data, self.send_counts, self.recv_counts)
            if self.w_action == ALL_GATHER:
                attn = r.weights.layers[layer].attn
                if self._linear(layer):
                    w = r.comm.iall_gatherv(pack_kda(attn))
                else:
                    w = r.comm.iall_gatherv(wt.pack_shard(attn))
        self.handles[layer] = (kv, w)

    def _finish(self, layer: int) -> None:
        """Land `layer`'s state (on the side stream) and make the compute stream wait for it."""
        kv, w = self.handles.pop(layer)
        r = self.r
        with self.streams.side():
            if self._kda_row(layer) is not None:
                self.state.finish_layer(self._kda_row(layer))
            if kv is not None:
                data = kv.wait()
                if self.recv_phys:
                    r.cache.unpack_blocks(r.family.pool_layer(layer), self.recv_phys, data)
            if w is not None:
                lw = r.weights.layers[layer]
                if self._linear(layer):
                    lw.attn = unpack_kda(lw.attn, w.wait(), self.m.world, r.family.linear_heads)
                else:
                    lw.attn = wt.unpack_full(lw.attn, w.wait(), self.m.world, r.cfg.num_attention_heads)
                self.streams.hand_over(lw.attn)
            event = self.streams.record()
        self.streams.wait(event)

    def _convert(self, layer: int) -> None:
        """Re-store `layer`'s held blocks in the destination's KV dtype, once its moves landed."""
        if layer in self.to_convert:
            self.to_convert.discard(layer)
            cl = self.r.family.pool_layer(layer)
            if cl is not None:   # a KDA layer holds no block
                self.r.cache.convert_layer(cl, self.m.dst_kv_dtype, self.held)

    def before_layer(self, layer: int) -> None:
        """Called by the model before layer `layer` runs (live mode)."""
        if self.mode != "live":
            return
        if layer == 0:
            self._start(0)
        self._finish(layer)
        if layer + 1 < self.m.num_layers:
            self._start(layer + 1)  # packs layer l+1, still in the source format
        self._convert(layer)  # overlaps layer l+1's transfer

    def end(self) -> None:
        """After the step: every transfer is complete; give discarded blocks back to the pool."""
        if self.state is not None:
            self.state.finish()
            self.state = None
        for layer in sorted(self.handles):
            self._finish(layer)
        for layer in sorted(self.to_convert):
            self._convert(layer)
        self.r.blocks.free_physical(self.pending_free)
        self.pending_free = []
