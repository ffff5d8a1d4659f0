"""The step batch every rank executes (replicated), and the rank-local attention plan built from it."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch


@dataclass(frozen=True)
class StepRequest:
    req_id: str
    start_pos: int   # tokens already in the KV history before this step
    num_new: int     # query rows this step (prefill chunk length, or 1 in decode)
    owner: int = 0   # owner rank under DP-attn / DOP

    @property
    def end_pos(self) -> int:
        return self.start_pos + self.num_new


@dataclass
class StepBatch:
    reqs: list[StepRequest]
    token_ids: torch.Tensor   # [N] long
    positions: torch.Tensor   # [N] long
    sample_rows: list[int]    # rows whose logits are needed (last row of each request that samples)

    @classmethod
    def build(cls, reqs: list[StepRequest], tokens: list[list[int]], sample: list[bool]) -> "StepBatch":
        ids, pos, rows, r = [], [], [], 0
        for q, t, s in zip(reqs, tokens, sample):
            assert len(t) == q.num_new, (q, len(t))
            ids.extend(t)
            pos.extend(range(q.start_pos, q.end_pos))
            r += q.num_new
            if s:
                rows.append(r - 1)
        return cls(reqs, torch.tensor(ids, dtype=torch.long), torch.tensor(pos, dtype=torch.long), rows)

    @property
    def num_rows(self) -> int:
        return int(self.token_ids.numel())

    def row_ranges(self) -> list[range]:
        out, r = [], 0
        for q in self.reqs:
            out.append(range(r, r + q.num_new))
            r += q.num_new
        return out


@dataclass
class AttnPlan:
    """Where this rank writes new KV and what each local query row attends to.

    Row indices refer to the caller's row space: the concatenated rows of `reqs` (a subset of the step,
    in step order)."""
    write_rows: torch.Tensor                 # rows whose new KV this rank stores
    write_slots: torch.Tensor                # their cache slots
    decode_rows: torch.Tensor                # [Bd] rows of single-row requests
    decode_slots: torch.Tensor               # [Bd, S] cache slots (padded)
    decode_valid: torch.Tensor               # [Bd, 1, S] bool
    prefill: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]  # (rows [n], slots [S], valid [1, n, S])
    num_rows: int


def build_attn_plan(reqs: list[StepRequest], table: Callable[[str], dict[int, int]], block_size: int,
                    write_here: Callable[[int], bool]) -> AttnPlan:
    """`table(req_id)` gives this rank's logical->physical blocks (already covering the new tokens it stores);
    `write_here(logical_block)` says whether this rank stores positions of that block."""
    w_rows, w_slots, dec, pre = [], [], [], []
    r = 0
    for q in reqs:
        t = table(q.req_id)
        for i, p in enumerate(range(q.start_pos, q.end_pos)):
            if write_here(p // block_size):
                w_rows.append(r + i)
                w_slots.append(t[p // block_size] * block_size + p % block_size)
        slots, spos = _visible(t, q.end_pos, block_size)
        rows = torch.arange(r, r + q.num_new)
        qpos = torch.arange(q.start_pos, q.end_pos)
        valid = spos[None, :] <= qpos[:, None]
        if q.num_new == 1:
            dec.append((r, slots, valid[0]))
        else:
            pre.append((rows, slots, valid[None]))
        r += q.num_new
    d_rows, d_slots, d_valid = _pad_decode(dec)
    return AttnPlan(torch.tensor(w_rows, dtype=torch.long), torch.tensor(w_slots, dtype=torch.long),
                    d_rows, d_slots, d_valid, pre, r)


def _visible(table: dict[int, int], end_pos: int, bs: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Slots and positions of every held position < end_pos."""
    slots, pos = [], []
    for lb in sorted(table):
        lo = lb * bs
        if lo >= end_pos:
            continue
        n = min(bs, end_pos - lo)
        base = table[lb] * bs
        slots.extend(range(base, base + n))
        pos.extend(range(lo, lo + n))
    return torch.tensor(slots, dtype=torch.long), torch.tensor(pos, dtype=torch.long)


def _pad_decode(dec: list) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    if not dec:
        return torch.empty(0, dtype=torch.long), torch.empty(0, 0, dtype=torch.long), torch.empty(0, 1, 0, dtype=torch.bool)
    s = max(x[1].numel() for x in dec)
    slots = torch.zeros(len(dec), s, dtype=torch.long)
    valid = torch.zeros(len(dec), 1, s, dtype=torch.bool)
    for i, (_, sl, v) in enumerate(dec):
        slots[i, :sl.numel()] = sl
        valid[i, 0, :sl.numel()] = v
    return torch.tensor([x[0] for x in dec], dtype=torch.long), slots, valid


def attend_plan(cache, layer: int, plan: AttnPlan, q: torch.Tensor, d_c: int,
                scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Run latent attention for every row of `plan` on this rank's cache.

    q [num_rows, H, D] -> (õ [num_rows, H, d_c], LSE [num_rows, H])."""
    from splash.attention.mla import attend_dense

    n, H = q.shape[0], q.shape[1]
    o = q.new_zeros(n, H, d_c, dtype=torch.float32)
    lse = torch.full((n, H), float("-inf"), dtype=torch.float32)
    if plan.decode_rows.numel():
        c, kpe = cache.read(layer, plan.decode_slots)
        oo, ll = attend_dense(q[plan.decode_rows][:, None], torch.cat([c, kpe], -1), plan.decode_valid, d_c, scale)
        o[plan.decode_rows], lse[plan.decode_rows] = oo[:, 0], ll[:, 0]
    for rows, slots, valid in plan.prefill:
        c, kpe = cache.read(layer, slots)
        oo, ll = attend_dense(q[rows][None], torch.cat([c, kpe], -1)[None], valid, d_c, scale)
        o[rows], lse[rows] = oo[0], ll[0]
    return o, lse
