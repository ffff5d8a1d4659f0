"""`flashinfer` MLA attention behind our kernel interface (NVIDIA; the SM90 paths checked on one H200,
trtllm-gen never on hardware).

Calls are in flashinfer 0.7's current keyword forms (TESTED range in backends.cuda.flashinfer_api, which also holds
the recorded signatures tests/test_vendor_kernels.py binds every call to), and name the backend and the LSE base
explicitly: under `backend="auto"` flashinfer may pick its cute-dsl kernel, whose LSE is natural log where
trtllm-gen's is base 2, and demands block tables aligned to 128 tokens.
- Steps with prefill rows, and decode on SM80/SM90: `flashinfer.mla.BatchMLAPagedAttentionWrapper` with backend
  "fa3" on SM90, "fa2" elsewhere, planned once per step and head count with
  `plan(metadata=MLAPlanMetadata.csr(qo_indptr, kv_indptr, kv_indices, kv_len_arr), …, query_layout="split",
  kv_cache_layout="split", lse_mode="basee", scale_mode="default")` and run as `run(query=(q_nope, q_pe),
  kv_cache=(ckv, kpe), return_lse=True, return_lse_base_on_e=True)`, reading our ckv [blocks, page, d_c] and kpe
  [blocks, page, d_r] pools in place (its split layout is ours; it takes their outer strides, so the two views of
  a fused bf16 pool, token stride d_c + d_r, go as they are).
- SM100 (B200), decode-only steps, pages of 32 or 64 tokens, rope width 64:
  `flashinfer.mla.trtllm_batch_decode_with_kv_cache_mla(…, backend="trtllm-gen", return_lse_base="basee")`, one
  call per layer for every row, on the layer's fused bf16 pool itself (`cache.fused[layer]` [blocks, page,
  d_c + d_r], viewed as [blocks, 1, page, d_c + d_r]) with the requests' own page tables as block tables, padded
  to a multiple of 128 tokens (external.block_tables, built once per step). trtllm-gen has no kernel for
  64 < heads < 128, so such a rank's queries are padded with zero heads to 128 and the padding cut from õ and
  the LSE.
- FP8 KV on SM90 (H200): the same wrapper planned with `kv_data_type=torch.float8_e4m3fn,
  scale_mode="kv-per-tensor"` (flashinfer 0.7.4 `_fa_common`: FP8 MLA needs SM90, bf16 queries, d_c 512 and d_r
  0/64) and run with `ckv_scale_arr=` our per-token per-128-value latent scales as stored ([blocks, page, 4] fp32:
  flashinfer's repack reads `ckv_scale_arr[slot * 4 + group]`) and `kpe_scale=quant.ROPE_FP8_SCALE`: on such a
  device the pool stores an fp8 layer's rope key in e4m3 at that one fixed scale (PagedLatentCache `rope_fp8`,
  chosen by splash.attention.kernels.kv_rope_fp8), as that kernel reads it.
- Everything else runs our Triton kernel (`Fallback`), with the reason logged once: FP8 KV off SM90 (FlashInfer's
  FP8 MLA is SM90-only; trtllm-gen's FP8 decode takes one per-tensor latent scale, not our per-token ones), INT8
  KV, CP steps, other latent/rope dims, sparse layers.
Which path a layer kind (its KV dtype, dense or sparse) takes is logged once.
Host reads (pages per request, the longest row) happen once per step in `plan`, never per layer.
"""
from __future__ import annotations

import logging

import torch

from splash.attention.kernels.external import (NOT_FUSED_REASON, SPARSE_REASON, Fallback, block_tables,
                                               pad_heads)
from splash.kv import quant
from splash.layouts.memory import ROPE_FP8_SM_MAJOR

WORKSPACE_BYTES = 128 << 20            # FlashInfer's recommended float workspace (counted in the device budget)
WRAPPER_DIMS = ((512, 64), (512, 0))    # (d_c, d_r) the MLA wrapper takes (DeepSeek/GLM; NoPE)
TRTLLM_PAGE_SIZES = (32, 64)
TRTLLM_TABLE_TOKENS = 128               # trtllm-gen / cute-dsl block tables: width × page a multiple of this
TRTLLM_QK_NOPE = 128                    # trtllm-gen's qk_nope_head_dim argument (unused by the dense path)
# FlashInfer's FP8 MLA (fa3 with kv-per-tensor scales): SM90 only; the same fact decides which pools keep an e4m3 rope
FP8_SM_MAJOR = ROPE_FP8_SM_MAJOR["flashinfer"]
_log = logging.getLogger("splash.attention")


