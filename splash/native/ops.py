"""SPLASH's CPU kernels as typed torch ops (`torch.ops.splash.<name>`), and the routes that pick them.

Each op has a schema (`torch.library.define` + impl: `custom_op` costs 43 µs a call, define + impl 8 µs), and its
CPU implementation checks dtype, device, shape, strides and index ranges, raising a ValueError naming the op and
the argument before C sees a pointer. The routes (public functions, with the signature of the torch function they
stand for) run the kernel where it applies (kernels on, fp32 on CPU, the alignment the C code needs, packed
weights) or return None, calling the checked implementations (`checked.<name>`) without the dispatcher; model
code reaches them only through `splash.native.fast_path(name)`.
"""
from __future__ import annotations

import types

import torch

from splash import native
from splash.native.packed import STRIP, PackedExperts, PackedLinear

CPU = torch.device("cpu")
_LIB = torch.library.Library("splash", "FRAGMENT")
# The checked implementations by name: what the routes call. torch's dispatcher in front of them costs ~4 µs a call,
# 10% of a tiny model's decode step (docs/benchmarks.md); `torch.ops.splash.<name>` runs the same checks.
checked = types.SimpleNamespace()


def _op(schema: str):
    name = schema.split("(", 1)[0]

    def register(fn):
        _LIB.define(schema)
        _LIB.impl(name, fn, "CPU")
        setattr(checked, name, fn)
        return fn
    return register


def _need(ok: bool, op: str, what) -> None:
    """Raise ValueError naming the op unless `ok`; `what`: the message, or a function making it (built only then)."""
    if not ok:
        raise ValueError(f"splash::{op}: {what() if callable(what) else what}")


def _f32(op: str, name: str, t: torch.Tensor, dim: int | None = None, contiguous: bool = False) -> None:
    """`t` is an fp32 CPU tensor (of `dim` dims; contiguous, or at least unit stride in its last dim)."""
    if (t.dtype == torch.float32 and t.is_cpu and (dim is None or t.dim() == dim)
            and (t.is_contiguous() if contiguous else t.dim() == 0 or t.stride(-1) == 1)):
        return   # the common case in one test; the checks below name what is wrong
    _need(t.dtype == torch.float32 and t.is_cpu, op,
          lambda: f"{name} must be float32 on CPU, got {t.dtype} on {t.device}")
    _need(dim is None or t.dim() == dim, op, lambda: f"{name} must have {dim} dims, got shape {tuple(t.shape)}")
    _need(not contiguous or t.is_contiguous(), op, lambda: f"{name} must be contiguous")
    _need(t.dim() == 0 or t.stride(-1) == 1 or t.shape[-1] <= 1, op,
          lambda: f"{name}'s last dim must be unit-stride")


def _ints(op: str, name: str, t: torch.Tensor, dtype: torch.dtype, n: int, hi: int | None = None) -> None:
    """`t` is a contiguous 1-D CPU tensor of `dtype` of `n` entries (values in [0, hi))."""
    _need(t.dtype == dtype and t.is_cpu and t.dim() == 1 and t.is_contiguous(), op,
          lambda: f"{name} must be a contiguous 1-D {dtype} CPU tensor, got {t.dtype} {tuple(t.shape)} on {t.device}")
    _need(t.numel() == n, op, lambda: f"{name} must have {n} entries, got {t.numel()}")
    if hi is not None and t.numel():
        _need(int(t.min()) >= 0 and int(t.max()) < hi, op, lambda: f"{name} must lie in [0, {hi})")


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


def _empty(*shape: int, dtype=torch.float32) -> torch.Tensor:   # explicit: a caller may have set other defaults
    return torch.empty(*shape, dtype=dtype, device=CPU)


# ---- the typed kernels ---------------------------------------------------------------------------------------
@_op("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor")
def _rms_norm(x, weight, eps):
    _f32("rms_norm", "x", x, 2)
    d = x.shape[1]
    _need(d % 8 == 0, "rms_norm", lambda: f"width must be a multiple of 8, got {d}")
    _f32("rms_norm", "weight", weight, 1, contiguous=True)
    _need(weight.shape[0] == d, "rms_norm", lambda: f"weight must have {d} entries, got {weight.shape[0]}")
    y = _empty(x.shape[0], d)
    native.lib().rms_norm(x.data_ptr(), x.shape[0], d, x.stride(0), weight.data_ptr(), eps, y.data_ptr())
    return y


