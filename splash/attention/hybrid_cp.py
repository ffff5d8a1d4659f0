"""GLM-5.3-Flash MLA-DSA layers under CP: KPool selection with a global top-k over position shards.

A request's history is block-round-robin over the ranks (splash.layouts.ownership.cp_block_rank); with
index_kpool dividing block_size every pool lies inside one block, so its key is computed where it lives. Per
layer with a full indexer, every rank scores its own complete pools for every query row, keeps its best
k = min(index_topk / P, T / P) candidates (score, pool id), and one all-gather exchanges them; every rank then
takes the same global top-k and attends, with all heads, the selected pools (and the query's tail pool) that
it holds, giving a partial output and LSE that merge exactly across ranks (as dense CP does). Shared indexer
layers reuse the selected pool ids. The KDA layers of the same step run owner-run on the request's anchor rank.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from splash.attention import mla
from splash.models.kpool import indexer_keys, indexer_queries


def local_history(r, req: str, end: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(positions, slots) of the request's tokens < end that this rank holds, in position order."""
    bs, table = r.block_size, r.bm.table(req)
    blocks, dev = sorted(b for b in table if b * bs < end), r.device
    if not blocks:
        return torch.empty(0, dtype=torch.long, device=dev), torch.empty(0, dtype=torch.long, device=dev)
    offs = torch.arange(bs, device=dev)
    pos = (torch.tensor(blocks, device=dev)[:, None] * bs + offs).reshape(-1)
    slots = (torch.tensor([table[b] for b in blocks], device=dev)[:, None] * bs + offs).reshape(-1)
    keep = pos < end
    return pos[keep], slots[keep]


