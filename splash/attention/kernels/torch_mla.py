"""`torch` MLA attention (the CPU backend's kernel): split-KV online softmax over the paged cache, read in place.

Decode requests form one group (sorted by page count, so those still active in a chunk are a prefix); each
prefill request is a group of its rows. A group walks its pages in ceil(pages / C) near-equal chunks: it gathers
those pages (`index_select` on page ids), dequantises fp8/int8, scores, masks keys past each query's position and
folds the chunk into a running (max, sum, õ) in fp32. `C` keeps one chunk's buffers under `scratch_bytes` whatever
the batch and context; page ids and masks depend only on the step, so later layers reuse them (within
`index_cache_bytes`). Over an fp32 pool every row goes to the C kernel `splash::mla_decode` instead (when enabled).

Math is fp32; `compute_dtype="bfloat16"` (or "auto" for a bf16 model on a CPU with bf16 units) feeds the two
GEMMs bf16 inputs, with fp32 softmax statistics. An fp32 model stays fp32 over every KV format, so its tokens are
the same in every layout; without bf16 units torch's bf16 bmm is 10-27x slower, so "auto" keeps fp32 there.
"""
from __future__ import annotations

from bisect import bisect_left
from dataclasses import dataclass

import torch

from splash import native
from splash.native import ops as native_ops
from splash.kv import quant
from splash.models.linear import bf16_units

SCRATCH_BYTES = 32 << 20      # one chunk's working buffers (the choice is measured in docs/benchmarks.md)
INDEX_CACHE_BYTES = 8 << 20   # page ids + masks kept across layers within a step


@dataclass
class _Group:
    reqs: torch.Tensor        # [G] request indices, in step order
    rows: torch.Tensor        # [G * Q] query rows, request-major
    q: int                    # query rows per request
    order: torch.Tensor | None  # [G] permutation sorting `reqs` by page count, descending (multi-chunk walks)
    npages: list[int]         # page counts, ascending (for bisect: how many requests reach a page)
    max_pages: int
    all_rows: bool = False    # the group is every row of the step, in order


