"""Ranks, communicators and process bootstrap (see docs/architecture.md)."""

from splash.distributed.communicator import (
    Communicator,
    Handle,
    MPICommunicator,
    SingleRankCommunicator,
)
from splash.distributed.launch import DistContext, init_dist, init_torch_distributed

__all__ = [
    "Communicator",
    "DistContext",
    "Handle",
    "MPICommunicator",
    "SingleRankCommunicator",
    "init_dist",
    "init_torch_distributed",
]
