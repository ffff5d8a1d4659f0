"""SPLASH's CPU kernels as typed torch ops (`torch.ops.splash.<name>`), and the routes that pick them.

Each op has a schema (`torch.library.define` + impl: `custom_op` costs 43 µs a call, define + impl 8 µs). Its CPU
implementation (`checked.<name>`) runs the op's checks — dtype, device, shape, strides, raising a ValueError naming
the op and the argument — then the C call (`kernels.<name>`); the C code itself checks every index it reads through
(page ids, query and page-table rows, expert ids, tokens, counts) before reading and returns an error code, which
`kernels.<name>` raises. The routes (public functions, with the signature of the torch function they stand for)
run the kernel where it applies (kernels on, fp32 on CPU, the alignment the C code needs, packed weights) or return
None. A route tests its arguments in one expression that covers everything the op's checks require (tests/
test_native_kernels.py puts the checks behind every route to show it) and then calls `kernels.<name>` directly:
the checks again in every route cost the tiny model's decode step 18%, torch's dispatcher another ~11%
(docs/benchmarks.md, "Fixed-layout speed vs bcfac5e"). Packed weights are checked where they are made
(splash.native.packed), `mla_decode`'s per-row arrays once a step (`decode_rows`). Model code reaches the routes only
through `splash.native.fast_path(name)`.
"""
from __future__ import annotations

import types

import torch

from splash import native
from splash.native.packed import STRIP, PackedExperts, PackedLinear

CPU, F32, I32, I64 = torch.device("cpu"), torch.float32, torch.int32, torch.int64
_LIB = torch.library.Library("splash", "FRAGMENT")
checked = types.SimpleNamespace()   # name -> the op's implementation: its checks, then the C call
kernels = types.SimpleNamespace()   # name -> the C call alone (the routes, which test their arguments first)


def _op(schema: str, check):
    """Register the C call below as `splash::<name>` whose implementation runs `check(*args)` first."""
    name = schema.split("(", 1)[0]

    def register(run):
        def impl(*args):
            check(*args)
            return run(*args)
        impl.check = check
        _LIB.define(schema)
        _LIB.impl(name, impl, "CPU")
        setattr(checked, name, impl)
        setattr(kernels, name, run)
        return run
    return register


def _need(ok: bool, op: str, what) -> None:
    """Raise ValueError naming the op unless `ok`; `what`: the message, or a function making it (built only then)."""
    if not ok:
        raise ValueError(f"splash::{op}: {what() if callable(what) else what}")


def _f32(op: str, name: str, t: torch.Tensor, dim: int | None = None, contiguous: bool = False) -> None:
    """`t` is an fp32 CPU tensor (of `dim` dims; contiguous, or at least unit stride in its last dim)."""
    if (t.dtype == F32 and t.is_cpu and (dim is None or t.dim() == dim)
            and (t.is_contiguous() if contiguous else t.dim() == 0 or t.stride(-1) == 1)):
        return   # the common case in one test; the checks below name what is wrong
    _need(t.dtype == F32 and t.is_cpu, op, lambda: f"{name} must be float32 on CPU, got {t.dtype} on {t.device}")
    _need(dim is None or t.dim() == dim, op, lambda: f"{name} must have {dim} dims, got shape {tuple(t.shape)}")
    _need(not contiguous or t.is_contiguous(), op, lambda: f"{name} must be contiguous")
    _need(t.dim() == 0 or t.stride(-1) == 1 or t.shape[-1] <= 1, op,
          lambda: f"{name}'s last dim must be unit-stride")


def _ints(op: str, name: str, t: torch.Tensor, dtype: torch.dtype, n: int) -> None:
    """`t` is a contiguous 1-D CPU tensor of `dtype` of `n` entries (the C code checks the values it reads)."""
    _need(t.dtype == dtype and t.is_cpu and t.dim() == 1 and t.is_contiguous(), op,
          lambda: f"{name} must be a contiguous 1-D {dtype} CPU tensor, got {t.dtype} {tuple(t.shape)} on {t.device}")
    _need(t.numel() == n, op, lambda: f"{name} must have {n} entries, got {t.numel()}")


