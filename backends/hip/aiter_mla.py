"""`aiter` MLA decode behind our kernel interface (AMD ROCm / Hygon DCU; not verified on hardware yet).

Decode-only steps with bf16 KV, a 512 + 64 latent/rope split, at most 128 heads and pages of 1 or 64 tokens run
`aiter.mla.mla_decode_fwd(q [N, H, 576], kv_buffer [pages, page, 1, 576], o [N, H, 512], qo_indptr, kv_indptr,
kv_indices, kv_last_page_lens, max_seqlen_q=1, page_size, nhead_kv=1, sm_scale, return_lse=True)`:
- heads are padded with zero queries up to a multiple of 16 (AITER's kernels are built for 16·k heads; a rank's
  head shard under TP/DOP can be fewer) and the padding is cut from õ and the LSE;
- the fused kv_buffer is a copy of the step's pages of the layer (splash.attention.kernels.external.fused_pages),
  in CSR order, so kv_indices is 0..P-1;
- `o` is the output (the function also returns split partials in some modes: we read `o`), LSE natural log.
Prefill rows, CP steps, quantised KV, NoPE models (d_r = 0, e.g. GLM-5.3-Flash) and other shapes run our
Triton kernel (`Fallback`), with the reason logged once.
"""
from __future__ import annotations

import torch

from splash.attention.kernels.external import SPARSE_REASON, Fallback, fused_pages, lse_to_natural, pad_heads

HEAD_MULTIPLE, MAX_HEADS = 16, 128
PAGE_SIZES = (1, 64)
DIMS = (512, 64)


def choose_path(kv_dtype: str, d_c: int, d_r: int, heads: int, page_size: int, cp: bool,
                decode_only: bool) -> str | None:
    """None when `mla_decode_fwd` runs this layer, else why our Triton kernel runs instead."""
    if cp:
        return "CP step (a rank's pages are every T-th block; AITER's mask wants contiguous pages)"
    if not decode_only:
        return "prefill rows in the step (AITER's mla_decode_fwd is run for decode steps only here)"
    if kv_dtype != "bfloat16":
        return f"KV dtype {kv_dtype} (our fp8/int8 pool keeps per-token scales; AITER takes a per-tensor scale)"
    if (d_c, d_r) != DIMS:
        return f"latent/rope dims {d_c}/{d_r} (AITER MLA decode is built for {DIMS[0]} + {DIMS[1]})"
    if heads > MAX_HEADS:
        return f"{heads} heads on this rank (AITER MLA decode takes at most {MAX_HEADS})"
    if page_size not in PAGE_SIZES:
        return f"page size {page_size} (AITER MLA decode takes {PAGE_SIZES})"
    return None


class AiterMLAKernel:
    name = "aiter"

    def __init__(self, softmax_scale: float):
        import aiter.mla  # noqa: F401 — fail at build time, not at the first step
        self.scale, self.meta = softmax_scale, None
        self.fallback = Fallback(softmax_scale, "aiter")
        self.paths: dict[str, int] = {}

    def plan(self, meta) -> None:
        self.meta = meta
        self.decode_only = all(n == 1 for n in meta.q_lens)
        self.fallback.plan(meta)

    def run(self, layer: int, q_latent: torch.Tensor, q_rope: torch.Tensor, cache):
        meta = self.meta
        n, h, dc = q_latent.shape
        dr = q_rope.shape[-1]
        if n == 0 or meta.num_reqs == 0:
            return (torch.zeros(n, h, dc, device=q_latent.device),
                    torch.full((n, h), float("-inf"), device=q_latent.device))
        why = choose_path(cache.kv_dtype_of(layer), dc, dr, h, meta.block_size, meta.cp, self.decode_only)
        if meta.sparse.get(layer) is not None:
            why = SPARSE_REASON
        if why is None and not q_latent.is_cuda:
            why = "tensors not on a GPU"
        self.paths["triton" if why else "aiter"] = self.paths.get("triton" if why else "aiter", 0) + 1
        if why is not None:
            return self.fallback.run(why, layer, q_latent, q_rope, cache)
        import aiter.mla
        indptr, indices, _ = meta.csr()
        kv = fused_pages(cache, layer, indices, torch.bfloat16)          # [P, page, 576]
        q, heads = pad_heads(torch.cat([q_latent, q_rope], dim=-1).to(torch.bfloat16), HEAD_MULTIPLE)
        o = torch.empty(n, q.shape[1], dc, dtype=torch.bfloat16, device=q.device)
        order = torch.arange(kv.shape[0], dtype=torch.int32, device=q.device)
        _, lse = aiter.mla.mla_decode_fwd(q, kv.unsqueeze(2), o, meta.qo_indptr, indptr, order,
                                          meta.kv_last_page_len, 1, page_size=meta.block_size, nhead_kv=1,
                                          sm_scale=self.scale, return_lse=True)
        return o[:, :heads].float(), lse_to_natural(lse.view(n, -1)[:, :heads], base2=False)
