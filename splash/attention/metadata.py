"""A step's attention metadata on one rank: built in O(requests + new tokens), never O(context).

Query rows are CSR over the step's local requests (`qo_indptr`); each request points at its row of the rank's page
table (read in place: `pages`, and `logical` for CP's non-contiguous pages). A key at position t is visible to a
query row at position p when t <= p. New KV goes to `write_slots` (page × block_size + offset) from rows
`write_rows`; DSA layers add their per-row selection, `sparse[layer]`. Vendor kernels get `kv_len`,
`kv_last_page_len` and FlashInfer-style CSR pages (`csr()`), computed on demand and cached for the step.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from operator import attrgetter

import torch

from splash.attention.batch import StepPiece
from splash.kv.page_table import PageTable, int_tensor


@dataclass
class AttnMetadata:
    block_size: int
    q_lens: list[int]            # query rows per request (python, for kernels that group requests)
    qo_indptr: torch.Tensor      # [B + 1] int32
    q_pos: torch.Tensor          # [N] int64: absolute position of each query row
    row_req: torch.Tensor        # [N] int64: request index of each query row
    req_rows: torch.Tensor       # [B] int64: page-table row of each request
    num_pages: torch.Tensor      # [B] int32: pages held here
    ends: torch.Tensor           # [B] int64: each request's end position (start + new tokens)
    pages: torch.Tensor          # [R, P] int32: the page table, physical pages (read in place)
    logical: torch.Tensor        # [R, P] int32: logical block of each page
    write_rows: torch.Tensor     # [W] int64
    write_slots: torch.Tensor    # [W] int64
    # DSA: per layer, the top-k selection of each row (splash.attention.dsa.SparseSelection; None: dense)
    sparse: dict = field(default_factory=dict)
    cp: bool = False             # CP placement: a request's pages here are every T-th block (not contiguous)
    _csr: tuple | None = field(default=None, repr=False)
    _lens: tuple | None = field(default=None, repr=False)

    @property
    def num_rows(self) -> int:
        return int(self.q_pos.numel())

    @property
    def num_reqs(self) -> int:
        return len(self.q_lens)

    @property
    def kv_last_page_len(self) -> torch.Tensor:
        """[B] int32: tokens of the last held page at positions < the request's end (0 when none is held)."""
        return self._kv_lens()[1]

    @property
    def kv_len(self) -> torch.Tensor:
        """[B] int32: held tokens at positions < the request's end (every held page but the last is full)."""
        return self._kv_lens()[0]

    def _kv_lens(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self._lens is None:
            bs, n = self.block_size, self.num_pages.long()
            last = self.logical[self.req_rows, (n - 1).clamp_min(0)].long()
            last_len = (self.ends - last * bs).clamp(0, bs) * (n > 0)
            self._lens = (((n - 1).clamp_min(0) * bs + last_len).to(torch.int32), last_len.to(torch.int32))
        return self._lens

    def csr(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(kv_indptr [B + 1] int32, kv_indices [P] int32 physical pages, kv_logical [P] int32 logical blocks)."""
        if self._csr is None:
            n = self.num_pages.long()
            width = int(n.max()) if n.numel() else 0
            dev = n.device
            take = torch.arange(width, device=dev)[None, :] < n[:, None]
            indptr = torch.zeros(len(n) + 1, dtype=torch.int32, device=dev)
            torch.cumsum(n, 0, out=indptr[1:])
            self._csr = (indptr, self.pages[self.req_rows, :width][take], self.logical[self.req_rows, :width][take])
        return self._csr

_req_id, _num_new, _start_pos = attrgetter("req_id"), attrgetter("num_new"), attrgetter("start_pos")


def build_metadata(reqs: Sequence[StepPiece], tables: PageTable, cp: tuple[int, int] | None = None) -> AttnMetadata:
    """Metadata for `reqs` (this rank's requests of the step, in row order), whose new tokens' pages are already
    in `tables`. `cp=(world, rank)`: block b of a request anchored at rank a lives on rank (b + a) % world
    (`splash.layouts.ownership.cp_block_rank`) as its (b // world)-th page there; None: every block is here."""
    bs = tables.block_size
    tables.flush()
    rows = tables.rows(list(map(_req_id, reqs)))   # a request holding no page here yet gets an (empty) row
    q_lens = list(map(_num_new, reqs))
    dev = tables.pages.device
    starts = int_tensor(list(map(_start_pos, reqs)), device=dev)
    req_rows = int_tensor(rows, device=dev)
    b = len(reqs)
    if q_lens.count(1) == b:  # pure decode: one row per request
        qo, row_req, q_pos, ends = (torch.arange(b + 1, dtype=torch.int32, device=dev),
                                    torch.arange(b, device=dev), starts, starts + 1)
    else:
        lens = int_tensor(q_lens, device=dev)
        qo = torch.zeros(b + 1, dtype=torch.long, device=dev)
        torch.cumsum(lens, 0, out=qo[1:])
        n = int(qo[-1])
        row_req = torch.repeat_interleave(torch.arange(b, device=dev), lens, output_size=n)
        q_pos = starts[row_req] + torch.arange(n, device=dev) - qo[:-1][row_req]
        ends = starts + lens
        qo = qo.to(torch.int32)
    blk = q_pos // bs
    if cp is None:   # every row's KV is stored here
        w_rows = torch.arange(len(q_pos), device=dev) if len(q_pos) != b else row_req
        w_slots = tables.pages[req_rows[row_req] if len(q_pos) != b else req_rows, blk].long() * bs + q_pos % bs
    else:
        world, rank = cp
        anchors = int_tensor([q.owner for q in reqs], device=dev)
        w_rows = torch.nonzero((blk + anchors[row_req]) % world == rank).squeeze(1)
        col, w_req = blk[w_rows] // world, row_req[w_rows]
        w_slots = tables.pages[req_rows[w_req], col].long() * bs + q_pos[w_rows] % bs
    return AttnMetadata(bs, q_lens, qo, q_pos, row_req, req_rows, tables.npages[req_rows], ends,
                        tables.pages, tables.logical, w_rows, w_slots, cp=cp is not None)
