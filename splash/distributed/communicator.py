"""Collective communication on tensors, passed explicitly to whoever needs it.

`MPICommunicator` moves data as bytes (so bf16/fp8 need no MPI type) and sums dtypes MPI cannot reduce in float32;
a GPU tensor goes through host memory (copied out, moved, copied back to its device), which is what lets ranks that
share one GPU, where NCCL refuses, run together; `SingleRankCommunicator` makes size-1 paths call no MPI. Gathers and
all-to-all move rows along dim 0; every rank passes the same trailing shape and dtype, even with zero rows.
"""

from __future__ import annotations

import abc
import math
from collections.abc import Callable, Sequence
from itertools import accumulate
from typing import Any

import numpy as np
import torch

# dtypes that MPI sums natively on every implementation; others are reduced in float32.
NATIVE_REDUCE = frozenset(
    {torch.float32, torch.float64, torch.int8, torch.uint8, torch.int16, torch.int32, torch.int64}
)


class Handle:
    """An in-flight collective (holding its buffers until complete): `wait()` -> the result, `test()` polls."""

    def __init__(self, request: Any, finish: Callable[[], torch.Tensor], keep: Any = ()) -> None:
        self._request = request
        self._finish = finish
        self._keep = keep
        self._result: torch.Tensor | None = None

    @classmethod
    def done(cls, result: torch.Tensor) -> Handle:
        """An already-completed handle."""
        h = cls(None, lambda: result)
        h._complete()
        return h

    def _complete(self) -> None:
        self._result = self._finish()
        self._request = self._finish = None
        self._keep = ()

    def test(self) -> bool:
        """True once the collective has completed (never blocks)."""
        if self._result is None and self._request.Test():
            self._complete()
        return self._result is not None

    def wait(self) -> torch.Tensor:
        """Block until complete; return the result (same tensor on repeated calls)."""
        if self._result is None:
            self._request.Wait()
            self._complete()
        return self._result


class Communicator(abc.ABC):
    """Collectives over a fixed group of ranks. Results are new tensors, except on a size-1 group, where one may be
    the input itself (do not modify the input while keeping the result)."""

    rank: int   # this process's rank in the group
    size: int

    @abc.abstractmethod
    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        """Element-wise sum over ranks."""

    @abc.abstractmethod
    def all_gather(self, t: torch.Tensor) -> torch.Tensor:
        """Equal shapes on all ranks; concatenated along dim 0 in rank order (0-dim -> 1 row)."""

    @abc.abstractmethod
    def all_gatherv(self, t: torch.Tensor, counts: Sequence[int] | None = None) -> torch.Tensor:
        """Dim-0 sizes may differ (incl. 0); concatenated in rank order. `counts` skips the count exchange."""

    @abc.abstractmethod
    def all_to_allv(
        self,
        t: torch.Tensor,
        send_counts: Sequence[int],
        recv_counts: Sequence[int] | None = None,
    ) -> torch.Tensor:
        """`t` holds rows for rank 0, then rank 1, ...; -> received rows in source-rank order (`recv_counts=None`
        exchanges counts first)."""

    @abc.abstractmethod
    def broadcast(self, t: torch.Tensor, root: int = 0) -> torch.Tensor:
        """Every rank passes a tensor of the same shape/dtype; returns root's values."""

    @abc.abstractmethod
    def broadcast_obj(self, obj: Any, root: int = 0) -> Any:
        """Pickled broadcast of a Python object."""

    @abc.abstractmethod
    def all_gather_obj(self, obj: Any) -> list[Any]:
        """Pickled all-gather; list indexed by rank."""

    @abc.abstractmethod
    def barrier(self) -> None: ...

    # Async variants: default to running the blocking op (a completed handle).
    def iall_gatherv(self, t: torch.Tensor, counts: Sequence[int] | None = None) -> Handle:
        return Handle.done(self.all_gatherv(t, counts))

    def iall_to_allv(
        self,
        t: torch.Tensor,
        send_counts: Sequence[int],
        recv_counts: Sequence[int] | None = None,
    ) -> Handle:
        return Handle.done(self.all_to_allv(t, send_counts, recv_counts))

    # Count helpers, built on the collectives above.
    def gather_counts(self, n: int) -> list[int]:
        """Every rank's `n`, in rank order (the counts `all_gatherv` would exchange)."""
        return self.all_gather(torch.tensor([n], dtype=torch.int64, device="cpu")).tolist()

    def exchange_counts(self, send_counts: Sequence[int]) -> list[int]:
        """Rows each source rank will send here (the counts `all_to_allv` would exchange)."""
        ones = [1] * self.size
        sc = torch.tensor(list(send_counts), dtype=torch.int64, device="cpu")
        return self.all_to_allv(sc, ones, ones).tolist()


