"""Handoff pieces of hybrid (glm5_next) models: KDA projections by head and per-request recurrent state.

KDA projections follow Q-B/KV-B/O's placement, so they are gathered / sliced when those are; every head-indexed
part travels as raw bytes, heads first (quantised ones with exactly their shard's scale blocks), and the state as
raw fp32 rows per request and head range, so both arrive bit for bit.
"""
from __future__ import annotations

from dataclasses import replace

import torch

from splash.models.kda import KDAWeights
from splash.models.qweight import QuantWeight, RowStack, cat_cols, cat_rows
from splash.switching.weights_transfer import take_quant_shard


# head-indexed fields that may be stored quantised: (by rows, rows/columns per head in units of head_dim, or 1)
_QUANT = {"f_b": (True, True), "b": (True, False), "g_b": (True, True), "o": (False, True)}


def _split(w: KDAWeights) -> tuple[dict[str, torch.Tensor], dict[str, tuple[QuantWeight, bool, int]]]:
    """Every head-indexed part of `w`: plain ones heads first, quantised ones as (weight, by rows, per head)."""
    H, d = w.num_heads, w.head_dim
    hid = w.f_a.shape[1]
    plain = {"conv": w.conv.view(3, H, d, -1).transpose(0, 1), "dt_bias": w.dt_bias.view(H, d),
             "a_log": w.a_log.view(H, 1)}
    quant: dict[str, tuple[QuantWeight, bool, int]] = {}
    if isinstance(w.qkv, RowStack):
        for i, p in enumerate(w.qkv.parts):
            if isinstance(p, QuantWeight):
                quant[f"qkv{i}"] = (p, True, d)
            else:
                plain[f"qkv{i}"] = p.view(H, d, hid)
    else:
        plain["qkv"] = w.qkv.view(3, H, d, hid).transpose(0, 1)
    for name, (rows, per_dim) in _QUANT.items():
        t = getattr(w, name)
        if isinstance(t, QuantWeight):
            quant[name] = (t, rows, d if per_dim else 1)
        elif name == "o":
            plain[name] = t.view(hid, H, d).permute(1, 0, 2)
        else:
            plain[name] = t.view(H, -1, t.shape[1])
    return plain, quant


def _join(w: KDAWeights, plain: dict, quant: dict, heads: range) -> KDAWeights:
    """KDAWeights for `heads` from parts shaped as `_split` gives them (quant: QuantWeights)."""
    H, d = len(heads), w.head_dim
    hid = w.f_a.shape[1]
    if "qkv" in plain:
        qkv = plain["qkv"].transpose(0, 1).reshape(3 * H * d, hid).contiguous()
    else:
        qkv = RowStack([quant[f"qkv{i}"] if f"qkv{i}" in quant else plain[f"qkv{i}"].reshape(H * d, hid).contiguous()
                        for i in range(3)])
    out = {}
    for name in _QUANT:
        if name in quant:
            out[name] = quant[name]
        elif name == "o":
            out[name] = plain[name].permute(1, 0, 2).reshape(hid, H * d).contiguous()
        else:
            out[name] = plain[name].reshape(-1, plain[name].shape[-1]).contiguous()
    return replace(w, qkv=qkv, conv=plain["conv"].transpose(0, 1).reshape(3, H * d, -1).contiguous(),
                   dt_bias=plain["dt_bias"].reshape(H * d).contiguous(), a_log=plain["a_log"].reshape(H).contiguous(),
                   heads=heads, **out)


def slice_kda(w: KDAWeights, heads: range) -> KDAWeights:
    """Keep `heads` (absolute ids) of replicated KDA weights (replicated → sharded 'discard')."""
    h0 = w.heads.start
    a, b = heads.start - h0, heads.stop - h0
    plain, quant = _split(w)
    return _join(w, {k: p[a:b].clone() for k, p in plain.items()},
                 {k: (q.rows if rows else q.cols)(a * per, b * per) for k, (q, rows, per) in quant.items()}, heads)


def pack_kda(w: KDAWeights) -> torch.Tensor:
    """This rank's KDA head shard as uint8 bytes: plain parts, then each quantised part's values and scales."""
    plain, quant = _split(w)
    parts = [p for _, p in sorted(plain.items())] + [t for _, (q, _, _) in sorted(quant.items()) for t in q.tensors()]
    return torch.cat([p.contiguous().reshape(-1).view(torch.uint8) for p in parts])


