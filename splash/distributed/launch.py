"""Process bootstrap: one process per rank under `mpiexec` (or a single rank without it)."""

from __future__ import annotations

import atexit
import os
import socket
from dataclasses import dataclass

from splash.distributed.communicator import Communicator, MPICommunicator, SingleRankCommunicator


@dataclass(frozen=True)
class DistContext:
    """Who this process is. `comm` spans all `world_size` ranks; `local_size` of them run on this node."""

    rank: int
    world_size: int
    local_rank: int
    comm: Communicator
    local_size: int = 1
    waits_yield: bool = False  # MPICH's waiting ranks yield their core (more ranks than cores here)


# MPICH's settings (read at MPI_Init) that make a rank waiting in a collective sleep in its progress loop instead
# of busy-polling. Without them, with more ranks than cores on a node, a waiting rank takes the core the rank it
# waits for needs (docs/benchmarks.md "MPICH's waiting ranks yield in splash-serve (session 24)").
YIELD_ENV = {"MPIR_CVAR_ENABLE_HEAVY_YIELD": "1", "MPIR_CVAR_CH4_PROGRESS_THROTTLE": "1"}


def yield_when_oversubscribed(environ=os.environ, cores: int | None = None) -> bool:
    """Before MPI starts: when the launcher puts more ranks on this node than it has cores, ask MPICH's waiting
    ranks to yield (a value the user set is kept). True when the ranks here are oversubscribed. Where a core per
    rank exists, busy-polling answers a collective soonest, so nothing is set."""
    local = environ.get("MPI_LOCALNRANKS") or environ.get("OMPI_COMM_WORLD_LOCAL_SIZE")
    try:
        ranks = int(local) if local else 0
    except ValueError:
        return False
    if ranks <= (cores if cores is not None else os.cpu_count() or 1):
        return False
    for name, value in YIELD_ENV.items():
        environ.setdefault(name, value)
    return True


def init_dist() -> DistContext:
    """Rank, size and node-local rank from MPI's `COMM_WORLD` (one rank without mpiexec); a larger group gets an
    `MPICommunicator` on a duplicate of it, so our traffic never mixes with other users'."""
    waits_yield = yield_when_oversubscribed()
    from mpi4py import MPI

    world = MPI.COMM_WORLD
    rank, size = world.Get_rank(), world.Get_size()
    local = world.Split_type(MPI.COMM_TYPE_SHARED, key=rank)
    local_rank, local_size = local.Get_rank(), local.Get_size()
    local.Free()
    comm: Communicator = MPICommunicator(world.Dup()) if size > 1 else SingleRankCommunicator()
    return DistContext(rank=rank, world_size=size, local_rank=local_rank, comm=comm, local_size=local_size,
                       waits_yield=waits_yield)


def set_threads(ctx: DistContext) -> int:
    """torch intra-op threads of this rank: OMP_NUM_THREADS when set, else this node's cores shared among its
    ranks (more would oversubscribe the cores the other ranks compute on)."""
    import torch

    if "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // ctx.local_size))
    return torch.get_num_threads()


def init_torch_distributed(ctx: DistContext, backend: str) -> None:
    """Start a torch.distributed process group over the MPI ranks: rank 0 opens a TCPStore on a free port and
    broadcasts it over MPI; host $MASTER_ADDR, else 127.0.0.1 on one node, else rank 0's hostname."""
    import torch.distributed as dist

    names = ctx.comm.all_gather_obj(socket.gethostname())
    host = os.environ.get("MASTER_ADDR") or ("127.0.0.1" if len(set(names)) == 1 else names[0])
    store, port = None, None
    if ctx.rank == 0:
        try:
            store = dist.TCPStore(host, 0, ctx.world_size, is_master=True, wait_for_workers=False)
            port = store.port
        finally:
            port = ctx.comm.broadcast_obj(port, root=0)  # never leave the others waiting
    else:
        port = ctx.comm.broadcast_obj(None, root=0)
        if port is None:
            raise RuntimeError("rank 0 failed to open the TCPStore")
        store = dist.TCPStore(host, port, ctx.world_size, is_master=False)
    dist.init_process_group(backend, store=store, rank=ctx.rank, world_size=ctx.world_size)
    atexit.register(_destroy_torch_group)


def _destroy_torch_group() -> None:
    """At exit: end the process group before the interpreter tears down (left to static destructors, gloo's
    threads can abort a rank after its work is done: "terminate called without an active exception")."""
    import torch.distributed as dist

    try:
        if dist.is_initialized():
            dist.destroy_process_group()
    except Exception:  # exiting anyway; nothing to report to
        pass


COMMUNICATORS = ("mpi", "torch")


def torch_dist_backend(device_backend: str) -> str:
    """gloo on cpu, "nccl" on cuda and hip (RCCL on ROCm builds)."""
    return "gloo" if device_backend == "cpu" else "nccl"


def check_communicator(kind: str, device_backend: str = "cpu") -> None:
    """Raise ValueError / RuntimeError (before any collective) if `kind` cannot run on `device_backend` here."""
    if kind not in COMMUNICATORS:
        raise ValueError(f"communicator {kind!r} is not one of {', '.join(COMMUNICATORS)}")
    if kind == "mpi" or torch_dist_backend(device_backend) != "nccl":
        return
    import torch
    import torch.distributed as dist

    if not (dist.is_nccl_available() and torch.cuda.is_available()):
        raise RuntimeError(f"communicator 'torch' on backend {device_backend!r} needs NCCL/RCCL: this torch "
                           f"({torch.__version__}) has no NCCL or sees no GPU")


def make_communicator(kind: str, ctx: DistContext, device_backend: str = "cpu") -> Communicator:
    """The data-plane communicator of `kind` ("mpi" | "torch") over `ctx`'s ranks: `ctx.comm` for mpi or a group
    of one, else a `TorchCommunicator` (torch.distributed started once per process; its tensors on
    cuda:<local_rank mod GPUs> for nccl)."""
    check_communicator(kind, device_backend)
    if kind == "mpi" or ctx.world_size == 1:
        return ctx.comm
    import torch
    import torch.distributed as dist

    from splash.distributed.torch_comm import TorchCommunicator

    backend, device = torch_dist_backend(device_backend), "cpu"
    if backend == "nccl":
        device = torch.device("cuda", ctx.local_rank % torch.cuda.device_count())
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        init_torch_distributed(ctx, backend)
    elif dist.get_backend() != backend:
        raise RuntimeError(f"torch.distributed already runs {dist.get_backend()!r}, not {backend!r}")
    return TorchCommunicator(ctx.comm, device)


def describe_communicator(comm: Communicator) -> str:
    """One line naming what carries `comm`'s tensor collectives (for startup logs)."""
    backend = getattr(comm, "backend", None)
    if backend is not None:
        return f"torch.distributed {backend} ({comm.size} ranks; objects and counts over MPI)"
    if isinstance(comm, MPICommunicator):
        return f"MPI (mpi4py, {comm.size} ranks)"
    return "none (a single rank)"
