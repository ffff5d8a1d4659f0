"""Rank 0's layout control: pinned target or auto, the switch decision and its memory headroom check.

A switch needs, on every rank, room for the blocks it will receive (discarded blocks are only freed after the
handoff step, because they may still be sent), one layer's transfer buffers, and the blocks the handoff step
itself may append. If a rank lacks it — or the destination cannot hold the live KV — the switch is deferred
with a logged reason and retried at the next step boundary; the run continues in the current layout.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass

from splash.layouts.layout import Layout, parse_layout
from splash.switching.manifest import Manifest, ReqState, plan_switch

log = logging.getLogger("splash.switch")
ALL_LAYOUTS = ("tp", "dp_attn", "cp", "dop")


@dataclass
class SwitchDecision:
    dst: str
    reqs: dict[str, tuple[int, int | None, int | None]]   # req -> (kv tokens, src owner, dst owner)
    manifest: Manifest


class LayoutController:
    def __init__(self, cfg, world: int, block_size: int, weight_bytes: int, kv_dtype: str,
                 allowed: tuple[str, ...] = ALL_LAYOUTS, mode: str = "live"):
        self.cfg, self.world, self.block_size = cfg, world, block_size
        self.weight_bytes, self.kv_dtype, self.mode = weight_bytes, kv_dtype, mode
        self.allowed = tuple(parse_layout(a).value for a in allowed)
        self.target: str | None = None
        self.layout_mode = "auto"
        self.switch_counts: dict[tuple[str, str], int] = {}
        self.deferrals = 0
        self.last_deferral: str | None = None

    def request(self, name: str) -> None:
        """Pin a layout (switch at the next step boundary) or hand control back with 'auto'."""
        if str(name).lower() == "auto":
            self.layout_mode, self.target = "auto", None
            return
        try:
            lay = parse_layout(name).value
        except ValueError as e:
            raise ValueError(f"layout: {e}") from None
        if lay not in self.allowed:
            raise ValueError(f"layout {lay!r} is not allowed here (allowed: {', '.join(self.allowed)})")
        if lay in ("tp", "dop") and self.cfg.num_attention_heads % self.world:
            raise ValueError(f"layout {lay!r} needs the world size {self.world} to divide "
                             f"num_attention_heads={self.cfg.num_attention_heads}")
        self.layout_mode, self.target = "pinned", lay

    def decide(self, current: str, ledger, kv_tokens: dict[str, int], reserve_blocks: int,
               auto_choice: str | None = None) -> SwitchDecision | None:
        """The switch to perform at this boundary, or None (no switch wanted, or deferred)."""
        dst = self.target if self.layout_mode == "pinned" else auto_choice
        if dst is None or dst == current:
            return None
        src_owned = Layout(current).owner_based
        reqs = {rid: ReqState(n, ledger.owner(rid) if src_owned else None, None) for rid, n in kv_tokens.items()}
        m = plan_switch(current, dst, self.cfg, self.world, reqs, self.block_size, self.weight_bytes, self.kv_dtype)
        owners = m.owners
        reason = self._headroom(m, ledger, owners, reserve_blocks)
        if reason:
            self.deferrals += 1
            if reason != self.last_deferral:
                log.warning("switch %s -> %s deferred: %s", current, dst, reason)
            self.last_deferral = reason
            return None
        self.last_deferral = None
        full = {rid: (s.num_tokens, s.src_owner, owners.get(rid)) for rid, s in reqs.items()}
        return SwitchDecision(dst, full, m)

    def _headroom(self, m: Manifest, ledger, owners: dict[str, int], reserve: int) -> str | None:
        cap, dst_cap = ledger.blocks_per_rank, ledger.cap(m.dst.value)
        block_all_layers = m.kv_block_bytes_layer * max(1, m.num_layers)
        incoming = [0] * self.world
        for mv in m.moves:
            incoming[mv.dst_rank] += 1
        dst_used = ledger.usage_under(m.dst.value, owners)
        for r in range(self.world):
            buf_bytes = incoming[r] * m.kv_block_bytes_layer + m.weight_recv_bytes[r]
            buf_blocks = -(-int(buf_bytes) // block_all_layers) if block_all_layers else 0
            peak = ledger.used[r] + incoming[r] + buf_blocks + reserve
            if dst_used[r] + reserve > dst_cap:
                return (f"rank {r}: destination {m.dst.value} needs {dst_used[r]} KV blocks (+{reserve} for the "
                        f"step) but holds at most {dst_cap} there")
            if peak > cap:
                return (f"rank {r}: handoff peak {peak} blocks (resident {ledger.used[r]} + incoming {incoming[r]}"
                        f" + one-layer buffers {buf_blocks} + step {reserve}) exceeds the pool of {cap}")
        return None

    def record(self, src: str, dst: str) -> None:
        self.switch_counts[(src, dst)] = self.switch_counts.get((src, dst), 0) + 1
