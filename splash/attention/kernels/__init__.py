"""The MLA attention-kernel interface every layout uses, and its implementations, chosen by name: "torch" (CPU
reference), "triton" (ours), "flashinfer" (CUDA) or "aiter" (ROCm), the vendor ones living with their backends.

    kernel = make_kernel(name, softmax_scale)
    kernel.plan(metadata)                                        # once per step (splash.attention.metadata)
    o_latent, lse = kernel.run(layer, q_latent, q_rope, cache)   # per layer

`q_latent` [N, H, d_c] / `q_rope` [N, H, d_r] (d_r = 0 for NoPE) are the absorbed queries of the metadata's rows
(prefill chunks and decode rows in one call); `cache` is the rank's `PagedLatentCache` in any of its formats, read
in place through the page table. Returns õ [N, H, d_c] and the natural-log LSE [N, H], both fp32 (−inf and õ = 0
for a row that sees no key here), so CP's and DOP's merges need not know the kernel. A layer with a top-k
selection (`meta.sparse[layer]`: splash.attention.dsa / kpool) attends only the selected slots, in every kernel.
"""
from __future__ import annotations

from typing import Protocol

import torch

# which pools keep an fp8 layer's rope key in e4m3 is decided, torch-free, where the memory model counts its bytes
from splash.layouts.memory import rope_fp8_pool

KERNELS = ("torch", "triton", "flashinfer", "aiter")


class AttentionKernel(Protocol):
    name: str

    def plan(self, meta) -> None: ...

    def run(self, layer: int, q_latent: torch.Tensor, q_rope: torch.Tensor,
            cache) -> tuple[torch.Tensor, torch.Tensor]: ...


def device_arch(device: str | torch.device) -> str:
    """The device's arch by name: "sm_90", "gfx942" (a ROCm device's gcnArchName), "cpu" off a GPU."""
    device = torch.device(device)
    if device.type != "cuda":
        return "cpu"
    if getattr(torch.version, "hip", None):
        return torch.cuda.get_device_properties(device).gcnArchName.split(":")[0]
    major, minor = torch.cuda.get_device_capability(device)
    return f"sm_{major}{minor}"


def kv_rope_fp8(name: str, device: str | torch.device) -> bool:
    return rope_fp8_pool(name, device_arch(device))


def make_kernel(name: str, softmax_scale: float) -> AttentionKernel:
    if name == "torch":
        from splash.attention.kernels.torch_mla import TorchMLAKernel
        return TorchMLAKernel(softmax_scale)
    if name == "triton":
        from splash.attention.kernels.triton_mla import TritonMLAKernel
        return TritonMLAKernel(softmax_scale)
    if name in ("flashinfer", "aiter"):   # names the missing packages and how to install them
        from backends import check_attention
        check_attention("cuda" if name == "flashinfer" else "hip", name)
    if name == "flashinfer":
        from backends.cuda.flashinfer_mla import FlashInferMLAKernel
        return FlashInferMLAKernel(softmax_scale)
    if name == "aiter":
        from backends.hip.aiter_mla import AiterMLAKernel
        return AiterMLAKernel(softmax_scale)
    raise ValueError(f"attention_backend {name!r} is not available here (built: {', '.join(KERNELS)})")
