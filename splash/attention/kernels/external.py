"""What the vendor attention kernels (FlashInfer, AITER) share at the boundary of our kernel interface.

Our LSE is natural log: a vendor call asks for base e explicitly (FlashInfer `lse_mode="basee"`; AITER's is natural).
trtllm-gen MLA and AITER read one fused [pages, page, d_c + d_r] buffer, which is how a bf16 layer's pool is stored
(splash.kv.paged_cache.FUSED_DTYPES), so the wrappers hand over the pool and the requests' page tables
(`block_tables`, padded to the vendor's width) or CSR page lists: no copy of the KV per layer. FlashInfer's FP8 MLA
on SM90 reads our per-token latent scales (`ckv_scale_arr`) and an e4m3 rope key; other quantised layers, CP steps
(a rank's pages are every T-th block, the vendors' causal masks assume contiguous positions), sparse layers
(`meta.sparse[layer]`: no vendor takes our slot selection) and shapes outside a vendor's limits run our Triton
kernel (`Fallback`, which logs each reason once).
"""
from __future__ import annotations

import logging

import torch

SPARSE_REASON = "a top-k selection of slots (DSA / KPool layer): the vendor path attends every page"
NOT_FUSED_REASON = "the layer's pool is not in the fused [blocks, page, d_c + d_r] layout (a CPU pool)"
_log = logging.getLogger("splash.attention")


def block_tables(meta, width: int) -> torch.Tensor:
    """[B, width] int32: request b's physical pages (`meta.pages` by row), the columns past them repeating its first
    page (kernels read only up to its length). Built once per step from the caller's host read: nothing syncs."""
    pages = meta.pages[meta.req_rows.long()]
    if pages.shape[1] == 0:   # no request holds a page here
        return torch.zeros(pages.shape[0], max(1, width), dtype=torch.int32, device=pages.device)
    have = min(width, pages.shape[1])
    cols = torch.arange(max(1, width), device=pages.device)[None, :]
    first = pages[:, :1].expand(-1, cols.shape[1])
    held = cols < meta.num_pages.long()[:, None]
    table = first.clone()
    table[:, :have] = torch.where(held[:, :have], pages[:, :have], first[:, :have])
    return table.to(torch.int32).contiguous()


def pad_heads(q: torch.Tensor, multiple: int) -> tuple[torch.Tensor, int]:
    """q [N, H, D] with H padded (zeros) up to a multiple of `multiple`; returns (padded, H)."""
    h = q.shape[1]
    want = -(-h // multiple) * multiple
    if want == h:
        return q, h
    pad = torch.zeros(q.shape[0], want - h, q.shape[2], dtype=q.dtype, device=q.device)
    return torch.cat([q, pad], dim=1), h


class Fallback:
    """Our Triton kernel for what a vendor kernel cannot run (created and planned only when first needed)."""

    def __init__(self, softmax_scale: float, owner: str):
        self.scale, self.owner, self.kernel, self.meta, self.planned = softmax_scale, owner, None, None, False
        self.reasons: dict[str, int] = {}

    def plan(self, meta) -> None:
        self.meta, self.planned = meta, False

    def run(self, reason: str, layer: int, q_latent, q_rope, cache):
        if reason not in self.reasons:
            _log.info("%s attention: %s; using the triton kernel there", self.owner, reason)
        self.reasons[reason] = self.reasons.get(reason, 0) + 1
        if self.kernel is None:
            from splash.attention.kernels.triton_mla import TritonMLAKernel
            self.kernel = TritonMLAKernel(self.scale)
        if not self.planned:
            self.kernel.plan(self.meta)
            self.planned = True
        return self.kernel.run(layer, q_latent, q_rope, cache)
