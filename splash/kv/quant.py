"""KV quantisation: per-token, per-128-element-group scales for the latent; rope kept 16-bit (or fp8 at one fixed
per-tensor scale in a `rope_fp8` pool, for FlashInfer's FP8 MLA on SM90).

Why per token (not per block): decode appends one token at a time, so a per-block scale would either be fixed
by the block's first token or force requantising the block on every append. Per-token scales make every append
independent and let a switch move a block's bytes and scales verbatim (reuse is exact). This matches FlashMLA's
FP8 KV layout (512 fp8 latent + 4 fp32 scales + 64 bf16 rope per token).
"""
from __future__ import annotations

import torch

from splash.layouts.memory import KV_DTYPES  # noqa: F401 — re-exported: the one list of KV dtypes
GROUP = 128
_QMAX = {"fp8_e4m3": 448.0, "int8": 127.0}


def is_quantized(kv_dtype: str) -> bool:
    return kv_dtype in _QMAX


_STORAGE = {"float32": (torch.float32, torch.float32), "bfloat16": (torch.bfloat16, torch.bfloat16),
            "fp8_e4m3": (torch.float8_e4m3fn, torch.bfloat16), "int8": (torch.int8, torch.bfloat16)}


def storage_dtypes(kv_dtype: str) -> tuple[torch.dtype, torch.dtype]:
    """(latent storage dtype, rope storage dtype)."""
    if kv_dtype not in _STORAGE:
        raise ValueError(f"kv_cache_dtype {kv_dtype!r} is not one of {', '.join(KV_DTYPES)}")
    return _STORAGE[kv_dtype]


# An fp8 rope key (`rope_fp8` pools: FlashInfer's FP8 MLA reads the rope cache in fp8 with one per-tensor scale,
# `kpe_scale`) is stored as k_rope / ROPE_FP8_SCALE in e4m3, clamped to ±448. One fixed scale needs no host read
# per step; rope keys sit well inside e4m3's normal range (2^-6 … 448) where its relative rounding (2^-4) equals
# that of the per-token-scaled fp8 latent, and a smaller value's absolute error (≤ 2^-10) is below the latent's.
ROPE_FP8_SCALE = 1.0
ROPE_FP8 = torch.float8_e4m3fn


def quantize_rope(k_pe: torch.Tensor) -> torch.Tensor:
    """Rope keys [..., d_r] float -> e4m3 at ROPE_FP8_SCALE (saturating at ±448)."""
    return (k_pe.float() / ROPE_FP8_SCALE).clamp(-448.0, 448.0).to(ROPE_FP8)


def dequantize_rope(kpe: torch.Tensor) -> torch.Tensor:
    """Stored rope keys [..., d_r] (fp8 at ROPE_FP8_SCALE, or bf16 / fp32) -> fp32."""
    return kpe.float() * ROPE_FP8_SCALE if kpe.dtype == ROPE_FP8 else kpe.float()


def num_groups(dim: int) -> int:
    return -(-dim // GROUP)


def quantize(x: torch.Tensor, kv_dtype: str) -> tuple[torch.Tensor, torch.Tensor]:
    """x [n, d] float -> (q [n, d] storage dtype, scales [n, groups] fp32)."""
    n, d = x.shape
    g = num_groups(d)
    pad = g * GROUP - d
    xf = torch.nn.functional.pad(x.float(), (0, pad)).view(n, g, GROUP)
    amax = xf.abs().amax(dim=-1).clamp_min(1e-12)
    scale = amax / _QMAX[kv_dtype]
    y = xf / scale[..., None]
    if kv_dtype == "int8":
        q = y.round().clamp(-127, 127).to(torch.int8)
    else:
        q = y.clamp(-448.0, 448.0).to(torch.float8_e4m3fn)
    return q.view(n, g * GROUP)[:, :d].contiguous(), scale


def dequantize(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """q [..., d], scale [..., groups] -> fp32 [..., d]."""
    d = q.shape[-1]
    g = scale.shape[-1]
    pad = g * GROUP - d
    qf = torch.nn.functional.pad(q.float(), (0, pad)).view(*q.shape[:-1], g, GROUP)
    return (qf * scale[..., None]).view(*q.shape[:-1], g * GROUP)[..., :d]