@_op("rope(Tensor x, Tensor cos, Tensor sin, bool interleave) -> Tensor")
def _rope(x, cos, sin, interleave):
    _f32("rope", "x", x)
    _need(x.dim() in (2, 3) and x.shape[-1] % 2 == 0, "rope",
          lambda: f"x must be [n, dim] or [n, H, dim], dim even, got "
          f"{tuple(x.shape)}")
    n, dim = x.shape[0], x.shape[-1]
    _cos_sin("rope", cos, sin, n, dim // 2)
    H, sh = (x.shape[1], x.stride(1)) if x.dim() == 3 else (1, 0)
    y = _empty(*x.shape)
    native.lib().rope(x.data_ptr(), n, H, x.stride(0), sh, dim, int(interleave), cos.data_ptr(), sin.data_ptr(),
                      y.data_ptr())
    return y


@_op("swiglu(Tensor h) -> Tensor")
def _swiglu(h):
    _f32("swiglu", "h", h, 2)
    inter = h.shape[1] // 2
    _need(h.shape[1] == 2 * inter and inter % 8 == 0, "swiglu",
          lambda: f"h must be [n, 2 * inter], inter a multiple of 8, "
          f"got {tuple(h.shape)}")
    y = _empty(h.shape[0], inter)
    native.lib().swiglu(h.data_ptr(), h.shape[0], inter, h.stride(0), y.data_ptr())
    return y


@_op("moe_route(Tensor scores, Tensor bias, int groups, int topk_group, int k, bool norm, float scale)"
     " -> (Tensor, Tensor)")
def _moe_route(scores, bias, groups, topk_group, k, norm, scale):
    _f32("moe_route", "scores", scores, 2, contiguous=True)
    n, E = scores.shape
    _f32("moe_route", "bias", bias, 1, contiguous=True)
    _need(bias.shape[0] == E, "moe_route", lambda: f"bias must have {E} entries, got {bias.shape[0]}")
    _need(0 < E <= 1024 and groups > 0 and E % groups == 0 and 0 < topk_group <= groups
          and 0 < k <= E // groups * topk_group, "moe_route",
          lambda: f"needs E <= 1024 split into groups, 0 < topk_group <= groups"
          f", 0 < k <= the experts of topk_group groups; got E={E}, "
          f"groups={groups}, topk_group={topk_group}, k={k}")
    idx, wt = _empty(n, k, dtype=torch.int64), _empty(n, k)
    rc = native.lib().moe_route(scores.data_ptr(), bias.data_ptr(), n, E, groups, topk_group, k, int(norm), scale,
                                idx.data_ptr(), wt.data_ptr())
    _need(rc == 0, "moe_route", lambda: f"the kernel refused the routing (code {rc})")
    return idx, wt


@_op("moe_sort(Tensor idx, Tensor weights, int num_experts) -> (Tensor, Tensor, Tensor)")
def _moe_sort(idx, weights, num_experts):
    _need(idx.dtype == torch.int64 and idx.dim() == 2 and idx.is_contiguous() and idx.is_cpu,
          "moe_sort", lambda: f"idx must be a contiguous [n, k] int64 CPU tensor, got {idx.dtype} {tuple(idx.shape)}")
    _f32("moe_sort", "weights", weights, 2, contiguous=True)
    _need(weights.shape == idx.shape, "moe_sort",
          lambda: f"weights {tuple(weights.shape)} must match idx {tuple(idx.shape)}")
    m = idx.numel()
    counts, tok, ws = _empty(num_experts, dtype=torch.int64), _empty(m, dtype=torch.int64), _empty(m)
    rc = native.lib().moe_sort(idx.data_ptr(), weights.data_ptr(), idx.shape[0], idx.shape[1], num_experts,
                               counts.data_ptr(), tok.data_ptr(), ws.data_ptr())
    _need(rc == 0, "moe_sort", lambda: f"idx must name experts in [0, {num_experts})")
    return counts, tok, ws


@_op("absorb_rope(Tensor q, Tensor w_uk, Tensor cos, Tensor sin, int d_nope, bool interleave) -> Tensor")
def _absorb_rope(q, w_uk, cos, sin, d_nope, interleave):
    _f32("absorb_rope", "q", q, 3)
    n, H, qk = q.shape
    _need(q.stride(1) == qk, "absorb_rope", "q's heads must be adjacent ([n, H, qk] with head stride qk)")
    _f32("absorb_rope", "w_uk", w_uk, 3, contiguous=True)
    d_c, d_r = w_uk.shape[2], qk - d_nope
    _need(tuple(w_uk.shape[:2]) == (H, d_nope) and d_c % 16 == 0 and d_r >= 0 and d_r % 2 == 0, "absorb_rope",
          lambda: f"w_uk must be [{H}, {d_nope}, d_c] with d_c % 16 == 0 and an even rope width, got "
          f"{tuple(w_uk.shape)}")
    _cos_sin("absorb_rope", cos, sin, n, d_r // 2)
    out = _empty(n, H, d_c + d_r)
    native.lib().absorb_rope(q.data_ptr(), n, H, q.stride(0), qk, d_nope, w_uk.data_ptr(), d_c, d_r, int(interleave),
                             cos.data_ptr(), sin.data_ptr(), out.data_ptr())
    return out


@_op("uv_heads(Tensor o_lat, Tensor uv_t) -> Tensor")
def _uv_heads(o_lat, uv_t):
    _f32("uv_heads", "o_lat", o_lat, 3, contiguous=True)
    _f32("uv_heads", "uv_t", uv_t, 3, contiguous=True)
    n, H, d_c = o_lat.shape
    d_v = uv_t.shape[2]
    _need(tuple(uv_t.shape[:2]) == (H, d_c) and d_v % 16 == 0, "uv_heads",
          lambda: f"uv_t must be [{H}, {d_c}, d_v] with d_v % 16 == 0, got {tuple(uv_t.shape)}")
    out = _empty(n, H * d_v)
    native.lib().uv_heads(o_lat.data_ptr(), n, H, d_c, uv_t.data_ptr(), d_v, out.data_ptr())
    return out


@_op("mla_project(Tensor x, Tensor wa, Tensor q_a_norm, Tensor q_b, Tensor w_uk, Tensor kv_a_norm, Tensor cos, "
     "Tensor sin, int parts, int heads, int d_nope, int d_r, float eps, bool interleave) -> Tensor[]")
def _mla_project(x, wa, q_a_norm, q_b, w_uk, kv_a_norm, cos, sin, parts, heads, d_nope, d_r, eps, interleave):
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
          lambda: f"wa must have {width} output columns for parts={parts}, "
          f"got {wa.shape[0] * STRIP}")
    _cos_sin(op, cos, sin, n, d_r // 2)
    qk = d_nope + d_r
    if parts & 1:
        _need(_packed(op, "q_b", q_b, 0, q_lora)[0] == heads * qk, op,
              lambda: f"q_b must have {heads} x {qk} output columns")
        _f32(op, "w_uk", w_uk, 3, contiguous=True)
        _need(tuple(w_uk.shape) == (heads, d_nope, d_c), op, lambda: f"w_uk must be [{heads}, {d_nope}, {d_c}], got "
              f"{tuple(w_uk.shape)}")
    qa, q = (_empty(n, q_lora), _empty(n, heads, d_c + d_r)) if parts & 1 else (_empty(0), _empty(0))
    c, kpe = (_empty(n, d_c), _empty(n, d_r)) if parts & 2 else (_empty(0), _empty(0))
    rc = native.lib().mla_project(x.data_ptr(), n, hidden, x.stride(0), parts, wa.data_ptr(), q_lora,
                                  q_a_norm.data_ptr(), q_b.data_ptr() if parts & 1 else 0, heads, qk, d_nope,
                                  w_uk.data_ptr() if parts & 1 else 0, d_c, d_r, kv_a_norm.data_ptr(), eps,
                                  int(interleave), cos.data_ptr(), sin.data_ptr(), qa.data_ptr(), q.data_ptr(),
                                  c.data_ptr(), kpe.data_ptr())
    if rc != 0:
        raise MemoryError("splash::mla_project could not allocate its scratch")
    return {3: [q, c, kpe, qa], 1: [q, qa], 2: [c, kpe]}[parts]


@_op("linear_packed(Tensor x, Tensor packed) -> Tensor")
def _linear_packed(x, packed):
    _f32("linear_packed", "x", x, 2)
    N, K = _packed("linear_packed", "packed", packed, 0, x.shape[1])
    y = _empty(x.shape[0], N)
    native.lib().linear_packed(x.data_ptr(), x.shape[0], K, x.stride(0), packed.data_ptr(), N, y.data_ptr())
    return y


@_op("grouped_gemm(Tensor x, Tensor packed, Tensor counts) -> Tensor")
def _grouped_gemm(x, packed, counts):
    _f32("grouped_gemm", "x", x, 2, contiguous=True)
    E, N, K = _packed("grouped_gemm", "packed", packed, 1, x.shape[1])
    _ints("grouped_gemm", "counts", counts, torch.int64, E)
    _need(int(counts.sum()) <= x.shape[0] and int(counts.min()) >= 0, "grouped_gemm",
          lambda: f"counts must be >= 0 and sum to at most x's {x.shape[0]} rows")
    y = _empty(x.shape[0], N)
    native.lib().grouped_gemm(x.data_ptr(), K, counts.data_ptr(), E, packed.data_ptr(), N, y.data_ptr())
    return y


@_op("moe_experts(Tensor x, Tensor tok, Tensor counts, Tensor weights, Tensor gate_up, Tensor down) -> Tensor")
def _moe_experts(x, tok, counts, weights, gate_up, down):
    op = "moe_experts"
    _f32(op, "x", x, 2, contiguous=True)
    n, K = x.shape
    E, I2, _ = _packed(op, "gate_up", gate_up, 1, K)
    I = I2 // 2
    _need(I % 8 == 0 and I2 == 2 * I, op, lambda: f"gate_up's width must be 2 * inter, inter % 8 == 0; got {I2}")
    E2, N, _ = _packed(op, "down", down, 1, I)
    _need(E2 == E and N % 8 == 0, op, lambda: f"down must be [{E}, N, {I}] packed with N % 8 == 0, got {E2}, {N}")
    _ints(op, "counts", counts, torch.int64, E)
    m = int(counts.sum())
    _need(int(counts.min()) >= 0, op, "counts must be >= 0")
    _ints(op, "tok", tok, torch.int64, m, n)
    _f32(op, "weights", weights, 1, contiguous=True)
    _need(weights.numel() == m, op, lambda: f"weights must have {m} entries, got {weights.numel()}")
    out = _empty(n, N)
    rc = native.lib().moe_experts(x.data_ptr(), n, K, tok.data_ptr(), counts.data_ptr(), weights.data_ptr(), E,
                                  gate_up.data_ptr(), I, down.data_ptr(), N, out.data_ptr())
    if rc != 0:
        raise MemoryError("splash::moe_experts could not allocate its scratch")
    return out


@_op("mla_decode(Tensor rows, Tensor page_rows, Tensor npages, Tensor qpos, Tensor pages, Tensor logical, "
     "Tensor q_latent, Tensor q_rope, Tensor ckv, Tensor kpe, float scale) -> (Tensor, Tensor)")
def _mla_decode(rows, page_rows, npages, qpos, pages, logical, q_latent, q_rope, ckv, kpe, scale):
    op = "mla_decode"
    _f32(op, "q_latent", q_latent, 3)
    _f32(op, "q_rope", q_rope, 3)
    n, h, d_c = q_latent.shape
    d_r = q_rope.shape[2]
    _need(q_rope.shape[:2] == q_latent.shape[:2] and q_rope.stride()[:2] == q_latent.stride()[:2], op,
          "q_latent and q_rope must share rows, heads and their strides (views of one q̃)")
    _f32(op, "ckv", ckv, 3, contiguous=True)
    _f32(op, "kpe", kpe, 3, contiguous=True)
    blocks, bs = ckv.shape[:2]
    _need(d_c % 16 == 0 and d_r % 8 == 0 and ckv.shape[2] == d_c and tuple(kpe.shape) == (blocks, bs, d_r), op,
          lambda: f"pools must be ckv [blocks, bs, {d_c}], kpe [blocks, bs, {d_r}] with d_c % 16 == 0, d_r % 8 == 0")
    for name, t in (("pages", pages), ("logical", logical)):
        _need(t.dtype == torch.int32 and t.dim() == 2 and t.is_contiguous() and t.is_cpu, op,
              lambda: f"{name} must be a contiguous 2-D int32 CPU tensor")
    _need(logical.shape == pages.shape, op, "logical must match pages' shape")
    G = rows.numel()
    _ints(op, "rows", rows, torch.int64, G, n)
    _ints(op, "page_rows", page_rows, torch.int64, G, pages.shape[0])
    _ints(op, "npages", npages, torch.int32, G)
    _ints(op, "qpos", qpos, torch.int64, G)
    o, lse = _empty(n, h, d_c), _empty(n, h)
    rc = native.lib().mla_decode(G, rows.data_ptr(), page_rows.data_ptr(), npages.data_ptr(), qpos.data_ptr(),
                                 pages.data_ptr(), logical.data_ptr(), pages.shape[1], blocks, h, d_c, d_r, bs,
                                 q_latent.data_ptr(), q_rope.data_ptr(), q_latent.stride(0), q_latent.stride(1),
                                 ckv.data_ptr(), kpe.data_ptr(), scale, o.data_ptr(), lse.data_ptr())
    if rc == -1:
        raise MemoryError("splash::mla_decode could not allocate its scratch")
    if rc != 0:
        raise RuntimeError("splash::mla_decode: the step's page table names a page outside the pool")
    return o, lse


# ---- routes: the kernel where it applies, else None (the decorated torch function runs) ----------------------
def _on(*ts: torch.Tensor) -> bool:
    return all(t.dtype == torch.float32 and t.is_cpu for t in ts) and native.enabled()


def rms_norm(x, w, eps):
    if x.dim() == 2 and x.shape[-1] % 8 == 0 and x.stride(1) == 1 and w.is_contiguous() and _on(x, w):
        return checked.rms_norm(x, w, eps)
    return None


def rope(x, cos, sin, interleave):
    if (x.dim() in (2, 3) and x.stride(-1) == 1 and x.shape[-1] % 2 == 0 and cos.is_contiguous()
            and sin.is_contiguous() and _on(x, cos, sin)):
        return checked.rope(x, cos, sin, interleave)
    return None


def swiglu(h, inter, limit=None):
    if limit is None and h.dim() == 2 and inter % 8 == 0 and h.stride(1) == 1 and _on(h):
        return checked.swiglu(h)
    return None


def moe_route(scores, bias, groups, topk_group, k, norm, scale):
    if scores.dim() == 2 and scores.is_contiguous() and bias.is_contiguous() and scores.shape[1] <= 1024 \
            and _on(scores, bias):
        return checked.moe_route(scores, bias, groups, topk_group, k, norm, scale)
    return None


def moe_sort(idx, weights, num_experts):
    if idx.dtype == torch.int64 and idx.is_contiguous() and weights.is_contiguous() and _on(weights):
        return checked.moe_sort(idx, weights, num_experts)
    return None


def absorb_rope(q, w_uk, d_nope, cos, sin, interleave):
    if (q.dim() == 3 and q.stride(2) == 1 and q.stride(1) == q.shape[2] and w_uk.is_contiguous()
            and w_uk.shape[2] % 16 == 0 and cos.is_contiguous() and sin.is_contiguous() and _on(q, w_uk, cos, sin)):
        return checked.absorb_rope(q, w_uk, cos, sin, d_nope, interleave)
    return None


def uv_heads(o_lat, uv_t):
    if o_lat.is_contiguous() and uv_t.is_contiguous() and uv_t.shape[-1] % 16 == 0 and _on(o_lat, uv_t):
        return checked.uv_heads(o_lat, uv_t)
    return None


def mla_project(cfg, rope, w, x, cos, sin, parts=3):
    """`parts` 3: [q̃, c_kv, k_rope, normed Q-A output]; 1: [q̃, normed Q-A output]; 2: [c_kv, k_rope]."""
    wa = {3: w.qkv_a, 1: w.q_a, 2: w.kv_a}[parts]
    if (not isinstance(wa, PackedLinear) or w.q_a is None or x.dim() != 2 or x.stride(1) != 1
            or (parts & 1 and (not isinstance(w.q_b, PackedLinear) or w.w_uk is None or not w.w_uk.is_contiguous()))
            or w.q_a.shape[0] % 8 or w.kv_a_norm.shape[0] % 16 or not cos.is_contiguous() or not sin.is_contiguous()
            or not _on(x, w.q_a_norm, w.kv_a_norm, cos, sin)):
        return None
    uk, qb = (w.w_uk, w.q_b.packed) if parts & 1 else (_empty(0), _empty(0))
    return checked.mla_project(x, wa.packed, w.q_a_norm, qb, uk, w.kv_a_norm, cos, sin, parts,
                                        len(w.heads), cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.rms_norm_eps,
                                        rope.interleave)


def linear_packed(x, w):
    if x.stride(-1) == 1 and _on(x):
        return checked.linear_packed(x, w.packed)
    return None


def grouped_gemm(x, stack, counts):
    if _on(x):
        return checked.grouped_gemm(x.contiguous(), stack.packed, counts.to(torch.int64).contiguous())
    return None


def moe_experts(x, w, counts, tok, weights, limit):
    if (limit is None and isinstance(w.gate_up, PackedExperts) and isinstance(w.down, PackedExperts)
            and w.down.shape[1] % 8 == 0 and x.is_contiguous() and tok.is_contiguous() and weights.is_contiguous()
            and _on(x, weights)):
        return checked.moe_experts(x, tok, counts.contiguous(), weights, w.gate_up.packed, w.down.packed)
    return None
