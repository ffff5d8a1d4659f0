"""Per-request recurrent state of KDA linear-attention layers (GLM-5.3-Flash), held by request, not by block.

A request's state on a rank is one fp32 tensor [L_lin, H_held, W]: for each KDA layer and each head this rank
holds, the recurrent matrix S [d, d] then the short-conv inputs [3, d, K−1] (W = d·d + 3·d·(K−1),
splash.models.kda.state_width). Which heads a rank holds follows the layout (splash.attention.hybrid): a
head-range slice of every request (TP, DOP) or all heads of the requests it owns (DP-attn, CP). A switch moves
whole rows of heads between ranks byte-exact (splash.switching.executor).
"""
from __future__ import annotations

import torch


class RecurrentStates:
    def __init__(self, num_layers: int, width: int, device: str | torch.device = "cpu"):
        self.num_layers, self.width, self.device = num_layers, width, device
        self.states: dict[str, torch.Tensor] = {}

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
        return sum(t.numel() * t.element_size() for t in self.states.values())
