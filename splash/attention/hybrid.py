"""GLM-5.3-Flash attention blocks in each layout: KDA linear-attention layers and NoPE MLA-DSA (KPool) layers.

KDA placement (its state is per request; the recurrence is per head and sequential in positions):
- TP, DOP — head-sharded: the layout already shards projections by head, so rank r runs KDA heads H_r of every
  request's rows and holds exactly those heads' state; O over H_r is a partial sum → all-reduce (as MLA's O).
- DP-attn, CP — owner-run: projections are replicated, so the request's owner (CP: its anchor rank) runs all
  heads of its rows and holds the whole state; outputs return by a variable all-gather. CP shards *positions*
  of the KV history, but a recurrence has no per-position history to shard (its state is already a fixed-size
  summary of every past position), and splitting the scan over ranks would serialise them; so under CP the
  KDA layers run owner-run while the MLA layers are position-sharded.

MLA-DSA placement: the rank that attends a request holds its whole latent history and its indexer keys (TP:
every rank, heads sharded; DP-attn: owner, all heads; DOP: owner, queries of all heads arrive by all-to-all)
and computes the KPool selection itself from replicated hidden states — identical on every rank that computes
it. CP (position-sharded history): a global top-k over the pools each rank holds (splash.attention.hybrid_cp).
"""
from __future__ import annotations

import torch

from splash.attention import mla
from splash.attention.batch import StepBatch
from splash.attention.grouping import OwnerGroups
from splash.models.kda import kda_forward
from splash.models.kpool import indexer_keys, indexer_queries, select, sparse_latent_attention
from splash.models.linear import linear

HEAD_SHARDED = ("tp", "dop")


def linear_heads_for(layout: str, num_heads: int, world: int, rank: int) -> range:
    """KDA heads a rank holds (projections and state) in `layout`."""
    from splash.layouts.ownership import head_range
    return head_range(num_heads, world, rank, layout)


