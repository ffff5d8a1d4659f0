"""DSA on the paged cache: indexer keys beside the latent KV, per-layer top-k selection, sparse MLA over it.

Per layer with an indexer (splash.models.indexer), each step: the new tokens' indexer keys go to the cache at their
latent's slots; the rows this rank attends score the positions it holds for their request (one pass per request
group, keys read through the page table) and keep the top-k visible ones; the selection (physical slots + validity)
becomes ``meta.sparse[layer]``, which the kernel attends in place. A "shared" layer reuses its source layer's
selection; when no row sees more than top-k positions the layer stays dense (``None``), without scoring.

Placement: TP, every rank stores every key and selects the same; DP-attn / DOP, the owner; CP, each rank scores the
positions it holds, and the all-gathered per-rank candidates decide the global top-k. Candidates travel as order
keys (score, then the earlier position on a tie), so the global top-k is the one-rank top-k even on ties.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from splash.models.indexer import NO_KEY, index_scores, indexer_keys, indexer_queries, select_topk_keys

SPARSE_SCRATCH_BYTES = 32 << 20  # bound on the gathered keys of one chunk of rows in sparse_attend


@dataclass
class SparseSelection:
    slots: torch.Tensor   # [N, K] int64: physical slots (page × block_size + offset) in this rank's pool
    valid: torch.Tensor   # [N, K] bool: selected (False: padding, or a candidate another CP rank won)


def needs_selection(meta, topk: int) -> bool:
    """Some row of the step sees more than `topk` positions (positions are global, so every CP rank agrees)."""
    return meta.num_rows > 0 and int(meta.q_pos.max()) + 1 > topk


def query_groups(meta) -> list[tuple[torch.Tensor, int]]:
    """(request indices, query rows per request): every decode request together, each prefill alone."""
    lens, dev = meta.q_lens, meta.q_pos.device
    dec = [i for i, n in enumerate(lens) if n == 1]
    out = [(torch.tensor(dec, dtype=torch.long, device=dev), 1)] if dec else []
    return out + [(torch.tensor([i], device=dev), n) for i, n in enumerate(lens) if n > 1]


def held_slots(meta, reqs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Slots [G, T], key positions [G, T] and held mask [G, T] of every page the requests hold here."""
    bs = meta.block_size
    rows, npg = meta.req_rows[reqs], meta.num_pages[reqs].long()
    P = int(npg.max()) if npg.numel() else 0
    held = torch.arange(P, device=npg.device)[None, :] < npg[:, None]
    pid = meta.pages[rows, :P].long() * held
    offs = torch.arange(bs, device=npg.device)
    slots = (pid[:, :, None] * bs + offs).reshape(len(reqs), -1)
    kpos = (meta.logical[rows, :P].long()[:, :, None] * bs + offs).reshape(len(reqs), -1)
    return slots, kpos, held[:, :, None].expand(-1, -1, bs).reshape(len(reqs), -1)


def held_scores(cache, layer: int, meta, q: torch.Tensor, hw: torch.Tensor, scale: float):
    """Index scores of every row of `meta` against the positions held here for its request, one request group
    at a time (every decode row together, each prefill alone; groups holding nothing skipped): yields (rows
    [G × Q] into meta's rows, slots [G, T], key positions [G, T], scores [G, Q, T] fp32, visible [G, Q, T])."""
    dev = q.device
    for reqs, nq in query_groups(meta):
        ks, kpos, held = held_slots(meta, reqs)
        if ks.shape[1] == 0:
            continue
        rows = (meta.qo_indptr[reqs].long()[:, None] + torch.arange(nq, device=dev)).reshape(-1)
        G = len(reqs)
        scores = index_scores(q[rows].view(G, nq, *q.shape[1:]), hw[rows].view(G, nq, -1),
                              cache.read_index(layer, ks), scale)                       # [G, Q, T]
        vis = held[:, None, :] & (kpos[:, None, :] <= meta.q_pos[rows].view(G, nq, 1))
        yield rows, ks, kpos, scores, vis


