"""`linear(x, w)` = x @ wᵀ for the dense projections of the CPU reference backend, in one place.

`w` is a plain tensor in the compute dtype, or a quantised weight in stored form (splash.models.qweight:
FP8 block-scaled, INT8 per-channel, or a row stack of them), which is dequantised per use into the compute dtype
— on CPU no FP8/INT8 GEMM is used, so the result is exactly the dequantised reference's.

A oneDNN path with prepacked weights was measured (1.3–2× faster per projection in isolation on this AMD host,
≈ 3% per decode step, within noise) and left out: it keeps a second, packed copy of every weight, which the
memory model and the per-layout KV capacity do not budget for.

bf16 weights and activations on a CPU without bf16 units (`bf16_units`: no AVX512-BF16 / AMX, e.g. this AVX2
host) are multiplied in fp32 (operands upcast per use, result rounded to bf16), like the quantised weights'
dequantise-per-use: no second copy of any weight is kept."""
from __future__ import annotations

import functools

import torch

from splash import native
from splash.native.packed import PackedExperts, PackedLinear


@functools.cache
def bf16_units() -> bool:
    """The CPU has bf16 GEMM units (AVX512-BF16 or AMX). Without them (AVX2 hosts) torch's bf16 GEMMs measured
    3-7x slower than upcasting both operands and multiplying in fp32, so bf16 products are computed that way
    (bf16 storage and results, fp32 products: at least as accurate as a bf16 GEMM)."""
    cpu = torch.cpu
    return bool(getattr(cpu, "_is_avx512_bf16_supported", lambda: False)()
                or getattr(cpu, "_is_amx_tile_supported", lambda: False)())


def _mm(x: torch.Tensor, wt: torch.Tensor) -> torch.Tensor:
    if x.dtype == torch.bfloat16 and x.device.type == "cpu" and not bf16_units():
        return (x.float() @ wt.float()).to(torch.bfloat16)
    return x @ wt


def bmm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """torch.bmm, with bf16 operands multiplied in fp32 on a CPU without bf16 units (see `bf16_units`)."""
    if a.dtype == torch.bfloat16 and a.device.type == "cpu" and not bf16_units():
        return torch.bmm(a.float(), b.float()).to(torch.bfloat16)
    return torch.bmm(a, b)


def dense(w) -> torch.Tensor:
    """A weight as a tensor in the compute dtype (a quantised one dequantised for this use)."""
    return w if isinstance(w, torch.Tensor) else w.dequant()


def linear(x: torch.Tensor, w) -> torch.Tensor:
    """x [n, in] @ w [out, in]ᵀ -> [n, out]."""
    if isinstance(w, torch.Tensor):
        return _mm(x, w.T)
    if isinstance(w, PackedLinear):
        return w(x)
    return _mm(x, w.dequant().T)


def expert_linear(x: torch.Tensor, stack, e: int) -> torch.Tensor:
    """x @ stack[e]ᵀ for one expert of a stacked weight [E, out, in]."""
    if isinstance(stack, torch.Tensor):
        return _mm(x, stack[e].T)
    return _mm(x, stack[e].dequant().T)


@native.fast_path("grouped_gemm")
def grouped_packed(x: torch.Tensor, stack: PackedExperts, counts: torch.Tensor) -> torch.Tensor:
    """Rows of `x` grouped by expert (counts[e] rows each) @ each expert's weightᵀ -> [n, N]: SPLASH's CPU grouped
    GEMM on the packed stack where it runs, else (e.g. the thread count changed since load) the plain stack's
    GEMMs, unpacked per call."""
    return grouped_linear(x, stack.unpacked().to(x.dtype), counts)


def grouped_linear(x: torch.Tensor, stack, counts: torch.Tensor) -> torch.Tensor:
    """Rows of `x` grouped by expert (the first counts[0] rows for expert 0, the next counts[1] for expert 1, ...)
    -> each group @ stack[e]ᵀ, [n, out], experts without rows skipped.

    A packed stack (splash.native.packed) runs SPLASH's CPU grouped GEMM. A plain stack on CPU goes through one
    `torch._grouped_mm` call (one C++ loop of the same GEMMs: results identical to per-expert matmuls, without a
    Python call, slice and transpose per expert). Quantised stacks (dequantised per used expert), bf16 on a CPU
    without bf16 units (upcast per used expert, as `_mm` does) and other devices loop over the experts that have
    rows."""
    if isinstance(stack, PackedExperts):
        return grouped_packed(x, stack, counts)
    upcast = x.dtype == torch.bfloat16 and not bf16_units()
    if isinstance(stack, torch.Tensor) and x.device.type == "cpu" and not upcast and hasattr(torch, "_grouped_mm"):
        return torch._grouped_mm(x, stack.transpose(1, 2), offs=counts.cumsum(0).to(torch.int32))
    out, start = [], 0
    for e, c in enumerate(counts.tolist()):
        if c:
            out.append(expert_linear(x[start:start + c], stack, e))
            start += c
    return torch.cat(out) if out else x.new_zeros(0, stack.shape[1])
