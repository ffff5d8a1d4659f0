"""Rank 0's layout control: pinned target or auto, the switch decision and its memory headroom check.

A switch needs, on every rank, room for the blocks it will receive, one layer's transfer buffers, and the blocks
the handoff step itself may append, on top of what stays resident: the blocks it keeps and the discarded ones it
still sends (freed after the handoff step); discards it sends nowhere are freed at the boundary
(``Manifest.freed_at_handoff``) — so TP → DOP with TP's pool nearly full is not deferred for TP's copies of the
requests DOP gives to the other owner. If a rank lacks it — or the destination cannot hold the live KV — the
switch is deferred with a logged reason and retried at the next step boundary; the run continues in the current
layout.

A probe of `layout: auto` (a switch made to measure a layout) must be able to come back: the same check, on the
switch back from the destination once the running requests grew there (`LayoutController.way_back`), decides
whether the probe is taken at all.

Layouts may store KV in different dtypes (``kv_dtypes``); the pool is sized in the widest of them. Converting a
layer allocates its new tensors before the old ones go, so a switch that converts also needs, on top of a pool
in the wider of the two formats, one pool layer in the narrower one (less what a pool sized for a still wider
format leaves spare) plus the conversion's fp32 scratch.
"""
from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace

from splash.layouts.layout import LAYOUT_NAMES, check_heads, heads_fit, parse_layout
from splash.layouts.memory import CONVERT_CHUNK_SLOTS, kv_bytes_per_token_layer
from splash.switching.block_plan import CachedBlock
from splash.switching.manifest import Manifest, ReqState, plan_switch

log = logging.getLogger("splash.switch")
ALL_LAYOUTS = LAYOUT_NAMES


@dataclass
class SwitchDecision:
    dst: str
    reqs: dict[str, ReqState]   # req -> its KV tokens, src owner, dst owner, hashes of its shared cached blocks
    manifest: Manifest
    cached: tuple = ()         # the idle cached blocks the plan was given
    cached_cap: tuple = ()
    move_cached: bool = False


