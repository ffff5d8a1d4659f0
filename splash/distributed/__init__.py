"""Ranks, communicators and process bootstrap (see docs/architecture.md)."""

from splash.distributed.communicator import (
    Communicator,
    Handle,
    MPICommunicator,
    SingleRankCommunicator,
)
from splash.distributed.launch import (
    DistContext,
    init_dist,
    init_torch_distributed,
    make_communicator,
)
from splash.distributed.torch_comm import TorchCommunicator

__all__ = [
    "Communicator",
    "DistContext",
    "Handle",
    "MPICommunicator",
    "SingleRankCommunicator",
    "TorchCommunicator",
    "init_dist",
    "init_torch_distributed",
    "make_communicator",
]
