"""One rank's page tables as tensors, updated incrementally alongside the block manager.

A request's row holds `pages[row, j]`, the physical page of its j-th held page, and `logical[row, j]`, that page's
logical block, in increasing order (under CP a rank holds every T-th block); `npages[row]` counts them. Updates
cost O(pages changed): appends are queued as `array` columns and `flush` writes a step's in one scatter; a switch
rewrites the rows it changed; rows and columns grow by doubling. Attention reads the tables in place, so nothing
per step walks a request's history (at 256K tokens per-page python per step costs ~0.2 s).
"""
from __future__ import annotations

from array import array
from collections.abc import Iterable, Mapping
from itertools import repeat
from operator import add, gt

import torch


def int_tensor(values: list[int], device: str | torch.device = "cpu") -> torch.Tensor:
    """A 1-D int64 tensor on `device` from python ints, through an `array` buffer (several times faster than
    `torch.tensor(list)`)."""
    if not values:
        return torch.empty(0, dtype=torch.long, device=device)
    t = torch.frombuffer(array("q", values), dtype=torch.long)
    return t if t.device == torch.device(device) else t.to(device)


class PageTable:
    def __init__(self, block_size: int, rows: int = 16, cols: int = 16, device: str | torch.device = "cpu"):
        self.block_size, self.device = block_size, device
        self.pages = torch.zeros(rows, cols, dtype=torch.int32, device=device)
        self.logical = torch.zeros(rows, cols, dtype=torch.int32, device=device)
        self.npages = torch.zeros(rows, dtype=torch.int32, device=device)
        self._row: dict[str, int] = {}
        self._count: dict[str, int] = {}     # held pages per request (python mirror of npages)
        self._last: dict[str, int] = {}      # last held logical block per request
        self._free = list(range(rows - 1, -1, -1))
        self._clear_pending()   # queued pages, as flat columns: row, column, logical block, physical page

    # ---- lookup ------------------------------------------------------------------------------------------
    def row(self, req: str) -> int:
        """The request's row; a request holding no page here gets an (empty) row too."""
        r = self._row.get(req)
        if r is None:
            r = self._new_row(req)
        return r

    def rows(self, reqs) -> list[int]:
        """The rows of `reqs` (`row` each; one dict pass when every request has one already)."""
        rows = list(map(self._row.get, reqs))
        if None in rows:
            rows = [r if r is not None else self.row(q) for r, q in zip(rows, reqs)]
        return rows

    def num_pages(self, req: str) -> int:
        return self._count.get(req, 0)

    def requests(self) -> list[str]:
        return list(self._row)

    # ---- updates -----------------------------------------------------------------------------------------
    def append(self, req: str, new: Iterable[tuple[int, int]]) -> None:
        """Add (logical, physical) pages to `req`, queued until `flush`: O(new pages) python, no tensor op."""
        new = sorted(new)
        if not new:
            return
        r = self._row.get(req)
        if r is None:
            r = self._new_row(req)
        n = self._count[req]
        if new[0][0] <= self._last.get(req, -1):   # not past the end (e.g. a re-fill after a switch): rewrite
            self.flush()
            held = dict(zip(self.logical[r, :n].tolist(), self.pages[r, :n].tolist()))
            held.update(new)
            self.rewrite(req, held)
            return
        k = len(new)
        self._p_rows.extend([r] * k)
        self._p_cols.extend(range(n, n + k))
        for b, p in new:
            self._p_logical.append(b)
            self._p_phys.append(p)
        self._count[req], self._last[req] = n + k, new[-1][0]

    def append_many(self, items: Iterable[tuple[str, list[tuple[int, int]]]]) -> None:
        """`append` for several requests (one step's new pages): O(requests + new pages) python, no tensor op."""
        rows, cols, logical, phys = self._p_rows, self._p_cols, self._p_logical, self._p_phys
        known, count, last = self._row, self._count, self._last
        for req, new in items:
            r = known.get(req)
            if r is None or len(new) != 1 or new[0][0] <= last.get(req, -1):
                self.append(req, new)    # a new row, several pages, or a rewrite (which may flush)
                rows, cols, logical, phys = self._p_rows, self._p_cols, self._p_logical, self._p_phys
                continue
            (b, p), n = new[0], count[req]   # the decode case: one page past the row's end
            rows.append(r)
            cols.append(n)
            logical.append(b)
            phys.append(p)
            count[req], last[req] = n + 1, b

    def append_pages(self, reqs: list[str], logical: list[int], phys: list[int]) -> None:
        """The decode case of `append_many` (reqs[i], distinct, gets page (logical[i], phys[i]) past its row's end)
        in C loops; falls back to `append_many` when the case does not apply."""
        rows = list(map(self._row.get, reqs))
        last = list(map(self._last.get, reqs, repeat(-1)))
        if None in rows or not all(map(gt, logical, last)):
            self.append_many((q, [(b, p)]) for q, b, p in zip(reqs, logical, phys))
            return
        counts = list(map(self._count.__getitem__, reqs))
        self._p_rows.extend(rows)
        self._p_cols.extend(counts)
        self._p_logical.extend(logical)
        self._p_phys.extend(phys)
        self._count.update(zip(reqs, map(add, counts, repeat(1))))
        self._last.update(zip(reqs, logical))

    def flush(self) -> None:
        """Write the queued pages and the changed page counts: three scatters, whatever the number of pages."""
        if self._p_rows:
            self._write_pending()

    @torch.inference_mode()
    def _write_pending(self) -> None:
        rows, cols = (torch.frombuffer(x, dtype=torch.long).to(self.device)
                      for x in (self._p_rows, self._p_cols))
        self._fit_cols(max(self._p_cols) + 1)
        self.logical[rows, cols] = torch.frombuffer(self._p_logical, dtype=torch.int32).to(self.device)
        self.pages[rows, cols] = torch.frombuffer(self._p_phys, dtype=torch.int32).to(self.device)
        # a row's count is one past its largest queued column (counts only grow between flushes)
        self.npages.scatter_reduce_(0, rows, (cols + 1).to(torch.int32), "amax")
        self._clear_pending()

    def _clear_pending(self) -> None:
        self._p_rows, self._p_cols = array("q"), array("q")
        self._p_logical, self._p_phys = array("i"), array("i")

    @torch.inference_mode()
    def rewrite(self, req: str, table: Mapping[int, int]) -> None:
        """Replace `req`'s row with `table` (logical -> physical): O(its pages); an empty table releases it."""
        if not table:
            self.release(req)
            return
        items = sorted(table.items())
        self.flush()
        r = self.row(req)
        self._fit_cols(len(items))
        self.logical[r, :len(items)] = torch.tensor([b for b, _ in items], dtype=torch.int32, device=self.device)
        self.pages[r, :len(items)] = torch.tensor([p for _, p in items], dtype=torch.int32, device=self.device)
        self.npages[r] = len(items)
        self._count[req], self._last[req] = len(items), items[-1][0]

    @torch.inference_mode()
    def release(self, req: str) -> None:
        r = self._row.pop(req, None)
        if r is None:
            return
        if r in self._p_rows:
            keep = [i for i, x in enumerate(self._p_rows) if x != r]
            self._p_rows, self._p_cols, self._p_logical, self._p_phys = (
                array(col.typecode, [col[i] for i in keep])
                for col in (self._p_rows, self._p_cols, self._p_logical, self._p_phys))
        self.npages[r] = 0
        self._count.pop(req, None)
        self._last.pop(req, None)
        self._free.append(r)

    # ---- internals ---------------------------------------------------------------------------------------
    @torch.inference_mode()
    def _new_row(self, req: str) -> int:
        if not self._free:
            self.flush()
            old = self.pages.shape[0]
            grow = max(old, 1)
            self.pages = torch.cat([self.pages, torch.zeros(grow, self.pages.shape[1], dtype=torch.int32,
                                                            device=self.device)])
            self.logical = torch.cat([self.logical, torch.zeros_like(self.pages[old:])])
            self.npages = torch.cat([self.npages, torch.zeros(grow, dtype=torch.int32, device=self.device)])
            self._free = list(range(old + grow - 1, old - 1, -1))
        r = self._free.pop()
        self._row[req], self._count[req] = r, 0
        self.npages[r] = 0
        return r

    @torch.inference_mode()
    def _fit_cols(self, n: int) -> None:
        cols = self.pages.shape[1]
        if n <= cols:
            return
        while cols < n:
            cols *= 2
        pad = cols - self.pages.shape[1]
        z = torch.zeros(self.pages.shape[0], pad, dtype=torch.int32, device=self.device)
        self.pages = torch.cat([self.pages, z], dim=1)
        self.logical = torch.cat([self.logical, z], dim=1)