def choose_path(sm_major: int, kv_dtype: str, d_c: int, d_r: int, page_size: int, cp: bool,
                decode_only: bool, rope_fp8: bool = False) -> tuple[str | None, str | None]:
    """('wrapper' | 'wrapper-fp8' | 'trtllm-gen', None), or (None, why our Triton kernel runs instead).
    `rope_fp8`: the layer's rope key is stored in e4m3 (what the FP8 wrapper reads)."""
    if cp:
        return None, "CP step (a rank's pages are every T-th block; FlashInfer's causal mask wants contiguous pages)"
    if kv_dtype not in ("bfloat16", "fp8_e4m3"):
        return None, f"KV dtype {kv_dtype} (FlashInfer MLA reads bf16, or fp8 e4m3 on SM90)"
    if sm_major < 8:
        return None, f"compute capability {sm_major}.x (FlashInfer MLA needs SM80 or newer)"
    if (d_c, d_r) not in WRAPPER_DIMS:
        return None, f"latent/rope dims {d_c}/{d_r} (FlashInfer MLA is built for {WRAPPER_DIMS})"
    if kv_dtype == "fp8_e4m3":
        if sm_major != FP8_SM_MAJOR:
            return None, (f"KV dtype fp8_e4m3 on SM{sm_major}x (FlashInfer's FP8 MLA with per-token latent scales "
                          "is SM90 only)")
        if d_r and not rope_fp8:
            return None, ("KV dtype fp8_e4m3 with a bf16 rope key (FlashInfer's FP8 MLA reads an e4m3 rope cache: "
                          "a pool built with rope_fp8)")
        return "wrapper-fp8", None
    if sm_major == 10 and decode_only and d_r == 64 and page_size in TRTLLM_PAGE_SIZES:   # SM100/SM103 only
        return "trtllm-gen", None
    return "wrapper", None


def arch_major(arch: str) -> int:
    """The compute capability's major version of an arch name: "sm_90" → 9, "sm_100" → 10, "sm_120" → 12."""
    return int(arch.removeprefix("sm_")) // 10


SM_MAJORS = (8, 9, 10, 12)                # compute capabilities FlashInfer MLA runs on (an unknown arch: any)


def workspace_bytes(launches, arch: str = "", dims: tuple[int, int] = WRAPPER_DIMS[0], page_size: int = 64) -> int:
    """What the kernel allocates for itself on an `arch` device ("" unknown: any of SM_MAJORS) for `launches`
    (splash.layouts.layout.RankAttention): WORKSPACE_BYTES for the MLA wrapper when some launch runs it, and
    another (zeroed) for trtllm-gen when some decode step runs that; nothing when every launch runs Triton."""
    from splash.attention.kernels import rope_fp8_pool
    if arch and not arch.startswith("sm_"):
        return 0
    paths = {choose_path(major, run.kv_dtype, *dims, page_size, run.position_split, decode_only,
                         rope_fp8_pool("flashinfer", f"sm_{major}0"))[0]
             for major in ((arch_major(arch),) if arch else SM_MAJORS) for run in launches
             for decode_only in (False, True)}
    return WORKSPACE_BYTES * (bool(paths & {"wrapper", "wrapper-fp8"}) + ("trtllm-gen" in paths))


def wrapper_backend(sm_major: int) -> str:
    """The MLA wrapper's backend by name (never "auto"): FA3 on Hopper, FA2 elsewhere (SM80+, SM100)."""
    return "fa3" if sm_major == 9 else "fa2"


def trtllm_heads(heads: int) -> int:
    """Heads to launch trtllm-gen MLA decode with: it has no kernel for 64 < heads < 128 (flashinfer 0.7.4,
    `_trtllm_gen_mla_incompatibility_reason`), so those pad to 128."""
    return 128 if 64 < heads < 128 else heads


