"""One rank's page tables as tensors, updated incrementally alongside the block manager.

Every request this rank holds pages for has a row of two int32 tensors: `pages[row, j]` is the physical page of
its j-th held page and `logical[row, j]` that page's logical block index (its positions are
`logical * block_size + offset`), in increasing logical order. Under TP, DP-attn and DOP a rank holds every
block of its requests (logical[row, j] = j); under CP it holds every T-th one (round-robin from the request's
anchor), and the logical column says which. `npages[row]` counts the held pages.

Updates cost O(pages changed): appending pages queues them for the row's end and `flush` writes every queued
page of the step in one scatter (the step's metadata flushes); releasing a request frees its row; a switch
rewrites the rows of the requests whose pages it changed. Rows and columns grow by doubling (amortised
O(1) per page). Attention reads the tables in place through each step's request rows
(`splash.attention.metadata`), so nothing per step walks a request's history.
"""
from __future__ import annotations

from collections.abc import Iterable, Mapping

import torch


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
        self._pending: list[tuple[int, int, int, int]] = []   # queued (row, column, logical, physical)

    # ---- lookup ------------------------------------------------------------------------------------------
    def row(self, req: str) -> int:
        """The request's row; a request holding no page here gets an (empty) row too."""
        r = self._row.get(req)
        if r is None:
            r = self._new_row(req)
        return r

    def num_pages(self, req: str) -> int:
        return self._count.get(req, 0)

    def requests(self) -> list[str]:
        return list(self._row)

    # ---- updates -----------------------------------------------------------------------------------------
    @torch.inference_mode()
    def append(self, req: str, new: Iterable[tuple[int, int]]) -> None:
        """Add (logical, physical) pages to `req`, queued until `flush`: O(new pages) python, no tensor op."""
        new = sorted(new)
        if not new:
            return
        r, n = self.row(req), self._count[req]
        if new[0][0] <= self._last.get(req, -1):   # not past the end (e.g. a re-fill after a switch): rewrite
            self.flush()
            held = dict(zip(self.logical[r, :n].tolist(), self.pages[r, :n].tolist()))
            held.update(new)
            self.rewrite(req, held)
            return
        self._pending.extend((r, n + i, b, p) for i, (b, p) in enumerate(new))
        self._count[req], self._last[req] = n + len(new), new[-1][0]

    @torch.inference_mode()
    def flush(self) -> None:
        """Write the queued pages and the changed page counts: three scatters, whatever the number of pages."""
        if not self._pending:
            return
        self._fit_cols(max(c for _, c, _, _ in self._pending) + 1)
        rows, cols, logical, phys = (torch.tensor(x, dtype=torch.long, device=self.device)
                                     for x in zip(*self._pending))
        self.logical[rows, cols] = logical.to(torch.int32)
        self.pages[rows, cols] = phys.to(torch.int32)
        counts = {r: c + 1 for r, c, _, _ in self._pending}   # a row's last queued column is its largest
        self.npages[torch.tensor(list(counts), device=self.device)] = torch.tensor(
            list(counts.values()), dtype=torch.int32, device=self.device)
        self._pending = []

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
        self._set_count(req, r, len(items), items[-1][0])

    @torch.inference_mode()
    def release(self, req: str) -> None:
        r = self._row.pop(req, None)
        if r is None:
            return
        if self._pending:
            self._pending = [x for x in self._pending if x[0] != r]
        self.npages[r] = 0
        self._count.pop(req, None)
        self._last.pop(req, None)
        self._free.append(r)

    # ---- internals ---------------------------------------------------------------------------------------
    def _set_count(self, req: str, r: int, n: int, last: int) -> None:
        self.npages[r] = n
        self._count[req], self._last[req] = n, last

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