def _local_pools(r, layer_w, cl: int, pos: torch.Tensor, slots: torch.Tensor, end: int, P: int):
    """(pool ids [m], pool keys [m, d_I]) of the complete pools (ending before `end`) held here."""
    full = pos[(pos // P + 1) * P <= end]
    ids = torch.unique(full // P)
    if ids.numel() == 0:
        return ids, torch.empty(0, r.cfg.index_head_dim, device=pos.device)
    sel = torch.isin(pos // P, ids)
    keys, gates = r.index_cache.read(cl, slots[sel])
    k = keys.view(len(ids), P, -1)
    prob = (gates.view(len(ids), P, -1) + layer_w.ape.float()).softmax(dim=1)
    return ids, (prob * k).sum(1)


def local_candidates(r, lw, cl, req, x_rows, qa_rows, end: int, K: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's best K pools for each query row of `req`: (scores [n, K] (-inf padding), pool ids [n, K])."""
    P = r.cfg.hybrid.index_kpool
    pos, slots = local_history(r, req.req_id, end)
    ids, pool_keys = _local_pools(r, lw.indexer, cl, pos, slots, end, P)
    n = x_rows.shape[0]
    vals = torch.full((n, K), float("-inf"), device=x_rows.device)
    out_ids = torch.full((n, K), -1.0, device=x_rows.device)
    if ids.numel():
        q, hw = indexer_queries(lw.indexer, x_rows, qa_rows)
        s = F.relu(torch.einsum("nhd,pd->nhp", q, pool_keys) * q.shape[-1] ** -0.5)
        score = torch.einsum("nh,nhp->np", hw, s)
        qpos = torch.arange(req.start_pos, req.end_pos, device=x_rows.device)
        score = score.masked_fill((ids[None, :] + 1) * P - 1 > qpos[:, None], float("-inf"))
        k = min(K, ids.numel())
        top = score.topk(k, dim=-1)
        vals[:, :k], out_ids[:, :k] = top.values, ids[top.indices].float()
    return vals, out_ids


def global_selection(comm, vals: torch.Tensor, ids: torch.Tensor, ks: torch.Tensor) -> torch.Tensor:
    """Every rank's candidates (all rows [N, K]) -> the global top-k pool ids [N, K] (-1: none); `ks` [N] is
    each row's k (its request's min(topk/P, T/P))."""
    if comm.size > 1:
        both = comm.all_gather(torch.cat([vals, ids], dim=1).contiguous()).view(comm.size, *vals.shape[:1], -1)
        K = vals.shape[1]
        vals = both[..., :K].permute(1, 0, 2).reshape(vals.shape[0], -1)
        ids = both[..., K:].permute(1, 0, 2).reshape(vals.shape[0], -1)
    K = int(ks.max()) if ks.numel() else 0
    top = vals.topk(min(K, vals.shape[1]), dim=-1)
    chosen = ids.gather(1, top.indices)
    rank_in_row = torch.arange(chosen.shape[1], device=chosen.device)[None, :]
    ok = torch.isfinite(top.values) & (rank_in_row < ks[:, None])
    return torch.where(ok, chosen, torch.full_like(chosen, -1.0))


def local_mask(pos_hist: torch.Tensor, qpos: torch.Tensor, chosen: torch.Tensor, P: int, tail: bool) -> torch.Tensor:
    """[n, m] visibility of the local positions for each query row: in a chosen pool, or in its tail pool."""
    pool = (pos_hist // P).float()
    mask = (pool[None, None, :] == chosen[:, :, None]).any(1)
    if tail:
        start = qpos[:, None] + 1 - (qpos[:, None] + 1) % P
        mask |= (pos_hist[None, :] >= start) & (pos_hist[None, :] <= qpos[:, None])
    return mask


def partial_attention(q: torch.Tensor, c_kv: torch.Tensor, mask: torch.Tensor, scale: float):
    """q̃ [n, H, d_c] over local keys c_kv [m, d_c] with mask [n, m] -> (õ [n, H, d_c], LSE [n, H])."""
    s = torch.einsum("nhc,tc->nht", q.float(), c_kv.float()) * scale
    s = s.masked_fill(~mask[:, None, :], float("-inf"))
    lse = torch.logsumexp(s, dim=-1)
    safe = torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse))
    return torch.einsum("nht,tc->nhc", torch.exp(s - safe[..., None]), c_kv.float()), lse


def mla_cp(ex, layer: int, x: torch.Tensor) -> torch.Tensor:
    """One MLA-DSA layer under CP for every row of the step (ex: the HybridAttention of this step)."""
    r, cfg, meta = ex.r, ex.r.cfg, ex.base.meta
    lw, cl, P = r.weights.layers[layer], r.mla_index[layer], cfg.hybrid.index_kpool
    w = lw.attn
    qa, q, c = ex._inputs(layer, x)
    wr = meta.write_rows
    r.cache.write(cl, meta.write_slots, c[wr], c.new_empty(len(wr), 0))
    if lw.indexer is not None:
        k, gate = indexer_keys(lw.indexer, x[wr])
        r.index_cache.write(cl, meta.write_slots, k, gate)
        ks = torch.cat([torch.full((q_.num_new,), min(cfg.index_topk // P, q_.end_pos // P), dtype=torch.long,
                                   device=x.device)
                        for q_ in ex.all_reqs]) if ex.all_reqs else torch.empty(0, dtype=torch.long, device=x.device)
        K = max(1, int(ks.max()) if ks.numel() else 1)
        vals = torch.full((x.shape[0], K), float("-inf"), device=x.device)
        ids = torch.full((x.shape[0], K), -1.0, device=x.device)
        for req, rr in zip(ex.all_reqs, ex.all_spans):
            vals[rr.start:rr.stop], ids[rr.start:rr.stop] = local_candidates(
                r, lw, cl, req, x[rr.start:rr.stop], qa[rr.start:rr.stop], req.end_pos, K)
        ex.sel_pools = global_selection(r.comm, vals, ids, ks)
    o = torch.zeros(x.shape[0], q.shape[1], cfg.kv_lora_rank, device=x.device)
    lse = torch.full((x.shape[0], q.shape[1]), float("-inf"), device=x.device)
    for req, rr in zip(ex.all_reqs, ex.all_spans):
        pos, slots = local_history(r, req.req_id, req.end_pos)
        if pos.numel() == 0:
            continue
        c_kv, _ = r.cache.read(cl, slots)
        qpos = torch.arange(req.start_pos, req.end_pos, device=x.device)
        mask = local_mask(pos, qpos, ex.sel_pools[rr.start:rr.stop], P, cfg.hybrid.index_kpool_always_select_tail)
        o[rr.start:rr.stop], lse[rr.start:rr.stop] = partial_attention(q[rr.start:rr.stop], c_kv, mask,
                                                                        cfg.softmax_scale)
    if r.comm.size > 1:
        n, h, dc = o.shape
        parts = r.comm.all_gather(torch.cat([o.reshape(n, h * dc), lse], dim=1).contiguous())
        parts = parts.view(r.comm.size, n, h * dc + h)
        o, _ = mla.merge_partials(parts[..., :h * dc].reshape(-1, n, h, dc), parts[..., h * dc:])
    return mla.out_projection(w, o)
