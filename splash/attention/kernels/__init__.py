"""The MLA attention-kernel interface every layout uses, and the implementations behind it (chosen by name).

    kernel = make_kernel(name, softmax_scale)       # "torch" (CPU reference), "triton" (our Triton kernels),
                                                    # "flashinfer" (CUDA) or "aiter" (ROCm): backends/cuda, hip
    kernel.plan(metadata)                           # once per step (splash.attention.metadata.AttnMetadata)
    o_latent, lse = kernel.run(layer, q_latent, q_rope, cache)   # per layer

`q_latent` [N, H, d_c] and `q_rope` [N, H, d_r] are the absorbed queries of the metadata's rows (any number of
heads H; d_r = 0 for a NoPE model such as GLM-5.3-Flash, whose pool stores a zero-width rope key); `cache` is
the rank's `PagedLatentCache`, read in place through the page table in any of its formats (fp32, bf16, fp8_e4m3
and int8 with per-token per-128-group scales, dequantised inside the kernel). Returns the latent output
õ [N, H, d_c] fp32 and the natural-log LSE [N, H] fp32 (−inf, õ = 0 for a row that sees no key here), so CP's
and DOP's merges need not know the kernel. Prefill chunks (causal within the chunk) and decode rows go in one
call. A kernel whose native LSE is base 2 converts inside its wrapper. A DSA layer whose rows have a top-k
selection (`meta.sparse[layer]`: DeepSeek-V3.2 / GLM-5.x by splash.attention.dsa, GLM-5.3-Flash's KPool pools
by splash.attention.kpool) attends only the selected slots, in every kernel.

The vendor kernels (flashinfer, aiter) live with their backends (backends/cuda, backends/hip) and are imported
only when named; where a layer or step is outside their limits they run our Triton kernel instead
(splash.attention.kernels.external lists the conversions at the boundary and the fallbacks).
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
    """The device's arch by name: "sm_90" (a CUDA device of compute capability 9.0), "gfx942" (a ROCm device's
    gcnArchName), "cpu" off a GPU."""
    device = torch.device(device)
    if device.type != "cuda":
        return "cpu"
    if getattr(torch.version, "hip", None):
        return torch.cuda.get_device_properties(device).gcnArchName.split(":")[0]
    major, minor = torch.cuda.get_device_capability(device)
    return f"sm_{major}{minor}"


def kv_rope_fp8(name: str, device: str | torch.device) -> bool:
    """rope_fp8_pool for the device itself."""
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
