"""What the vendor attention kernels (FlashInfer, AITER) share behind our kernel interface: the boundary.

Our interface (splash.attention.kernels): `plan(meta)` once per step, `run(layer, q_latent, q_rope, cache)` per
layer → (õ fp32 [N, H, d_c], natural-log LSE fp32 [N, H]) over the paged latent cache with ckv [blocks, page,
d_c] and kpe [blocks, page, d_r] in separate tensors. Where a vendor kernel differs, the wrapper converts here:
- LSE base: our LSE is natural log; a vendor call asks for base e explicitly (FlashInfer: `lse_mode="basee"` /
  `return_lse_base="basee"`; AITER's is natural log), so nothing converts here.
- page layout: trtllm-gen MLA and AITER read one fused [pages, page, d_c + d_r] buffer → `fused_pages` gathers
  the step's pages of one layer into it (a copy of the KV read per layer: it doubles KV traffic; a fused pool
  layout would remove it, not done) and `remap_tables` renumbers the requests' pages into that buffer, padded
  to the width the caller asks (trtllm-gen: a multiple of 128 tokens).
- FP8 / INT8 KV: our quantised pool stores the latent as fp8/int8 with one fp32 scale per token per 128 values
  and the rope key in bf16; neither vendor path reads that (FlashInfer's FP8 MLA takes our per-row latent scales
  as `ckv_scale_arr` but wants the rope cache in fp8 with a per-tensor scale, SM90 only; AITER a per-tensor
  scale), so quantised layers run our Triton kernel, which dequantises in place. So do CP steps (a rank's pages are every T-th block: the vendors' causal masks assume
  contiguous positions) and shapes outside a vendor's limits (`Fallback` records why, once per reason).
- Sparse layers (a top-k selection in `meta.sparse[layer]`: DSA, KPool): neither vendor path takes our selection
  of slots, so such a layer runs our Triton kernel's sparse path too.
"""
from __future__ import annotations

import logging

import torch

SPARSE_REASON = "a top-k selection of slots (DSA / KPool layer): the vendor path attends every page"
FUSED_BUFFER_BYTES = 512 << 20   # bound on one fused-page copy with its gather temporaries (in the device budget)
_log = logging.getLogger("splash.attention")


def fused_pages(cache, layer: int, kv_indices: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """[P, page, d_c + d_r] in `dtype`: the pages `kv_indices` of one layer with latent and rope key side by side
    (an unquantised layer only)."""
    idx = kv_indices.long()
    ckv, kpe = cache.ckv[layer].index_select(0, idx), cache.kpe[layer].index_select(0, idx)
    return torch.cat([ckv.to(dtype), kpe.to(dtype)], dim=-1)


def page_groups(pages: list[int], page_bytes: int, budget: int | None = None) -> list[tuple[int, int]]:
    """Consecutive request ranges [a, b) whose fused copy — the gathered latent and rope pages plus the
    concatenated buffer, 2 × pages × `page_bytes` — fits `budget` (a request larger than that alone is its own
    range), so the copy a vendor call needs stays a bounded, budgeted buffer however long the batch's contexts."""
    per_group = max(1, (FUSED_BUFFER_BYTES if budget is None else budget) // (2 * page_bytes))
    groups, start, held = [], 0, 0
    for i, p in enumerate(pages):
        if held and held + p > per_group:
            groups.append((start, i))
            start, held = i, 0
        held += p
    if start < len(pages):
        groups.append((start, len(pages)))
    return groups


class PageGroup:
    """One range of a decode step's requests for a vendor call on fused pages: its rows, its pages' indices in
    the pool, block tables into its fused buffer (padded to `align` pages) — built once per step, used by every
    layer."""

    def __init__(self, a: int, b: int, kv_indptr: torch.Tensor, kv_indices: torch.Tensor, host_indptr: list[int],
                 width=lambda pages: pages):
        self.rows = slice(a, b)
        self.indices = kv_indices[host_indptr[a]:host_indptr[b]]
        self.kv_indptr = kv_indptr[a:b + 1] - kv_indptr[a]
        widest = max(host_indptr[i + 1] - host_indptr[i] for i in range(a, b))
        self.tables = remap_tables(self.kv_indptr, width(widest))


def step_groups(meta, host_pages: list[int], page_bytes: int, width=lambda pages: pages) -> list[PageGroup]:
    """The step's PageGroups (decode rows = requests) from its per-request page counts read once on the host."""
    indptr, indices, _ = meta.csr()
    host_indptr = [0]
    for p in host_pages:
        host_indptr.append(host_indptr[-1] + p)
    return [PageGroup(a, b, indptr, indices, host_indptr, width) for a, b in page_groups(host_pages, page_bytes)]


def remap_tables(kv_indptr: torch.Tensor, width: int) -> torch.Tensor:
    """Block tables [B, width] into the fused buffer: request b's j-th page is row kv_indptr[b] + j (columns past
    its pages — up to its widest sibling's and the vendor's alignment — repeat its first page; kernels read only
    up to its length). `width` comes from the caller's once-per-step host read: nothing here syncs."""
    ptr = kv_indptr.long()
    n = ptr[1:] - ptr[:-1]
    cols = torch.arange(max(1, width), device=ptr.device)[None, :]
    return (ptr[:-1, None] + torch.where(cols < n[:, None], cols, torch.zeros_like(cols))).to(torch.int32)


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
