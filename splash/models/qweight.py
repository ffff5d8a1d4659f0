"""Quantised weights kept in their stored form (scales held in fp32):
- ``fp8``: FP8 E4M3 with one scale per 128×128 block, w = q × s (DeepSeek/GLM ``weight_scale_inv``);
- ``int8``: INT8 with one scale per output row, w = q × s (compressed-tensors ``weight_scale`` [out, 1], symmetric).

A head or FFN shard is a row or column range. An ``fp8`` range need not start on a block boundary (GLM-5.x KV-B:
448 rows per head = 3.5 blocks): it carries every scale block it touches and its offset inside the first, so
``cat_rows``/``cat_cols`` of all ranks' shards give back the original bit for bit. On CPU ``linear`` dequantises per
use into the compute dtype, so a quantised model computes exactly what the engine computes on the dequantised
checkpoint.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

FP8, INT8 = "fp8", "int8"
WEIGHT_QUANTS = (FP8, INT8)
BLOCK = 128
FP8_MAX = 448.0  # largest finite float8_e4m3fn
STORE_DTYPES = {FP8: torch.float8_e4m3fn, INT8: torch.int8}


def owned(t: torch.Tensor) -> torch.Tensor:
    """A contiguous copy with its own storage. `.contiguous()` of a row slice is a view that keeps the whole
    (unsharded) weight alive; a shard must not."""
    return t.clone(memory_format=torch.contiguous_format)


def take_rows(w, r0: int, r1: int):
    """Rows [r0, r1) of a plain or quantised weight, with their own storage (and their scale blocks)."""
    return w.rows(r0, r1) if isinstance(w, QuantWeight) else owned(w[r0:r1])


def take_cols(w, c0: int, c1: int):
    return w.cols(c0, c1) if isinstance(w, QuantWeight) else owned(w[:, c0:c1])


def scale_blocks(start: int, n: int) -> tuple[int, int]:
    """(first block, block count) touched by elements [start, start + n)."""
    return start // BLOCK, -(-(start + n) // BLOCK) - start // BLOCK


@dataclass
class QuantWeight:
    """A 2-D weight [rows, cols] in stored form; ``dtype`` is the compute dtype it dequantises to."""
    data: torch.Tensor    # [rows, cols] float8_e4m3fn (fp8) or int8 (int8)
    scale: torch.Tensor   # fp32; fp8: [row blocks, col blocks] touched by this range; int8: [rows, 1]
    fmt: str
    dtype: torch.dtype = torch.float32
    row_off: int = 0      # fp8: index of data row 0 inside its first scale block
    col_off: int = 0      # fp8: index of data column 0 inside its first scale block

    def __post_init__(self) -> None:
        r, c = self.data.shape
        want = ((scale_blocks(self.row_off, r)[1], scale_blocks(self.col_off, c)[1]) if self.fmt == FP8 else (r, 1))
        if tuple(self.scale.shape) != want or self.data.dtype != STORE_DTYPES[self.fmt]:
            raise ValueError(f"{self.fmt} weight {tuple(self.data.shape)} {self.data.dtype}: scale shape "
                             f"{tuple(self.scale.shape)} != {want}")

    @property
    def shape(self) -> torch.Size:
        return self.data.shape

    def tensors(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.data, self.scale

    def dequant(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The weight in `dtype` (default: the compute dtype): q × s in fp32, then rounded once."""
        s = self.scale
        if self.fmt == FP8:
            r, c = self.data.shape
            s = s.repeat_interleave(BLOCK, 0)[self.row_off:self.row_off + r]
            s = s.repeat_interleave(BLOCK, 1)[:, self.col_off:self.col_off + c]
        return (self.data.float() * s).to(dtype or self.dtype)

    def rows(self, r0: int, r1: int) -> "QuantWeight":
        """Rows [r0, r1) with exactly the scales they need (partial first/last blocks included)."""
        if self.fmt == INT8:
            return QuantWeight(owned(self.data[r0:r1]), owned(self.scale[r0:r1]), INT8, self.dtype)
        b0, nb = scale_blocks(self.row_off + r0, r1 - r0)
        return QuantWeight(owned(self.data[r0:r1]), owned(self.scale[b0:b0 + nb]), FP8, self.dtype,
                           (self.row_off + r0) % BLOCK, self.col_off)

    def cols(self, c0: int, c1: int) -> "QuantWeight":
        """Columns [c0, c1); an int8 column range keeps every row's scale (each output row needs its own)."""
        if self.fmt == INT8:
            return QuantWeight(owned(self.data[:, c0:c1]), owned(self.scale), INT8, self.dtype)
        b0, nb = scale_blocks(self.col_off + c0, c1 - c0)
        return QuantWeight(owned(self.data[:, c0:c1]), owned(self.scale[:, b0:b0 + nb]), FP8,
                           self.dtype, self.row_off, (self.col_off + c0) % BLOCK)


