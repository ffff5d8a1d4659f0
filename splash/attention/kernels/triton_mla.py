"""`triton` MLA attention: our own split-KV Triton kernels over the paged latent cache (NVIDIA and AMD alike).

`mla_split`, grid (query rows, head blocks, splits): one query row (decode or prefill alike: its position decides
what it sees) and a block of heads walk a split of the row's held tokens, looked up in the page table in place;
the latent is dequantised (bf16; fp8 e4m3 / int8 × per-token per-128-group scales) and the rope key (fp32, bf16,
or e4m3 at one per-tensor scale), keys past the query's position masked, online softmax; it writes the split's
partial õ and natural-log LSE, which `mla_merge` (grid rows × heads) merges exactly. `mla_sparse`, same grid,
is the DSA layer's form: a split of the row's top-k selected slots (splash.attention.dsa.SparseSelection) in place
of its pages; the key blocks go through the same `_attend_block` (gather, dequantise, products, online softmax).
Over a bf16 / fp8 / int8 pool both products take bf16 operands with fp32 accumulation (matrix units: mma / wgmma /
MFMA); an fp32 pool keeps exact fp32 products. Offsets are int64 (rows × heads × d_c passes 2^31 at 16K-row chunks
× 128 heads). tests/test_triton_aot.py compiles every shape `launch_config` / `split_count` can return for the
shipped targets (of `mla_sparse`, each launch's largest tile).
Without a GPU the module sets TRITON_INTERPRET=1 before importing triton (CI checks the math that way).
"""
from __future__ import annotations

import collections
import os
import sys

import torch

if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "0":   # "0": compile only (AOT checks)
    if "triton" in sys.modules and os.environ.get("TRITON_INTERPRET") != "1":
        raise RuntimeError("attention_backend triton without a GPU needs Triton's interpreter, but triton was "
                           "imported before it could be switched on: set TRITON_INTERPRET=1 in the environment")
    os.environ["TRITON_INTERPRET"] = "1"

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from splash.kv import quant  # noqa: E402
from splash.layouts.device_budget import ATTN_SCRATCH_BYTES  # noqa: E402

FORMATS = {"float32": 0, "bfloat16": 1, "fp8_e4m3": 2, "int8": 3}
MAX_SPLITS = 8    # splits of a row's keys (more parallelism for long contexts on a GPU)
# (head block cap, num_warps, keys per inner step, num_stages or None for the backend's default) per launch table
# and KV format. "cuda" (NVIDIA but SM90) and "hip" hold the largest head block whose ahead-of-time compile fits the
# target's shared memory (gfx942: 64 KiB per workgroup) and spills no registers (tests/test_triton_aot.py, for
# sm_100 / sm_120 / gfx942 / gfx950 / gfx90a); no hardware has timed them. "sm_90" (H100 / H200) holds, for the
# formats in MEASURED, the fastest launch of an H200 sweep (docs/benchmarks.md "Second GPU run"): 4 warps and 32
# keys per step spill 40-480 B of registers there and still ran 1.6-2.8x faster than the spill-free 8-warp, 16-key
# launch. float32 pools were not timed. The sparse kernel launches the same tiles (no page-table loads).
_SPILL_FREE = {"float32": (16, 8, 16, None), "bfloat16": (32, 8, 16, None), "fp8_e4m3": (16, 8, 16, None),
               "int8": (16, 8, 16, None)}
LAUNCH = {
    "cuda": _SPILL_FREE,
    "sm_90": dict(_SPILL_FREE, bfloat16=(32, 4, 32, 2), fp8_e4m3=(16, 4, 32, 2), int8=(16, 4, 32, 2)),
    "hip": {"float32": (16, 4, 16, None), "bfloat16": (32, 4, 16, None), "fp8_e4m3": (32, 4, 16, None),
            "int8": (32, 4, 16, None)},
}
MEASURED = {"sm_90": ("bfloat16", "fp8_e4m3", "int8")}   # timed on hardware: their register spills are allowed