def local_candidates(cache, layer: int, meta, q: torch.Tensor, hw: torch.Tensor, k: int, scale: float,
                     width: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Top-k of the positions held here for every row of `meta`: (slots, valid, order keys), each [N, width]
    (keys NO_KEY where invalid). q [N, H_i, d_i] and hw [N, H_i] are the rows' indexer queries / head weights."""
    n, dev = meta.num_rows, q.device
    slots = torch.zeros(n, width, dtype=torch.long, device=dev)
    valid = torch.zeros(n, width, dtype=torch.bool, device=dev)
    keys = torch.full((n, width), NO_KEY, dtype=torch.long, device=dev)
    for rows, ks, kpos, scores, vis in held_scores(cache, layer, meta, q, hw, scale):
        G, nq = scores.shape[:2]
        idx, ok, v = select_topk_keys(scores, vis, min(k, width), kpos[:, None, :])
        kk = idx.shape[-1]
        slots[rows, :kk] = ks[:, None, :].expand(-1, nq, -1).gather(2, idx).reshape(G * nq, kk)
        valid[rows, :kk] = ok.reshape(G * nq, kk)
        keys[rows, :kk] = v.reshape(G * nq, kk)
    return slots, valid, keys


def global_topk(keys: torch.Tensor, comm, k: int) -> torch.Tensor:
    """CP: which of this rank's candidates [N, K] (int64 order keys, NO_KEY = none) are in the global top-k of
    the rows over every rank's candidates -> bool [N, K]. Every rank computes the same global choice; the keys
    are distinct per row (they carry the position), so it is the one-rank choice, ties included."""
    n, K = keys.shape
    R = comm.size
    every = comm.all_gather(keys.contiguous()).view(R, n, K).permute(1, 0, 2).reshape(n, R * K)
    top = every.topk(min(k, R * K), dim=-1).indices
    chosen = torch.zeros(n, R * K, dtype=torch.bool, device=keys.device).scatter_(1, top, True) & (every != NO_KEY)
    return chosen.view(n, R, K)[:, comm.rank]


def select_layer(r, layer: int, meta, key_in: tuple, q_in: tuple, cp_comm=None) -> None:
    """Layer `layer`'s DSA step on rank context `r`: store the new keys, then set ``meta.sparse[layer]``. key_in =
    (x, cos, sin) of the rows this rank stores (meta.write_rows order); q_in = (x, q_resid, cos, sin) of the rows it
    attends. cp_comm: the group, under CP (global top-k)."""
    cfg = r.cfg
    if not cfg.has_indexer(layer):
        meta.sparse[layer] = meta.sparse.get(cfg.indexer_source(layer))
        return
    w = r.weights.layers[layer].indexer
    if meta.write_slots.numel():
        r.cache.write_index(layer, meta.write_slots, indexer_keys(w, *key_in))
    k = cfg.index_topk
    if not needs_selection(meta, k):
        meta.sparse[layer] = None
        return
    x, qa, cos, sin = q_in
    q, hw = indexer_queries(w, qa, x, cos, sin)
    width = min(k, int(meta.q_pos.max()) + 1)
    slots, valid, keys = local_candidates(r.cache, layer, meta, q, hw, k, w.softmax_scale, width)
    if cp_comm is not None and cp_comm.size > 1:
        valid = valid & global_topk(keys, cp_comm, k)
    meta.sparse[layer] = SparseSelection(slots * valid, valid)


def sparse_attend(q_latent: torch.Tensor, q_rope: torch.Tensor, cache, layer: int, sel: SparseSelection,
                  scale: float, scratch_bytes: int = SPARSE_SCRATCH_BYTES) -> tuple[torch.Tensor, torch.Tensor]:
    """Latent attention of rows [N, H, d_c] / [N, H, d_r] over their selected slots only -> (õ [N, H, d_c] fp32,
    natural-log LSE [N, H]; −inf and õ = 0 for a row with no selected key here). Rows go in chunks so the
    gathered (dequantised) keys stay under `scratch_bytes`."""
    n, h, dc = q_latent.shape
    K = sel.slots.shape[1]
    o = torch.zeros(n, h, dc, device=q_latent.device)
    lse = torch.full((n, h), float("-inf"), device=q_latent.device)
    if K == 0 or n == 0:
        return o, lse
    per_row = K * (dc + q_rope.shape[2] + 2 * h) * 4
    step = max(1, scratch_bytes // per_row)
    for a in range(0, n, step):
        b = min(n, a + step)
        c, kpe = cache.read(layer, sel.slots[a:b])                                     # [m, K, d_c], [m, K, d_r]
        sc = (torch.bmm(q_latent[a:b].float(), c.transpose(1, 2))
              + torch.bmm(q_rope[a:b].float(), kpe.transpose(1, 2))) * scale            # [m, H, K]
        sc = sc.masked_fill(~sel.valid[a:b, None, :], float("-inf"))
        part = torch.logsumexp(sc, dim=-1)
        safe = torch.where(torch.isfinite(part), part, torch.zeros_like(part))
        o[a:b] = torch.bmm(torch.exp(sc - safe[..., None]), c)
        lse[a:b] = part
    return o, lse