def _cos_sin(op: str, cos: torch.Tensor, sin: torch.Tensor, n: int, half: int) -> None:
    for name, t in (("cos", cos), ("sin", sin)):
        _f32(op, name, t, 2, contiguous=True)
        _need(tuple(t.shape) == (n, half), op, lambda: f"{name} must be [{n}, {half}], got {tuple(t.shape)}")


def _packed(op: str, name: str, p: torch.Tensor, lead: int, K: int) -> tuple[int, ...]:
    """A packed weight [*lead, N / 16, K, 16] -> (*lead, N, K)."""
    _f32(op, name, p, lead + 3, contiguous=True)
    _need(p.shape[-1] == STRIP and p.shape[-2] == K, op,
          lambda: f"{name} must be packed [..., N/16, {K}, 16], got {tuple(p.shape)}")
    return (*p.shape[:lead], p.shape[-3] * STRIP, p.shape[-2])


def _empty(*shape: int, dtype=F32) -> torch.Tensor:   # explicit: a caller may have set other defaults
    return torch.empty(*shape, dtype=dtype, device=CPU)


# The routes' tests: each the conjunction of what the op's checks require, in as few tensor queries as it takes (one
# `.shape` or `.stride()` read costs ~0.1-0.3 µs: ~40 kernel calls a decode step of the tiny model spend them).
def _vec(t: torch.Tensor) -> bool:   # _f32(t, 1, contiguous); the caller compares the length
    return t.dtype == F32 and t.is_cpu and t.is_contiguous() and t.dim() == 1


def _table(t: torch.Tensor, n: int, half: int) -> bool:   # _cos_sin's
    return t.dtype == F32 and t.is_cpu and t.is_contiguous() and t.shape == (n, half)


def _rows(x: torch.Tensor) -> bool:   # _f32(x, 2): fp32 CPU [n, d] with unit-stride rows
    return x.dtype == F32 and x.is_cpu and x.dim() == 2 and (x.is_contiguous() or x.stride(1) == 1)


# ---- the typed kernels: each op's checks, then its C call ---------------------------------------------------
def _check_rms_norm(x, weight, eps):
    _f32("rms_norm", "x", x, 2)
    d = x.shape[1]
    _need(d % 8 == 0, "rms_norm", lambda: f"width must be a multiple of 8, got {d}")
    _f32("rms_norm", "weight", weight, 1, contiguous=True)
    _need(weight.shape[0] == d, "rms_norm", lambda: f"weight must have {d} entries, got {weight.shape[0]}")


@_op("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor", _check_rms_norm)
def _rms_norm(x, weight, eps):
    y = _empty(x.shape[0], x.shape[1])
    native.lib().rms_norm(x.data_ptr(), x.shape[0], x.shape[1], x.stride(0), weight.data_ptr(), eps, y.data_ptr())
    return y


