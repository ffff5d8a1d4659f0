"""Handoff pieces of hybrid (glm5_next) models: KDA projections by head and per-request recurrent state.

KDA projections follow the MLA projections' placement (head-sharded in TP/DOP, replicated in DP-attn/CP), so
they are all-gathered / sliced exactly when Q-B/KV-B/O are; every head-indexed part travels as raw bytes
(head dimension first), so the receiver rebuilds the weights bit for bit. The recurrent + conv state moves
per request and per head range as raw fp32 rows (splash.kv.recurrent), so it survives byte-exact.
"""
from __future__ import annotations

from dataclasses import replace

import torch

from splash.models.kda import KDAWeights


def _head_parts(w: KDAWeights) -> list[torch.Tensor]:
    """Every head-indexed tensor of `w` with heads as dim 0."""
    H, d = w.num_heads, w.head_dim
    hid = w.qkv.shape[1]
    return [w.qkv.view(3, H, d, hid).transpose(0, 1), w.conv.view(3, H, d, -1).transpose(0, 1),
            w.f_b.view(H, d, -1), w.dt_bias.view(H, d), w.a_log.view(H, 1), w.b, w.g_b.view(H, d, -1),
            w.o.view(hid, H, d).permute(1, 0, 2)]


def _rebuild(w: KDAWeights, parts: list[torch.Tensor], heads: range) -> KDAWeights:
    H, d = len(heads), w.head_dim
    qkv, conv, f_b, dt, a_log, b, g_b, o = parts
    hid = qkv.shape[-1]
    return replace(w, qkv=qkv.transpose(0, 1).reshape(3 * H * d, hid).contiguous(),
                   conv=conv.transpose(0, 1).reshape(3, H * d, -1).contiguous(), f_b=f_b.reshape(H * d, -1).contiguous(),
                   dt_bias=dt.reshape(H * d).contiguous(), a_log=a_log.reshape(H).contiguous(), b=b.contiguous(),
                   g_b=g_b.reshape(H * d, -1).contiguous(), o=o.permute(1, 0, 2).reshape(hid, H * d).contiguous(),
                   heads=heads)


def slice_kda(w: KDAWeights, heads: range) -> KDAWeights:
    """Keep `heads` (absolute ids) of replicated KDA weights (replicated → sharded 'discard')."""
    h0 = w.heads.start
    sl = slice(heads.start - h0, heads.stop - h0)
    return _rebuild(w, [p[sl].clone() for p in _head_parts(w)], heads)


def pack_kda(w: KDAWeights) -> torch.Tensor:
    """This rank's KDA head shard as uint8 bytes."""
    return torch.cat([p.contiguous().reshape(-1).view(torch.uint8) for p in _head_parts(w)])


def unpack_kda(w: KDAWeights, gathered: torch.Tensor, world: int, num_heads: int) -> KDAWeights:
    """All heads from every rank's packed shard (rank order; equal shards of `w`'s shapes)."""
    local = _head_parts(w)
    per_rank = gathered.view(world, -1)
    pieces: list[list[torch.Tensor]] = [[] for _ in local]
    for r in range(world):
        off = 0
        for i, p in enumerate(local):
            n = p.numel() * p.element_size()
            pieces[i].append(per_rank[r, off:off + n].clone().view(p.dtype).view(p.shape))
            off += n
    return _rebuild(w, [torch.cat(ps, dim=0) for ps in pieces], range(num_heads))


class StateHandoff:
    """Moves per-request KDA state for a manifest's ``state_moves`` (one all-to-all, raw fp32 rows).

    Started at the step boundary (after the source's last update) and finished before the first KDA layer
    runs; afterwards every rank holds, per request, exactly the heads the destination layout assigns it."""

    def __init__(self, runner, manifest, dst_heads: range):
        self.r, self.m, self.dst_heads = runner, manifest, dst_heads
        self.handle = None

    def start(self) -> None:
        r, m, me = self.r, self.m, self.r.comm.rank
        self.old = {req: (r.states.get(req), heads) for req, heads in self._held_before(me).items()}
        sends = sorted((mv for mv in m.state_moves if mv.src_rank == me), key=lambda mv: mv.dst_rank)
        counts = [0] * m.world
        rows = []
        for mv in sends:
            st, held = self.old[mv.req]
            rows.append(st[:, mv.h0 - held.start:mv.h1 - held.start].contiguous().reshape(-1))
            counts[mv.dst_rank] += rows[-1].numel()
        self.recv = sorted((mv for mv in m.state_moves if mv.dst_rank == me), key=lambda mv: mv.src_rank)
        rcounts = [0] * m.world
        for mv in self.recv:
            rcounts[mv.src_rank] += r.states.num_layers * (mv.h1 - mv.h0) * r.states.width
        data = torch.cat(rows) if rows else torch.empty(0, dtype=torch.float32, device=r.states.device)
        if r.comm.size > 1:
            self.handle = r.comm.iall_to_allv(data, counts, rcounts)
        self.local = data

    def _held_before(self, me: int) -> dict[str, range]:
        """Heads of each request this rank holds in the source layout (from the store: its state's width)."""
        out = {}
        for req in self.r.states.requests():
            n = self.r.states.get(req).shape[1]
            out[req] = self.m.src_heads_of(req, me, n)
        return out

    def finish(self) -> None:
        r, m, me = self.r, self.m, self.r.comm.rank
        if self.handle is None and not self.recv and not self.old:
            return
        data = self.handle.wait() if self.handle is not None else self.local
        L, W = r.states.num_layers, r.states.width
        got: dict[str, list[tuple[int, torch.Tensor]]] = {}
        off = 0
        for mv in self.recv:
            n = L * (mv.h1 - mv.h0) * W
            got.setdefault(mv.req, []).append((mv.h0, data[off:off + n].view(L, mv.h1 - mv.h0, W)))
            off += n
        for req in set(self.old) | set(got):
            need = m.dst_heads_of(req, me, self.dst_heads)
            if need is None:
                r.states.release(req)
                continue
            parts = list(got.get(req, []))
            if req in self.old:
                st, held = self.old[req]
                lo, hi = max(need.start, held.start), min(need.stop, held.stop)
                if lo < hi:
                    parts.append((lo, st[:, lo - held.start:hi - held.start]))
            parts.sort(key=lambda p: p[0])
            r.states.put(req, torch.cat([p for _, p in parts], dim=1).clone())
        self.handle = None
