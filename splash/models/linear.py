"""`linear(x, w)` = x @ wᵀ for the dense projections of the CPU reference backend, in one place.

`w` is a plain tensor in the compute dtype, or a quantised weight in stored form (splash.models.qweight:
FP8 block-scaled, INT8 per-channel, or a row stack of them), which is dequantised per use into the compute dtype
— on CPU no FP8/INT8 GEMM is used, so the result is exactly the dequantised reference's.

A oneDNN path with prepacked weights was measured (1.3–2× faster per projection in isolation on this AMD host,
≈ 3% per decode step, within noise) and left out: it keeps a second, packed copy of every weight, which the
memory model and the per-layout KV capacity do not budget for."""
from __future__ import annotations

import torch


def dense(w) -> torch.Tensor:
    """A weight as a tensor in the compute dtype (a quantised one dequantised for this use)."""
    return w if isinstance(w, torch.Tensor) else w.dequant()


def linear(x: torch.Tensor, w) -> torch.Tensor:
    """x [n, in] @ w [out, in]ᵀ -> [n, out]."""
    if isinstance(w, torch.Tensor):
        return x @ w.T
    return x @ w.dequant().T


def expert_linear(x: torch.Tensor, stack, e: int) -> torch.Tensor:
    """x @ stack[e]ᵀ for one expert of a stacked weight [E, out, in]."""
    if isinstance(stack, torch.Tensor):
        return x @ stack[e].T
    return x @ stack[e].dequant().T