@triton.jit
def _dot(a, b, DOT_BF16: tl.constexpr, EMULATED: tl.constexpr):
    """a @ b with fp32 accumulate. Triton's interpreter gets bf16 dots wrong, so there (EMULATED) the bf16 values
    are widened first: the same products (exact in fp32), summed in fp32."""
    if DOT_BF16:
        if EMULATED:
            return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
        return tl.dot(a, b, out_dtype=tl.float32)
    return tl.dot(a, b, input_precision="ieee")


@triton.jit
def _start_rows(QL, QR, row, hb, H, DC: tl.constexpr, DR: tl.constexpr, BDC: tl.constexpr, BDR: tl.constexpr,
                BH: tl.constexpr, DOT_BF16: tl.constexpr):
    """A program's head block of query row `row`: its query rows and mask, the offsets over d_c / d_r, the latent
    [BH, BDC] and rope [BH, BDR] queries as the products take them, and an empty online softmax (m, l, acc)."""
    offs_h = hb * BH + tl.arange(0, BH)
    offs_c = tl.arange(0, BDC)
    offs_r = tl.arange(0, BDR)
    hmask = offs_h < H
    qrow = row * H + offs_h
    ql = tl.load(QL + qrow[:, None] * DC + offs_c[None, :], mask=hmask[:, None] & (offs_c[None, :] < DC), other=0.0)
    qr = tl.load(QR + qrow[:, None] * DR + offs_r[None, :], mask=hmask[:, None] & (offs_r[None, :] < DR), other=0.0)
    if DOT_BF16:  # matrix-unit operands (mma / wgmma / MFMA): bf16 in, fp32 accumulate
        ql = ql.to(tl.bfloat16)
        qr = qr.to(tl.bfloat16)
    else:
        ql = ql.to(tl.float32)
        qr = qr.to(tl.float32)
    m_i = tl.full([BH], float("-inf"), tl.float32)
    return qrow, hmask, offs_c, offs_r, ql, qr, m_i, tl.zeros([BH], tl.float32), tl.zeros([BH, BDC], tl.float32)


