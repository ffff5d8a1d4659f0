"""A stand-in for a GPU tensor on a CPU-only machine, holding a CUDA tensor's preconditions that host code can break.

`OnDevice` says it lives on cuda:0 and, like a real CUDA tensor, refuses to be viewed as numpy (mpi4py's buffers);
`.cpu()` / `.to("cpu")` give a plain host tensor. Everything else torch does on it keeps it an `OnDevice`, so a
result a collective makes from it (`new_empty`, `copy_`) stays "on the device" as a real one would. Code that hands
its storage to the host without copying it out first fails as it would on a GPU.
"""
from __future__ import annotations

import torch

DEVICE = torch.device("cuda", 0)


def _to_host(func, args, kwargs) -> bool:
    if func is torch.Tensor.cpu:
        return True
    if func is not torch.Tensor.to:
        return False
    target = kwargs.get("device", next((a for a in args[1:] if isinstance(a, (str, torch.device))), None))
    return target is not None and torch.device(target).type == "cpu"


class OnDevice(torch.Tensor):
    @property
    def device(self) -> torch.device:
        return DEVICE

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.Tensor.numpy:
            raise TypeError("can't convert cuda:0 device type tensor to numpy. Use Tensor.cpu() to copy the tensor "
                            "to host memory first.")
        if func is torch.Tensor.__array__:
            raise TypeError("can't convert cuda:0 device type tensor to numpy (__array__)")
        if _to_host(func, args, kwargs):
            with torch._C.DisableTorchFunctionSubclass():
                return func(*args, **kwargs).as_subclass(torch.Tensor).clone()
        return super().__torch_function__(func, types, args, kwargs)


def on_device(t: torch.Tensor) -> OnDevice:
    """A copy of host tensor `t` "on the device"."""
    return t.clone().as_subclass(OnDevice)
