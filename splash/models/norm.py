"""RMSNorm, the model's normalisation (every layer's input / post-attention norms, MLA's Q-A and KV-A norms)."""
from __future__ import annotations

import torch

from splash.native import fast_path


@fast_path("rms_norm")
def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """w * x / sqrt(mean(x²) + eps), statistics in fp32 (transformers' DeepseekV3RMSNorm, the same ops)."""
    if x.dtype == torch.float32:   # no casts; the same products as below, two of them in place
        return (x * x.pow(2).mean(-1, keepdim=True).add_(eps).rsqrt_()).mul_(w)
    xf = x.float()
    return w * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
