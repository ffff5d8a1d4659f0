"""The step batch every rank executes (replicated); each rank's attention metadata for it is in metadata.py."""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from itertools import accumulate
from typing import Protocol

import torch


class StepPiece(Protocol):
    """What the executors read of one request's piece of a step. The engine's step-message item
    (splash.engine.messages.StepItem) is one, handed over as it arrives; `StepRequest` builds one by hand (benchmarks,
    calibration, tests)."""

    @property
    def req_id(self) -> str: ...

    @property
    def start_pos(self) -> int: ...   # tokens already in the KV history before this step

    @property
    def num_new(self) -> int: ...     # query rows this step (prefill chunk length, or 1 in decode)

    @property
    def end_pos(self) -> int: ...

    @property
    def owner(self) -> int: ...       # owner rank under DP-attn / DOP, anchor under CP


@dataclass(frozen=True)
class StepRequest:
    """A `StepPiece` built by hand."""
    req_id: str
    start_pos: int
    num_new: int
    owner: int = 0

    @property
    def end_pos(self) -> int:
        return self.start_pos + self.num_new


@dataclass
class StepBatch:
    reqs: Sequence[StepPiece]
    token_ids: torch.Tensor   # [N] long
    positions: torch.Tensor   # [N] long
    sample_rows: list[int]    # rows whose logits are needed (last row of each request that samples)

    @classmethod
    def build(cls, reqs: Sequence[StepPiece], tokens: Sequence[Sequence[int]], sample: Sequence[bool],
              device="cpu") -> "StepBatch":
        ids, pos, rows, r = [], [], [], 0
        for q, t, s in zip(reqs, tokens, sample):
            assert len(t) == q.num_new, (q, len(t))
            ids.extend(t)
            pos.extend(range(q.start_pos, q.end_pos))
            r += q.num_new
            if s:
                rows.append(r - 1)
        return cls(reqs, torch.tensor(ids, dtype=torch.long, device=device),
                   torch.tensor(pos, dtype=torch.long, device=device), rows)

    @property
    def num_rows(self) -> int:
        return int(self.token_ids.numel())

    def row_ranges(self) -> list[range]:
        return row_ranges(self.reqs)


def row_ranges(reqs: Sequence[StepPiece]) -> list[range]:
    """Each request's query rows when `reqs`' rows lie one request after another, in order."""
    return [range(a, a + q.num_new) for q, a in zip(reqs, accumulate((q.num_new for q in reqs), initial=0))]
