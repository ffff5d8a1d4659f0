"""`linear(x, w)` = x @ wᵀ for the dense projections of the CPU reference backend, in one place.

`w` is a plain tensor in the compute dtype, a packed weight (splash.native.packed), or a quantised weight in stored
form (splash.models.qweight), dequantised per use: on CPU no FP8/INT8 GEMM runs, so the result is exactly the
dequantised reference's. On a CPU without bf16 units, bf16 operands are multiplied in fp32 (`bf16_units`). Neither
keeps a second copy of any weight (the memory model does not budget for one; see docs/benchmarks.md for oneDNN).
"""
from __future__ import annotations

import functools

import torch

from splash import native
from splash.native.packed import PackedExperts, PackedLinear, packed_linear


@functools.cache
def bf16_units() -> bool:
    """The CPU has bf16 GEMM units (AVX512-BF16 or AMX). Without them torch's bf16 GEMMs are 3-7x slower than
    upcasting both operands to fp32 (bf16 results, at least as accurate), so bf16 products are computed that way."""
    cpu = torch.cpu
    return bool(getattr(cpu, "_is_avx512_bf16_supported", lambda: False)()
                or getattr(cpu, "_is_amx_tile_supported", lambda: False)())


def matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a @ b (2-D, or batched 3-D as torch.bmm), with bf16 operands multiplied in fp32 on a CPU without bf16 units
    (see `bf16_units`)."""
    if a.dtype == torch.bfloat16 and a.device.type == "cpu" and not bf16_units():
        return (a.float() @ b.float()).to(torch.bfloat16)
    return a @ b


def linear(x: torch.Tensor, w) -> torch.Tensor:
    """x [n, in] @ w [out, in]ᵀ -> [n, out]."""
    if isinstance(w, torch.Tensor):
        return matmul(x, w.T)
    if isinstance(w, PackedLinear):
        return packed_linear(x, w)
    return matmul(x, w.dequant().T)


@native.fast_path("grouped_gemm")
def grouped_packed(x: torch.Tensor, stack: PackedExperts, counts: torch.Tensor) -> torch.Tensor:
    """SPLASH's grouped GEMM on a packed stack, else (the thread count changed since load) unpacked per call."""
    return grouped_linear(x, stack.unpacked().to(x.dtype), counts)


def grouped_linear(x: torch.Tensor, stack, counts: torch.Tensor) -> torch.Tensor:
    """Rows of `x` grouped by expert (counts[e] rows each, in expert order) -> each group @ stack[e]ᵀ, [n, out].
    A plain CPU stack goes through one `torch._grouped_mm` (the same GEMMs, without a Python call per expert);
    quantised stacks, bf16 without bf16 units and other devices loop over the experts that have rows."""
    if isinstance(stack, PackedExperts):
        return grouped_packed(x, stack, counts)
    upcast = x.dtype == torch.bfloat16 and not bf16_units()
    if isinstance(stack, torch.Tensor) and x.device.type == "cpu" and not upcast and hasattr(torch, "_grouped_mm"):
        return torch._grouped_mm(x, stack.transpose(1, 2), offs=counts.cumsum(0).to(torch.int32))
    out, start = [], 0
    for e, c in enumerate(counts.tolist()):
        if c:
            out.append(linear(x[start:start + c], stack[e]))   # a tensor, or a QuantWeight
            start += c
    return torch.cat(out) if out else x.new_zeros(0, stack.shape[1])
