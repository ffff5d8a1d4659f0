"""Moving attention projections between head-sharded and replicated placement (one layer at a time).

Weights travel as stored, never dequantised: quantised ones with exactly the scale blocks of the sender's shard,
packed fp32 ones (splash.native.packed) packed, every part with heads as its first dimension so shards concatenate
and slice along it; the receiver rebuilds them bit for bit. Common state (Q-A, KV-A) is not touched.
"""
from __future__ import annotations

from dataclasses import replace

import torch

from splash.native.packed import PackedLinear
from splash.models.qweight import BLOCK, FP8, QuantWeight, cat_cols, cat_rows, owned, scale_blocks
from splash.models.weights import AttnWeights


def _head_rows(w: AttnWeights) -> list[torch.Tensor]:
    """Q-B, W_UK, W_UV and O (column-sharded: transposed) as views whose first dimension runs over heads."""
    q_b = w.q_b.packed if isinstance(w.q_b, PackedLinear) else w.q_b
    o = w.o.packed.transpose(0, 1) if isinstance(w.o, PackedLinear) else w.o.T
    return [q_b, w.w_uk, w.w_uv, o]


def _from_rows(w: AttnWeights, q_b: torch.Tensor, w_uk: torch.Tensor, w_uv: torch.Tensor, o_rows: torch.Tensor,
               heads: range) -> AttnWeights:
    """Inverse of `_head_rows` for the heads in `heads` (each part its own storage), stored as `w`'s are."""
    if isinstance(w.q_b, PackedLinear):
        q_b = PackedLinear.of_strips(q_b)
    if isinstance(w.o, PackedLinear):
        o = PackedLinear.of_strips(o_rows.transpose(0, 1).contiguous())
    else:
        o = o_rows.T.contiguous()
    return replace(w, q_b=q_b, w_uk=w_uk, w_uv=w_uv, o=o, heads=heads)


def _quant_parts(w: AttnWeights) -> list[QuantWeight]:
    return [w.q_b, w.kv_b, w.o]


def pack_shard(w: AttnWeights) -> torch.Tensor:
    """This rank's head shard of Q-B, KV-B (W_UK, W_UV) and O as one flat tensor (uint8 bytes when quantised)."""
    if w.kv_b is not None:
        return torch.cat([t.contiguous().reshape(-1).view(torch.uint8) for q in _quant_parts(w) for t in q.tensors()])
    return torch.cat([p.reshape(-1) for p in _head_rows(w)])


def shard_geometry(q: QuantWeight, heads: range, per_head: int, by_rows: bool) -> tuple[tuple, tuple, int]:
    """(data shape, scale shape, offset in first block) of the shard for `heads` of the weight `q` is a shard of."""
    a0, n = heads.start * per_head, len(heads) * per_head
    other = q.shape[1] if by_rows else q.shape[0]
    data = (n, other) if by_rows else (other, n)
    if q.fmt != FP8:
        return data, ((n, 1) if by_rows else (other, 1)), 0
    nb, nother = scale_blocks(a0, n)[1], -(-other // BLOCK)
    return data, ((nb, nother) if by_rows else (nother, nb)), a0 % BLOCK


def take_quant_shard(gathered: torch.Tensor, off: int, q: QuantWeight, heads: range, per_head: int,
                     by_rows: bool) -> tuple[QuantWeight, int]:
    """The shard for `heads` of `q`'s weight, read from the packed bytes `gathered` at `off` -> (shard, next off)."""
    dshape, sshape, a_off = shard_geometry(q, heads, per_head, by_rows)
    nd, ns = dshape[0] * dshape[1] * q.data.element_size(), sshape[0] * sshape[1] * 4
    data = gathered[off:off + nd].clone().view(q.data.dtype).view(dshape)
    scale = gathered[off + nd:off + nd + ns].clone().view(torch.float32).view(sshape)
    r_off, c_off = (a_off, q.col_off) if by_rows else (q.row_off, a_off)
    return QuantWeight(data, scale, q.fmt, q.dtype, r_off, c_off), off + nd + ns


def unpack_full(w: AttnWeights, gathered: torch.Tensor, world: int, num_heads: int) -> AttnWeights:
    """Rebuild replicated (all-head) weights from every rank's packed shard, concatenated in rank order."""
    if w.kv_b is not None:   # Q-B, KV-B by rows, O by columns: each rank's values and scale blocks, bit for bit
        pieces: list[list[QuantWeight]] = [[], [], []]
        off, per = 0, num_heads // world
        for r in range(world):
            for i, (q, rows) in enumerate(zip(_quant_parts(w), (True, True, False))):
                shard, off = take_quant_shard(gathered, off, q, range(r * per, (r + 1) * per),
                                              (q.shape[0] if rows else q.shape[1]) // len(w.heads), rows)
                pieces[i].append(shard)
        return replace(w, q_b=cat_rows(pieces[0]), kv_b=cat_rows(pieces[1]), o=cat_cols(pieces[2]),
                       heads=range(num_heads))
    shapes = [p.shape for p in _head_rows(w)]
    per_rank = [row.split([s.numel() for s in shapes]) for row in gathered.view(world, -1)]
    return _from_rows(w, *(torch.cat([parts[i].view(s) for parts in per_rank]) for i, s in enumerate(shapes)),
                      heads=range(num_heads))


def slice_heads(w: AttnWeights, heads: range, qk_head_dim: int) -> AttnWeights:
    """Keep only `heads` of replicated weights (the 'discard' of a replicated→sharded switch)."""
    h0, h1 = heads.start, heads.stop
    if w.kv_b is not None:
        rows_kv = w.kv_b.shape[0] // len(w.heads)
        dv = w.o.shape[1] // len(w.heads)
        return replace(w, q_b=w.q_b.rows(h0 * qk_head_dim, h1 * qk_head_dim),
                       kv_b=w.kv_b.rows(h0 * rows_kv, h1 * rows_kv), o=w.o.cols(h0 * dv, h1 * dv), heads=heads)
    rows = _head_rows(w)
    q_b, w_uk, w_uv, o = (p[h0 * (p.shape[0] // len(w.heads)):h1 * (p.shape[0] // len(w.heads))] for p in rows)
    return _from_rows(w, owned(q_b), owned(w_uk), owned(w_uv), o, heads)   # _from_rows copies O
