"""KPool selection (GLM-5.3-Flash's NoPE MLA-DSA layers) on the paged cache, as DSA's per-layer subset.

Per MLA layer with a full indexer (splash.models.kpool), each step: the new tokens' indexer keys and pool gate
logits go to the cache at their latent's slots; the rows this rank attends score the complete pools it holds of
their request (a pool is P = index_kpool consecutive columns of a page row) and keep the best ``index_topk // P``
ending at or before the row's position, plus the row's own incomplete pool (the tail) where it is held; the
selection becomes ``meta.sparse[layer]`` as in splash.attention.dsa, including its placement per layout (under CP
a pool lies in one block, the tail is attended by the rank holding it).
"""
from __future__ import annotations

import torch

from splash.attention.dsa import SparseSelection, global_topk, held_slots, query_groups
from splash.models.indexer import NO_KEY, index_scores, indexer_queries, select_topk_keys
from splash.models.kpool import KPoolWeights, kpool_keys, pool_keys


def needs_selection(meta, topk: int, P: int, tail: bool) -> bool:
    """Some row of the step has more complete pools than it keeps (or the tail is not always attended)."""
    return meta.num_rows > 0 and (not tail or (int(meta.q_pos.max()) + 1) // P > topk // P)


def _pools(meta, reqs: torch.Tensor, P: int):
    """Slots, positions and held mask [G, pools, P] of the request group's page rows, padded to whole pools."""
    slots, kpos, held = held_slots(meta, reqs)
    pad = -slots.shape[1] % P
    if pad:
        slots, kpos = (torch.nn.functional.pad(t, (0, pad)) for t in (slots, kpos))
        held = torch.nn.functional.pad(held, (0, pad), value=False)
    G = len(reqs)
    return slots.view(G, -1, P), kpos.view(G, -1, P), held.view(G, -1, P)


def local_candidates(cache, layer: int, meta, w: KPoolWeights, q: torch.Tensor, hw: torch.Tensor, K: int,
                     tail: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """For every row of `meta`: (slots [N, K·P (+ P)], valid [N, K·P (+ P)], pool order keys [N, K], NO_KEY
    where none) — its best K pools held here, each expanded to its P slots, then its tail pool's slots (`tail`).
    Exact score ties break towards the earlier pool (indexer.order_keys, keyed by the pool's first position), so
    CP's global top-k over these keys is the one-rank choice, ties included."""
    n, dev, P = meta.num_rows, q.device, w.pool
    width = (K + int(tail)) * P
    slots = torch.zeros(n, width, dtype=torch.long, device=dev)
    valid = torch.zeros(n, width, dtype=torch.bool, device=dev)
    vals = torch.full((n, K), NO_KEY, dtype=torch.long, device=dev)
    offs = torch.arange(P, device=dev)
    for reqs, nq in query_groups(meta):
        ks, kpos, held = _pools(meta, reqs, P)
        G, NP = ks.shape[:2]
        if NP == 0:
            continue
        rows = (meta.qo_indptr[reqs].long()[:, None] + torch.arange(nq, device=dev)).reshape(-1)
        qpos = meta.q_pos[rows].view(G, nq)
        flat_s, flat_p, flat_h = ks.reshape(G, 1, -1), kpos.reshape(G, 1, -1), held.reshape(G, 1, -1)

        def take(t: torch.Tensor, cols: torch.Tensor) -> torch.Tensor:   # [G, 1, T] at cols [G, nq, c]
            return t.expand(-1, nq, -1).gather(2, cols)

        if K:
            keys = pool_keys(w, cache.read_index(layer, ks))                                 # [G, NP, d_I]
            scores = index_scores(q[rows].view(G, nq, *q.shape[1:]), hw[rows].view(G, nq, -1), keys,
                                  w.softmax_scale)                                            # [G, nq, NP]
            vis = held.all(-1)[:, None, :] & (kpos[..., -1][:, None, :] <= qpos[..., None])
            idx, ok, v = select_topk_keys(scores, vis, min(K, NP), kpos[..., 0][:, None, :] // P)
            kk = idx.shape[-1]
            cols = (idx[..., None] * P + offs).reshape(G, nq, kk * P)
            slots[rows, :kk * P] = take(flat_s, cols).reshape(G * nq, -1)
            valid[rows, :kk * P] = ok.repeat_interleave(P, dim=-1).reshape(G * nq, -1)
            vals[rows, :kk] = v.reshape(G * nq, kk)
        if tail:  # positions (p + 1) // P · P … p, in the pool (of this rank) starting there
            here = held[..., 0][:, None, :] & (kpos[..., 0][:, None, :] == ((qpos + 1) // P * P)[..., None])
            cols = here.float().argmax(-1, keepdim=True) * P + offs                          # [G, nq, P]
            ok = here.any(-1, keepdim=True) & take(flat_h, cols) & (take(flat_p, cols) <= qpos[..., None])
            slots[rows, K * P:] = take(flat_s, cols).reshape(G * nq, P)
            valid[rows, K * P:] = ok.reshape(G * nq, P)
    return slots, valid, vals


def select_layer(r, layer: int, cl: int, meta, key_x: torch.Tensor, q_in: tuple, cp_comm=None) -> None:
    """Layer `layer` (pool layer `cl`) on rank context `r`: store the new tokens' KPool vectors, then set
    ``meta.sparse[cl]``; as dsa.select_layer, with key_x the stored rows' inputs and q_in = (x, q_resid)."""
    hy, w = r.cfg.hybrid, r.weights.layers[layer].indexer
    if w is None:  # "shared": the previous indexed layer's selection, as it is (same blocks, same slots)
        meta.sparse[cl] = meta.sparse.get(cl - 1)
        return
    if meta.write_slots.numel():
        r.cache.write_index(cl, meta.write_slots, kpool_keys(w, key_x))
    P, tail, topk = w.pool, hy.index_kpool_always_select_tail, r.cfg.index_topk
    if not needs_selection(meta, topk, P, tail):
        meta.sparse[cl] = None
        return
    x, qa = q_in
    q, hw = indexer_queries(w, qa, x, None, None)
    K = min(topk // P, (int(meta.q_pos.max()) + 1) // P)   # the same on every CP rank (positions are global)
    slots, valid, vals = local_candidates(r.cache, cl, meta, w, q, hw, K, tail)
    if cp_comm is not None and cp_comm.size > 1 and K:
        valid[:, :K * P] &= global_topk(vals, cp_comm, topk // P).repeat_interleave(P, dim=1)
    meta.sparse[cl] = SparseSelection(slots * valid, valid)
