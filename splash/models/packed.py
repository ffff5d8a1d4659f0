"""MoE expert stacks stored for SPLASH's CPU grouped GEMM (splash.native): [E, N, K] weights packed as
[E, N / 16, K, 16] — strips of 16 output columns, input-major — in the same memory as the plain stack.

`pack_experts` packs a plain fp32 CPU stack when the native kernels are in use at load time (one intra-op thread)
and its output width is a multiple of 16; otherwise it returns the stack unchanged. A packed stack still answers
`shape`, `dtype` and `stack[e]` (that expert's [N, K] weight, unpacked) like the tensor it replaces.
"""
from __future__ import annotations

import torch

from splash import native

STRIP = 16


class PackedExperts:
    def __init__(self, packed: torch.Tensor):
        self.packed = packed                    # [E, N / STRIP, K, STRIP], contiguous
        E, S, K, _ = packed.shape
        self.shape = torch.Size((E, S * STRIP, K))
        self.dtype, self.device = packed.dtype, packed.device

    def __getitem__(self, e: int) -> torch.Tensor:
        p = self.packed[e]
        return p.transpose(1, 2).reshape(self.shape[1], self.shape[2])

    def __len__(self) -> int:
        return self.shape[0]

    def unpacked(self) -> torch.Tensor:
        """The plain [E, N, K] stack (a copy)."""
        return self.packed.transpose(2, 3).reshape(self.shape)


def pack_experts(stack: torch.Tensor):
    """[E, N, K] -> PackedExperts when the native grouped GEMM will run it, else `stack` itself."""
    E, N, K = stack.shape
    if stack.dtype != torch.float32 or stack.device.type != "cpu" or N % STRIP or not native.enabled():
        return stack
    return PackedExperts(stack.view(E, N // STRIP, STRIP, K).transpose(2, 3).contiguous())


def grouped_packed(x: torch.Tensor, stack: PackedExperts, counts: torch.Tensor) -> torch.Tensor:
    """Rows of `x` grouped by expert (counts[e] rows each) @ each expert's weightᵀ -> [n, N]."""
    E, N, K = stack.shape
    x = x.contiguous()
    if x.dtype != torch.float32 or not native.enabled():   # threads changed since load: the plain stack, per call
        from splash.models.linear import grouped_linear
        return grouped_linear(x, stack.unpacked().to(x.dtype), counts)
    counts = counts.to(torch.int64).contiguous()
    y = torch.empty(x.shape[0], N, dtype=torch.float32)
    native.lib().grouped_gemm(x.data_ptr(), K, counts.data_ptr(), E, stack.packed.data_ptr(), N, y.data_ptr())
    return y
