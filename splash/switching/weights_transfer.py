"""Moving attention projections between head-sharded and replicated placement (one layer at a time)."""
from __future__ import annotations

import torch

from splash.models.weights import AttnWeights


def _parts(w: AttnWeights) -> list[torch.Tensor]:
    return [w.q_b, w.w_uk, w.w_uv, w.o.T.contiguous()]  # O is column-sharded: gather its transpose by rows


def pack_shard(w: AttnWeights) -> torch.Tensor:
    """This rank's head shard of Q-B, W_UK, W_UV and O as one flat tensor."""
    return torch.cat([p.reshape(-1) for p in _parts(w)])


def unpack_full(w: AttnWeights, gathered: torch.Tensor, world: int, num_heads: int) -> AttnWeights:
    """Rebuild replicated (all-head) weights from every rank's packed shard, concatenated in rank order."""
    shapes = [p.shape for p in _parts(w)]
    per_rank = gathered.view(world, -1)
    pieces: list[list[torch.Tensor]] = [[] for _ in shapes]
    for r in range(world):
        off = 0
        for i, s in enumerate(shapes):
            n = s.numel()
            pieces[i].append(per_rank[r, off:off + n].view(s))
            off += n
    q_b, w_uk, w_uv, o_t = (torch.cat(p, dim=0) for p in pieces)
    return AttnWeights(q_a=w.q_a, q_a_norm=w.q_a_norm, q_b=q_b, kv_a=w.kv_a, kv_a_norm=w.kv_a_norm,
                       w_uk=w_uk, w_uv=w_uv, o=o_t.T.contiguous(), heads=range(num_heads))


def slice_heads(w: AttnWeights, heads: range, qk_head_dim: int) -> AttnWeights:
    """Keep only `heads` of replicated weights (the 'discard' of a replicated→sharded switch)."""
    h0, h1 = heads.start, heads.stop
    v = w.w_uv.shape[1]
    q_in = w.q_b.shape[1]
    q_b = w.q_b.view(-1, qk_head_dim, q_in)[h0:h1].reshape(-1, q_in).contiguous()
    o = w.o.view(w.o.shape[0], -1, v)[:, h0:h1].reshape(w.o.shape[0], -1).contiguous()
    return AttnWeights(q_a=w.q_a, q_a_norm=w.q_a_norm, q_b=q_b, kv_a=w.kv_a, kv_a_norm=w.kv_a_norm,
                       w_uk=w.w_uk[h0:h1].contiguous(), w_uv=w.w_uv[h0:h1].contiguous(), o=o, heads=heads)
