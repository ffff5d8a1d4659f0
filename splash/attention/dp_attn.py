"""DP-attn: replicated projections; each rank attends only the requests it owns, on its own cache, with all
heads (TP's attention on the owner's rows: splash.attention.tp.attend_stored_rows); a variable-size all-gather
brings every rank's output rows back to all ranks."""
from __future__ import annotations

import torch

from splash.attention.grouping import OwnedAttention
from splash.attention.tp import attend_stored_rows


class DPAttention(OwnedAttention):
    def attention(self, layer: int, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        rows = self.g.rows_mine
        out = attend_stored_rows(self.r, self.meta, layer, x[rows], cos[rows], sin[rows])
        return self.g.gather(self.r.comm, out)
