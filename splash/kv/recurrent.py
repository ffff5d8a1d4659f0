"""Per-request recurrent state of KDA linear-attention layers (GLM-5.3-Flash), held by request, not by block.

A request's state on a rank is one fp32 tensor [L_lin, H_held, W]: per KDA layer and held head, the recurrent
matrix S [d, d] then the short-conv inputs [3, d, K−1] (splash.models.kda.state_width); the heads held follow the
layout, and a switch moves whole rows of heads byte-exact. Prefix-cache snapshots (rank 0 decides every one) are
copies of that tensor at a block boundary, named by the prefix hash of the block ending there, filled layer by
layer as the KDA layers pass the boundary; a layout switch drops them all.
"""
from __future__ import annotations

from typing import Iterable, NamedTuple

import torch


class SnapshotPoint(NamedTuple):
    """Take a snapshot of `req_id`'s state after its tokens [0, position), named `hash`."""
    req_id: str
    position: int
    hash: int


class Boundary(NamedTuple):
    """A planned snapshot inside one step's rows of a request: at row `offset`, named `hash`."""
    offset: int
    hash: int


class RecurrentStates:
    def __init__(self, num_layers: int, width: int, device: str | torch.device = "cpu"):
        self.num_layers, self.width, self.device = num_layers, width, device
        self.states: dict[str, torch.Tensor] = {}
        self.snapshots: dict[int, torch.Tensor] = {}      # prefix hash -> state at the end of that block
        self.planned: dict[str, list[SnapshotPoint]] = {}   # req -> its snapshots this step

    def has(self, req: str) -> bool:
        return req in self.states

    def get(self, req: str) -> torch.Tensor:
        return self.states[req]

    def create(self, req: str, heads: int) -> torch.Tensor:
        """A new request's zero state for `heads` heads (replacing any stale one)."""
        self.states[req] = torch.zeros(self.num_layers, heads, self.width, dtype=torch.float32,
                                       device=self.device)
        return self.states[req]

    def put(self, req: str, state: torch.Tensor) -> None:
        self.states[req] = state.contiguous()

    def release(self, req: str) -> None:
        self.states.pop(req, None)

    def requests(self) -> list[str]:
        return sorted(self.states)

    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.states.values())

    # ---- prefix-cache snapshots ----------------------------------------------------------------------------
    def plan_snapshots(self, points: Iterable[SnapshotPoint]) -> None:
        """This step's snapshots."""
        self.planned = {}
        for p in points:
            self.planned.setdefault(p.req_id, []).append(p)

    def boundaries(self, req: str, start: int, end: int) -> list[Boundary]:
        """`req`'s planned snapshots in (start, end], as offsets into its step rows that start at position `start`."""
        return [Boundary(p.position - start, p.hash) for p in self.planned.get(req, ()) if start < p.position <= end]

    def keep(self, h: int, layer: int, state: torch.Tensor) -> None:
        """Row `layer` of snapshot `h` (allocated at its first layer) is `state` [H_held, W]."""
        snap = self.snapshots.get(h)
        if snap is None or snap.shape[1] != state.shape[0]:
            snap = self.snapshots[h] = torch.empty(self.num_layers, *state.shape, dtype=torch.float32,
                                                    device=self.device)
        snap[layer].copy_(state)

    def restore(self, req: str, h: int) -> None:
        """`req` resumes from snapshot `h` (its own copy). KeyError if this rank has none: rank 0 only sends a hit
        whose snapshot it recorded on the ranks that run the request."""
        if h not in self.snapshots:
            raise KeyError(f"no KDA state snapshot {h:#x} for request {req!r}")
        self.states[req] = self.snapshots[h].clone()

    def drop_snapshots(self, hashes) -> None:
        for h in hashes:
            self.snapshots.pop(h, None)

    def clear_snapshots(self) -> None:
        self.snapshots.clear()
        self.planned = {}
