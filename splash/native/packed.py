"""Weights stored for SPLASH's CPU GEMMs (splash.native): [N, K] packed as [N / 16, K, 16] (strips of 16 output
columns, input-major), MoE stacks [E, N, K] as [E, N / 16, K, 16]; the plain tensor is not kept. Packed only when
the kernels are on at load and N % 16 == 0, and only weights no layout switch rewrites — MoE experts, dense and
shared MLPs, an untied LM head — plus Q-B, O and [Q-A ; KV-A] (`pack_attention`), which a switch moves packed
(splash.switching.weights_transfer). A packed weight answers `shape`, `dtype` (and `stack[e]`) like the tensor.
"""
from __future__ import annotations

import torch

from splash import native

STRIP = 16


class PackedWeight:
    """A weight [..., N, K] stored as [..., N / STRIP, K, STRIP] (contiguous fp32 on CPU). The packed tensor is checked
    here, where the weight is made, so the kernels' routes (splash.native.ops) compare only `shape` against their
    inputs; `packed` is not reassigned afterwards."""

    def __init__(self, w: torch.Tensor | None, packed: torch.Tensor | None = None):
        if w is not None:
            *lead, N, K = w.shape
            packed = w.view(*lead, N // STRIP, STRIP, K).transpose(-1, -2).contiguous()
        if not (packed.dtype == torch.float32 and packed.is_cpu and packed.dim() >= 3 and packed.is_contiguous()
                and packed.shape[-1] == STRIP):
            raise ValueError(f"a packed weight must be a contiguous float32 CPU tensor [..., N/{STRIP}, K, {STRIP}], "
                             f"got {packed.dtype} {tuple(packed.shape)} on {packed.device}")
        self.packed = packed
        self.shape = torch.Size((*packed.shape[:-3], packed.shape[-3] * STRIP, packed.shape[-2]))
        self.dtype, self.device = packed.dtype, packed.device

    def unpacked(self) -> torch.Tensor:   # a copy
        return self.packed.transpose(-1, -2).reshape(self.shape)


class PackedExperts(PackedWeight):
    def __getitem__(self, e: int) -> torch.Tensor:
        return self.packed[e].transpose(-1, -2).reshape(self.shape[1:])

    def __len__(self) -> int:
        return self.shape[0]


class PackedLinear(PackedWeight):
    @classmethod
    def of_strips(cls, packed: torch.Tensor) -> "PackedLinear":
        """A packed [N / 16, K, 16] tensor (e.g. some strips of another: a view, no copy) as a weight [N, K]."""
        return cls(None, packed)


@native.fast_path("linear_packed")
def packed_linear(x: torch.Tensor, w: PackedLinear) -> torch.Tensor:
    return x @ w.unpacked().to(x.dtype).T   # e.g. the thread count changed since load


def _packable(w: torch.Tensor) -> bool:
    return (isinstance(w, torch.Tensor) and w.dtype == torch.float32 and w.device.type == "cpu"
            and w.shape[-2] % STRIP == 0 and native.enabled())


def pack_linear(w: torch.Tensor):
    return PackedLinear(w) if _packable(w) else w


def pack_attention(w):
    """AttnWeights (plain fp32, CPU, native GEMMs on) -> the same with Q-B, O and [Q-A ; KV-A] packed, where each
    head's Q-B rows are whole strips and Q-A / KV-A split on a strip boundary (Q-A and KV-A then strip views of the
    packed stack); otherwise `w` unchanged. The plain tensors are not kept."""
    from dataclasses import replace
    if w.kv_b is not None or not _packable(w.q_b) or not _packable(w.o) or (w.q_b.shape[0] // len(w.heads)) % STRIP:
        return w
    qkv_a, q_a, kv_a = w.qkv_a, w.q_a, w.kv_a
    if (isinstance(qkv_a, torch.Tensor) and _packable(qkv_a) and q_a is not None and q_a.shape[0] % STRIP == 0
            and q_a.data_ptr() == qkv_a.data_ptr()):
        qkv_a = PackedLinear(qkv_a)
        split = q_a.shape[0] // STRIP
        q_a, kv_a = PackedLinear.of_strips(qkv_a.packed[:split]), PackedLinear.of_strips(qkv_a.packed[split:])
    return replace(w, q_b=PackedLinear(w.q_b), o=PackedLinear(w.o), qkv_a=qkv_a, q_a=q_a, kv_a=kv_a)


def pack_experts(stack: torch.Tensor):
    return PackedExperts(stack) if _packable(stack) else stack