def ensure_step_pages(bm, tables: PageTable, reqs, keep=None) -> None:
    """Allocate in `bm` the blocks the step's new tokens touch (those `keep(q, block)` accepts: CP's held ones) and
    append them to `tables`, with the ids a per-request `bm.ensure` in step order would hand out. A decode step
    takes its new pages in one block-manager and one page-table call (C loops)."""
    bs = tables.block_size
    if any(q.num_new > 1 for q in reqs):
        needs = []
        for q in reqs:
            if q.num_new == 0 or (q.num_new == 1 and q.start_pos % bs):
                continue  # a decode token inside a page: its page holds the previous position, so is held
            blocks = range(q.start_pos // bs, (q.end_pos - 1) // bs + 1)
            blocks = [b for b in blocks if keep is None or keep(q, b)]
            if blocks:
                needs.append((q.req_id, blocks))
        if needs:
            tables.append_many(bm.ensure_many(needs))
        return
    cross = [q for q in reqs if q.num_new == 1 and not q.start_pos % bs]  # other decode tokens' pages are held
    if keep is not None:
        cross = [q for q in cross if keep(q, q.start_pos // bs)]
    if cross:
        ids, blocks = [q.req_id for q in cross], [q.start_pos // bs for q in cross]
        phys = bm.append_blocks(ids, blocks)
        if phys is not None:
            tables.append_pages(ids, blocks, phys)
        else:  # a request repeated or a block already held (e.g. refilled by a switch): the general path
            tables.append_many(bm.ensure_many(list(zip(ids, ([b] for b in blocks)))))
