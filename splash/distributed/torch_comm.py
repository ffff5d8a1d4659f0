"""Collectives over a torch.distributed process group: NCCL on CUDA torch, RCCL on ROCm torch, gloo on CPU.

Tensors go over the process group; objects, row counts and barriers stay on MPI (the control plane), so a count
exchange costs no device round trip and the watchdog still has an MPI communicator to poll and abort. Data moves
as flat uint8 bytes (gloo has no fp8 type); all-gatherv pads rows to the largest count (gloo's list all-gather
refuses uneven sizes); all-reduce sums in float32 what MPI would (bf16/fp16 too on gloo, to match it bit for bit;
natively on NCCL).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from splash.distributed.communicator import (
    NATIVE_REDUCE,
    Communicator,
    Handle,
    MPICommunicator,
    alltoallv_rows,
    as_rows,
    gatherv_rows,
)

_NCCL_REDUCE = NATIVE_REDUCE | {torch.float16, torch.bfloat16}
# equal-block all-gather into one tensor: torch 2.13 renamed all_gather_into_tensor (older GPU builds lack the new name)
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


class _Work:
    """A torch.distributed `Work` seen through the Test()/Wait() protocol `Handle` polls."""

    def __init__(self, work: Any) -> None:
        self._work = work

    def Test(self) -> bool:  # noqa: N802 — the mpi4py request protocol
        return self._work.is_completed()

    def Wait(self) -> None:  # noqa: N802
        self._work.wait()


def _u8(t: torch.Tensor) -> torch.Tensor:
    """Flat uint8 view sharing memory with contiguous `t`."""
    return t.reshape(-1).view(torch.uint8)


# A planned collective: run(async_op) issues it and returns the torch Work (or None); finish builds the result.
_Plan = tuple[Callable[[bool], Any], Callable[[], torch.Tensor], tuple[Any, ...]]


class TorchCommunicator(Communicator):
    """Tensor collectives over the default torch.distributed group (same ranks and order as `mpi`); objects,
    counts and barriers over `mpi`."""

    def __init__(self, mpi: MPICommunicator, device: torch.device | str = "cpu") -> None:
        if not dist.is_initialized():
            raise RuntimeError("TorchCommunicator needs torch.distributed initialised (init_torch_distributed)")
        if (dist.get_rank(), dist.get_world_size()) != (mpi.rank, mpi.size):
            raise RuntimeError(f"torch.distributed rank {dist.get_rank()}/{dist.get_world_size()} does not match "
                               f"MPI rank {mpi.rank}/{mpi.size}")
        self._mpi, self.rank, self.size = mpi, mpi.rank, mpi.size
        self.mpi_comm = getattr(mpi, "mpi_comm", None)   # the control plane's, for StepChannel and the watchdog
        self.device = torch.device(device)
        self.backend = dist.get_backend()
        self._reduce_native = _NCCL_REDUCE if self.backend == "nccl" else NATIVE_REDUCE

    # --- plans shared by the blocking and nonblocking forms ---

    def _plan_all_gatherv(self, t: torch.Tensor, counts: Sequence[int] | None) -> _Plan:
        src, counts = gatherv_rows(self, t, counts)
        trail, most = src.shape[1:], max(counts)
        if most == src.shape[0]:
            block = src
        else:  # pad to the largest count: every rank then contributes an equal block
            block = torch.empty((most, *trail), dtype=src.dtype, device=src.device)
            block[: src.shape[0]] = src
        out = torch.empty((self.size * most, *trail), dtype=src.dtype, device=src.device)
        run = lambda a: _all_gather_single(_u8(out), _u8(block), async_op=a)  # noqa: E731

        def finish() -> torch.Tensor:
            if all(c == most for c in counts):
                return out
            return torch.cat([out[q * most: q * most + c] for q, c in enumerate(counts)])

        return run, finish, (block, out)

    def _plan_all_to_allv(self, t: torch.Tensor, send_counts: Sequence[int],
                          recv_counts: Sequence[int] | None) -> _Plan:
        src, out, sb, rb = alltoallv_rows(self, t, send_counts, recv_counts)
        run = lambda a: dist.all_to_all_single(_u8(out), _u8(src), rb, sb, async_op=a)  # noqa: E731
        return run, (lambda: out), (src, out)

    @staticmethod
    def _blocking(plan: _Plan) -> torch.Tensor:
        run, finish, _ = plan
        run(False)
        return finish()

    @staticmethod
    def _async(plan: _Plan) -> Handle:
        run, finish, keep = plan
        return Handle(_Work(run(True)), finish, keep)

    # --- blocking ---

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        src = t.detach().contiguous()
        work = src.clone() if src.dtype in self._reduce_native else src.to(torch.float32)
        dist.all_reduce(work)
        return work if work.dtype == t.dtype else work.to(t.dtype)

    def all_gather(self, t: torch.Tensor) -> torch.Tensor:
        src = as_rows(t)
        out = torch.empty((self.size * src.shape[0], *src.shape[1:]), dtype=src.dtype, device=src.device)
        _all_gather_single(_u8(out), _u8(src))
        return out

    def all_gatherv(self, t: torch.Tensor, counts: Sequence[int] | None = None) -> torch.Tensor:
        return self._blocking(self._plan_all_gatherv(t, counts))

    def all_to_allv(self, t, send_counts, recv_counts=None) -> torch.Tensor:
        return self._blocking(self._plan_all_to_allv(t, send_counts, recv_counts))

    def broadcast(self, t: torch.Tensor, root: int = 0) -> torch.Tensor:
        if not 0 <= root < self.size:
            raise ValueError(f"root={root} out of range for size {self.size}")
        src = t.detach().contiguous()
        buf = src if self.rank == root else torch.empty_like(src)
        dist.broadcast(_u8(buf), src=root)
        return buf

    # --- nonblocking (count exchanges, when needed, are blocking and go over MPI) ---

    def iall_gatherv(self, t: torch.Tensor, counts: Sequence[int] | None = None) -> Handle:
        return self._async(self._plan_all_gatherv(t, counts))

    def iall_to_allv(self, t, send_counts, recv_counts=None) -> Handle:
        return self._async(self._plan_all_to_allv(t, send_counts, recv_counts))

    # --- control plane: MPI ---

    def gather_counts(self, n: int) -> list[int]:
        return self._mpi.gather_counts(n)

    def exchange_counts(self, send_counts: Sequence[int]) -> list[int]:
        return self._mpi.exchange_counts(send_counts)

    def broadcast_obj(self, obj: Any, root: int = 0) -> Any:
        return self._mpi.broadcast_obj(obj, root)

    def all_gather_obj(self, obj: Any) -> list[Any]:
        return self._mpi.all_gather_obj(obj)

    def barrier(self) -> None:
        """Every rank has reached this point and this rank's issued collectives have finished on its device."""
        if self.device.type == "cuda":  # ROCm torch reports its GPUs as "cuda" too
            torch.cuda.synchronize(self.device)
        self._mpi.barrier()