def _check_rope(x, cos, sin, interleave):
    _f32("rope", "x", x)
    _need(x.dim() in (2, 3) and x.shape[-1] % 2 == 0, "rope",
          lambda: f"x must be [n, dim] or [n, H, dim], dim even, got {tuple(x.shape)}")
    _cos_sin("rope", cos, sin, x.shape[0], x.shape[-1] // 2)


@_op("rope(Tensor x, Tensor cos, Tensor sin, bool interleave) -> Tensor", _check_rope)
def _rope(x, cos, sin, interleave):
    H, sh = (x.shape[1], x.stride(1)) if x.dim() == 3 else (1, 0)
    y = _empty(*x.shape)
    native.lib().rope(x.data_ptr(), x.shape[0], H, x.stride(0), sh, x.shape[-1], int(interleave), cos.data_ptr(),
                      sin.data_ptr(), y.data_ptr())
    return y


def _check_swiglu(h):
    _f32("swiglu", "h", h, 2)
    inter = h.shape[1] // 2
    _need(h.shape[1] == 2 * inter and inter % 8 == 0, "swiglu",
          lambda: f"h must be [n, 2 * inter], inter a multiple of 8, got {tuple(h.shape)}")


@_op("swiglu(Tensor h) -> Tensor", _check_swiglu)
def _swiglu(h):
    inter = h.shape[1] // 2
    y = _empty(h.shape[0], inter)
    native.lib().swiglu(h.data_ptr(), h.shape[0], inter, h.stride(0), y.data_ptr())
    return y


def _route_fits(E, groups, topk_group, k) -> bool:
    return 0 < E <= 1024 and groups > 0 and E % groups == 0 and 0 < topk_group <= groups \
        and 0 < k <= E // groups * topk_group


def _check_moe_route(scores, bias, groups, topk_group, k, norm, scale):
    _f32("moe_route", "scores", scores, 2, contiguous=True)
    E = scores.shape[1]
    _f32("moe_route", "bias", bias, 1, contiguous=True)
    _need(bias.shape[0] == E, "moe_route", lambda: f"bias must have {E} entries, got {bias.shape[0]}")
    _need(_route_fits(E, groups, topk_group, k), "moe_route",
          lambda: f"needs E <= 1024 split into groups, 0 < topk_group <= groups, 0 < k <= the experts of topk_group "
          f"groups; got E={E}, groups={groups}, topk_group={topk_group}, k={k}")


@_op("moe_route(Tensor scores, Tensor bias, int groups, int topk_group, int k, bool norm, float scale)"
     " -> (Tensor, Tensor)", _check_moe_route)
def _moe_route(scores, bias, groups, topk_group, k, norm, scale):
    n, E = scores.shape
    idx, wt = _empty(n, k, dtype=I64), _empty(n, k)
    rc = native.lib().moe_route(scores.data_ptr(), bias.data_ptr(), n, E, groups, topk_group, k, int(norm), scale,
                                idx.data_ptr(), wt.data_ptr())
    _need(rc == 0, "moe_route", lambda: f"the kernel refused the routing (code {rc})")
    return idx, wt


def _check_moe_sort(idx, weights, num_experts):
    _need(idx.dtype == I64 and idx.dim() == 2 and idx.is_contiguous() and idx.is_cpu,
          "moe_sort", lambda: f"idx must be a contiguous [n, k] int64 CPU tensor, got {idx.dtype} {tuple(idx.shape)}")
    _f32("moe_sort", "weights", weights, 2, contiguous=True)
    _need(weights.shape == idx.shape, "moe_sort",
          lambda: f"weights {tuple(weights.shape)} must match idx {tuple(idx.shape)}")


@_op("moe_sort(Tensor idx, Tensor weights, int num_experts) -> (Tensor, Tensor, Tensor)", _check_moe_sort)
def _moe_sort(idx, weights, num_experts):
    m = idx.numel()
    counts, tok, ws = _empty(num_experts, dtype=I64), _empty(m, dtype=I64), _empty(m)
    rc = native.lib().moe_sort(idx.data_ptr(), weights.data_ptr(), idx.shape[0], idx.shape[1], num_experts,
                               counts.data_ptr(), tok.data_ptr(), ws.data_ptr())
    _need(rc == 0, "moe_sort", lambda: f"idx must name experts in [0, {num_experts})")
    return counts, tok, ws


def _check_absorb_rope(q, w_uk, cos, sin, d_nope, interleave):
    _f32("absorb_rope", "q", q, 3)
    n, H, qk = q.shape
    _need(q.stride(1) == qk, "absorb_rope", "q's heads must be adjacent ([n, H, qk] with head stride qk)")
    _f32("absorb_rope", "w_uk", w_uk, 3, contiguous=True)
    d_c, d_r = w_uk.shape[2], qk - d_nope
    _need(tuple(w_uk.shape[:2]) == (H, d_nope) and d_c % 16 == 0 and d_r >= 0 and d_r % 2 == 0, "absorb_rope",
          lambda: f"w_uk must be [{H}, {d_nope}, d_c] with d_c % 16 == 0 and an even rope width, got "
          f"{tuple(w_uk.shape)}")
    _cos_sin("absorb_rope", cos, sin, n, d_r // 2)


@_op("absorb_rope(Tensor q, Tensor w_uk, Tensor cos, Tensor sin, int d_nope, bool interleave) -> Tensor",
     _check_absorb_rope)
def _absorb_rope(q, w_uk, cos, sin, d_nope, interleave):
    n, H, qk = q.shape
    d_c, d_r = w_uk.shape[2], qk - d_nope
    out = _empty(n, H, d_c + d_r)
    native.lib().absorb_rope(q.data_ptr(), n, H, q.stride(0), qk, d_nope, w_uk.data_ptr(), d_c, d_r, int(interleave),
                             cos.data_ptr(), sin.data_ptr(), out.data_ptr())
    return out


def _check_uv_heads(o_lat, uv_t):
    _f32("uv_heads", "o_lat", o_lat, 3, contiguous=True)
    _f32("uv_heads", "uv_t", uv_t, 3, contiguous=True)
    H, d_c = o_lat.shape[1:]
    _need(tuple(uv_t.shape[:2]) == (H, d_c) and uv_t.shape[2] % 16 == 0, "uv_heads",
          lambda: f"uv_t must be [{H}, {d_c}, d_v] with d_v % 16 == 0, got {tuple(uv_t.shape)}")


@_op("uv_heads(Tensor o_lat, Tensor uv_t) -> Tensor", _check_uv_heads)
def _uv_heads(o_lat, uv_t):
    n, H, d_c = o_lat.shape
    d_v = uv_t.shape[2]
    out = _empty(n, H * d_v)
    native.lib().uv_heads(o_lat.data_ptr(), n, H, d_c, uv_t.data_ptr(), d_v, out.data_ptr())
    return out


def _check_mla_project(x, wa, q_a_norm, q_b, w_uk, kv_a_norm, cos, sin, parts, heads, d_nope, d_r, eps, interleave):
    op = "mla_project"
    _need(parts in (1, 2, 3), op, lambda: f"parts must be 1 (queries), 2 (latent) or 3 (both), got {parts}")
    _f32(op, "x", x, 2)
    n, hidden = x.shape
    _f32(op, "q_a_norm", q_a_norm, 1, contiguous=True)
    _f32(op, "kv_a_norm", kv_a_norm, 1, contiguous=True)
    q_lora, d_c = q_a_norm.shape[0], kv_a_norm.shape[0]
    _need(q_lora % 8 == 0 and d_c % 16 == 0 and d_r % 2 == 0 and d_r >= 0, op,
          lambda: f"needs q_lora % 8 == 0, d_c % 16 == 0, an even d_r; got {q_lora}, {d_c}, {d_r}")
    width = (q_lora if parts & 1 else 0) + (d_c + d_r if parts & 2 else 0)
    _need(_packed(op, "wa", wa, 0, hidden)[0] == width, op,
          lambda: f"wa must have {width} output columns for parts={parts}, got {wa.shape[0] * STRIP}")
    _cos_sin(op, cos, sin, n, d_r // 2)
    if parts & 1:
        qk = d_nope + d_r
        _need(_packed(op, "q_b", q_b, 0, q_lora)[0] == heads * qk, op,
              lambda: f"q_b must have {heads} x {qk} output columns")
        _f32(op, "w_uk", w_uk, 3, contiguous=True)
        _need(tuple(w_uk.shape) == (heads, d_nope, d_c), op, lambda: f"w_uk must be [{heads}, {d_nope}, {d_c}], got "
              f"{tuple(w_uk.shape)}")


@_op("mla_project(Tensor x, Tensor wa, Tensor q_a_norm, Tensor q_b, Tensor w_uk, Tensor kv_a_norm, Tensor cos, "
     "Tensor sin, int parts, int heads, int d_nope, int d_r, float eps, bool interleave) -> Tensor[]",
     _check_mla_project)
def _mla_project(x, wa, q_a_norm, q_b, w_uk, kv_a_norm, cos, sin, parts, heads, d_nope, d_r, eps, interleave):
    n, hidden = x.shape
    q_lora, d_c = q_a_norm.shape[0], kv_a_norm.shape[0]
    qa, q = (_empty(n, q_lora), _empty(n, heads, d_c + d_r)) if parts & 1 else (_empty(0), _empty(0))
    c, kpe = (_empty(n, d_c), _empty(n, d_r)) if parts & 2 else (_empty(0), _empty(0))
    rc = native.lib().mla_project(x.data_ptr(), n, hidden, x.stride(0), parts, wa.data_ptr(), q_lora,
                                  q_a_norm.data_ptr(), q_b.data_ptr() if parts & 1 else 0, heads, d_nope + d_r,
                                  d_nope, w_uk.data_ptr() if parts & 1 else 0, d_c, d_r, kv_a_norm.data_ptr(), eps,
                                  int(interleave), cos.data_ptr(), sin.data_ptr(), qa.data_ptr(), q.data_ptr(),
                                  c.data_ptr(), kpe.data_ptr())
    if rc != 0:
        raise MemoryError("splash::mla_project could not allocate its scratch")
    return {3: [q, c, kpe, qa], 1: [q, qa], 2: [c, kpe]}[parts]


def _check_linear_packed(x, packed):
    _f32("linear_packed", "x", x, 2)
    _packed("linear_packed", "packed", packed, 0, x.shape[1])


@_op("linear_packed(Tensor x, Tensor packed) -> Tensor", _check_linear_packed)
def _linear_packed(x, packed):
    N, K = packed.shape[0] * STRIP, x.shape[1]
    y = _empty(x.shape[0], N)
    native.lib().linear_packed(x.data_ptr(), x.shape[0], K, x.stride(0), packed.data_ptr(), N, y.data_ptr())
    return y


def _check_mlp_packed(x, gate_up, down):
    _f32("mlp_packed", "x", x, 2)
    I2, _ = _packed("mlp_packed", "gate_up", gate_up, 0, x.shape[1])
    _packed("mlp_packed", "down", down, 0, I2 // 2)


@_op("mlp_packed(Tensor x, Tensor gate_up, Tensor down) -> Tensor", _check_mlp_packed)
def _mlp_packed(x, gate_up, down):
    I, N = gate_up.shape[0] * STRIP // 2, down.shape[0] * STRIP   # I: a multiple of 8, as 2 I is of 16
    y = _empty(x.shape[0], N)
    rc = native.lib().mlp_packed(x.data_ptr(), x.shape[0], x.shape[1], x.stride(0), gate_up.data_ptr(), I,
                                 down.data_ptr(), N, y.data_ptr())
    if rc != 0:
        raise MemoryError("splash::mlp_packed could not allocate its scratch")
    return y


def _check_grouped_gemm(x, packed, counts):
    _f32("grouped_gemm", "x", x, 2, contiguous=True)
    E, _, _ = _packed("grouped_gemm", "packed", packed, 1, x.shape[1])
    _ints("grouped_gemm", "counts", counts, I64, E)


@_op("grouped_gemm(Tensor x, Tensor packed, Tensor counts) -> Tensor", _check_grouped_gemm)
def _grouped_gemm(x, packed, counts):
    N = packed.shape[1] * STRIP
    y = _empty(x.shape[0], N)
    rc = native.lib().grouped_gemm(x.data_ptr(), x.shape[0], x.shape[1], counts.data_ptr(), packed.shape[0],
                                   packed.data_ptr(), N, y.data_ptr())
    _need(rc == 0, "grouped_gemm", lambda: f"counts must be >= 0 and sum to at most x's {x.shape[0]} rows")
    return y


def _check_moe_experts(x, tok, counts, weights, gate_up, down):
    op = "moe_experts"
    _f32(op, "x", x, 2, contiguous=True)
    E, I2, _ = _packed(op, "gate_up", gate_up, 1, x.shape[1])
    E2, N, _ = _packed(op, "down", down, 1, I2 // 2)   # I2 is a multiple of 16, so I of 8
    _need(E2 == E, op, lambda: f"down must hold {E} experts, got {E2}")
    _ints(op, "counts", counts, I64, E)
    _ints(op, "tok", tok, I64, tok.numel())
    _f32(op, "weights", weights, 1, contiguous=True)
    _need(weights.numel() == tok.numel(), op, lambda: f"weights must have tok's {tok.numel()} entries")


@_op("moe_experts(Tensor x, Tensor tok, Tensor counts, Tensor weights, Tensor gate_up, Tensor down) -> Tensor",
     _check_moe_experts)
def _moe_experts(x, tok, counts, weights, gate_up, down):
    n, K = x.shape
    I, N = gate_up.shape[1] * STRIP // 2, down.shape[1] * STRIP
    out = _empty(n, N)
    rc = native.lib().moe_experts(x.data_ptr(), n, K, tok.data_ptr(), tok.shape[0], counts.data_ptr(),
                                  weights.data_ptr(), gate_up.shape[0], gate_up.data_ptr(), I, down.data_ptr(), N,
                                  out.data_ptr())
    _need(rc != -2, "moe_experts", lambda: f"counts must be >= 0 and sum to tok's {tok.shape[0]} entries")
    _need(rc != -3, "moe_experts", lambda: f"tok must lie in [0, {n})")
    if rc != 0:
        raise MemoryError("splash::moe_experts could not allocate its scratch")
    return out


def _check_decode_rows(rows, page_rows, npages, qpos, pages, logical):
    op = "mla_decode"
    for name, t in (("pages", pages), ("logical", logical)):
        _need(t.dtype == I32 and t.dim() == 2 and t.is_contiguous() and t.is_cpu, op,
              lambda: f"{name} must be a contiguous 2-D int32 CPU tensor")
    _need(logical.shape == pages.shape, op, "logical must match pages' shape")
    G = rows.numel()
    _ints(op, "rows", rows, I64, G)
    _ints(op, "page_rows", page_rows, I64, G)
    _ints(op, "npages", npages, I32, G)
    _ints(op, "qpos", qpos, I64, G)


def _check_mla_decode(rows, page_rows, npages, qpos, pages, logical, q_latent, q_rope, ckv, kpe, scale):
    op = "mla_decode"
    _f32(op, "q_latent", q_latent, 3)
    _f32(op, "q_rope", q_rope, 3)
    d_c, d_r = q_latent.shape[2], q_rope.shape[2]
    _need(q_rope.shape[:2] == q_latent.shape[:2] and q_rope.stride()[:2] == q_latent.stride()[:2], op,
          "q_latent and q_rope must share rows, heads and their strides (views of one q̃)")
    _f32(op, "ckv", ckv, 3, contiguous=True)
    _f32(op, "kpe", kpe, 3, contiguous=True)
    blocks, bs = ckv.shape[:2]
    _need(d_c % 16 == 0 and d_r % 8 == 0 and ckv.shape[2] == d_c and tuple(kpe.shape) == (blocks, bs, d_r), op,
          lambda: f"pools must be ckv [blocks, bs, {d_c}], kpe [blocks, bs, {d_r}] with d_c % 16 == 0, d_r % 8 == 0")
    _check_decode_rows(rows, page_rows, npages, qpos, pages, logical)


@_op("mla_decode(Tensor rows, Tensor page_rows, Tensor npages, Tensor qpos, Tensor pages, Tensor logical, "
     "Tensor q_latent, Tensor q_rope, Tensor ckv, Tensor kpe, float scale) -> (Tensor, Tensor)", _check_mla_decode)
def _mla_decode(rows, page_rows, npages, qpos, pages, logical, q_latent, q_rope, ckv, kpe, scale):
    n, h, d_c = q_latent.shape
    o, lse = _empty(n, h, d_c), _empty(n, h)
    rc = native.lib().mla_decode(rows.shape[0], rows.data_ptr(), n, page_rows.data_ptr(), pages.shape[0],
                                 npages.data_ptr(), qpos.data_ptr(), pages.data_ptr(), logical.data_ptr(),
                                 pages.shape[1], ckv.shape[0], h, d_c, q_rope.shape[2], ckv.shape[1],
                                 q_latent.data_ptr(), q_rope.data_ptr(), q_latent.stride(0), q_latent.stride(1),
                                 ckv.data_ptr(), kpe.data_ptr(), scale, o.data_ptr(), lse.data_ptr())
    _need(rc != -3, "mla_decode", lambda: f"rows must lie in [0, {n})")
    _need(rc != -4, "mla_decode", lambda: f"page_rows must lie in [0, {pages.shape[0]})")
    if rc == -1:
        raise MemoryError("splash::mla_decode could not allocate its scratch")
    if rc != 0:
        raise RuntimeError("splash::mla_decode: the step's page table names a page outside the pool")
    return o, lse


# ---- routes: the kernel where it applies, else None (the decorated torch function runs) ----------------------
def rms_norm(x, w, eps):
    if _rows(x) and _vec(w) and native.enabled():
        d = x.shape[1]
        if d % 8 == 0 and w.shape[0] == d:
            return kernels.rms_norm(x, w, eps)
    return None


def rope(x, cos, sin, interleave):
    if x.dtype == F32 and x.is_cpu and (x.is_contiguous() or x.stride(-1) == 1) and native.enabled():
        s = x.shape
        if len(s) in (2, 3) and s[-1] % 2 == 0 and _table(cos, s[0], s[-1] // 2) and _table(sin, s[0], s[-1] // 2):
            return kernels.rope(x, cos, sin, interleave)
    return None


def swiglu(h, inter, limit=None):
    if limit is None and inter % 8 == 0 and _rows(h) and h.shape[1] == 2 * inter and native.enabled():
        return kernels.swiglu(h)
    return None


def moe_route(scores, bias, groups, topk_group, k, norm, scale):
    if scores.dtype == F32 and scores.is_cpu and scores.is_contiguous() and scores.dim() == 2 and _vec(bias) \
            and native.enabled():
        E = scores.shape[1]
        if bias.shape[0] == E and _route_fits(E, groups, topk_group, k):
            return kernels.moe_route(scores, bias, groups, topk_group, k, norm, scale)
    return None


def moe_sort(idx, weights, num_experts):
    if (idx.dtype == I64 and idx.is_cpu and idx.is_contiguous() and idx.dim() == 2 and weights.dtype == F32
            and weights.is_cpu and weights.is_contiguous() and weights.shape == idx.shape and native.enabled()):
        return kernels.moe_sort(idx, weights, num_experts)
    return None


def absorb_rope(q, w_uk, d_nope, cos, sin, interleave):
    if (q.dtype == F32 and q.is_cpu and q.dim() == 3 and w_uk.dtype == F32 and w_uk.is_cpu and w_uk.is_contiguous()
            and native.enabled()):
        (n, H, qk), st, u = q.shape, q.stride(), w_uk.shape
        d_r = qk - d_nope
        if (st[2] == 1 and st[1] == qk and len(u) == 3 and u[0] == H and u[1] == d_nope and u[2] % 16 == 0
                and d_r >= 0 and d_r % 2 == 0 and _table(cos, n, d_r // 2) and _table(sin, n, d_r // 2)):
            return kernels.absorb_rope(q, w_uk, cos, sin, d_nope, interleave)
    return None


def uv_heads(o_lat, uv_t):
    if (o_lat.dtype == F32 and o_lat.is_cpu and o_lat.is_contiguous() and o_lat.dim() == 3 and uv_t.dtype == F32
            and uv_t.is_cpu and uv_t.is_contiguous() and native.enabled()):
        s, u = o_lat.shape, uv_t.shape
        if len(u) == 3 and u[0] == s[1] and u[1] == s[2] and u[2] % 16 == 0:
            return kernels.uv_heads(o_lat, uv_t)
    return None


def mla_project(cfg, rope, w, x, cos, sin, parts=3):
    """`parts` 3: [q̃, c_kv, k_rope, normed Q-A output]; 1: [q̃, normed Q-A output]; 2: [c_kv, k_rope]."""
    wa = w.qkv_a if parts == 3 else w.q_a if parts == 1 else w.kv_a if parts == 2 else None
    qn, kn = w.q_a_norm, w.kv_a_norm
    if not (isinstance(wa, PackedLinear) and w.q_a is not None and _rows(x) and _vec(qn) and _vec(kn)
            and native.enabled()):
        return None
    (n, hidden), q_lora, d_c, d_r = x.shape, qn.shape[0], kn.shape[0], cfg.qk_rope_head_dim
    width = (q_lora if parts & 1 else 0) + (d_c + d_r if parts & 2 else 0)
    if (q_lora % 8 or d_c % 16 or d_r < 0 or d_r % 2 or wa.shape != (width, hidden)
            or not _table(cos, n, d_r // 2) or not _table(sin, n, d_r // 2)):
        return None
    heads, d_nope = len(w.heads), cfg.qk_nope_head_dim
    if parts & 1:
        qb, uk = w.q_b, w.w_uk
        if (not isinstance(qb, PackedLinear) or qb.shape != (heads * (d_nope + d_r), q_lora) or uk is None
                or uk.dtype != F32 or not uk.is_cpu or not uk.is_contiguous() or uk.shape != (heads, d_nope, d_c)):
            return None
        qb = qb.packed
    else:
        qb = uk = _empty(0)
    return kernels.mla_project(x, wa.packed, qn, qb, uk, kn, cos, sin, parts, heads, d_nope, d_r, cfg.rms_norm_eps,
                               rope.interleave)


def linear_packed(x, w):
    if isinstance(w, PackedLinear) and _rows(x) and native.enabled():
        ws = w.shape
        if len(ws) == 2 and ws[1] == x.shape[1]:
            return kernels.linear_packed(x, w.packed)
    return None


def mlp_packed(w, x, limit=None):
    gu, down = w.gate_up, w.down
    if (limit is None and isinstance(gu, PackedLinear) and isinstance(down, PackedLinear) and _rows(x)
            and native.enabled()):
        g, d = gu.shape, down.shape
        if len(g) == 2 and len(d) == 2 and g[1] == x.shape[1] and d[1] * 2 == g[0]:
            return kernels.mlp_packed(x, gu.packed, down.packed)
    return None


def grouped_gemm(x, stack, counts):
    if (isinstance(stack, PackedExperts) and x.dtype == F32 and x.is_cpu and x.dim() == 2 and counts.is_cpu
            and counts.dim() == 1 and native.enabled()):
        s = stack.shape
        if len(s) == 3 and s[2] == x.shape[1] and counts.shape[0] == s[0]:
            return kernels.grouped_gemm(x.contiguous(), stack.packed, counts.to(I64).contiguous())
    return None


def moe_experts(x, w, counts, tok, weights, limit):
    gu, down = w.gate_up, w.down
    if (limit is None and isinstance(gu, PackedExperts) and isinstance(down, PackedExperts) and x.dtype == F32
            and x.is_cpu and x.is_contiguous() and x.dim() == 2 and counts.dtype == I64 and counts.is_cpu
            and counts.dim() == 1 and tok.dtype == I64 and tok.is_cpu and tok.is_contiguous() and tok.dim() == 1
            and _vec(weights) and native.enabled()):
        g, d = gu.shape, down.shape
        if (len(g) == 3 and len(d) == 3 and g[2] == x.shape[1] and d[2] * 2 == g[1] and d[0] == g[0]
                and counts.shape[0] == g[0] and weights.shape == tok.shape):
            return kernels.moe_experts(x, tok, counts.contiguous(), weights, gu.packed, down.packed)
    return None


class DecodeRows:
    """A step's per-row arrays for `mla_decode` — query rows, page-table rows, pages held, positions — and its page
    table (physical and logical ids), checked once when made (`decode_rows`): the step's layers pass it unchanged."""
    __slots__ = ("tensors",)

    def __init__(self, tensors: tuple[torch.Tensor, ...]):
        self.tensors = tensors


def decode_rows(rows, page_rows, npages, qpos, pages, logical) -> DecodeRows:
    """The step's arrays after the op's checks on them (a ValueError naming the one that fails)."""
    _check_decode_rows(rows, page_rows, npages, qpos, pages, logical)
    return DecodeRows((rows, page_rows, npages, qpos, pages, logical))


def mla_decode(step: DecodeRows, q_latent, q_rope, ckv, kpe, scale):
    """Every query row's attention, for the `torch` attention backend once it has chosen the kernel: the C call
    where the layer's tensors pass the test below, else the op's checks (they raise, naming the argument)."""
    if (type(step) is DecodeRows and q_latent.dtype == F32 and q_latent.is_cpu and q_rope.dtype == F32
            and q_rope.is_cpu and ckv.dtype == F32 and ckv.is_cpu and ckv.is_contiguous() and kpe.dtype == F32
            and kpe.is_cpu and kpe.is_contiguous()):
        s, sr, st, c, k = q_latent.shape, q_rope.shape, q_latent.stride(), ckv.shape, kpe.shape
        if (len(s) == 3 and len(sr) == 3 and st[2] == 1 and q_rope.stride() == st and s[:2] == sr[:2]
                and len(c) == 3 and c[2] == s[2] and s[2] % 16 == 0 and sr[2] % 8 == 0 and k == (c[0], c[1], sr[2])):
            return kernels.mla_decode(*step.tensors, q_latent, q_rope, ckv, kpe, scale)
    return checked.mla_decode(*step.tensors, q_latent, q_rope, ckv, kpe, scale)
