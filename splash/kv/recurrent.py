"""Per-request recurrent state of KDA linear-attention layers (GLM-5.3-Flash), held by request, not by block.

A request's state on a rank is one fp32 tensor [L_lin, H_held, W]: for each KDA layer and each head this rank
holds, the recurrent matrix S [d, d] then the short-conv inputs [3, d, K−1] (W = d·d + 3·d·(K−1),
splash.models.kda.state_width). Which heads a rank holds follows the layout (splash.attention.hybrid): a
head-range slice of every request (TP, DOP) or all heads of the requests it owns (DP-attn, CP). A switch moves
whole rows of heads between ranks byte-exact (splash.switching.executor).

Prefix-cache snapshots (splash.engine.state_snapshots, rank 0 decides every one): a copy of a request's state at a
block boundary, named by the prefix hash of the block ending there, in the same form ([L_lin, H_held, W], this
rank's heads). The step message names the boundaries to snapshot (`plan_snapshots`); the KDA layers fill each
snapshot's layer row as they pass the boundary (`boundaries`, `keep`); a request starting on cached blocks takes a
copy of the snapshot at their end (`restore`). Snapshots go when rank 0 says (`drop_snapshots`) and all of them at a
layout switch (`clear_snapshots`).
"""
from __future__ import annotations

import torch


class RecurrentStates:
    def __init__(self, num_layers: int, width: int, device: str | torch.device = "cpu"):
        self.num_layers, self.width, self.device = num_layers, width, device
        self.states: dict[str, torch.Tensor] = {}
        self.snapshots: dict[int, torch.Tensor] = {}      # prefix hash -> state at the end of that block
        self.planned: dict[str, list[tuple[int, int]]] = {}   # req -> [(position, hash)] to snapshot this step

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
    def plan_snapshots(self, points: list[tuple[str, int, int]]) -> None:
        """This step's snapshots: (req, position, hash) — `req`'s state after its tokens [0, position)."""
        self.planned = {}
        for req, pos, h in points:
            self.planned.setdefault(req, []).append((pos, h))

    def boundaries(self, req: str, start: int, end: int) -> list[tuple[int, int]]:
        """(offset into the step's rows of `req` starting at `start`, hash) of its planned snapshots in (start, end]."""
        return [(pos - start, h) for pos, h in self.planned.get(req, ()) if start < pos <= end]

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
