"""The messages rank 0 broadcasts to every rank each step (pure data, no torch): a step plan or a stop.

Every rank acts on the same message in the same order, so the collectives of a step always line up.
"""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class StepItem:
    """One request's piece of the step: `tokens` at positions `start_pos`…; `sample` its last row; its owner
    rank (DP-attn/DOP owner, CP anchor)."""
    req_id: str
    start_pos: int
    tokens: tuple[int, ...]
    sample: bool
    owner: int


@dataclass(frozen=True)
class SwitchPlan:
    """A layout switch handed off at this step's boundary: per request (KV tokens, src owner, dst owner)."""
    dst: str
    mode: str
    reqs: dict[str, tuple[int, int | None, int | None]] = field(default_factory=dict)


@dataclass(frozen=True)
class StepMessage:
    items: tuple[StepItem, ...]
    release: tuple[str, ...] = ()            # requests whose KV every rank frees before the step
    switch: SwitchPlan | None = None
    logits: tuple[int, ...] = ()             # items whose prompt rows' logits come back (prompt logprobs)
    # prefix cache (splash.engine.ledger decides; every rank applies, in this order, before the step):
    register: tuple[tuple[str, int, int], ...] = ()         # (req, block, hash): blocks the last step filled
    evict: tuple[tuple[int, ...], ...] = ()                  # per rank: cached blocks to free
    attach: tuple[tuple[str, int, tuple[int, ...]], ...] = ()   # (req, owner, hashes): cached blocks it starts on
    # KDA state snapshots of a hybrid model (splash.engine.state_snapshots): dropped per rank after the attaches,
    # taken during the step (the state of `req` at the end of its block `block`, named by that block's hash)
    unsnap: tuple[tuple[int, ...], ...] = ()                 # per rank: snapshots to drop
    snapshot: tuple[tuple[str, int, int], ...] = ()          # (req, block, hash)


@dataclass(frozen=True)
class StopMessage:
    """Followers leave their step loop."""
