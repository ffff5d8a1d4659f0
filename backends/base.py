"""The Backend object: a device, its streams and its memory (no GPU package imported here).

`Backend.streams()` gives the switch executor a side stream for layer l+1's transfer while layer l computes:

    s = backend.streams()
    with s.side():              # work issued here goes to the side stream (CUDA/HIP), inline on CPU
        ... start layer l+1's transfer ...
        ev = s.record()         # an event at the end of that work
    s.wait(ev)                  # the compute stream waits for it before layer l+1 reads the state

On CPU every call is a no-op (there is one stream), so the same code runs everywhere.
"""
from __future__ import annotations

from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from typing import Any

from splash.models.config import ConfigError


class BackendUnavailable(ConfigError):
    """The backend (or an attention kernel, or a package it needs) cannot run on this machine."""


class NullStreams:
    """CPU: one stream; recording and waiting do nothing."""
    device = None

    def side(self):
        return nullcontext()

    def record(self) -> None:
        return None

    def wait(self, event: Any) -> None:
        return None

    def hand_over(self, obj: Any) -> None:
        return None


class DeviceStreams:
    """CUDA/HIP: one side stream for transfers; events order it before the layer that reads what it moved.

    Tensors allocated on the side stream and used on the compute stream must be `record_stream`-ed (or kept
    alive until the event is waited on); the switch executor keeps its handles until `_finish`."""

    def __init__(self, device: Any):
        import torch
        self.torch, self.device = torch, device
        self.compute = torch.cuda.current_stream(device)
        self.stream = torch.cuda.Stream(device=device)

    @contextmanager
    def side(self):
        self.stream.wait_stream(self.compute)   # the transfer reads state the compute stream wrote before
        with self.torch.cuda.stream(self.stream):
            yield self.stream

    def record(self) -> Any:
        ev = self.torch.cuda.Event()
        ev.record(self.stream)
        return ev

    def wait(self, event: Any) -> None:
        if event is not None:
            self.compute.wait_event(event)

    def hand_over(self, obj: Any) -> None:
        """Tensors made on the side stream that the compute stream keeps using (received weights): tell the
        caching allocator, so their memory is not reused before the compute stream is done with them."""
        from splash.models.weights import weight_tensors
        for t in weight_tensors(obj):
            if t.is_cuda:
                t.record_stream(self.compute)


def ranks_on_gpu(local_rank: int, local_size: int, gpus: int) -> int:
    """How many of a node's `local_size` ranks share the GPU of `local_rank` (rank r runs on GPU r % gpus)."""
    return len(range(local_rank % gpus, max(local_size, local_rank + 1), gpus))


def share_of(free: int, total: int, ranks: int) -> tuple[int, int]:
    """(free, total) of one of `ranks` equal shares of a GPU measured (free, total): a share of the total, less a
    share of what is in use then (the ranks start together; what one of them has taken counts against all)."""
    in_use = (total - free) // ranks
    return total // ranks - in_use, total // ranks


@dataclass(frozen=True)
class Backend:
    name: str                  # cpu | cuda | hip
    device_name: str           # "cpu" or "cuda:N" (ROCm devices are torch "cuda" devices too)
    ranks_on_device: int = 1   # this node's ranks on that GPU (more ranks than GPUs: they share)
    _cache: dict = field(default_factory=dict, compare=False, repr=False)

    @property
    def device(self):
        import torch
        return torch.device(self.device_name)

    @property
    def is_gpu(self) -> bool:
        return self.name != "cpu"

    def streams(self):
        """Side-stream helper for switch transfers (one per backend object)."""
        if "streams" not in self._cache:
            self._cache["streams"] = DeviceStreams(self.device) if self.is_gpu else NullStreams()
        return self._cache["streams"]

    def memory_info(self) -> tuple[int, int] | None:
        """(free, total) device bytes of this rank's share of its GPU: the GPU's, divided among the ranks on it
        (each would otherwise budget the whole GPU for itself); None on CPU (budgets come from the config)."""
        if not self.is_gpu:
            return None
        import torch
        free, total = torch.cuda.mem_get_info(self.device)
        return share_of(int(free), int(total), self.ranks_on_device)

    def describe(self) -> str:
        if not self.is_gpu:
            return "cpu"
        import torch
        return f"{self.name} {self.device_name} ({torch.cuda.get_device_name(self.device)})"

    def synchronize(self) -> None:
        if self.is_gpu:
            import torch
            torch.cuda.synchronize(self.device)
