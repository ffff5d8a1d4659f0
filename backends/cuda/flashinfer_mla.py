"""`flashinfer` MLA attention behind our kernel interface (NVIDIA; not verified on hardware yet).

- SM90 (H200) and any step with prefill rows: `flashinfer.mla.BatchMLAPagedAttentionWrapper`, planned once per
  step and head count from our CSR metadata (`qo_indptr`, `meta.csr()` → kv_indptr / kv_indices, `kv_len`),
  causal, reading our ckv [blocks, page, d_c] and kpe [blocks, page, d_r] pools in place (its layout is ours).
  Its LSE is base 2 unless the installed version takes `return_lse_base_on_e` (then we ask for base e).
- SM100 (B200), decode-only steps: `flashinfer.mla.trtllm_batch_decode_with_kv_cache_mla` (trtllm-gen) on a
  fused [pages, page, d_c + d_r] copy of the step's pages (splash.attention.kernels.external.fused_pages) with
  renumbered block tables; pages of 32 or 64 tokens.
- Everything else (quantised KV, CP steps, other latent/rope dims): our Triton kernel (`Fallback`), with the
  reason logged once. The boundary conversions are listed in splash.attention.kernels.external.
"""
from __future__ import annotations

import inspect

import torch

from splash.attention.kernels.external import SPARSE_REASON, Fallback, fused_pages, lse_to_natural, remap_tables

WORKSPACE_BYTES = 128 << 20            # FlashInfer's recommended float workspace
WRAPPER_DIMS = ((512, 64), (512, 0))    # (d_c, d_r) the MLA wrapper is built for (DeepSeek/GLM; NoPE)
TRTLLM_PAGE_SIZES = (32, 64)
TRTLLM_LSE_BASE2 = True                 # assumed like the wrapper's; scripts/gpu-check.sh checks it on hardware
TRTLLM_QK_NOPE = 128                    # trtllm-gen's qk_nope_head_dim argument (unused by the dense path)


def choose_path(sm_major: int, kv_dtype: str, d_c: int, d_r: int, page_size: int, cp: bool,
                decode_only: bool) -> tuple[str | None, str | None]:
    """('wrapper' | 'trtllm-gen', None), or (None, why our Triton kernel runs instead)."""
    if cp:
        return None, "CP step (a rank's pages are every T-th block; FlashInfer's causal mask wants contiguous pages)"
    if kv_dtype != "bfloat16":
        return None, (f"KV dtype {kv_dtype} (FlashInfer MLA reads bf16 pages here; our fp8/int8 pool keeps "
                      "per-token scales and a bf16 rope key, which its FP8 path does not read)")
    if sm_major < 8:
        return None, f"compute capability {sm_major}.x (FlashInfer MLA needs SM80 or newer)"
    if (d_c, d_r) not in WRAPPER_DIMS:
        return None, f"latent/rope dims {d_c}/{d_r} (FlashInfer MLA is built for {WRAPPER_DIMS})"
    if sm_major >= 10 and decode_only and d_r == 64 and page_size in TRTLLM_PAGE_SIZES:
        return "trtllm-gen", None
    return "wrapper", None


class FlashInferMLAKernel:
    name = "flashinfer"

    def __init__(self, softmax_scale: float):
        import flashinfer.mla  # noqa: F401 — fail at build time, not at the first step
        self.scale, self.meta = softmax_scale, None
        self.fallback = Fallback(softmax_scale, "flashinfer")
        self.wrapper = self.workspace = self.trt_workspace = None
        self.paths: dict[str, int] = {}   # runs per path (gpu-check reports it)

    def plan(self, meta) -> None:
        self.meta, self.planned_heads, self.fused = meta, None, {}
        self.decode_only = all(n == 1 for n in meta.q_lens)
        self.fallback.plan(meta)

    def run(self, layer: int, q_latent: torch.Tensor, q_rope: torch.Tensor, cache):
        n, h, dc = q_latent.shape
        if n == 0 or self.meta.num_reqs == 0:
            return (torch.zeros(n, h, dc, device=q_latent.device),
                    torch.full((n, h), float("-inf"), device=q_latent.device))
        sm = torch.cuda.get_device_capability(q_latent.device)[0] if q_latent.is_cuda else 0
        path, why = choose_path(sm, cache.kv_dtype_of(layer), dc, q_rope.shape[-1], self.meta.block_size,
                                self.meta.cp, self.decode_only)
        if self.meta.sparse.get(layer) is not None:
            path, why = None, SPARSE_REASON
        self.paths[path or "triton"] = self.paths.get(path or "triton", 0) + 1
        if path is None:
            return self.fallback.run(why, layer, q_latent, q_rope, cache)
        if path == "trtllm-gen":
            return self._trtllm(layer, q_latent, q_rope, cache)
        return self._wrapper(layer, q_latent, q_rope, cache)

    def _wrapper(self, layer: int, q_latent, q_rope, cache):
        import flashinfer.mla
        meta, dev, h = self.meta, q_latent.device, q_latent.shape[1]
        if self.wrapper is None:
            self.workspace = torch.empty(WORKSPACE_BYTES, dtype=torch.int8, device=dev)
            self.wrapper = flashinfer.mla.BatchMLAPagedAttentionWrapper(self.workspace, backend="auto")
            self.base_e = "return_lse_base_on_e" in inspect.signature(self.wrapper.run).parameters
        if self.planned_heads != h:
            indptr, indices, _ = meta.csr()
            self.wrapper.plan(meta.qo_indptr, indptr, indices, meta.kv_len, h, q_latent.shape[2], q_rope.shape[2],
                              meta.block_size, True, self.scale, torch.bfloat16, torch.bfloat16)
            self.planned_heads = h
        kw = {"return_lse_base_on_e": True} if self.base_e else {}
        o, lse = self.wrapper.run(q_latent.to(torch.bfloat16).contiguous(), q_rope.to(torch.bfloat16).contiguous(),
                                  cache.ckv[layer], cache.kpe[layer], return_lse=True, **kw)
        return o.float(), lse_to_natural(lse, base2=not self.base_e)

    def _trtllm(self, layer: int, q_latent, q_rope, cache):
        import flashinfer.mla
        meta, dev = self.meta, q_latent.device
        n, h, dc = q_latent.shape
        dr = q_rope.shape[-1]
        indptr, indices, _ = meta.csr()
        if self.trt_workspace is None:   # trtllm-gen wants a zeroed workspace (semaphores)
            self.trt_workspace = torch.zeros(WORKSPACE_BYTES, dtype=torch.int8, device=dev)
        kv = fused_pages(cache, layer, indices, torch.bfloat16)          # [P, page, d_c + d_r]
        query = torch.cat([q_latent, q_rope], dim=-1).to(torch.bfloat16).view(n, 1, h, dc + dr)
        out, lse = flashinfer.mla.trtllm_batch_decode_with_kv_cache_mla(
            query=query, kv_cache=kv.unsqueeze(1), workspace_buffer=self.trt_workspace,
            qk_nope_head_dim=TRTLLM_QK_NOPE, kv_lora_rank=dc, qk_rope_head_dim=dr,
            block_tables=remap_tables(indptr, meta.num_reqs), seq_lens=meta.kv_len,
            max_seq_len=int(meta.kv_len.max()), bmm1_scale=self.scale, bmm2_scale=1.0, return_lse=True)
        return out.view(n, h, dc).float(), lse_to_natural(lse.view(n, h), base2=TRTLLM_LSE_BASE2)
