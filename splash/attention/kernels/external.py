"""What the vendor attention kernels (FlashInfer, AITER) share behind our kernel interface: the boundary.

Our interface (splash.attention.kernels): `plan(meta)` once per step, `run(layer, q_latent, q_rope, cache)` per
layer → (õ fp32 [N, H, d_c], natural-log LSE fp32 [N, H]) over the paged latent cache with ckv [blocks, page,
d_c] and kpe [blocks, page, d_r] (on a GPU, views of one fused tensor for a bf16 layer). Where a vendor kernel
differs, the wrapper converts here:
- LSE base: our LSE is natural log; a vendor call asks for base e explicitly (FlashInfer: `lse_mode="basee"` /
  `return_lse_base="basee"`; AITER's is natural log), so nothing converts here.
- page layout: trtllm-gen MLA and AITER read one fused [pages, page, d_c + d_r] buffer: a bf16 layer's pool is
  stored exactly so (splash.kv.paged_cache.FUSED_DTYPES: `cache.fused[layer]`, ckv / kpe are views of it), so
  the wrappers hand the vendor the pool itself and the requests' own page tables (`block_tables`, padded to the
  width the vendor asks: trtllm-gen a multiple of 128 tokens) or CSR page lists: no copy of the KV per layer.
- FP8 / INT8 KV: our quantised pool stores the latent as fp8/int8 with one fp32 scale per token per 128 values
  and the rope key in bf16 — or, on SM90 with FlashInfer, in e4m3 at one fixed per-tensor scale (PagedLatentCache
  `rope_fp8`), which is what FlashInfer's FP8 MLA reads, taking our per-token latent scales as `ckv_scale_arr`
  (backends/cuda/flashinfer_mla.py). Elsewhere (trtllm-gen's dense FP8 MLA folds one per-tensor K scale into
  bmm1/bmm2_scale; AITER takes per-tensor scales only)
  quantised layers run our Triton kernel, which dequantises in place. So do CP steps (a rank's pages are every
  T-th block: the vendors' causal masks assume contiguous positions) and shapes outside a vendor's limits
  (`Fallback` records why, once per reason).
- Sparse layers (a top-k selection in `meta.sparse[layer]`: DSA, KPool): neither vendor path takes our selection
  of slots, so such a layer runs our Triton kernel's sparse path too.
"""
from __future__ import annotations

import logging

import torch

SPARSE_REASON = "a top-k selection of slots (DSA / KPool layer): the vendor path attends every page"
NOT_FUSED_REASON = "the layer's pool is not in the fused [blocks, page, d_c + d_r] layout (a CPU pool)"
_log = logging.getLogger("splash.attention")


def block_tables(meta, width: int) -> torch.Tensor:
    """[B, width] int32: request b's physical pages from the step's page table (`meta.pages`, read in place by
    row), columns past its pages — up to its widest sibling's and the vendor's alignment — repeating its first
    page (kernels read only up to its length). `width` comes from the caller's once-per-step host read; built
    once per step, shared by every layer: nothing here syncs."""
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
