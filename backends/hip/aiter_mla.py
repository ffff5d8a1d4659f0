"""`aiter` MLA decode behind our kernel interface (AMD ROCm; not verified on hardware yet).

What our wrapper relies on, read from ROCm/aiter at commit e4048607 (2026-08-22) — AITER is not on PyPI, so these
facts are written down once here (AITER_FACTS) and tests/test_vendor_kernels.py runs the wrapper through a
stand-in that enforces them:
- `aiter.mla.mla_decode_fwd(q [N, H, 576], kv_buffer [pages, page, 1, 576], o [N, H, 512], qo_indptr, kv_indptr,
  kv_indices, kv_last_page_lens, max_seqlen_q, page_size=1, nhead_kv=1, sm_scale=None, …, return_lse=False)`
  (aiter/mla.py); it writes õ into `o` (also returned) and returns the LSE, natural log.
- Heads: the non-persistent bf16 decode picks an assembly kernel by (arch, heads, q length) from
  hsa/<arch>/mla/mla_asm.csv (csrc/py_itfs_cu/asm_mla.cu `get_heuristic_kernel_mla`; any other head count raises
  "cannot get heuristic kernel"). For one query row per request: gfx942 (MI300) ships 8, 16, 32 and 128 heads
  (its 64-head kernel is for q length 0 only), gfx950 (MI350) also 64 — DECODE_HEADS. A rank's heads are padded
  with zero queries up to the next size its arch ships, and the padding is cut from õ and the LSE.
- LSE: with one KV split and 8 or 32 bf16 heads mla_decode_fwd returns the stage-1 LSE buffer, which the
  non-LSE kernels never write; older trees also left it unwritten for 64/128 heads with one split. The split
  count is chosen inside aiter, so for those head counts (LSE_UNWRITTEN_HEADS) the wrapper returns NaN, never
  the vendor's buffer: no caller can read an unwritten LSE as a number. Only CP merges the LSE, and CP steps run
  our Triton kernel.
- Per-call buffers: the non-persistent decode (no work_meta_data, num_kv_splits left to aiter, as we call it)
  takes its split count from get_meta_param, which searches 1…16 splits (`range(1, 17)`; the fp8 cap only lowers
  it): MAX_KV_SPLITS. Each call then allocates fp32 stage-1 partials `logits` [rows, splits, H', 512] (a view of
  `o` instead when splits == 1 and 8 or 32 bf16 heads), fp32 `attn_lse` [rows, splits, H', 1], fp32 `final_lse`
  [rows, H'] (return_lse), int32 `valid_split_count` [requests] and get_meta_param's int32 split indptr
  [requests + 1] — call_buffer_bytes, which the device budget counts (backends.attention_workspace_bytes).
- Archs: AITER has kernels for gfx942 and gfx950 only (no Hygon DCU arch): elsewhere our Triton kernel runs
  (backends.hip.arch checks at startup that the installed Triton can compile for the device).
The KV buffer is the layer's fused bf16 pool itself (`cache.fused[layer]` [blocks, page, 576], viewed as
[blocks, page, 1, 576]) with the step's CSR page lists (AttnMetadata.csr: physical pages), one call per layer for
every row: no copy of the KV. Prefill rows, CP steps, quantised KV, NoPE models (d_r = 0, e.g. GLM-5.3-Flash)
and other shapes run our Triton kernel (`Fallback`), with the reason logged once.
"""
from __future__ import annotations

import logging

import torch

from splash.attention.kernels import device_arch   # "gfx942" from a ROCm device (startup asks it here)
from splash.attention.kernels.external import NOT_FUSED_REASON, SPARSE_REASON, Fallback, pad_heads

