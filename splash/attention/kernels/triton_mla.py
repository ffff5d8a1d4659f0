"""`triton` MLA attention: our own split-KV Triton kernels over the paged latent cache (NVIDIA and AMD alike).

Kernel 1 (`_mla_split`), grid (query rows, head blocks, splits): each program takes one query row (decode or a
prefill-chunk row alike: its position decides what it sees) and a block of heads, walks its split of the row's
held tokens in blocks of BLOCK_N — token t of the request here is offset t % page of page t // page, looked up
in the page table in place — loads and dequantises the latent (fp32; bf16; fp8 e4m3 and int8 × their per-token
per-128-group fp32 scales) and the rope key, scores q_lat·c + q_rope·k_rope, masks keys past the query's
position (and CP's pages by their logical block), and keeps an online softmax; it writes the split's normalised
partial õ and natural-log LSE. Kernel 2 (`_mla_merge`), grid (rows, heads), merges the splits exactly.
bf16 and fp8 are decoded from their bits (no float8 loads), so the same code runs under the interpreter.

On a machine with no GPU the module sets TRITON_INTERPRET=1 before importing triton: the kernels then run in
Triton's interpreter on CPU tensors (slow; it is how CI checks their math).
"""
from __future__ import annotations

import os
import sys

import torch

if not torch.cuda.is_available():
    if "triton" in sys.modules and os.environ.get("TRITON_INTERPRET") != "1":
        raise RuntimeError("attention_backend triton without a GPU needs Triton's interpreter, but triton was "
                           "imported before it could be switched on: set TRITON_INTERPRET=1 in the environment")
    os.environ["TRITON_INTERPRET"] = "1"

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from splash.kv import quant  # noqa: E402

FORMATS = {"float32": 0, "bfloat16": 1, "fp8_e4m3": 2, "int8": 3}
BLOCK_N = 16      # keys per inner step
MAX_SPLITS = 8    # splits of a row's keys (more parallelism for long contexts on a GPU)


@triton.jit
def _bf16_bits_to_f32(x):
    return (x.to(tl.int32) << 16).to(tl.float32, bitcast=True)


@triton.jit
def _e4m3_bits_to_f32(x):
    b = x.to(tl.int32) & 0xFF
    e = (b >> 3) & 15
    m = (b & 7).to(tl.float32)
    mag = tl.where(e == 0, m * 0.001953125, (m + 8.0) * tl.exp2((e - 10).to(tl.float32)))
    return tl.where((b & 128) != 0, -mag, mag)


