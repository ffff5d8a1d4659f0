"""Strict CPU stand-ins for the vendor MLA kernels our wrappers call (flashinfer.mla, aiter.mla).

Each stand-in binds every call to the vendor's recorded signature (backends/cuda/flashinfer_api.json;
backends/hip/aiter_mla.AITER_FACTS), enforces the vendor preconditions our wrappers must meet, and computes the
attention in fp32 from what it was handed, so a wrapper that passes the wrong pages, scale, heads or LSE base gets
the wrong answer:
- flashinfer: explicit backends (never "auto"), keyword-only calls in the current (non-deprecated) forms, an
  explicit LSE base, block tables aligned to 128 tokens, trtllm-gen's page sizes and head limits
  (no 64 < heads < 128), bf16 operands (FP8 KV on the MLA wrapper: scale_mode "kv-per-tensor", per-row
  `ckv_scale_arr` of the KV's shape, a float `kpe_scale`, dequantised to bf16 as flashinfer does), unit inner
  strides and 16-byte aligned outer strides on the split tensors; the LSE is returned in the base asked for.
- aiter: the per-arch head table (a head count it ships no kernel for raises "cannot get heuristic kernel"), page
  sizes, and no LSE written for the shapes where the real kernel leaves it unwritten (the buffer comes back NaN).
"""
from __future__ import annotations

import importlib.machinery
import inspect
import math
import sys
import types

import torch

from backends.cuda import flashinfer_api

DEPRECATED_RUN = ("q_nope", "q_pe", "ckv_cache", "kpe_cache")
DEPRECATED_PLAN = ("qo_indptr", "kv_indptr", "kv_indices", "kv_len_arr", "cum_seq_lens_q", "block_tables",
                   "seq_lens")


class VendorPrecondition(AssertionError):
    """A call the real vendor kernel would reject (or answer wrongly)."""


_KINDS = {"posonly": inspect.Parameter.POSITIONAL_ONLY, "pos": inspect.Parameter.POSITIONAL_OR_KEYWORD,
          "kwonly": inspect.Parameter.KEYWORD_ONLY, "varargs": inspect.Parameter.VAR_POSITIONAL,
          "varkw": inspect.Parameter.VAR_KEYWORD}


def _bind(call: str, args: tuple, kwargs: dict, overload: int | None = None) -> inspect.BoundArguments:
    """Bind a call to the recorded signature: its parameter names, kinds and which have defaults."""
    rec = flashinfer_api.load()["calls"][call]
    params = rec["impl"] if overload is None else rec["overloads"][overload]
    sig = inspect.Signature([inspect.Parameter(n, _KINDS[k], default=inspect.Parameter.empty if d is None else d)
                             for n, k, d in params])
    return sig.bind(*args, **kwargs)


def _attend(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float, q_pos, k_pos):
    """q [r, H, D], keys [t, D], values [t, d_c]; causal by position. (o [r, H, d_c], natural-log lse [r, H])."""
    s = torch.einsum("rhd,td->rht", q.float(), keys.float()) * scale
    s = s.masked_fill(k_pos[None, None, :] > q_pos[:, None, None], float("-inf"))
    lse = torch.logsumexp(s, -1)
    p = torch.softmax(s, -1).nan_to_num(0.0)
    return torch.einsum("rht,tc->rhc", p, values.float()), lse


# ---- flashinfer ---------------------------------------------------------------------------------------------

class MLAPlanMetadata:
    def __init__(self, **fields):
        self.__dict__.update(fields)

    @classmethod
    def csr(cls, *args, **kwargs):
        b = _bind("MLAPlanMetadata.csr", args, kwargs)
        return cls(**b.arguments)


