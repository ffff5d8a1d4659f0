"""Row-wise fp32 ops on SPLASH's CPU kernels, each returning None when the kernel does not apply (not enabled, not
fp32, a layout it does not take) so the caller runs its torch expression instead."""
from __future__ import annotations

import torch

from splash import native
from splash.native.packed import PackedLinear, PackedWeight

CPU = torch.device("cpu")


def _f32(*shape: int) -> torch.Tensor:
    """An fp32 CPU output buffer (device and dtype explicit: a caller may have set other defaults)."""
    return torch.empty(*shape, dtype=torch.float32, device=CPU)


def _i64(*shape: int) -> torch.Tensor:
    return torch.empty(*shape, dtype=torch.int64, device=CPU)


def _ok(x: torch.Tensor, *more: torch.Tensor) -> bool:
    """fp32 CPU tensors (checked on the first; the others must match it) and the kernels on."""
    return (x.dtype == torch.float32 and x.device.type == "cpu" and all(t.dtype == x.dtype for t in more)
            and native.enabled())


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor | None:
    """x [n, d] (rows may be strided), w [d] -> RMSNorm, contiguous."""
    d = x.shape[-1]
    if x.dim() != 2 or d % 8 or x.stride(1) != 1 or not w.is_contiguous() or not _ok(x, w):
        return None
    y = torch.empty(x.shape[0], d, dtype=torch.float32, device=x.device)
    native.lib().rms_norm(x.data_ptr(), x.shape[0], d, x.stride(0), w.data_ptr(), eps, y.data_ptr())
    return y


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleave: bool) -> torch.Tensor | None:
    """x [n, dim] or [n, H, dim] (last dim contiguous), cos/sin [n, dim / 2] -> rotated, contiguous."""
    if (x.dim() not in (2, 3) or x.stride(-1) != 1 or x.shape[-1] % 2 or not cos.is_contiguous()
            or not sin.is_contiguous() or cos.shape != (x.shape[0], x.shape[-1] // 2) or not _ok(x, cos, sin)):
        return None
    n, dim = x.shape[0], x.shape[-1]
    H, sh = (x.shape[1], x.stride(1)) if x.dim() == 3 else (1, 0)
    y = torch.empty(x.shape, dtype=torch.float32, device=x.device)
    native.lib().rope(x.data_ptr(), n, H, x.stride(0), sh, dim, int(interleave), cos.data_ptr(), sin.data_ptr(),
                      y.data_ptr())
    return y


def swiglu(h: torch.Tensor, inter: int) -> torch.Tensor | None:
    """h [n, 2 * inter] = [gate | up] -> silu(gate) * up [n, inter]."""
    if h.dim() != 2 or inter % 8 or h.shape[1] != 2 * inter or h.stride(1) != 1 or not _ok(h):
        return None
    y = torch.empty(h.shape[0], inter, dtype=torch.float32, device=h.device)
    native.lib().swiglu(h.data_ptr(), h.shape[0], inter, h.stride(0), y.data_ptr())
    return y


def moe_route(score: torch.Tensor, bias: torch.Tensor, groups: int, topk_group: int, k: int, norm: bool,
              scale: float) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Sigmoid router scores [n, E] and correction bias [E] -> DeepSeek-V3's (expert ids [n, k], weights [n, k])."""
    if (score.dim() != 2 or not score.is_contiguous() or not bias.is_contiguous() or score.shape[1] > 1024
            or not _ok(score, bias)):
        return None
    n = score.shape[0]
    idx, wt = _i64(n, k), _f32(n, k)
    rc = native.lib().moe_route(score.data_ptr(), bias.data_ptr(), n, score.shape[1], groups, topk_group, k,
                                int(norm), scale, idx.data_ptr(), wt.data_ptr())
    return (idx, wt) if rc == 0 else None


def moe_sort(idx: torch.Tensor, wt: torch.Tensor, E: int) -> tuple[torch.Tensor, ...] | None:
    """Routing (ids, weights [n, k]) -> the grouped GEMM's order: (rows per expert [E], token of each sorted row,
    its weight) — the rows in expert order, tokens ascending within an expert (a stable argsort's order)."""
    if (idx.dtype != torch.int64 or not idx.is_contiguous() or not wt.is_contiguous() or wt.shape != idx.shape
            or not _ok(wt)):
        return None
    m = idx.numel()
    counts, tok, ws = _i64(E), _i64(m), _f32(m)
    rc = native.lib().moe_sort(idx.data_ptr(), wt.data_ptr(), idx.shape[0], idx.shape[1], E, counts.data_ptr(),
                               tok.data_ptr(), ws.data_ptr())
    return (counts, tok, ws) if rc == 0 else None


def moe_combine(ys: torch.Tensor, tok: torch.Tensor, w: torch.Tensor, n: int) -> torch.Tensor | None:
    """Expert outputs ys [m, d] of sorted rows -> [n, d]: row r the sum of w[i] * ys[i] over the rows i of token r,
    in row order (mul_ then index_add_ into zeros, the same products and sums)."""
    if (ys.dim() != 2 or not ys.is_contiguous() or ys.shape[1] % 8 or tok.dtype != torch.int64
            or not tok.is_contiguous() or not w.is_contiguous() or not _ok(ys, w)):
        return None
    out = _f32(n, ys.shape[1])
    native.lib().moe_combine(ys.data_ptr(), ys.shape[0], ys.shape[1], tok.data_ptr(), w.data_ptr(), n, out.data_ptr())
    return out


def absorb_rope(q: torch.Tensor, w_uk: torch.Tensor, d_nope: int, cos: torch.Tensor, sin: torch.Tensor,
                interleave: bool) -> torch.Tensor | None:
    """Q-B's output q [n, H, qk] (= [q_nope ; q_rope] per head) and W_UK [H, d_nope, d_c] -> the absorbed queries
    q̃ [n, H, d_c + d_r] = [q_nope · W_UK ; RoPE(q_rope)] (cos/sin [n, d_r / 2]), in one call."""
    if q.dim() != 3 or w_uk.dim() != 3:
        return None
    n, H, qk = q.shape
    d_c, d_r = w_uk.shape[2], qk - d_nope
    if (q.stride(2) != 1 or q.stride(1) != qk or not w_uk.is_contiguous() or tuple(w_uk.shape[:2]) != (H, d_nope)
            or d_c % 16 or d_r % 2 or not cos.is_contiguous() or not sin.is_contiguous()
            or tuple(cos.shape) != (n, d_r // 2) or tuple(sin.shape) != (n, d_r // 2) or not _ok(q, w_uk, cos, sin)):
        return None
    out = _f32(n, H, d_c + d_r)
    native.lib().absorb_rope(q.data_ptr(), n, H, q.stride(0), qk, d_nope, w_uk.data_ptr(), d_c, d_r, int(interleave),
                             cos.data_ptr(), sin.data_ptr(), out.data_ptr())
    return out


def uv_heads(o_lat: torch.Tensor, uv_t: torch.Tensor) -> torch.Tensor | None:
    """õ [n, H, d_c] and W_UV transposed [H, d_c, d_v] -> O's input [n, H * d_v] (head h: õ_h @ W_UV_hᵀ)."""
    if o_lat.dim() != 3 or uv_t.dim() != 3:
        return None
    n, H, d_c = o_lat.shape
    d_v = uv_t.shape[2]
    if (not o_lat.is_contiguous() or not uv_t.is_contiguous() or tuple(uv_t.shape[:2]) != (H, d_c) or d_v % 16
            or not _ok(o_lat, uv_t)):
        return None
    out = _f32(n, H * d_v)
    native.lib().uv_heads(o_lat.data_ptr(), n, H, d_c, uv_t.data_ptr(), d_v, out.data_ptr())
    return out


def mla_project(x: torch.Tensor, w, d_nope: int, eps: float, cos: torch.Tensor, sin: torch.Tensor,
                interleave: bool, parts: int = 3) -> tuple[torch.Tensor, ...] | None:
    """x [n, hidden] and AttnWeights whose projections are packed -> `parts` 3: (q̃ [n, H, d_c + d_r], c_kv [n, d_c],
    k_rope [n, d_r], normed Q-A output [n, q_lora]) — `splash.attention.mla.query_and_latent`'s steps in one call;
    1: (q̃, normed Q-A output) — `latent_query`'s; 2: (c_kv, k_rope) — `new_latent_kv`'s."""
    wa = {3: w.qkv_a, 1: w.q_a, 2: w.kv_a}[parts]
    if (not isinstance(wa, PackedLinear) or not isinstance(w.kv_a, PackedLinear) or w.q_a is None
            or (parts & 1 and (not isinstance(w.q_b, PackedLinear) or w.w_uk is None or not w.w_uk.is_contiguous()))
            or x.dim() != 2 or x.stride(1) != 1):
        return None
    n, H = x.shape[0], len(w.heads)
    q_lora, d_c = w.q_a.shape[0], w.kv_a_norm.shape[0]
    d_r, qk = w.kv_a.shape[0] - d_c, w.q_b.shape[0] // H
    if (parts & 1 and (tuple(w.w_uk.shape) != (H, d_nope, d_c) or qk != d_nope + d_r)) or d_c % 16 or q_lora % 8 \
            or d_r % 2 or tuple(cos.shape) != (n, d_r // 2) or not cos.is_contiguous() or not sin.is_contiguous() \
            or not _ok(x, w.q_a_norm, w.kv_a_norm, cos, sin):
        return None
    e = _f32(0)
    qa, q = (_f32(n, q_lora), _f32(n, H, d_c + d_r)) if parts & 1 else (e, e)
    c, kpe = (_f32(n, d_c), _f32(n, d_r)) if parts & 2 else (e, e)
    uk = w.w_uk.data_ptr() if parts & 1 else 0
    rc = native.lib().mla_project(x.data_ptr(), n, x.shape[1], x.stride(0), parts, wa.packed.data_ptr(), q_lora,
                                  w.q_a_norm.data_ptr(), w.q_b.packed.data_ptr() if parts & 1 else 0, H, qk, d_nope,
                                  uk, d_c, d_r, w.kv_a_norm.data_ptr(), eps, int(interleave), cos.data_ptr(),
                                  sin.data_ptr(), qa.data_ptr(), q.data_ptr(), c.data_ptr(), kpe.data_ptr())
    if rc != 0:
        return None
    return {3: (q, c, kpe, qa), 1: (q, qa), 2: (c, kpe)}[parts]


def _packed_fp32(*ws) -> bool:
    return all(isinstance(w, PackedWeight) and w.dtype == torch.float32 and w.device.type == "cpu" for w in ws)


def mlp_packed(x: torch.Tensor, gate_up, down) -> torch.Tensor | None:
    """x [M, K] -> swiglu(x @ [gate ; up]ᵀ) @ downᵀ, both weights packed (splash.native.packed), in one call."""
    if x.dim() != 2 or x.stride(1) != 1 or not _packed_fp32(gate_up, down) or not _ok(x):
        return None
    (I2, K), (N, I) = gate_up.shape, down.shape
    if K != x.shape[1] or I2 != 2 * I or I % 8:
        return None
    y = _f32(x.shape[0], N)
    rc = native.lib().mlp_packed(x.data_ptr(), x.shape[0], K, x.stride(0), gate_up.packed.data_ptr(), I,
                                 down.packed.data_ptr(), N, y.data_ptr())
    return y if rc == 0 else None


def moe_experts(x: torch.Tensor, tok: torch.Tensor, counts: torch.Tensor, w: torch.Tensor, gate_up,
                down) -> torch.Tensor | None:
    """The routed experts in one call: rows sorted by expert (counts [E]; token tok[i] and weight w[i] of sorted
    row i) through each expert's packed SwiGLU MLP, w[i] times each result summed into its token's row [n, N]."""
    if (x.dim() != 2 or not x.is_contiguous() or not _packed_fp32(gate_up, down) or tok.dtype != torch.int64
            or counts.dtype != torch.int64 or not tok.is_contiguous() or not counts.is_contiguous()
            or not w.is_contiguous() or not _ok(x, w)):
        return None
    (E, I2, K), (_, N, I) = gate_up.shape, down.shape
    if K != x.shape[1] or I2 != 2 * I or I % 8 or N % 8 or counts.numel() != E:
        return None
    out = _f32(x.shape[0], N)
    rc = native.lib().moe_experts(x.data_ptr(), x.shape[0], K, tok.data_ptr(), counts.data_ptr(), w.data_ptr(), E,
                                  gate_up.packed.data_ptr(), I, down.packed.data_ptr(), N, out.data_ptr())
    return out if rc == 0 else None