def _merge_scales(parts: list[QuantWeight], dim: int) -> torch.Tensor:
    """FP8 scale grid of consecutive ranges along `dim`; a block two ranges share is the same value in both."""
    off = parts[0].row_off if dim == 0 else parts[0].col_off
    total = sum(p.data.shape[dim] for p in parts)
    other = parts[0].scale.shape[1 - dim]
    n = scale_blocks(off, total)[1]
    out = torch.empty((n, other) if dim == 0 else (other, n), dtype=torch.float32, device=parts[0].scale.device)
    g = off
    for p in parts:
        b0 = g // BLOCK - off // BLOCK
        k = p.scale.shape[dim]
        out.narrow(dim, b0, k).copy_(p.scale)
        g += p.data.shape[dim]
    return out


def cat_rows(parts: list[QuantWeight]) -> QuantWeight:
    """Inverse of splitting a weight into consecutive row ranges (e.g. the head shards of all ranks)."""
    p0 = parts[0]
    data = torch.cat([p.data for p in parts], dim=0)
    scale = torch.cat([p.scale for p in parts], dim=0) if p0.fmt == INT8 else _merge_scales(parts, 0)
    return QuantWeight(data, scale, p0.fmt, p0.dtype, p0.row_off, p0.col_off)


def cat_cols(parts: list[QuantWeight]) -> QuantWeight:
    """Inverse of splitting a weight into consecutive column ranges."""
    p0 = parts[0]
    data = torch.cat([p.data for p in parts], dim=1)
    scale = p0.scale.clone() if p0.fmt == INT8 else _merge_scales(parts, 1)
    return QuantWeight(data, scale, p0.fmt, p0.dtype, p0.row_off, p0.col_off)


class RowStack:
    """Row-wise concatenation [A ; B ; ...] of quantised weights without a copy ([Q-A ; KV-A], [gate ; up])."""

    def __init__(self, parts: list):
        self.parts = parts
        self.dtype = parts[0].dtype

    def dequant(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        dtype = dtype or self.dtype
        return torch.cat([p.to(dtype) if isinstance(p, torch.Tensor) else p.dequant(dtype) for p in self.parts])


class ExpertStack:
    """Per-expert quantised weights with a stacked tensor's indexing and shape [E, out, in]."""

    def __init__(self, experts: list):
        self.experts = experts
        self.dtype = experts[0].dtype

    def __getitem__(self, e: int):
        return self.experts[e]

    @property
    def shape(self) -> torch.Size:
        return torch.Size((len(self.experts), *self.experts[0].shape))


def is_quantized(w) -> bool:
    return isinstance(w, (QuantWeight, RowStack, ExpertStack))


# ---- quantisers (``--quantization`` at load, and tests) ---------------------------------------------------
def quantize_fp8_blocks(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w [out, in] -> (float8_e4m3fn values, fp32 scale [ceil(out/128), ceil(in/128)]): scale = block amax / 448."""
    out, inn = w.shape
    bo, bi = -(-out // BLOCK), -(-inn // BLOCK)
    wf = w.float()
    padded = torch.zeros(bo * BLOCK, bi * BLOCK, device=w.device)
    padded[:out, :inn] = wf.abs()
    amax = padded.view(bo, BLOCK, bi, BLOCK).amax(dim=(1, 3))
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    s = scale.repeat_interleave(BLOCK, 0)[:out].repeat_interleave(BLOCK, 1)[:, :inn]
    return (wf / s).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn), scale


def quantize_int8_channel(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w [out, in] -> (int8 values, fp32 scale [out, 1]): symmetric, scale = row amax / 127, round to nearest."""
    wf = w.float()
    amax = wf.abs().amax(dim=1, keepdim=True)
    scale = torch.where(amax > 0, amax / 127.0, torch.ones_like(amax))
    return torch.round(wf / scale).clamp(-127, 127).to(torch.int8), scale


def quantize(w: torch.Tensor, fmt: str, dtype: torch.dtype) -> QuantWeight:
    q, s = quantize_fp8_blocks(w) if fmt == FP8 else quantize_int8_channel(w)
    return QuantWeight(q, s, fmt, dtype)


# KDA's gate and beta projections: `--quantization` keeps them in the compute dtype, as quantised hybrid checkpoints
# do (cf. Qwen3-Next FP8's modules_to_not_convert); a checkpoint storing them quantised loads all the same.
KEPT_DENSE = ("f_a_proj", "f_b_proj", "g_a_proj", "g_b_proj", "b_proj")


def quantized_at_load(name: str) -> bool:
    return is_linear_weight(name) and name.rsplit(".", 2)[-2] not in KEPT_DENSE


def is_linear_weight(name: str) -> bool:
    """Weights of linear layers that a quantised checkpoint stores quantised (attention, DSA indexer and FFN/MoE
    projections; not embeddings, LM head, norms or the MoE router)."""
    return (name.endswith(("_proj.weight", "_proj_with_mqa.weight", "indexer.wq_b.weight", "indexer.wk.weight"))
            and not name.startswith("lm_head"))