class HybridAttention:
    """Wraps the MLA executor of a layout (its block allocation and metadata) and runs both layer kinds."""

    def __init__(self, layout: str, base):
        self.layout, self.base, self.r = layout, base, base.r
        P, bs = self.r.cfg.hybrid.index_kpool, self.r.block_size
        if layout == "cp" and bs % P:
            raise ValueError(f"glm5_next under CP needs index_kpool ({P}) to divide block_size ({bs}): each rank "
                             "scores the KPool pools of the blocks it holds")

    # ---- step set-up ---------------------------------------------------------------------------------------
    def prepare(self, batch: StepBatch) -> None:
        r = self.r
        self.base.prepare(batch)
        self.g = OwnerGroups.build(batch, r.comm.size, r.comm.rank)
        sharded = self.layout in HEAD_SHARDED
        reqs = batch.reqs if sharded else self.g.mine
        spans, at = [], 0
        for q in reqs:
            spans.append(range(at, at + q.num_new))
            at += q.num_new
        self.reqs, self.spans = reqs, spans
        self.all_reqs, self.all_spans = batch.reqs, batch.row_ranges()
        self.rows = None if sharded else self.g.rows_mine
        self.sel: dict[str, torch.Tensor] = {}
        self.states_ready = False

    def _ensure_states(self) -> None:
        """New requests get a zero state; the others must hold theirs. Checked at the first KDA layer, not in
        prepare: during a live handoff the state lands just before that layer runs."""
        r = self.r
        for q in self.reqs:
            if q.start_pos == 0 and q.num_new:
                r.states.create(q.req_id, len(r.linear_heads))
            elif not r.states.has(q.req_id):
                raise RuntimeError(f"request {q.req_id!r} at position {q.start_pos} has no KDA state on rank "
                                   f"{r.comm.rank} in layout {self.layout}")
        self.states_ready = True

    def attention(self, layer: int, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        if self.r.cfg.is_linear_layer(layer):
            return self._kda(layer, x)
        if self.layout == "cp":
            from splash.attention.hybrid_cp import mla_cp
            return mla_cp(self, layer, x)
        return {"tp": self._mla_tp, "dp_attn": self._mla_dp, "dop": self._mla_dop}[self.layout](layer, x)

    def _gather(self, out: torch.Tensor) -> torch.Tensor:
        r = self.r
        if r.comm.size == 1:
            return out
        return self.g.to_step_order(r.comm.all_gatherv(out.contiguous(), self.g.counts))

    def _reduce(self, out: torch.Tensor) -> torch.Tensor:
        return self.r.comm.all_reduce(out) if self.r.comm.size > 1 else out

    # ---- KDA -------------------------------------------------------------------------------------------------
    def _kda(self, layer: int, x: torch.Tensor) -> torch.Tensor:
        r, cfg = self.r, self.r.cfg
        li = r.linear_index[layer]
        if not self.states_ready:
            self._ensure_states()
        xs = x if self.rows is None else x[self.rows]
        states = [r.states.get(q.req_id)[li] for q in self.reqs]
        out, new = kda_forward(r.weights.layers[layer].attn, xs, self.spans, states, cfg.rms_norm_eps,
                               cfg.hybrid.linear_lower_bound)
        for st, s in zip(states, new):
            st.copy_(s)
        return self._reduce(out) if self.rows is None else self._gather(out)

    # ---- MLA-DSA ---------------------------------------------------------------------------------------------
    def _inputs(self, layer: int, x: torch.Tensor):
        """x [n, hidden] -> (Q-A output [n, q_lora], absorbed queries q̃ [n, H_l, d_c], normed latent [n, d_c])."""
        cfg, w = self.r.cfg, self.r.weights.layers[layer].attn
        n = x.shape[0]
        qa = rms_norm_(linear(x, w.q_a), w.q_a_norm, cfg.rms_norm_eps)
        q = linear(qa, w.q_b).view(n, len(w.heads), cfg.qk_nope_head_dim)
        q_lat = torch.bmm(q.transpose(0, 1), w.uk()).transpose(0, 1)
        return qa, q_lat, rms_norm_(linear(x, w.kv_a), w.kv_a_norm, cfg.rms_norm_eps)

    def _store(self, layer: int, x_rows: torch.Tensor, c: torch.Tensor) -> None:
        """Write the attended requests' new latent (and indexer keys) at the step's write slots (rows in order)."""
        r, meta = self.r, self.base.meta
        cl, lw = r.mla_index[layer], r.weights.layers[layer]
        empty = c.new_empty(c.shape[0], 0)
        r.cache.write(cl, meta.write_slots, c, empty)
        if lw.indexer is not None:
            k, gate = indexer_keys(lw.indexer, x_rows)
            r.index_cache.write(cl, meta.write_slots, k, gate)

    def _attend(self, layer: int, reqs, x_rows: torch.Tensor, qa: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
        """Sparse attention of `reqs` (rows in order: x_rows / qa / q̃ [n, H, d_c]) over this rank's full history."""
        r, cfg = self.r, self.r.cfg
        cl, lw = r.mla_index[layer], r.weights.layers[layer]
        out = torch.empty(q.shape[0], q.shape[1], cfg.kv_lora_rank, device=q.device)
        at = 0
        for req in reqs:
            rr = slice(at, at + req.num_new)
            at += req.num_new
            slots = history_slots(r, req.req_id, req.end_pos)
            c_kv, _ = r.cache.read(cl, slots)
            if lw.indexer is not None:
                keys, gates = r.index_cache.read(cl, slots)
                iq, hw = indexer_queries(lw.indexer, x_rows[rr], qa[rr])
                pos = torch.arange(req.start_pos, req.end_pos, device=q.device)
                self.sel[req.req_id] = select(iq, hw, pos, keys, gates, lw.indexer.ape, cfg.index_topk,
                                              cfg.hybrid.index_kpool_always_select_tail)
            out[rr] = sparse_latent_attention(q[rr], c_kv, self.sel[req.req_id], cfg.softmax_scale)
        return out

    def _mla_tp(self, layer: int, x: torch.Tensor) -> torch.Tensor:
        qa, q, c = self._inputs(layer, x)
        self._store(layer, x, c)
        o = self._attend(layer, self.reqs, x, qa, q)
        return self._reduce(mla.out_projection(self.r.weights.layers[layer].attn, o))

    def _mla_dp(self, layer: int, x: torch.Tensor) -> torch.Tensor:
        xm = x[self.rows]
        qa, q, c = self._inputs(layer, xm)
        self._store(layer, xm, c)
        o = self._attend(layer, self.reqs, xm, qa, q)
        return self._gather(mla.out_projection(self.r.weights.layers[layer].attn, o))

    def _mla_dop(self, layer: int, x: torch.Tensor) -> torch.Tensor:
        r, g = self.r, self.g
        T, dc, w = r.comm.size, r.cfg.kv_lora_rank, r.weights.layers[layer].attn
        qa_all, q, _ = self._inputs(layer, x)                            # q̃ of local heads, all rows
        rows = g.rows_mine
        xm = x[rows]
        c = rms_norm_(linear(xm, w.kv_a), w.kv_a_norm, r.cfg.rms_norm_eps)
        self._store(layer, xm, c)
        mine = self.g.mine
        if T == 1:
            return mla.out_projection(w, self._attend(layer, mine, xm, qa_all, q))
        n, hl = len(rows), q.shape[1]
        recv = r.comm.all_to_allv(q[g.by_owner].reshape(-1, hl * dc).contiguous(), g.counts, [n] * T)
        q_own = recv.view(T, n, hl, dc).permute(1, 0, 2, 3).reshape(n, T * hl, dc)
        o = self._attend(layer, mine, xm, qa_all[rows], q_own)
        back = o.view(n, T, hl, dc).permute(1, 0, 2, 3).reshape(T * n, hl * dc).contiguous()
        o_local = r.comm.all_to_allv(back, [n] * T, g.counts).view(-1, hl, dc)
        return self._reduce(mla.out_projection(w, g.to_step_order(o_local)))


def rms_norm_(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return mla.rms_norm(x, w, eps)


def history_slots(r, req: str, end: int) -> torch.Tensor:
    """Slots of positions 0..end−1 of a request whose every block this rank holds."""
    bs, table = r.block_size, r.bm.table(req)
    nb = -(-end // bs)
    pages = torch.tensor([table[b] for b in range(nb)], dtype=torch.long, device=r.device)
    return (pages[:, None] * bs + torch.arange(bs, device=r.device)).reshape(-1)[:end]
