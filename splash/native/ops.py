"""Row-wise fp32 ops on SPLASH's CPU kernels, each returning None when the kernel does not apply (not enabled, not
fp32, a layout it does not take) so the caller runs its torch expression instead."""
from __future__ import annotations

import torch

from splash import native


def _ok(x: torch.Tensor, *more: torch.Tensor) -> bool:
    """fp32 CPU tensors (checked on the first; the others must match it) and the kernels on."""
    return (x.dtype == torch.float32 and x.device.type == "cpu" and all(t.dtype == x.dtype for t in more)
            and native.enabled())


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor | None:
    """x [n, d] (rows may be strided), w [d] -> RMSNorm, contiguous."""
    d = x.shape[-1]
    if x.dim() != 2 or d % 8 or x.stride(1) != 1 or not w.is_contiguous() or not _ok(x, w):
        return None
    y = torch.empty(x.shape[0], d, dtype=torch.float32, device=x.device)
    native.lib().rms_norm(x.data_ptr(), x.shape[0], d, x.stride(0), w.data_ptr(), eps, y.data_ptr())
    return y


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleave: bool) -> torch.Tensor | None:
    """x [n, dim] or [n, H, dim] (last dim contiguous), cos/sin [n, dim / 2] -> rotated, contiguous."""
    if (x.dim() not in (2, 3) or x.stride(-1) != 1 or x.shape[-1] % 2 or not cos.is_contiguous()
            or not sin.is_contiguous() or cos.shape != (x.shape[0], x.shape[-1] // 2) or not _ok(x, cos, sin)):
        return None
    n, dim = x.shape[0], x.shape[-1]
    H, sh = (x.shape[1], x.stride(1)) if x.dim() == 3 else (1, 0)
    y = torch.empty(x.shape, dtype=torch.float32, device=x.device)
    native.lib().rope(x.data_ptr(), n, H, x.stride(0), sh, dim, int(interleave), cos.data_ptr(), sin.data_ptr(),
                      y.data_ptr())
    return y


def swiglu(h: torch.Tensor, inter: int) -> torch.Tensor | None:
    """h [n, 2 * inter] = [gate | up] -> silu(gate) * up [n, inter]."""
    if h.dim() != 2 or inter % 8 or h.shape[1] != 2 * inter or h.stride(1) != 1 or not _ok(h):
        return None
    y = torch.empty(h.shape[0], inter, dtype=torch.float32, device=h.device)
    native.lib().swiglu(h.data_ptr(), h.shape[0], inter, h.stride(0), y.data_ptr())
    return y