class BatchMLAPagedAttentionWrapper:
    BACKENDS = ("fa2", "fa3")

    def __init__(self, *args, **kwargs):
        b = _bind("BatchMLAPagedAttentionWrapper", args, kwargs)
        backend = b.arguments.get("backend", "auto")
        if backend not in self.BACKENDS:
            raise VendorPrecondition(f"wrapper backend {backend!r}: name one (auto may pick cute-dsl, natural-log "
                                     "LSE and aligned tables)")
        self.backend, self.plan_args, self.runs = backend, None, 0

    def plan(self, *args, **kwargs):
        if args:
            raise VendorPrecondition("positional plan() arguments are deprecated in flashinfer 0.7")
        if set(kwargs) & set(DEPRECATED_PLAN):
            raise VendorPrecondition(f"flat plan metadata {sorted(set(kwargs) & set(DEPRECATED_PLAN))} is "
                                     "deprecated: pass metadata=MLAPlanMetadata.csr(...)")
        b = _bind("BatchMLAPagedAttentionWrapper.plan", (), kwargs, overload=0)
        a = b.arguments
        if a.get("lse_mode", "none") not in ("basee", "base2"):
            raise VendorPrecondition("plan without an LSE mode: run(return_lse=True) would mismatch")
        if a["q_data_type"] != torch.bfloat16:
            raise VendorPrecondition("this stand-in plans bf16 queries only")
        mode = a.get("scale_mode", "default")
        if a["kv_data_type"] == torch.float8_e4m3fn:      # flashinfer 0.7.4 _fa_common: FP8 MLA (SM90 only)
            if self.backend not in ("fa2", "fa3") or mode != "kv-per-tensor":
                raise VendorPrecondition("FP8 MLA plans require scale_mode='kv-per-tensor' (fa2/fa3, SM90)")
            if a["head_dim_ckv"] != 512 or a["head_dim_kpe"] not in (0, 64):
                raise VendorPrecondition("FP8 MLA: head_dim_ckv 512, head_dim_kpe 0 or 64")
        elif a["kv_data_type"] != torch.bfloat16 or mode != "default":
            raise VendorPrecondition("non-FP8 MLA plans: KV dtype = query dtype, scale_mode='default'")
        if a.get("query_layout") != "split" or a.get("kv_cache_layout") != "split":
            raise VendorPrecondition("split (q_nope, q_pe) / (ckv, kpe) inputs need split layouts in plan()")
        self.plan_args = a

    def run(self, *args, **kwargs):
        if args:
            raise VendorPrecondition("positional run() arguments are deprecated in flashinfer 0.7")
        if set(kwargs) & set(DEPRECATED_RUN):
            raise VendorPrecondition("q_nope/q_pe/ckv_cache/kpe_cache are deprecated: pass query= and kv_cache=")
        b = _bind("BatchMLAPagedAttentionWrapper.run", (), kwargs, overload=1)   # the (output, lse) form
        a, p = b.arguments, self.plan_args
        if p is None:
            raise VendorPrecondition("run() before plan()")
        base_e = a.get("return_lse_base_on_e", False)
        if ("basee" if base_e else "base2") != p["lse_mode"] or not a.get("return_lse"):
            raise VendorPrecondition(f"run LSE mode vs planned {p['lse_mode']!r}")
        (q_nope, q_pe), (ckv, kpe) = a["query"], a["kv_cache"]
        kv_type = p["kv_data_type"]
        if q_nope.dtype != torch.bfloat16 or q_pe.dtype != torch.bfloat16 or ckv.dtype != kv_type \
                or kpe.dtype != kv_type:
            raise VendorPrecondition(f"dtypes differ from the plan's (bf16 queries, {kv_type} KV)")
        for t in (q_nope, q_pe, ckv, kpe):   # native FA takes outer strides only, in 16-byte vectors
            if t.numel() and (t.ndim != 3 or t.stride(-1) != 1 or t.data_ptr() % 16 or any(
                    t.shape[i] > 1 and t.stride(i) * t.element_size() % 16 for i in (0, 1))):
                raise VendorPrecondition(f"tensor {tuple(t.shape)} strides {t.stride()}: FA needs unit inner "
                                         "stride and 16-byte aligned pointers / outer strides")
        ckv, kpe = self._dequantised(a, ckv, kpe)
        h = p["num_heads"]
        if q_nope.shape[1] != h or q_nope.shape[2] != p["head_dim_ckv"] or q_pe.shape[2] != p["head_dim_kpe"]:
            raise VendorPrecondition(f"query shape {tuple(q_nope.shape)} vs plan")
        m, page = p["metadata"], p["page_size"]
        qo, ptr, idx, lens = (m.qo_indptr.long(), m.kv_indptr.long(), m.kv_indices.long(), m.kv_len_arr.long())
        o = torch.zeros(q_nope.shape[0], h, ckv.shape[-1])
        lse = torch.full((q_nope.shape[0], h), float("-inf"))
        for r in range(len(lens)):
            rows = slice(int(qo[r]), int(qo[r + 1]))
            n_kv = int(lens[r])
            pages = idx[int(ptr[r]):int(ptr[r + 1])]
            c = ckv[pages].reshape(-1, ckv.shape[-1])[:n_kv]
            k = torch.cat([c, kpe[pages].reshape(-1, kpe.shape[-1])[:n_kv]], -1)
            q = torch.cat([q_nope[rows], q_pe[rows]], -1)
            nq = q.shape[0]
            q_pos = torch.arange(n_kv - nq, n_kv)        # causal: the request's last nq positions
            o[rows], lse[rows] = _attend(q, k, c, p["sm_scale"], q_pos, torch.arange(n_kv))
        self.runs += 1
        return o.to(torch.bfloat16), (lse if base_e else lse / math.log(2.0))

    def _dequantised(self, a: dict, ckv: torch.Tensor, kpe: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The KV as the kernel computes with it: bf16 as given; FP8 × its scales (exactly one of ckv_scale /
        ckv_scale_arr [*ckv.shape[:-1], d_c / 128] fp32 contiguous, and a positive float kpe_scale), rounded to
        bf16 as flashinfer's repack does before the MMA."""
        given = [k for k in ("ckv_scale", "ckv_scale_arr", "kpe_scale") if a.get(k) is not None]
        if self.plan_args["kv_data_type"] != torch.float8_e4m3fn:
            if given:
                raise VendorPrecondition(f"{given} are only valid when kv_data_type is FP8")
            return ckv, kpe
        arr, kpe_scale = a.get("ckv_scale_arr"), a.get("kpe_scale")
        if (a.get("ckv_scale") is None) == (arr is None) or kpe_scale is None:
            raise VendorPrecondition("FP8 KV: exactly one of ckv_scale / ckv_scale_arr, and kpe_scale")
        if isinstance(kpe_scale, torch.Tensor) or not math.isfinite(float(kpe_scale)) or float(kpe_scale) <= 0:
            raise VendorPrecondition(f"kpe_scale must be a finite positive float, got {kpe_scale!r}")
        if arr is not None:
            want = (*ckv.shape[:-1], self.plan_args["head_dim_ckv"] // 128)
            if tuple(arr.shape) != want or arr.dtype != torch.float32 or not arr.is_contiguous():
                raise VendorPrecondition(f"ckv_scale_arr {tuple(arr.shape)} {arr.dtype}: want {want} fp32 contiguous")
            scale = arr.repeat_interleave(128, dim=-1)
        else:
            scale = float(a["ckv_scale"])
        return ((ckv.float() * scale).to(torch.bfloat16), (kpe.float() * float(kpe_scale)).to(torch.bfloat16))


def trtllm_batch_decode_with_kv_cache_mla(*args, **kwargs):
    if args:
        raise VendorPrecondition("pass trtllm_batch_decode_with_kv_cache_mla arguments by keyword")
    a = _bind("trtllm_batch_decode_with_kv_cache_mla", (), kwargs).arguments
    backend = a.get("backend", "auto")
    if backend not in ("trtllm-gen",):
        raise VendorPrecondition(f"backend {backend!r}: auto may pick cute-dsl (natural-log LSE, other limits)")
    if a.get("return_lse") and a.get("return_lse_base") not in ("basee", "base2"):
        raise VendorPrecondition("LSE base left to the backend's default (say return_lse_base explicitly)")
    q, kv, tables = a["query"], a["kv_cache"], a["block_tables"]
    if kv.ndim != 4 or kv.shape[1] != 1:
        raise VendorPrecondition(f"kv_cache {tuple(kv.shape)}: want [pages, 1, page, d_c + d_r]")
    page = kv.shape[2]
    if page not in (32, 64):
        raise VendorPrecondition(f"trtllm-gen requires block_size in (32, 64), got {page}")
    heads = q.shape[2]
    if 64 < heads < 128:
        raise VendorPrecondition(f"trtllm-gen MLA decode does not support 64 < num_heads_q < 128; got {heads}")
    if tables.shape[1] % (128 // page):
        raise VendorPrecondition(f"block_num {tables.shape[1]} not a multiple of 128 / block_size {page}")
    if q.dtype != torch.bfloat16 or kv.dtype != torch.bfloat16:
        raise VendorPrecondition("bf16 query and KV")
    dc, dr = a["kv_lora_rank"], a["qk_rope_head_dim"]
    if q.shape[-1] != dc + dr or kv.shape[-1] != dc + dr:
        raise VendorPrecondition("head dim must be kv_lora_rank + qk_rope_head_dim")
    lens = a["seq_lens"].long()
    if int(lens.max()) > a["max_seq_len"] or tables.shape[1] * page < int(lens.max()):
        raise VendorPrecondition("max_seq_len / block table narrower than a row")
    n = q.shape[0]
    o = torch.zeros(n, 1, heads, dc)
    lse = torch.full((n, 1, heads), float("-inf"))
    for b in range(n):
        t = int(lens[b])
        keys = kv[tables[b, :-(-t // page)].long(), 0].reshape(-1, dc + dr)[:t]
        ob, lb = _attend(q[b], keys, keys[:, :dc], float(a["bmm1_scale"]), torch.tensor([t - 1]),
                         torch.arange(t))
        o[b], lse[b] = ob * float(a["bmm2_scale"]), lb
    if a["return_lse_base"] == "base2":
        lse = lse / math.log(2.0)
    return o.to(torch.bfloat16), lse.reshape(n, heads)


def _install(monkeypatch, package: str, mla: types.ModuleType) -> types.ModuleType:
    """`package` and `package.mla` (= `mla`) in sys.modules for the test's duration."""
    pkg = types.ModuleType(package)
    pkg.mla = mla
    for name, m in ((package, pkg), (f"{package}.mla", mla)):
        m.__spec__ = importlib.machinery.ModuleSpec(name, None)
        monkeypatch.setitem(sys.modules, name, m)
    return mla


def install_flashinfer(monkeypatch) -> types.ModuleType:
    """Put the stand-in in sys.modules as flashinfer / flashinfer.mla for the test's duration."""
    mla = types.ModuleType("flashinfer.mla")
    mla.BatchMLAPagedAttentionWrapper = BatchMLAPagedAttentionWrapper
    mla.MLAPlanMetadata = MLAPlanMetadata
    mla.trtllm_batch_decode_with_kv_cache_mla = trtllm_batch_decode_with_kv_cache_mla
    return _install(monkeypatch, "flashinfer", mla)


# ---- aiter --------------------------------------------------------------------------------------------------

def _aiter_signature() -> inspect.Signature:
    from backends.hip import aiter_mla as ai
    kind = inspect.Parameter.POSITIONAL_OR_KEYWORD
    return inspect.Signature([inspect.Parameter(p, kind, default=inspect.Parameter.empty
                                                if i < ai.DECODE_FWD_REQUIRED else None)
                              for i, p in enumerate(ai.DECODE_FWD_PARAMS)])


def make_mla_decode_fwd(arch: str, splits: int, allocated: list[int]):
    """aiter.mla.mla_decode_fwd as `arch`'s build answers: its head table, page sizes, bf16, one query row per
    request; õ written into `o`; the LSE left unwritten (garbage, as torch.empty would) for those head counts.
    Each call allocates the buffers aiter's non-persistent decode does for `splits` KV splits (its own pick:
    get_meta_param, 1…16) and appends their bytes to `allocated`."""
    from backends.hip import aiter_mla as ai

    def mla_decode_fwd(*args, **kwargs):
        a = _aiter_signature().bind(*args, **kwargs).arguments
        q, kv, o = a["q"], a["kv_buffer"], a["o"]
        heads = q.shape[1]
        if heads not in ai.DECODE_HEADS.get(arch, ()):
            raise RuntimeError(f"get_heuristic_kernel_mla: cannot get heuristic kernel! gqa: {heads} ({arch})")
        rows, bs, f32 = q.shape[0], a["qo_indptr"].shape[0] - 1, torch.float32
        bufs = [torch.empty(rows, splits, heads, 1, dtype=f32), torch.empty(bs + 1, dtype=torch.int32),
                torch.full((bs,), splits, dtype=torch.int32)]
        if not (splits == 1 and heads in (8, 32)):    # else stage 1 writes its partials into `o`
            bufs.append(torch.empty(rows, splits, heads, o.shape[-1], dtype=f32))
        if a.get("return_lse"):
            bufs.append(torch.empty(rows, heads, dtype=f32))
        allocated.append(sum(b.nbytes for b in bufs))
        page = a.get("page_size") or 1
        if page not in ai.PAGE_SIZES or kv.ndim != 4 or kv.shape[1] != page or kv.shape[2] != 1:
            raise VendorPrecondition(f"kv_buffer {tuple(kv.shape)} / page_size {page}")
        if a["max_seqlen_q"] != 1 or (a.get("nhead_kv") or 1) != 1:
            raise VendorPrecondition("decode: max_seqlen_q 1, one KV head")
        if q.dtype != torch.bfloat16 or kv.dtype != torch.bfloat16 or o.dtype != torch.bfloat16:
            raise VendorPrecondition("bf16 q / kv / o")
        if o.shape != (q.shape[0], heads, q.shape[2] - 64):
            raise VendorPrecondition(f"o {tuple(o.shape)}")
        ptr, idx, last = a["kv_indptr"].long(), a["kv_indices"].long(), a["kv_last_page_lens"].long()
        qo = a["qo_indptr"].long()
        lse = torch.full((q.shape[0], heads), 7.0e3)          # what an unwritten buffer may hold
        true_lse = torch.full_like(lse, float("-inf"))
        for b in range(len(ptr) - 1):
            pages = idx[int(ptr[b]):int(ptr[b + 1])]
            t = max(0, (len(pages) - 1) * page + int(last[b]))
            keys = kv[pages, :, 0].reshape(-1, kv.shape[-1])[:t]
            r = int(qo[b])
            ob, lb = _attend(q[r:r + 1], keys, keys[:, :o.shape[-1]], float(a["sm_scale"]), torch.tensor([t - 1]),
                             torch.arange(t))
            o[r] = ob[0].to(o.dtype)
            true_lse[r] = lb[0]
        if heads not in ai.LSE_UNWRITTEN_HEADS:
            lse = true_lse
        return o, lse

    return mla_decode_fwd


def install_aiter(monkeypatch, arch: str, splits: int = 16) -> types.ModuleType:
    """aiter + aiter.mla for `arch`; `mla.allocated` lists each call's own buffer bytes at `splits` KV splits."""
    mla = types.ModuleType("aiter.mla")
    mla.allocated = []
    mla.mla_decode_fwd = make_mla_decode_fwd(arch, splits, mla.allocated)
    return _install(monkeypatch, "aiter", mla)