def _check_counts(name: str, counts: Sequence[int], size: int, total: int | None = None) -> None:
    if len(counts) != size or any(c < 0 for c in counts):
        raise ValueError(f"{name}={list(counts)} must hold {size} non-negative counts")
    if total is not None and sum(counts) != total:
        raise ValueError(f"{name}={list(counts)} sum to {sum(counts)}, tensor has {total} rows")


def as_rows(t: torch.Tensor) -> torch.Tensor:
    """Detached, contiguous, at least 1-d."""
    t = t.detach().contiguous()
    return t.reshape(1) if t.dim() == 0 else t


def gatherv_rows(comm, t: torch.Tensor, counts: Sequence[int] | None) -> tuple[torch.Tensor, Sequence[int]]:
    """An all-gatherv's checked inputs: (t as contiguous rows, per-rank row counts, gathered when None)."""
    if t.dim() == 0:
        raise ValueError("all_gatherv needs a tensor with a row dimension")
    src = as_rows(t)
    if counts is None:
        counts = comm.gather_counts(src.shape[0])
    _check_counts("counts", counts, comm.size)
    if counts[comm.rank] != src.shape[0]:
        raise ValueError(f"counts[{comm.rank}]={counts[comm.rank]} but tensor has {src.shape[0]} rows")
    return src, counts


def alltoallv_rows(comm, t: torch.Tensor, send_counts: Sequence[int], recv_counts: Sequence[int] | None
                   ) -> tuple[torch.Tensor, torch.Tensor, list[int], list[int]]:
    """An all-to-allv's checked inputs: (t as contiguous rows, the output, send and receive bytes per rank)."""
    if t.dim() == 0:
        raise ValueError("all_to_allv needs a tensor with a row dimension")
    src = as_rows(t)
    _check_counts("send_counts", send_counts, comm.size, src.shape[0])
    if recv_counts is None:
        recv_counts = comm.exchange_counts(send_counts)
    _check_counts("recv_counts", recv_counts, comm.size)
    row = math.prod(src.shape[1:]) * src.element_size()
    out = torch.empty((sum(recv_counts), *src.shape[1:]), dtype=src.dtype, device=src.device)
    return src, out, [c * row for c in send_counts], [c * row for c in recv_counts]


def _host(t: torch.Tensor) -> torch.Tensor:
    """`t`, or its copy in host memory when it lives on a device (mpi4py reads and writes host buffers)."""
    return t if t.device.type == "cpu" else t.detach().to("cpu")


