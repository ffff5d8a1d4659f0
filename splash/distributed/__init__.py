"""Ranks, communicators and process bootstrap (see docs/architecture.md)."""

from splash.distributed.communicator import (
    Communicator,
    Handle,
    MPICommunicator,
    SingleRankCommunicator,
)
from splash.distributed.launch import (
    COMMUNICATORS,
    DistContext,
    init_dist,
    init_torch_distributed,
    make_communicator,
    torch_dist_backend,
)
from splash.distributed.torch_comm import TorchCommunicator

__all__ = [
    "COMMUNICATORS",
    "Communicator",
    "DistContext",
    "Handle",
    "MPICommunicator",
    "SingleRankCommunicator",
    "TorchCommunicator",
    "init_dist",
    "init_torch_distributed",
    "make_communicator",
    "torch_dist_backend",
]