AITER_FACTS = "ROCm/aiter e4048607 (2026-08-22): aiter/mla.py, csrc/py_itfs_cu/asm_mla.cu, hsa/<arch>/mla/mla_asm.csv"
# mla_decode_fwd's parameters in order (aiter/mla.py); the stand-in binds our call to them
DECODE_FWD_PARAMS = ("q", "kv_buffer", "o", "qo_indptr", "kv_indptr", "kv_indices", "kv_last_page_lens",
                     "max_seqlen_q", "page_size", "nhead_kv", "sm_scale", "logit_cap", "num_kv_splits",
                     "num_kv_splits_indptr", "work_meta_data", "work_indptr", "work_info_set", "reduce_indptr",
                     "reduce_final_map", "reduce_partial_map", "q_scale", "kv_scale", "intra_batch_mode",
                     "return_logits", "return_lse", "g_kv_indptr", "cp_world_size", "cp_rank", "causal")
DECODE_FWD_REQUIRED = 8          # q … max_seqlen_q have no default
DECODE_HEADS = {"gfx942": (8, 16, 32, 128), "gfx950": (8, 16, 32, 64, 128)}
LSE_UNWRITTEN_HEADS = (8, 32, 64, 128)
PAGE_SIZES = (1, 64)
DIMS = (512, 64)
MAX_KV_SPLITS = 16               # get_meta_param's largest pick (aiter/mla.py)
LOGITS_IN_O_HEADS = (8, 32)      # bf16 heads whose one-split partials are written into `o` (no fp32 buffer)
_log = logging.getLogger("splash.attention")


def decode_heads(arch: str, heads: int) -> int | None:
    """The head count to launch `heads` with on `arch`: the smallest AITER ships that holds them (None: none)."""
    return next((h for h in DECODE_HEADS.get(arch, ()) if h >= heads), None)


def call_buffer_bytes(rows: int, launched_heads: int, splits: int = MAX_KV_SPLITS, requests: int | None = None) -> int:
    """Device bytes one bf16 decode call of mla_decode_fwd allocates for itself (see the module doc), for `rows`
    query rows of `launched_heads` (padded) heads with `splits` KV splits; `requests` defaults to `rows` (one
    query row per request)."""
    requests = rows if requests is None else requests
    logits = 0 if splits == 1 and launched_heads in LOGITS_IN_O_HEADS else rows * splits * launched_heads * DIMS[0]
    return 4 * (logits + rows * splits * launched_heads + rows * launched_heads) + 4 * (2 * requests + 1)


def workspace_bytes(launches, max_rows: int, arch: str = "", dims: tuple[int, int] = DIMS,
                    page_size: int = PAGE_SIZES[-1]) -> int:
    """The most any decode step's call allocates (call_buffer_bytes): `max_rows` decode rows, the largest split
    count aiter can choose, and the widest head launch among `launches` (splash.layouts.layout.RankAttention)
    that choose_path sends to AITER on `arch` ("" unknown: any arch AITER ships; gfx942 pads 64 → 128). A
    launch that runs our Triton kernel (another arch, KV dtype, dims or page size, a head count no kernel holds,
    CP) allocates nothing here."""
    archs = (arch,) if arch else tuple(DECODE_HEADS)
    widest = max((decode_heads(a, run.heads) for a in archs for run in launches
                  if choose_path(a, run.kv_dtype, *dims, run.heads, page_size, run.position_split, True) is None),
                 default=0)
    return call_buffer_bytes(max_rows, widest) if widest and max_rows > 0 else 0