class TorchMLAKernel:
    name = "torch"

    def __init__(self, softmax_scale: float, scratch_bytes: int = SCRATCH_BYTES,
                 index_cache_bytes: int = INDEX_CACHE_BYTES, compute_dtype: str = "auto"):
        if compute_dtype not in ("auto", "float32", "bfloat16"):
            raise ValueError(f"compute_dtype must be auto, float32 or bfloat16, got {compute_dtype!r}")
        self.scale, self.scratch_budget, self.index_budget = softmax_scale, scratch_bytes, index_cache_bytes
        self.compute_dtype = compute_dtype
        self.peak_scratch_bytes = 0   # largest chunk working set seen (bytes of the tensors it allocated)
        self._page_bufs = {}          # multi-chunk walks gather into these, reused across chunks, layers, steps
        self.meta = None

    # ---- per step -----------------------------------------------------------------------------------------
    def plan(self, meta) -> None:
        """Group the step's requests: O(requests)."""
        self.meta, self.groups, self._index, self._index_bytes, self._blind = meta, [], {}, 0, {}
        self._native_args = {}
        lens = meta.q_lens
        npg = meta.num_pages.tolist()
        dev = meta.num_pages.device
        everyone = lens.count(1) == len(lens)
        dec = range(len(lens)) if everyone else [i for i, n in enumerate(lens) if n == 1]
        if dec:
            idx = meta.row_req if everyone else torch.tensor(dec, dtype=torch.long, device=dev)
            counts = npg if everyone else [npg[i] for i in dec]
            counts = sorted(counts)
            self.groups.append(_Group(idx, idx if everyone else meta.qo_indptr[idx].long(), 1, None,
                                      counts, counts[-1], everyone))
        qo = meta.qo_indptr.tolist() if len(dec) < len(lens) else None
        for i, n in enumerate(lens):
            if n > 1:
                self.groups.append(_Group(torch.tensor([i], device=dev), torch.arange(qo[i], qo[i + 1], device=dev), n,
                                          torch.zeros(1, dtype=torch.long, device=dev), [npg[i]], npg[i],
                                          len(lens) == 1))

    def _dtype(self, ql: torch.Tensor) -> torch.dtype:
        if self.compute_dtype == "bfloat16" or (self.compute_dtype == "auto" and ql.dtype == torch.bfloat16
                                                and bf16_units()):
            return torch.bfloat16
        return torch.float32

    def chunk_pages(self, g: _Group, heads: int, d_c: int, d_r: int, bs: int) -> int:
        """Pages per chunk so one chunk's buffers (dequantised KV, raw pages, scores + probabilities, mask, page
        ids) stay within the scratch budget; at least one page."""
        per_page = bs * (8 * (d_c + d_r) + g.q * (8 * heads + 1)) + 16
        return max(1, min(g.max_pages, self.scratch_budget // max(1, len(g.reqs) * per_page)))

    # ---- per layer ----------------------------------------------------------------------------------------
    def run(self, layer: int, q_latent: torch.Tensor, q_rope: torch.Tensor,
            cache) -> tuple[torch.Tensor, torch.Tensor]:
        sel = self.meta.sparse.get(layer)
        if sel is not None:  # DSA layer with a top-k selection (splash.attention.dsa): only the selected slots
            from splash.attention.dsa import sparse_attend
            return sparse_attend(q_latent, q_rope, cache, layer, sel, self.scale)
        n, h, d_c = q_latent.shape
        o = lse = None
        if self.groups and self._native_ok(layer, q_latent, q_rope, cache):   # SPLASH's C kernel, one call
            return self._native_run(layer, q_latent, q_rope, cache)
        for gi, g in enumerate(self.groups):
            C = self.chunk_pages(g, h, d_c, q_rope.shape[2], self.meta.block_size)
            single = C >= g.max_pages        # one chunk: step order, plain softmax
            if single and g.all_rows:
                return self._attend(gi, g, layer, q_latent, q_rope, cache, C, single)
            if not single and g.order is None:
                g.order = torch.sort(self.meta.num_pages[g.reqs], descending=True, stable=True).indices
            rows = g.rows if single else g.rows.view(len(g.reqs), g.q)[g.order].reshape(-1)
            if o is None:
                o = torch.zeros(n, h, d_c, dtype=torch.float32, device=q_latent.device)
                lse = torch.full((n, h), float("-inf"), dtype=torch.float32, device=q_latent.device)
            o[rows], lse[rows] = self._attend(gi, g, layer, q_latent[rows], q_rope[rows], cache, C, single)
        if o is None:  # no request at all
            dev = q_latent.device
            return torch.zeros(n, h, d_c, device=dev), torch.full((n, h), float("-inf"), device=dev)
        return o, lse

    def _native_ok(self, layer: int, ql: torch.Tensor, qr: torch.Tensor, cache) -> bool:
        """The C kernel applies: available on one thread, fp32 queries and cache, d_c % 16 == 0, d_r % 8 == 0."""
        return (self.compute_dtype != "bfloat16" and ql.dtype == torch.float32 and qr.dtype == torch.float32
                and ql.device.type == "cpu" and cache.scale[layer] is None and cache.ckv[layer].dtype == torch.float32
                and cache.kpe[layer].dtype == torch.float32 and ql.shape[2] % 16 == 0 and qr.shape[2] % 8 == 0
                and cache.ckv[layer].is_contiguous() and cache.kpe[layer].is_contiguous() and native.enabled())

    def _native_run(self, layer: int, ql: torch.Tensor, qr: torch.Tensor, cache) -> tuple[torch.Tensor, torch.Tensor]:
        """Every row of the step in one `splash::mla_decode` call: an entry per query row, so a prefill chunk's rows
        each see the keys up to their own position."""
        meta = self.meta
        step = self._native_args.get("args")
        if step is None:   # per step: query rows, page-table rows, held pages, positions, checked once
            gs = self.groups
            per_row = lambda g, t: t if g.q == 1 else t.repeat_interleave(g.q)  # noqa: E731
            rows = torch.cat([g.rows.long() for g in gs])
            step = self._native_args["args"] = native_ops.decode_rows(
                rows.contiguous(), torch.cat([per_row(g, meta.req_rows[g.reqs].long()) for g in gs]).contiguous(),
                torch.cat([per_row(g, meta.num_pages[g.reqs].int()) for g in gs]).contiguous(),
                meta.q_pos[rows].long().contiguous(), meta.pages.int().contiguous(), meta.logical.int().contiguous())
        st = ql.stride()
        if st[2] != 1 or qr.stride() != st:
            q = torch.cat([ql, qr], dim=-1)   # not views of one q̃ (the engine's are): one copy holds both
            ql, qr = q[..., :ql.shape[2]], q[..., ql.shape[2]:]
        h, d_c, d_r, bs = ql.shape[1], ql.shape[2], qr.shape[2], meta.block_size
        o, lse = native_ops.mla_decode(step, ql, qr, cache.ckv[layer], cache.kpe[layer], self.scale)
        hp = -(-h // 8) * 8   # what mla_decode allocates: õ, transposed queries, a page's scores and weights, stats
        self.peak_scratch_bytes = max(self.peak_scratch_bytes, 4 * (h * d_c + (d_c + d_r) * hp + 2 * bs * hp + 4 * hp))
        return o, lse

    def _attend(self, gi: int, g: _Group, layer: int, ql: torch.Tensor, qr: torch.Tensor, cache, C: int,
                single: bool):
        """Rows of group `g` (step order if `single`, else sorted by page count) -> (õ, LSE) in that order."""
        G, h, d_c, d_r = len(g.reqs), ql.shape[1], ql.shape[2], qr.shape[2]
        dt = self._dtype(ql)
        ql = ql.reshape(G, g.q * h, d_c).to(dt)
        qr = qr.reshape(G, g.q * h, d_r).to(dt)
        if single:
            return self._attend_once(gi, g, layer, ql, qr, cache, dt)
        dev = ql.device
        m = torch.full((G, g.q * h, 1), float("-inf"), device=dev)
        s = torch.zeros(G, g.q * h, 1, device=dev)
        acc = torch.zeros(G, g.q * h, d_c, device=dev)
        for j, C in chunk_spans(g.max_pages, C):
            a = G - bisect_left(g.npages, j + 1)   # requests holding more than j pages: a prefix
            pid, hidden = self._chunk_index(gi, g, g.reqs[g.order], j, C, a)
            c, kpe, raw = _read_pages(cache, layer, pid, dt, self._page_bufs)
            sc = torch.baddbmm(torch.bmm(qr[:a], kpe.transpose(1, 2)), ql[:a], c.transpose(1, 2)).float()
            sc.mul_(self.scale).view(a, g.q, h, -1).masked_fill_(hidden[:, :, None, :], float("-inf"))
            cm = sc.amax(dim=-1, keepdim=True)
            m_new = torch.maximum(m[:a], cm)
            m_safe = torch.where(torch.isfinite(m_new), m_new, torch.zeros_like(m_new))
            alpha = torch.exp(m[:a] - m_safe)
            p = sc.sub_(m_safe).exp_()
            s[:a] = s[:a] * alpha + p.sum(dim=-1, keepdim=True)
            acc[:a] = acc[:a] * alpha + torch.bmm(p.to(dt), c).float()
            m[:a] = m_new
            self._track(c, kpe, raw, sc, pid, hidden)
        o = acc / s.clamp_min(torch.finfo(torch.float32).tiny)
        m_safe = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
        lse = (m_safe + s.log()).squeeze(-1)
        return o.view(G * g.q, h, d_c), lse.view(G * g.q, h)

    def _attend_once(self, gi: int, g: _Group, layer: int, ql: torch.Tensor, qr: torch.Tensor, cache, dt):
        """Every page of the group in one chunk (short histories: most decode steps): a plain masked softmax."""
        G, h, d_c = len(g.reqs), ql.shape[1] // g.q, ql.shape[2]
        pid, hidden = self._chunk_index(gi, g, g.reqs, 0, g.max_pages, G)
        if pid.shape[1] == 0:  # no page of these requests here (a CP rank holding none of them)
            dev = ql.device
            return (torch.zeros(G * g.q, h, d_c, device=dev), torch.full((G * g.q, h), float("-inf"), device=dev))
        c, kpe, raw = _read_pages(cache, layer, pid, dt)
        sc = torch.baddbmm(torch.bmm(qr, kpe.transpose(1, 2)), ql, c.transpose(1, 2)).float()
        sc.mul_(self.scale).view(G, g.q, h, -1).masked_fill_(hidden[:, :, None, :], float("-inf"))
        m = sc.amax(dim=-1, keepdim=True)
        blind = self._blind.get(gi)
        if blind is None:   # does some row see no key here (a CP rank without its pages)? once per step
            blind = self._blind[gi] = bool(hidden.all(dim=-1).any())
        if blind:  # rows without a key: m = 0 and den = 0 -> õ = 0, LSE = -inf; otherwise m is finite, den >= 1
            m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
        p = sc.sub_(m).exp_()
        den = p.sum(dim=-1, keepdim=True)
        o = torch.bmm(p.to(dt), c).float().div_(den.clamp_min(torch.finfo(torch.float32).tiny) if blind else den)
        self._track(c, kpe, raw, sc, pid, hidden)
        return o.view(G * g.q, h, d_c), (m + den.log()).view(G * g.q, h)

    def _chunk_index(self, gi: int, g: _Group, reqs_all: torch.Tensor, j: int, C: int,
                     a: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Page ids [a, c] of pages j..j+C of the first `a` of `reqs_all` (the group's requests in the order
        walked), and the mask [a, Q, c × bs] of keys each query row must not see (page not held, or position
        past the query's); cached across layers within the budget."""
        key = (gi, j, C)
        hit = self._index.get(key)
        if hit is not None:
            return hit
        meta, bs = self.meta, self.meta.block_size
        reqs = reqs_all[:a]
        rows = meta.req_rows[reqs]
        cols = slice(j, min(j + C, meta.pages.shape[1]))
        pid = meta.pages[rows, cols].long()
        dev = pid.device
        held = (torch.arange(cols.start, cols.stop, device=dev)[None, :] < meta.num_pages[reqs].long()[:, None])
        pid = pid * held
        kpos = (meta.logical[rows, cols].long()[:, :, None] * bs + torch.arange(bs, device=dev)).view(a, -1)
        qpos = meta.q_pos[(meta.qo_indptr[reqs].long()[:, None] + torch.arange(g.q, device=dev))]   # [a, Q]
        hidden = (~held[:, :, None].expand(-1, -1, bs).reshape(a, -1)[:, None, :]
                  | (kpos[:, None, :] > qpos[:, :, None]))        # keys a query row must not see
        size = pid.numel() * 8 + hidden.numel()
        if self._index_bytes + size <= self.index_budget:
            self._index[key] = (pid, hidden)
            self._index_bytes += size
        return pid, hidden

    def _track(self, *tensors) -> None:
        used = sum(t.numel() * t.element_size() for t in tensors if t is not None)
        self.peak_scratch_bytes = max(self.peak_scratch_bytes, used)


def chunk_spans(pages: int, C: int) -> list[tuple[int, int]]:
    """(first page, pages) of each of ceil(pages / C) near-equal chunks (not full chunks and a remainder: none at
    the full scratch budget when a smaller one does)."""
    n = -(-pages // C)
    return [(k * pages // n, (k + 1) * pages // n - k * pages // n) for k in range(n)]


def _read_pages(cache, layer: int, pid: torch.Tensor, dt: torch.dtype, bufs: dict | None = None):
    """Pages `pid` [a, c] of one layer -> (c_kv [a, c × bs, d_c], k_rope [a, c × bs, d_r]) in `dt`, dequantised
    here for fp8/int8 (per-token per-128-group scales); also returns the raw quantised gather (for accounting).
    With `bufs` the gathers land in buffers kept there (valid until the next call with the same `bufs`)."""
    a, c = pid.shape
    flat = pid.reshape(-1)
    fused = cache.fused[layer]
    if fused is not None:   # one gather of whole [page, d_c + d_r] rows, then the two column ranges (views)
        both = _take_pages(fused, flat, bufs)
        d_c = cache.ckv[layer].shape[-1]
        ckv, kpe = both[..., :d_c], both[..., d_c:]
    else:
        ckv = _take_pages(cache.ckv[layer], flat, bufs)       # [a*c, bs, d_c] in storage dtype
        kpe = _take_pages(cache.kpe[layer], flat, bufs)
    raw = None
    if cache.scale[layer] is not None:
        raw = ckv
        ckv = quant.dequantize(ckv, cache.scale[layer].index_select(0, flat))
    bs = ckv.shape[1]
    if kpe.dtype == quant.ROPE_FP8:
        kpe = quant.dequantize_rope(kpe)
    return (ckv.reshape(a, c * bs, -1).to(dt), kpe.reshape(a, c * bs, kpe.shape[-1]).to(dt), raw)  # d_r may be 0


def _take_pages(pool: torch.Tensor, flat: torch.Tensor, bufs: dict | None = None) -> torch.Tensor:
    """pool[flat] for a [blocks, bs, width] pool, gathered as rows of its 2-D view (one memcpy a row; 3-D
    index_select is up to 4x slower). With `bufs`, into a kept buffer grown to the largest gather: a fresh
    multi-MB result would be first-touched page by page whenever glibc serves it by mmap."""
    if pool.numel() == 0:  # a zero-width pool (NoPE layers have no rope part)
        return pool.new_empty((flat.shape[0], *pool.shape[1:]))
    rows = pool.view(pool.shape[0], -1)
    if bufs is None:
        return rows.index_select(0, flat).view(flat.shape[0], *pool.shape[1:])
    need, key = flat.shape[0] * rows.shape[1], (pool.dtype, rows.shape[1], pool.device)
    buf = bufs.get(key)
    if buf is None or buf.numel() < need:
        buf = bufs[key] = torch.empty(need, dtype=pool.dtype, device=pool.device)
    out = buf[:need].view(flat.shape[0], rows.shape[1])
    torch.index_select(rows, 0, flat, out=out)
    return out.view(flat.shape[0], *pool.shape[1:])