class LayoutController:
    def __init__(self, cfg, world: int, block_size: int, weight_bytes: int, kv_dtype: str | Mapping[str, str],
                 allowed: tuple[str, ...] = ALL_LAYOUTS, mode: str = "live", rope_fp8: bool = False):
        """`kv_dtype`: one KV dtype for every layout, or layout → KV dtype (all four layouts). `rope_fp8`: the
        pool keeps an fp8 layer's rope key in e4m3 (the runner's pool: splash.layouts.memory.rope_fp8_pool), so
        blocks, moves and the headroom are counted in its bytes."""
        self.cfg, self.world, self.block_size = cfg, world, block_size
        self.weight_bytes, self.mode, self.rope_fp8 = weight_bytes, mode, rope_fp8
        self.weight_quant: str | None = None  # "fp8"/"int8" when the projections are stored quantised
        self.kv_dtypes = (dict.fromkeys(ALL_LAYOUTS, kv_dtype) if isinstance(kv_dtype, str)
                          else {parse_layout(k).value: v for k, v in kv_dtype.items()})
        # one block of one layer in the pool's (widest) format
        self.pool_block_bytes_layer = max(kv_bytes_per_token_layer(cfg, d, rope_fp8=rope_fp8)
                                          for d in self.kv_dtypes.values()) * block_size
        # head-sharded layouts need the world size to divide the heads; where it does not they are not offered
        self.allowed = tuple(a for a in (parse_layout(x).value for x in allowed)
                             if heads_fit(a, cfg.num_attention_heads, world))
        self.target: str | None = None
        self.layout_mode = "auto"
        self.switch_counts: dict[tuple[str, str], int] = {}
        self.deferrals = 0
        self.last_deferral: str | None = None

    def request(self, name: str) -> None:
        """Pin a layout (switch at the next step boundary) or hand control back with 'auto'."""
        if str(name).lower() == "auto":
            self.layout_mode, self.target, self.last_deferral = "auto", None, None
            return
        try:
            lay = parse_layout(name).value
        except ValueError as e:
            raise ValueError(f"layout: {e}") from None
        check_heads(lay, self.cfg.num_attention_heads, self.world)
        if lay not in self.allowed:
            raise ValueError(f"layout {lay!r} is not allowed here (allowed: {', '.join(self.allowed)})")
        if lay != self.target:
            self.last_deferral = None   # a deferral was for the old target: let an idle engine try the new one
        self.layout_mode, self.target = "pinned", lay

    def decide(self, current: str, ledger, kv_tokens: dict[str, int], reserve_blocks: int,
               auto_choice: str | None = None,
               vet: Callable[..., str | None] | None = None,
               move_cached: bool = False) -> SwitchDecision | None:
        """The switch to perform at this boundary, or None (no switch wanted, or deferred).

        In auto mode `auto_choice` is the scheduler's proposal and `vet(manifest, deferral, way_back=...)` its last
        word once the manifest is planned: called with the headroom deferral reason (or None) and a
        `way_back(grow)` that says whether the switch back would fit after this one (`way_back`); it returns a
        reason to refuse.
        With the prefix cache on, the plan carries each request's shared blocks and the idle cached blocks, kept within
        the destination's usable pool less the handoff step's reserve (`move_cached`: the cost verdict on sending
        them); if keeping them is what breaks the handoff's memory peak, the switch drops them instead."""
        dst = self.target if self.layout_mode == "pinned" else auto_choice
        if dst is None or dst == current:
            return None
        m, reason, owners, reqs, cached, cap = self._plan(current, dst, ledger, kv_tokens, reserve_blocks,
                                                          move_cached)
        if vet is not None and vet(m, reason, way_back=lambda grow: self.way_back(
                current, m, ledger, kv_tokens, reserve_blocks, grow)) is not None:
            return None
        if reason:
            self.deferrals += 1
            if reason != self.last_deferral:
                log.warning("switch %s -> %s deferred: %s", current, dst, reason)
            self.last_deferral = reason
            return None
        self.last_deferral = None
        full = {rid: replace(s, dst_owner=owners.get(rid)) for rid, s in reqs.items()}
        return SwitchDecision(dst, full, m, cached, tuple(cap), move_cached)

    def way_back(self, current: str, m: Manifest, ledger, kv_tokens: Mapping[str, int], reserve_blocks: int,
                 grow: Mapping[str, int]) -> str | None:
        """The headroom check of the switch from `m`'s destination back to `current`, made after `m` once each
        request grew by `grow[req]` tokens there: the reason it would be deferred, or None when it fits. The same
        check as any switch's (`_headroom`), on a copy of the ledger mirrored through `m` (new owners, no idle
        cached block kept: a switch drops those rather than defer) and grown in the destination's layout."""
        dst = m.dst.value
        led = ledger.fork(ledger.layout, ledger.blocks_per_rank)
        led.capacity = dict(ledger.capacity)
        led.relayout(dst, m.owners, [()] * self.world if led.prefix else None)
        grown = {}
        for rid, n in kv_tokens.items():
            grown[rid] = n + max(0, int(grow.get(rid, 0)))
            led.grow(rid, grown[rid], led.owner(rid))
        return self._plan(dst, current, led, grown, reserve_blocks, False)[1]

    def _plan(self, current: str, dst: str, ledger, kv_tokens: Mapping[str, int], reserve_blocks: int,
              move_cached: bool) -> tuple[Manifest, str | None, dict[str, int], dict[str, ReqState], tuple, list]:
        """The switch's manifest, its headroom deferral reason (None: it fits), the requests' new owners, the
        requests and idle cached blocks planned, and the cached blocks' cap per rank."""
        # every request has a ledger owner in every layout: the owner for DP-attn/DOP, the CP anchor for CP
        shared = ledger.shared if ledger.prefix else {}
        reqs = {rid: ReqState(n, ledger.owner(rid), None, tuple(shared.get(rid, ()))) for rid, n in kv_tokens.items()}
        cached = tuple(CachedBlock(*c) for c in ledger.idle_blocks()) if ledger.prefix else ()
        cap = [max(0, ledger.cap(dst) - reserve_blocks)] * self.world

        def plan(cap):
            return self.plan(current, dst, reqs, cached, cap, move_cached)
        m = plan(cap)
        owners = m.owners
        reason = self._headroom(m, ledger, owners, reserve_blocks)
        if reason and any(m.cached_kept):   # keep no idle cached block rather than defer the switch
            cap = [0] * self.world
            m = plan(cap)
            reason = self._headroom(m, ledger, owners, reserve_blocks)
        return m, reason, owners, reqs, cached, cap

    def plan(self, src: str, dst: str, reqs: Mapping[str, ReqState], cached=(), cached_cap=None,
             move_cached: bool = False) -> Manifest:
        """The src → dst manifest of this group (splash.switching.manifest.plan_switch): rank 0's decision and
        every rank's executor plan it here, with the same dtypes, weight storage and pool bytes."""
        return plan_switch(src, dst, self.cfg, self.world, reqs, self.block_size, self.weight_bytes,
                           self.kv_dtypes[src], src_kv_dtype=self.kv_dtypes[src], dst_kv_dtype=self.kv_dtypes[dst],
                           weight_quant=self.weight_quant, cached=cached, cached_cap=cached_cap,
                           move_cached=move_cached, rope_fp8=self.rope_fp8)

    def convert_bytes(self, m: Manifest, cap: int, held_blocks: int) -> int:
        """Memory a KV format conversion needs beyond the pool on one rank (0 when the formats match): one pool
        layer in the narrower format on top of a pool in the wider one (the peak, at the first layer going
        narrower or the last going wider), less the spare of a pool sized for a wider format still, plus the
        fp32 scratch of one conversion chunk (decoded rows and the requantiser's working copies)."""
        if not m.converts_kv:
            return 0
        src_b, dst_b, pool_b = m.kv_block_bytes_layer, m.dst_kv_block_bytes_layer, self.pool_block_bytes_layer
        layers = m.num_layers
        extra = cap * (layers * max(src_b, dst_b) + min(src_b, dst_b)) - cap * layers * pool_b
        rows = min(held_blocks * self.block_size, CONVERT_CHUNK_SLOTS)
        scratch = rows * (self.cfg.kv_lora_rank + self.cfg.qk_rope_head_dim) * 4 * 3
        return max(0, extra) + scratch

    def _headroom(self, m: Manifest, ledger, owners: dict[str, int], reserve: int) -> str | None:
        cap, dst_cap = ledger.blocks_per_rank, ledger.cap(m.dst.value)
        block_all_layers = self.pool_block_bytes_layer * max(1, m.num_layers)
        incoming = [0] * self.world
        for mv in m.moves:
            incoming[mv.dst_rank] += 1
        dst_used = ledger.usage_under(m.dst.value, owners, shared=ledger.prefix)
        for r in range(self.world):
            # idle cached blocks count until dropped; what is freed before the step appends does not
            resident = (ledger.used[r] + len(ledger.lru[r]) - len(m.freed_at_handoff(r))
                        - len(m.hashes_freed_at_handoff(r)))
            buf_bytes = (incoming[r] * m.kv_block_bytes_layer + m.weight_recv_bytes[r]
                         + self.convert_bytes(m, cap, resident + incoming[r]))
            buf_blocks = -(-int(buf_bytes) // block_all_layers) if block_all_layers else 0
            peak = resident + incoming[r] + buf_blocks + reserve
            if dst_used[r] + reserve > dst_cap:
                return (f"rank {r}: destination {m.dst.value} needs {dst_used[r]} KV blocks (+{reserve} for the "
                        f"step) but holds at most {dst_cap} there")
            if peak > cap:
                return (f"rank {r}: handoff peak {peak} blocks (resident {resident} + incoming {incoming[r]}"
                        f" + one-layer buffers {buf_blocks} + step {reserve}) exceeds the pool of {cap}"
                        + (f" ({m.src_kv_dtype} -> {m.dst_kv_dtype} conversion included)" if m.converts_kv else ""))
        return None

    def record(self, src: str, dst: str) -> None:
        self.switch_counts[(src, dst)] = self.switch_counts.get((src, dst), 0) + 1