def unpack_kda(w: KDAWeights, gathered: torch.Tensor, world: int, num_heads: int) -> KDAWeights:
    """All heads from every rank's packed shard (rank order; each shaped as `w`), bit for bit."""
    plain, quant = _split(w)
    per = num_heads // world
    pieces: dict[str, list] = {k: [] for k in list(plain) + list(quant)}
    off = 0
    for r in range(world):
        for k, p in sorted(plain.items()):
            pieces[k].append(gathered[off:off + p.nbytes].clone().view(p.dtype).view(p.shape))
            off += p.nbytes
        for k, (q, rows, n) in sorted(quant.items()):
            shard, off = take_quant_shard(gathered, off, q, range(r * per, (r + 1) * per), n, rows)
            pieces[k].append(shard)
    return _join(w, {k: torch.cat(pieces[k], dim=0) for k in plain},
                 {k: (cat_rows if rows else cat_cols)(pieces[k]) for k, (_, rows, _) in quant.items()},
                 range(num_heads))


class StateHandoff:
    """Moves per-request KDA state (``state_moves``): one all-to-all per KDA layer, beside its KV transfer, landed
    right before the layer runs. Sound per layer: every state is final at the boundary and the next step touches
    layer j's only when it runs. `begin` stores each destination tensor at once (kept rows copied in; the source
    tensors kept aside for sending)."""

    def __init__(self, ctx, manifest):
        self.r, self.m = ctx, manifest  # ctx: splash.attention.context.RankContext
        self.handles: dict[int, object] = {}

    def begin(self) -> None:
        r, m, me = self.r, self.m, self.r.comm.rank
        # the source tensors, with the heads each holds (its width says how many)
        old = {req: r.states.get(req) for req in r.states.requests()}
        self.old = {req: (t, m.src_heads_of(req, me, t.shape[1])) for req, t in old.items()}
        self.sends = sorted((mv for mv in m.state_moves if mv.src_rank == me), key=lambda mv: mv.dst_rank)
        self.recv = sorted((mv for mv in m.state_moves if mv.dst_rank == me), key=lambda mv: mv.src_rank)
        self.counts, self.rcounts = [0] * m.world, [0] * m.world
        for mv in self.sends:
            self.counts[mv.dst_rank] += (mv.h1 - mv.h0) * r.states.width
        for mv in self.recv:
            self.rcounts[mv.src_rank] += (mv.h1 - mv.h0) * r.states.width
        self.new: dict[str, tuple[torch.Tensor, range]] = {}
        for req in set(self.old) | {mv.req for mv in self.recv}:
            need = m.dst_heads_of(req, me)
            if need is None:
                r.states.release(req)
                continue
            st = torch.empty(r.states.num_layers, len(need), r.states.width, dtype=torch.float32,
                             device=r.states.device)
            if req in self.old:
                old, held = self.old[req]
                lo, hi = max(need.start, held.start), min(need.stop, held.stop)
                if lo < hi:
                    st[:, lo - need.start:hi - need.start] = old[:, lo - held.start:hi - held.start]
            r.states.put(req, st)
            self.new[req] = (st, need)
        self.pending = set(range(r.states.num_layers)) if m.state_moves else set()

    def start_layer(self, j: int) -> None:
        """Issue KDA layer j's all-to-all (every rank issues it whenever the manifest moves any state)."""
        if j not in self.pending or j in self.handles:
            return
        rows = []
        for mv in self.sends:
            old, held = self.old[mv.req]
            rows.append(old[j, mv.h0 - held.start:mv.h1 - held.start].reshape(-1))
        data = torch.cat(rows) if rows else torch.empty(0, dtype=torch.float32, device=self.r.states.device)
        self.handles[j] = self.r.comm.iall_to_allv(data, self.counts, self.rcounts)

    def finish_layer(self, j: int) -> None:
        """Land KDA layer j's received rows in the destination tensors."""
        if j not in self.pending:
            return
        self.start_layer(j)
        data = self.handles.pop(j).wait()
        self.pending.discard(j)
        W = self.r.states.width
        for mv, rows in zip(self.recv, data.split([(mv.h1 - mv.h0) * W for mv in self.recv])):
            st, need = self.new[mv.req]
            st[j, mv.h0 - need.start:mv.h1 - need.start] = rows.view(-1, W)

    def finish(self) -> None:
        """Every layer landed; the source tensors are dropped."""
        for j in sorted(self.pending):
            self.finish_layer(j)
        self.old = {}