def choose_path(arch: str, kv_dtype: str, d_c: int, d_r: int, heads: int, page_size: int, cp: bool,
                decode_only: bool) -> str | None:
    """None when `mla_decode_fwd` runs this layer, else why our Triton kernel runs instead."""
    if arch not in DECODE_HEADS:
        return f"arch {arch} (AITER ships MLA decode kernels for {', '.join(DECODE_HEADS)} only)"
    if cp:
        return "CP step (a rank's pages are every T-th block; AITER's mask wants contiguous pages)"
    if not decode_only:
        return "prefill rows in the step (AITER's mla_decode_fwd is run for decode steps only here)"
    if kv_dtype != "bfloat16":
        return f"KV dtype {kv_dtype} (our fp8/int8 pool keeps per-token scales; AITER takes a per-tensor scale)"
    if (d_c, d_r) != DIMS:
        return f"latent/rope dims {d_c}/{d_r} (AITER MLA decode is built for {DIMS[0]} + {DIMS[1]})"
    if decode_heads(arch, heads) is None:
        return f"{heads} heads on this rank (AITER's {arch} MLA decode ships {DECODE_HEADS[arch]} heads)"
    if page_size not in PAGE_SIZES:
        return f"page size {page_size} (AITER MLA decode takes {PAGE_SIZES})"
    return None


class AiterMLAKernel:
    name = "aiter"

    def __init__(self, softmax_scale: float, arch: str | None = None):
        import aiter.mla  # noqa: F401 — fail at build time, not at the first step
        self.scale, self.meta, self.arch = softmax_scale, None, arch
        self.fallback = Fallback(softmax_scale, "aiter")
        self.paths: dict[str, int] = {}

    def plan(self, meta) -> None:
        """Per step: the CSR page lists every layer's call reads (AttnMetadata.csr, one host read)."""
        self.meta = meta
        self.decode_only = all(n == 1 for n in meta.q_lens)
        if self.decode_only and meta.num_reqs and not meta.cp:
            meta.csr()
        self.fallback.plan(meta)

    def run(self, layer: int, q_latent: torch.Tensor, q_rope: torch.Tensor, cache):
        meta = self.meta
        n, h, dc = q_latent.shape
        dr = q_rope.shape[-1]
        if n == 0 or meta.num_reqs == 0:
            return (torch.zeros(n, h, dc, device=q_latent.device),
                    torch.full((n, h), float("-inf"), device=q_latent.device))
        if self.arch is None:
            self.arch = device_arch(q_latent.device)
        why = choose_path(self.arch, cache.kv_dtype_of(layer), dc, dr, h, meta.block_size, meta.cp,
                          self.decode_only)
        if meta.sparse.get(layer) is not None:
            why = SPARSE_REASON
        elif why is None and cache.fused[layer] is None:
            why = NOT_FUSED_REASON
        key = "triton" if why else "aiter"
        if key not in self.paths and why is None:
            _log.info("aiter attention: mla_decode_fwd on %s (%d heads, launched as %d)", self.arch, h,
                      decode_heads(self.arch, h))
        self.paths[key] = self.paths.get(key, 0) + 1
        if why is not None:
            return self.fallback.run(why, layer, q_latent, q_rope, cache)
        return self._decode(layer, q_latent, q_rope, cache)

    def _decode(self, layer: int, q_latent, q_rope, cache):
        """Every decode row in one call on the layer's fused pool and the step's page lists."""
        import aiter.mla
        meta, (n, h, dc) = self.meta, q_latent.shape
        hp = decode_heads(self.arch, h)
        kv_indptr, kv_indices, _ = meta.csr()    # built in plan: cached for the step
        q, _ = pad_heads(torch.cat([q_latent, q_rope], dim=-1).to(torch.bfloat16), hp)
        o = torch.empty(n, hp, dc, dtype=torch.bfloat16, device=q.device)
        _, lse_v = aiter.mla.mla_decode_fwd(q, cache.fused[layer].unsqueeze(2), o, meta.qo_indptr, kv_indptr,
                                            kv_indices, meta.kv_last_page_len, 1, page_size=meta.block_size,
                                            nhead_kv=1, sm_scale=self.scale, return_lse=True)
        if hp in LSE_UNWRITTEN_HEADS:   # the vendor's buffer may be unwritten: NaN, never it
            lse = torch.full((n, h), float("nan"), device=q.device)
        else:
            lse = lse_v.reshape(n, hp)[:, :h].float()
        return o[:, :h].float(), lse