@triton.jit
def _mla_split(QL, QR, CKV, KPE, SCALE, PAGES, LOGICAL, NUM_PAGES, ROW_REQ, REQ_ROWS, QPOS, OPART, LPART,
               H, PCOLS, tokens_per_split, sm_scale,
               DC: tl.constexpr, DR: tl.constexpr, BDC: tl.constexpr, BDR: tl.constexpr, BH: tl.constexpr,
               BN: tl.constexpr, PAGE: tl.constexpr, GROUPS: tl.constexpr, FMT: tl.constexpr,
               ROPE_BF16: tl.constexpr, HAS_ROPE: tl.constexpr, NSPLIT: tl.constexpr):
    row, hb, sp = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    req = tl.load(ROW_REQ + row)
    prow = tl.load(REQ_ROWS + req)
    n_tok = tl.load(NUM_PAGES + req) * PAGE
    qpos = tl.load(QPOS + row)
    offs_h = hb * BH + tl.arange(0, BH)
    offs_c = tl.arange(0, BDC)
    offs_r = tl.arange(0, BDR)
    hmask = offs_h < H
    ql = tl.load(QL + (row * H + offs_h)[:, None] * DC + offs_c[None, :],
                 mask=hmask[:, None] & (offs_c[None, :] < DC), other=0.0)
    qr = tl.load(QR + (row * H + offs_h)[:, None] * DR + offs_r[None, :],
                 mask=hmask[:, None] & (offs_r[None, :] < DR), other=0.0)
    m_i = tl.full([BH], float("-inf"), tl.float32)
    l_i = tl.zeros([BH], tl.float32)
    acc = tl.zeros([BH, BDC], tl.float32)
    start = sp * tokens_per_split
    stop = tl.minimum(start + tokens_per_split, n_tok)
    for t0 in range(start, stop, BN):
        t = t0 + tl.arange(0, BN)
        tmask = t < stop
        col = t // PAGE
        page = tl.load(PAGES + prow * PCOLS + col, mask=tmask, other=0).to(tl.int64)
        kpos = tl.load(LOGICAL + prow * PCOLS + col, mask=tmask, other=0) * PAGE + t % PAGE
        valid = tmask & (kpos <= qpos)
        slot = page * PAGE + t % PAGE
        cmask = valid[:, None] & (offs_c[None, :] < DC)
        raw = tl.load(CKV + slot[:, None] * DC + offs_c[None, :], mask=cmask, other=0)
        if FMT == 0:
            c = raw
        elif FMT == 1:
            c = _bf16_bits_to_f32(raw)
        else:
            if FMT == 2:
                c = _e4m3_bits_to_f32(raw)
            else:
                c = raw.to(tl.float32)
            s = tl.load(SCALE + slot[:, None] * GROUPS + offs_c[None, :] // 128, mask=cmask, other=0.0)
            c = c * s
        sc = tl.dot(ql, tl.trans(c), input_precision="ieee")
        if HAS_ROPE:
            rmask = valid[:, None] & (offs_r[None, :] < DR)
            kr = tl.load(KPE + slot[:, None] * DR + offs_r[None, :], mask=rmask, other=0)
            if ROPE_BF16:
                kr = _bf16_bits_to_f32(kr)
            sc += tl.dot(qr, tl.trans(kr), input_precision="ieee")
        sc = tl.where(valid[None, :], sc * sm_scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(sc, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp(m_i - m_safe)
        p = tl.exp(sc - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p, c, input_precision="ieee")
        m_i = m_new
    o = acc / tl.maximum(l_i, 1e-30)[:, None]
    lse = tl.where(l_i > 0, m_i + tl.log(tl.maximum(l_i, 1e-30)), float("-inf"))
    base = (row * H + offs_h) * NSPLIT + sp
    tl.store(OPART + base[:, None] * DC + offs_c[None, :], o, mask=hmask[:, None] & (offs_c[None, :] < DC))
    tl.store(LPART + base, lse, mask=hmask)


@triton.jit
def _mla_merge(OPART, LPART, O, LSE, DC: tl.constexpr, BDC: tl.constexpr, NSPLIT: tl.constexpr,
               BS: tl.constexpr):
    rh = tl.program_id(0)
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


def _pow2(n: int, floor: int = 16) -> int:
    return max(floor, triton.next_power_of_2(max(1, n)))


class TritonMLAKernel:
    name = "triton"

    def __init__(self, softmax_scale: float, max_splits: int = MAX_SPLITS):
        self.scale, self.max_splits, self.meta = softmax_scale, max_splits, None

    def plan(self, meta) -> None:
        """Split count and keys per split from the longest held row: O(requests)."""
        self.meta = meta
        longest = int(meta.num_pages.max()) * meta.block_size if meta.num_reqs else 0
        blocks = -(-longest // BLOCK_N)
        self.splits = max(1, min(self.max_splits, blocks))
        self.tokens_per_split = max(BLOCK_N, -(-blocks // self.splits) * BLOCK_N)

    def run(self, layer: int, q_latent: torch.Tensor, q_rope: torch.Tensor,
            cache) -> tuple[torch.Tensor, torch.Tensor]:
        meta = self.meta
        sel = meta.sparse.get(layer)
        if sel is not None:  # DSA layer with a top-k selection: the torch reference's sparse path (no Triton one yet)
            from splash.attention.dsa import sparse_attend
            return sparse_attend(q_latent, q_rope, cache, layer, sel, self.scale)
        n, h, dc = q_latent.shape
        dr = q_rope.shape[-1]
        dev = q_latent.device
        o = torch.empty(n, h, dc, dtype=torch.float32, device=dev)
        lse = torch.empty(n, h, dtype=torch.float32, device=dev)
        if n == 0:
            return o, lse
        fmt = FORMATS[cache.kv_dtype_of(layer)]
        ckv = cache.ckv[layer]
        ckv = {1: ckv.view(torch.int16), 2: ckv.view(torch.uint8)}.get(fmt, ckv)
        kpe = cache.kpe[layer] if dr else torch.zeros(1, device=dev)
        rope_bf16 = kpe.dtype == torch.bfloat16
        if rope_bf16:
            kpe = kpe.view(torch.int16)
        scale = cache.scale[layer] if cache.scale[layer] is not None else torch.zeros(1, device=dev)
        ql = q_latent.float().contiguous()
        qr = q_rope.float().contiguous() if dr else torch.zeros(n, h, 1, device=dev)
        S = self.splits
        opart = torch.empty(n, h, S, dc, dtype=torch.float32, device=dev)
        lpart = torch.empty(n, h, S, dtype=torch.float32, device=dev)
        bh = min(64, _pow2(h))
        _mla_split[(n, triton.cdiv(h, bh), S)](
            ql, qr, ckv, kpe, scale, meta.pages, meta.logical, meta.num_pages, meta.row_req, meta.req_rows,
            meta.q_pos, opart, lpart, h, meta.pages.shape[1], self.tokens_per_split, self.scale,
            DC=dc, DR=max(dr, 1), BDC=_pow2(dc), BDR=_pow2(dr), BH=bh, BN=BLOCK_N, PAGE=meta.block_size,
            GROUPS=quant.num_groups(dc), FMT=fmt, ROPE_BF16=rope_bf16, HAS_ROPE=dr > 0, NSPLIT=S)
        if S == 1:  # one split: its normalised partial is the result
            return opart[:, :, 0], lpart[:, :, 0]
        _mla_merge[(n * h,)](opart, lpart, o, lse, DC=dc, BDC=_pow2(dc, 1), NSPLIT=S, BS=_pow2(S, 1))
        return o, lse