def aligned_width(pages: int, page_size: int) -> int:
    """Block-table width (pages) covering `pages`, a multiple of TRTLLM_TABLE_TOKENS / page_size."""
    step = max(1, TRTLLM_TABLE_TOKENS // page_size)
    return max(step, -(-pages // step) * step)


class FlashInferMLAKernel:
    name = "flashinfer"

    def __init__(self, softmax_scale: float, sm_major: int | None = None):
        import flashinfer.mla  # noqa: F401 — fail at build time, not at the first step
        self.scale, self.meta, self.sm_major = softmax_scale, None, sm_major
        self.fallback = Fallback(softmax_scale, "flashinfer")
        self.wrapper = self.workspace = self.trt_workspace = None
        self.paths: dict[str, int] = {}   # runs per path (gpu-check reports it)
        self.logged: set[tuple] = set()    # layer kinds whose path was logged

    def plan(self, meta) -> None:
        """Per step: the host reads the vendor calls need (the most pages a request holds, the longest row), in
        one sync."""
        self.meta, self.planned, self.tables = meta, None, None
        self.decode_only = all(n == 1 for n in meta.q_lens)
        self.widest = self.longest = 0
        if meta.num_reqs:
            self.widest, self.longest = torch.stack([meta.num_pages.max().to(torch.int64),
                                                     meta.kv_len.max().to(torch.int64)]).tolist()
        self.fallback.plan(meta)

    def _sm(self, device: torch.device) -> int:
        if self.sm_major is None:
            self.sm_major = torch.cuda.get_device_capability(device)[0] if device.type == "cuda" else 0
        return self.sm_major

    def run(self, layer: int, q_latent: torch.Tensor, q_rope: torch.Tensor, cache):
        n, h, dc = q_latent.shape
        if n == 0 or self.meta.num_reqs == 0:
            return (torch.zeros(n, h, dc, device=q_latent.device),
                    torch.full((n, h), float("-inf"), device=q_latent.device))
        kv_dtype, sparse = cache.kv_dtype_of(layer), self.meta.sparse.get(layer) is not None
        path, why = choose_path(self._sm(q_latent.device), kv_dtype, dc, q_rope.shape[-1], self.meta.block_size,
                                self.meta.cp, self.decode_only, cache.kpe[layer].dtype == quant.ROPE_FP8)
        if sparse:
            path, why = None, SPARSE_REASON
        elif path == "trtllm-gen" and cache.fused[layer] is None:
            path, why = None, NOT_FUSED_REASON
        kind = (kv_dtype, sparse, path or why)
        if kind not in self.logged and path is not None:    # the fallback logs its reasons once itself
            _log.info("flashinfer attention: %s for %s%s layers (%d heads)", path, kv_dtype,
                      " sparse" if sparse else "", h)
        self.logged.add(kind)
        key = path or "triton"
        self.paths[key] = self.paths.get(key, 0) + 1
        if path is None:
            return self.fallback.run(why, layer, q_latent, q_rope, cache)
        if path == "trtllm-gen":
            return self._trtllm(layer, q_latent, q_rope, cache)
        return self._wrapper(layer, q_latent, q_rope, cache, fp8=path == "wrapper-fp8")

    def _wrapper(self, layer: int, q_latent, q_rope, cache, fp8: bool):
        """The MLA wrapper over the layer's ckv / kpe pools in place; `fp8`: the scaled FP8 form (SM90)."""
        import flashinfer.mla as fm
        meta, dev, (n, h, dc), dr = self.meta, q_latent.device, q_latent.shape, q_rope.shape[-1]
        kv_type = torch.float8_e4m3fn if fp8 else torch.bfloat16
        if self.wrapper is None:
            self.workspace = torch.empty(WORKSPACE_BYTES, dtype=torch.int8, device=dev)
            self.wrapper = fm.BatchMLAPagedAttentionWrapper(self.workspace, backend=wrapper_backend(self._sm(dev)))
        if self.planned != (h, kv_type):   # once per step, and again only when a handoff mixes KV dtypes
            indptr, indices, _ = meta.csr()
            self.wrapper.plan(
                metadata=fm.MLAPlanMetadata.csr(qo_indptr=meta.qo_indptr, kv_indptr=indptr, kv_indices=indices,
                                                kv_len_arr=meta.kv_len),
                num_heads=h, head_dim_ckv=dc, head_dim_kpe=dr, page_size=meta.block_size, causal=True,
                sm_scale=self.scale, q_data_type=torch.bfloat16, kv_data_type=kv_type, query_layout="split",
                kv_cache_layout="split", lse_mode="basee", scale_mode="kv-per-tensor" if fp8 else "default")
            self.planned = (h, kv_type)
        kpe = cache.kpe[layer]
        scales = {}
        if fp8:
            if kpe.dtype != kv_type:   # NoPE: a zero-width rope pool; the kernel wants it typed as the KV
                kpe = torch.empty(*kpe.shape, dtype=kv_type, device=dev)
            scales = dict(ckv_scale_arr=cache.scale[layer], kpe_scale=quant.ROPE_FP8_SCALE)
        o, lse = self.wrapper.run(
            query=(q_latent.to(torch.bfloat16).contiguous(), q_rope.to(torch.bfloat16).contiguous()),
            kv_cache=(cache.ckv[layer], kpe), return_lse=True, return_lse_base_on_e=True, **scales)
        return o.float(), lse.float()

    def _trtllm(self, layer: int, q_latent, q_rope, cache):
        """Every decode row in one call on the layer's fused pool, block tables padded to 128 tokens."""
        import flashinfer.mla as fm
        meta, dev = self.meta, q_latent.device
        (n, h, dc), dr = q_latent.shape, q_rope.shape[-1]
        if self.trt_workspace is None:   # trtllm-gen wants a zeroed workspace (semaphores)
            self.trt_workspace = torch.zeros(WORKSPACE_BYTES, dtype=torch.int8, device=dev)
        if self.tables is None:          # once per step: every layer reads the same pages
            self.tables = block_tables(meta, aligned_width(self.widest, meta.block_size))
        q, _ = pad_heads(torch.cat([q_latent, q_rope], dim=-1).to(torch.bfloat16), trtllm_heads(h))
        hp = q.shape[1]
        o, lse = fm.trtllm_batch_decode_with_kv_cache_mla(
            query=q.view(n, 1, hp, dc + dr), kv_cache=cache.fused[layer].unsqueeze(1),
            workspace_buffer=self.trt_workspace, qk_nope_head_dim=TRTLLM_QK_NOPE, kv_lora_rank=dc,
            qk_rope_head_dim=dr, block_tables=self.tables, seq_lens=meta.kv_len, max_seq_len=self.longest,
            bmm1_scale=self.scale, bmm2_scale=1.0, backend="trtllm-gen", return_lse=True, return_lse_base="basee")
        return o.reshape(n, hp, dc)[:, :h].float(), lse.reshape(n, hp)[:, :h].float()
