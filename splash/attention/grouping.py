"""Row bookkeeping for owner-based layouts (DP-attn, DOP): which step rows each owner rank attends."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from splash.attention.batch import StepBatch, StepPiece
from splash.attention.context import RankContext


@dataclass
class OwnerGroups:
    mine: list[StepPiece]       # this rank's requests, in step order
    rows_mine: torch.Tensor     # their rows in the step
    by_owner: torch.Tensor      # all step rows, grouped by owner rank (rank 0's rows first), step order inside
    counts: list[int]           # rows per owner rank

    @classmethod
    def build(cls, batch: StepBatch, world: int, rank: int) -> "OwnerGroups":
        rows: list[list[int]] = [[] for _ in range(world)]
        mine = []
        for q, rr in zip(batch.reqs, batch.row_ranges()):
            rows[q.owner].extend(rr)
            if q.owner == rank:
                mine.append(q)
        flat = [i for r in rows for i in r]
        dev = batch.token_ids.device
        return cls(mine, torch.tensor(rows[rank], dtype=torch.long, device=dev),
                   torch.tensor(flat, dtype=torch.long, device=dev),
                   [len(r) for r in rows])

    def to_step_order(self, grouped: torch.Tensor) -> torch.Tensor:
        """Inverse of indexing with `by_owner`: rows grouped by owner -> rows in step order."""
        out = torch.empty_like(grouped)
        out[self.by_owner] = grouped
        return out

    def gather(self, comm, out: torch.Tensor) -> torch.Tensor:
        """Each rank's output rows of the requests it owns -> every row of the step on every rank, in step order
        (one variable all-gather)."""
        if comm.size == 1:
            return out
        return self.to_step_order(comm.all_gatherv(out.contiguous(), self.counts))

    def attend_at_owners(self, comm, q: torch.Tensor, attend) -> torch.Tensor:
        """DOP: this rank's heads' queries q [N, H_l, D] of every step row -> their õ [N, H_l, d_c] in step order,
        each row attended with all heads by its owner (`attend` runs the owner's kernel over its rows). Two variable
        all-to-alls carry the rows there and the per-head outputs back: one row per request in decode."""
        T = comm.size
        if T == 1:
            return attend(q)
        n, hl, d = len(self.rows_mine), q.shape[1], q.shape[2]
        recv = comm.all_to_allv(q[self.by_owner].reshape(-1, hl * d).contiguous(), self.counts, [n] * T)
        o = attend(recv.view(T, n, hl, d).permute(1, 0, 2, 3).reshape(n, T * hl, d))   # heads by source rank
        dc = o.shape[2]
        back = o.view(n, T, hl, dc).permute(1, 0, 2, 3).reshape(T * n, hl * dc).contiguous()
        return self.to_step_order(comm.all_to_allv(back, [n] * T, self.counts).view(-1, hl, dc))


class OwnedAttention:
    """Shared step preparation of the request-owned layouts (DP-attn, DOP): this rank allocates blocks for the
    new tokens of the requests it owns and plans attention over their rows (in step order)."""

    def __init__(self, ctx: RankContext):
        self.r = ctx  # this rank's state (splash.attention.context)

    def prepare(self, batch: StepBatch) -> None:
        self.g = OwnerGroups.build(batch, self.r.comm.size, self.r.comm.rank)
        self.meta = self.r.plan_step(self.g.mine)