@triton.jit
def _attend_block(ql, qr, CKV, KPE, SCALE, slot, valid, m_i, l_i, acc, sm_scale, offs_c, offs_r,
                  DC: tl.constexpr, DR: tl.constexpr, BDC: tl.constexpr, BN: tl.constexpr, GROUPS: tl.constexpr,
                  FMT: tl.constexpr, ROPE_BF16: tl.constexpr, HAS_ROPE: tl.constexpr, DOT_BF16: tl.constexpr,
                  GW: tl.constexpr, EMULATED: tl.constexpr, ROW_C: tl.constexpr, ROW_R: tl.constexpr,
                  ROPE_FP8: tl.constexpr, ROPE_SCALE: tl.constexpr):
    """One block of BN keys at pool slots `slot` (int64 [BN]; `valid` masks them) into the online softmax (m_i,
    l_i, acc) of the head block: the latent dequantised, the rope key read in its format, both products.
    Both kernels run it: the dense one on the page table's slots, the sparse one on the selected slots."""
    # ROW_C / ROW_R: elements between consecutive tokens of the latent / rope pool (d_c / d_r, or d_c + d_r
    # for both when the layer's pool is fused: splash.kv.paged_cache.FUSED_DTYPES)
    cmask = valid[:, None] & (offs_c[None, :] < DC)
    raw = tl.load(CKV + slot[:, None] * ROW_C + offs_c[None, :], mask=cmask, other=0)
    if FMT == 0:
        c = raw
    elif FMT == 1:
        c = raw.to(tl.bfloat16, bitcast=True)
    else:
        if FMT == 2:
            c = raw.to(tl.float8e4nv, bitcast=True).to(tl.float32)
        else:
            c = raw.to(tl.float32)
        # one scale per token per 128 values: load [BN, groups] and broadcast over each group's values
        offs_g = tl.arange(0, BDC // GW)
        s = tl.load(SCALE + slot[:, None] * GROUPS + offs_g[None, :],
                    mask=valid[:, None] & (offs_g[None, :] < GROUPS), other=0.0)
        c = tl.reshape(tl.reshape(c, (BN, BDC // GW, GW)) * s[:, :, None], (BN, BDC)).to(tl.bfloat16)
    sc = _dot(ql, tl.trans(c), DOT_BF16, EMULATED)
    if HAS_ROPE:
        rmask = valid[:, None] & (offs_r[None, :] < DR)
        kr = tl.load(KPE + slot[:, None] * ROW_R + offs_r[None, :], mask=rmask, other=0)
        if ROPE_BF16:
            kr = kr.to(tl.bfloat16, bitcast=True)
        if ROPE_FP8:   # e4m3 at one per-tensor scale (splash.kv.quant.ROPE_FP8_SCALE)
            kr = kr.to(tl.float8e4nv, bitcast=True).to(tl.float32) * ROPE_SCALE
        sc += _dot(qr, tl.trans(kr.to(qr.dtype)), DOT_BF16, EMULATED)
    sc = tl.where(valid[None, :], sc * sm_scale, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(sc, axis=1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp(m_i - m_safe)
    p = tl.exp(sc - m_safe[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    acc = acc * alpha[:, None] + _dot(p.to(c.dtype), c, DOT_BF16, EMULATED)
    return m_new, l_i, acc


@triton.jit
def _store_partial(OPART, LPART, qrow, hmask, sp, m_i, l_i, acc, offs_c, DC: tl.constexpr, NSPLIT: tl.constexpr):
    """The split's õ and natural-log LSE (õ = 0, LSE = −inf where it saw no valid key), for mla_merge."""
    o = acc / tl.maximum(l_i, 1e-30)[:, None]
    lse = tl.where(l_i > 0, m_i + tl.log(tl.maximum(l_i, 1e-30)), float("-inf"))
    base = qrow * NSPLIT + sp
    tl.store(OPART + base[:, None] * DC + offs_c[None, :], o, mask=hmask[:, None] & (offs_c[None, :] < DC))
    tl.store(LPART + base, lse, mask=hmask)


@triton.jit
def mla_split(QL, QR, CKV, KPE, SCALE, PAGES, LOGICAL, NUM_PAGES, ROW_REQ, REQ_ROWS, QPOS, OPART, LPART,
              H, PCOLS, tokens_per_split, sm_scale,
              DC: tl.constexpr, DR: tl.constexpr, BDC: tl.constexpr, BDR: tl.constexpr, BH: tl.constexpr,
              BN: tl.constexpr, PAGE: tl.constexpr, GROUPS: tl.constexpr, FMT: tl.constexpr,
              ROPE_BF16: tl.constexpr, HAS_ROPE: tl.constexpr, NSPLIT: tl.constexpr, DOT_BF16: tl.constexpr,
              GW: tl.constexpr, EMULATED: tl.constexpr, ROW_C: tl.constexpr, ROW_R: tl.constexpr,
              ROPE_FP8: tl.constexpr, ROPE_SCALE: tl.constexpr):
    # int64 row/slot arithmetic: rows × heads × d_c and pages × page × d_c pass 2^31 at serving sizes
    row = tl.program_id(0).to(tl.int64)
    hb, sp = tl.program_id(1), tl.program_id(2)
    req = tl.load(ROW_REQ + row).to(tl.int64)
    prow = tl.load(REQ_ROWS + req).to(tl.int64)
    n_tok = tl.load(NUM_PAGES + req) * PAGE
    qpos = tl.load(QPOS + row)
    qrow, hmask, offs_c, offs_r, ql, qr, m_i, l_i, acc = _start_rows(QL, QR, row, hb, H, DC, DR, BDC, BDR, BH,
                                                                     DOT_BF16)
    start = sp * tokens_per_split
    stop = tl.minimum(start + tokens_per_split, n_tok)
    for t0 in range(start, stop, BN):
        t = t0 + tl.arange(0, BN)
        tmask = t < stop
        col = t // PAGE
        page = tl.load(PAGES + prow * PCOLS + col, mask=tmask, other=0).to(tl.int64)
        kpos = tl.load(LOGICAL + prow * PCOLS + col, mask=tmask, other=0) * PAGE + t % PAGE
        m_i, l_i, acc = _attend_block(ql, qr, CKV, KPE, SCALE, page * PAGE + t % PAGE, tmask & (kpos <= qpos),
                                      m_i, l_i, acc, sm_scale, offs_c, offs_r, DC, DR, BDC, BN, GROUPS, FMT,
                                      ROPE_BF16, HAS_ROPE, DOT_BF16, GW, EMULATED, ROW_C, ROW_R, ROPE_FP8, ROPE_SCALE)
    _store_partial(OPART, LPART, qrow, hmask, sp, m_i, l_i, acc, offs_c, DC, NSPLIT)


@triton.jit
def mla_sparse(QL, QR, CKV, KPE, SCALE, SLOTS, VALID, OPART, LPART, H, K, slots_per_split, sm_scale,
               DC: tl.constexpr, DR: tl.constexpr, BDC: tl.constexpr, BDR: tl.constexpr, BH: tl.constexpr,
               BN: tl.constexpr, GROUPS: tl.constexpr, FMT: tl.constexpr, ROPE_BF16: tl.constexpr,
               HAS_ROPE: tl.constexpr, NSPLIT: tl.constexpr, DOT_BF16: tl.constexpr, GW: tl.constexpr,
               EMULATED: tl.constexpr, ROW_C: tl.constexpr, ROW_R: tl.constexpr, ROPE_FP8: tl.constexpr,
               ROPE_SCALE: tl.constexpr):
    # a DSA row's K selected slots (SLOTS [N, K] int64, VALID [N, K] as bytes) in blocks of BN: no page table and
    # no position mask (the selection holds only keys the row sees); a slot selected twice counts twice, as in
    # splash.attention.dsa.sparse_attend
    row = tl.program_id(0).to(tl.int64)
    hb, sp = tl.program_id(1), tl.program_id(2)
    qrow, hmask, offs_c, offs_r, ql, qr, m_i, l_i, acc = _start_rows(QL, QR, row, hb, H, DC, DR, BDC, BDR, BH,
                                                                     DOT_BF16)
    start = sp * slots_per_split
    stop = tl.minimum(start + slots_per_split, K)
    for j0 in range(start, stop, BN):
        j = row * K + j0 + tl.arange(0, BN)
        jmask = j0 + tl.arange(0, BN) < stop
        slot = tl.load(SLOTS + j, mask=jmask, other=0)
        valid = jmask & (tl.load(VALID + j, mask=jmask, other=0) != 0)
        m_i, l_i, acc = _attend_block(ql, qr, CKV, KPE, SCALE, slot, valid, m_i, l_i, acc, sm_scale, offs_c,
                                      offs_r, DC, DR, BDC, BN, GROUPS, FMT, ROPE_BF16, HAS_ROPE, DOT_BF16, GW,
                                      EMULATED, ROW_C, ROW_R, ROPE_FP8, ROPE_SCALE)
    _store_partial(OPART, LPART, qrow, hmask, sp, m_i, l_i, acc, offs_c, DC, NSPLIT)


@triton.jit
def mla_merge(OPART, LPART, O, LSE, DC: tl.constexpr, BDC: tl.constexpr, NSPLIT: tl.constexpr,
               BS: tl.constexpr):
    rh = tl.program_id(0).to(tl.int64)
    offs_s = tl.arange(0, BS)
    offs_c = tl.arange(0, BDC)
    smask = offs_s < NSPLIT
    lse = tl.load(LPART + rh * NSPLIT + offs_s, mask=smask, other=float("-inf"))
    mx = tl.max(lse, axis=0)
    mx_safe = tl.where(mx == float("-inf"), 0.0, mx)
    w = tl.exp(lse - mx_safe)
    tot = tl.sum(w, axis=0)
    op = tl.load(OPART + (rh * NSPLIT + offs_s)[:, None] * DC + offs_c[None, :],
                 mask=smask[:, None] & (offs_c[None, :] < DC), other=0.0)
    o = tl.sum(op * w[:, None], axis=0) / tl.maximum(tot, 1e-30)
    tl.store(O + rh * DC + offs_c, o, mask=offs_c < DC)
    tl.store(LSE + rh, tl.where(tot > 0, mx_safe + tl.log(tl.maximum(tot, 1e-30)), float("-inf")))


def pow2(n: int, floor: int = 16) -> int:
    return max(floor, triton.next_power_of_2(max(1, n)))


def launch_table(vendor: str, sm_major: int | None = None) -> str:
    """The LAUNCH table a device uses: "hip" on AMD, "sm_90" on an SM90 NVIDIA GPU, "cuda" on any other."""
    return "hip" if vendor == "hip" else "sm_90" if sm_major == 9 else "cuda"


def launch_config(table: str, heads: int, kv_dtype: str) -> tuple[int, int, int, int | None]:
    """(head block, num_warps, keys per inner step, num_stages) for `heads` query heads on this rank over a
    `kv_dtype` pool: the head block is the heads rounded up to a power of two (at least 16, tl.dot's smallest tile),
    capped per launch table and format."""
    cap, warps, keys, stages = LAUNCH[table][kv_dtype]
    return min(cap, pow2(heads)), warps, keys, stages


def launch_options(warps: int, stages: int | None) -> dict:
    """The launch options of a LAUNCH entry, as TritonMLAKernel.run passes them and triton_aot compiles them
    (no num_stages: the backend's default)."""
    return dict(num_warps=warps, **({"num_stages": stages} if stages else {}))


def sparse_constants(kv_dtype: str, dc: int, dr: int, bh: int, bn: int, splits: int, rope_bf16: bool,
                     rope_fp8: bool, row_c: int, row_r: int) -> dict:
    """`mla_sparse`'s compile-time arguments for one launch (the pool's format, dims, tile): what
    TritonMLAKernel.run passes and triton_aot compiles; `mla_split` takes these and the page size."""
    bdc, fmt = pow2(dc), FORMATS[kv_dtype]
    return dict(DC=dc, DR=max(dr, 1), BDC=bdc, BDR=pow2(dr), BH=bh, BN=bn, GROUPS=quant.num_groups(dc),
                FMT=fmt, ROPE_BF16=rope_bf16, HAS_ROPE=dr > 0, NSPLIT=splits, DOT_BF16=fmt != 0,
                GW=min(quant.GROUP, bdc), EMULATED=INTERPRETED, ROW_C=row_c, ROW_R=row_r, ROPE_FP8=rope_fp8,
                ROPE_SCALE=quant.ROPE_FP8_SCALE)


def split_constants(kv_dtype: str, dc: int, dr: int, bh: int, bn: int, page: int, splits: int, rope_bf16: bool,
                    rope_fp8: bool, row_c: int, row_r: int) -> dict:
    """`mla_split`'s compile-time arguments for one launch: what TritonMLAKernel.run passes and triton_aot compiles."""
    return dict(sparse_constants(kv_dtype, dc, dr, bh, bn, splits, rope_bf16, rope_fp8, row_c, row_r), PAGE=page)


def split_count(rows: int, heads: int, d_c: int, decode_only: bool, longest_blocks: int, max_splits: int,
                scratch_bytes: int = ATTN_SCRATCH_BYTES) -> int:
    """Splits of each row's keys. More than one only for a decode-only step whose partials (rows × heads × splits
    × (d_c + 1) fp32) fit `scratch_bytes`: a prefill chunk has rows enough to fill the device, and its partials
    would not fit (16,384 rows × 128 heads × 8 splits × 2 KiB = 32 GiB)."""
    if not decode_only or rows == 0:
        return 1
    fit = scratch_bytes // (rows * heads * (d_c + 1) * 4)
    return max(1, min(max_splits, longest_blocks, fit))


class TritonMLAKernel:
    name = "triton"

    def __init__(self, softmax_scale: float, max_splits: int = MAX_SPLITS):
        self.scale, self.max_splits, self.meta = softmax_scale, max_splits, None
        self.launches = collections.Counter()   # kernel launches by name (gpu-check says which ran)
        self.last_launch: tuple = ()             # (head block, num_warps, keys per step, num_stages, splits)
        gpu = torch.cuda.is_available() and not INTERPRETED
        self.table = launch_table("hip" if torch.version.hip else "cuda",
                                  torch.cuda.get_device_capability()[0] if gpu else None)

    def plan(self, meta) -> None:
        """The longest held row, whose key blocks `run` splits: O(requests), one host read per step."""
        self.meta = meta
        self.longest = int(meta.num_pages.max()) * meta.block_size if meta.num_reqs else 0
        self.decode_only = meta.num_rows == meta.num_reqs

    @staticmethod
    def _pool(layer: int, cache, dr: int, dev) -> tuple:
        """The layer's pool as both kernels read it: (KV dtype, latent, rope key, scales, (rope_bf16, rope_fp8,
        latent / rope token strides)) — the pointer dtypes the AOT check compiles (triton_aot._signature)."""
        kv_dtype = cache.kv_dtype_of(layer)
        ckv = cache.ckv[layer]
        ckv = {1: ckv.view(torch.int16), 2: ckv.view(torch.uint8)}.get(FORMATS[kv_dtype], ckv)
        kpe = cache.kpe[layer] if dr else torch.zeros(1, device=dev)
        rope_bf16, rope_fp8 = kpe.dtype == torch.bfloat16, kpe.dtype == quant.ROPE_FP8
        if rope_bf16:
            kpe = kpe.view(torch.int16)
        elif rope_fp8:
            kpe = kpe.view(torch.uint8)
        scale = cache.scale[layer] if cache.scale[layer] is not None else torch.zeros(1, device=dev)
        return kv_dtype, ckv, kpe, scale, (rope_bf16, rope_fp8, ckv.stride(1), kpe.stride(1) if dr else 1)

    def run(self, layer: int, q_latent: torch.Tensor, q_rope: torch.Tensor,
            cache) -> tuple[torch.Tensor, torch.Tensor]:
        """A dense layer walks each row's pages (`mla_split`); a DSA layer with a top-k selection
        (`meta.sparse[layer]`) only the row's selected slots (`mla_sparse`); either way split partials merge in
        `mla_merge`."""
        meta = self.meta
        sel = meta.sparse.get(layer)
        n, h, dc = q_latent.shape
        dr = q_rope.shape[-1]
        dev = q_latent.device
        o = torch.empty(n, h, dc, dtype=torch.float32, device=dev)
        lse = torch.empty(n, h, dtype=torch.float32, device=dev)
        if n == 0:
            return o, lse
        if sel is not None and sel.slots.shape[1] == 0:   # nothing selected anywhere: õ = 0, LSE = −inf
            return o.zero_(), lse.fill_(float("-inf"))
        kv_dtype, ckv, kpe, scale, fmt_args = self._pool(layer, cache, dr, dev)
        qdt = torch.float32 if kv_dtype == "float32" else torch.bfloat16
        ql = q_latent.to(qdt).contiguous()
        qr = q_rope.to(qdt).contiguous() if dr else torch.zeros(n, h, 1, dtype=qdt, device=dev)
        bh, warps, bn, stages = launch_config(self.table, h, kv_dtype)
        opts = launch_options(warps, stages)
        blocks = -(-(self.longest if sel is None else sel.slots.shape[1]) // bn)   # shapes only: no host read
        S = split_count(n, h, dc, self.decode_only, blocks, self.max_splits)
        per_split = max(bn, -(-blocks // S) * bn)
        # one split: the kernel writes the result itself; more: partials, then the exact merge
        opart = o if S == 1 else torch.empty(n, h, S, dc, dtype=torch.float32, device=dev)
        lpart = lse if S == 1 else torch.empty(n, h, S, dtype=torch.float32, device=dev)
        grid = (n, triton.cdiv(h, bh), S)
        if sel is None:
            mla_split[grid](
                ql, qr, ckv, kpe, scale, meta.pages, meta.logical, meta.num_pages, meta.row_req, meta.req_rows,
                meta.q_pos, opart, lpart, h, meta.pages.shape[1], per_split, self.scale, **opts,
                **split_constants(kv_dtype, dc, dr, bh, bn, meta.block_size, S, *fmt_args))
        else:
            mla_sparse[grid](
                ql, qr, ckv, kpe, scale, sel.slots.contiguous(), sel.valid.contiguous().view(torch.uint8), opart,
                lpart, h, sel.slots.shape[1], per_split, self.scale, **opts,
                **sparse_constants(kv_dtype, dc, dr, bh, bn, S, *fmt_args))
        self.launches["mla_sparse" if sel is not None else "mla_split"] += 1
        self.last_launch = (bh, warps, bn, stages, S)
        if S > 1:
            mla_merge[(n * h,)](opart, lpart, o, lse, DC=dc, BDC=pow2(dc, 1), NSPLIT=S, BS=pow2(S, 1))
            self.launches["mla_merge"] += 1
        return o, lse