def _back(out: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """A collective's host result `out`, on the device `like` lives on (a new tensor there, made by `like` itself)."""
    return out if like.device.type == "cpu" else like.new_empty(out.shape, dtype=out.dtype).copy_(out)


def _bytes(t: torch.Tensor) -> np.ndarray:
    """Flat uint8 numpy view sharing memory with contiguous `t`."""
    return t.reshape(-1).view(torch.uint8).numpy()


def _displs(counts: Sequence[int]) -> list[int]:
    return [0, *accumulate(counts)][:len(counts)]


class SingleRankCommunicator(Communicator):
    """A group of one: every op is the identity (no MPI calls)."""

    rank = 0
    size = 1

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        return t

    def all_gather(self, t: torch.Tensor) -> torch.Tensor:
        return t.reshape(1) if t.dim() == 0 else t

    def all_gatherv(self, t: torch.Tensor, counts: Sequence[int] | None = None) -> torch.Tensor:
        if counts is not None:
            _check_counts("counts", counts, 1, t.shape[0])
        return t

    def all_to_allv(self, t, send_counts, recv_counts=None) -> torch.Tensor:
        _check_counts("send_counts", send_counts, 1, t.shape[0])
        if recv_counts is not None:
            _check_counts("recv_counts", recv_counts, 1, t.shape[0])
        return t

    def broadcast(self, t: torch.Tensor, root: int = 0) -> torch.Tensor:
        if root != 0:
            raise ValueError(f"root={root} out of range for size 1")
        return t

    def broadcast_obj(self, obj: Any, root: int = 0) -> Any:
        return obj

    def all_gather_obj(self, obj: Any) -> list[Any]:
        return [obj]

    def barrier(self) -> None:
        pass


# A planned collective: the MPI call's positional args and a function building the result.
_Plan = tuple[tuple[Any, ...], Callable[[], torch.Tensor]]


class MPICommunicator(Communicator):
    """Collectives over an mpi4py communicator (buffer interface, no pickling); device tensors through host memory."""

    def __init__(self, mpi_comm: Any) -> None:
        from mpi4py import MPI

        self._MPI = MPI
        self.mpi_comm = mpi_comm
        self.rank, self.size = mpi_comm.Get_rank(), mpi_comm.Get_size()

    # --- plans: (args, finish) shared by blocking and nonblocking forms ---

    def _plan_all_gatherv(self, t: torch.Tensor, counts: Sequence[int] | None) -> _Plan:
        src, counts = gatherv_rows(self, _host(t), counts)
        row = math.prod(src.shape[1:]) * src.element_size()
        out = torch.empty((sum(counts), *src.shape[1:]), dtype=src.dtype, device="cpu")
        nbytes = [c * row for c in counts]
        byte = self._MPI.BYTE
        args = ([_bytes(src), byte], [_bytes(out), (nbytes, _displs(nbytes)), byte])
        return args, (lambda: _back(out, t))

    def _plan_all_to_allv(
        self, t: torch.Tensor, send_counts: Sequence[int], recv_counts: Sequence[int] | None
    ) -> _Plan:
        src, out, sb, rb = alltoallv_rows(self, _host(t), send_counts, recv_counts)
        byte = self._MPI.BYTE
        args = ([_bytes(src), (sb, _displs(sb)), byte], [_bytes(out), (rb, _displs(rb)), byte])
        return args, (lambda: _back(out, t))

    # --- blocking ---

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        src = _host(t).detach().contiguous()
        work = src if src.dtype in NATIVE_REDUCE else src.to(torch.float32)
        out = torch.empty_like(work)
        self.mpi_comm.Allreduce(work.reshape(-1).numpy(), out.reshape(-1).numpy(), self._MPI.SUM)
        return _back(out if out.dtype == t.dtype else out.to(t.dtype), t)

    def all_gather(self, t: torch.Tensor) -> torch.Tensor:
        src = as_rows(_host(t))
        out = torch.empty((self.size * src.shape[0], *src.shape[1:]), dtype=src.dtype, device="cpu")
        self.mpi_comm.Allgather([_bytes(src), self._MPI.BYTE], [_bytes(out), self._MPI.BYTE])
        return _back(out, t)

    def all_gatherv(self, t: torch.Tensor, counts: Sequence[int] | None = None) -> torch.Tensor:
        args, finish = self._plan_all_gatherv(t, counts)
        self.mpi_comm.Allgatherv(*args)
        return finish()

    def all_to_allv(self, t, send_counts, recv_counts=None) -> torch.Tensor:
        args, finish = self._plan_all_to_allv(t, send_counts, recv_counts)
        self.mpi_comm.Alltoallv(*args)
        return finish()

    def exchange_counts(self, send_counts: Sequence[int]) -> list[int]:
        _check_counts("send_counts", send_counts, self.size)
        recv = np.empty(self.size, dtype=np.int64)
        self.mpi_comm.Alltoall(np.asarray(send_counts, dtype=np.int64), recv)
        return recv.tolist()

    def broadcast(self, t: torch.Tensor, root: int = 0) -> torch.Tensor:
        src = _host(t).detach().contiguous()
        buf = src if self.rank == root else torch.empty_like(src)
        self.mpi_comm.Bcast([_bytes(buf), self._MPI.BYTE], root=root)
        return _back(buf, t)

    def broadcast_obj(self, obj: Any, root: int = 0) -> Any:
        return self.mpi_comm.bcast(obj, root=root)

    def all_gather_obj(self, obj: Any) -> list[Any]:
        return self.mpi_comm.allgather(obj)

    def barrier(self) -> None:
        self.mpi_comm.Barrier()

    # --- nonblocking (count exchanges, when needed, are blocking) ---

    def iall_gatherv(self, t: torch.Tensor, counts: Sequence[int] | None = None) -> Handle:
        args, finish = self._plan_all_gatherv(t, counts)
        return Handle(self.mpi_comm.Iallgatherv(*args), finish, args)

    def iall_to_allv(self, t, send_counts, recv_counts=None) -> Handle:
        args, finish = self._plan_all_to_allv(t, send_counts, recv_counts)
        return Handle(self.mpi_comm.Ialltoallv(*args), finish, args)
