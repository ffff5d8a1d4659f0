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
                    write_here: Callable[[StepRequest, int], bool]) -> AttnPlan:
    """`table(req_id)` gives this rank's logical->physical blocks (already covering the new tokens it stores);
    `write_here(request, logical_block)` says whether this rank stores positions of that block."""
    w_rows, w_slots, pre = [], [], []
    d_rows, d_blocks, d_qpos = [], [], []  # decode requests: held (logical, physical) blocks, tensorised once
    r = 0
    for q in reqs:
        t = table(q.req_id)
        for i, p in enumerate(range(q.start_pos, q.end_pos)):
            if write_here(q, p // block_size):
                w_rows.append(r + i)
                w_slots.append(t[p // block_size] * block_size + p % block_size)
        if q.num_new == 1:
            d_rows.append(r)
            d_blocks.append([(lb, t[lb]) for lb in sorted(t) if lb * block_size < q.end_pos])
            d_qpos.append(q.start_pos)
        else:
            slots, spos = _visible(t, q.end_pos, block_size)
            valid = spos[None, :] <= torch.arange(q.start_pos, q.end_pos)[:, None]
            pre.append((torch.arange(r, r + q.num_new), slots, valid[None]))
        r += q.num_new
    dr, ds, dv = _pad_decode(d_rows, d_blocks, d_qpos, block_size)
    return AttnPlan(torch.tensor(w_rows, dtype=torch.long), torch.tensor(w_slots, dtype=torch.long),
                    dr, ds, dv, pre, r)


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


def _pad_decode(rows: list[int], blocks: list[list[tuple[int, int]]], qpos: list[int],
                bs: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Decode requests as whole held blocks, padded to the most blocks: rows [Bd], slots [Bd, S], valid [Bd, 1, S]
    with S = blocks × block_size. Keys past the query position (the unwritten tail of the last block, padding
    blocks) are invalid; vectorised because this runs every step for every running request."""
    if not rows:
        return torch.empty(0, dtype=torch.long), torch.empty(0, 0, dtype=torch.long), torch.empty(0, 1, 0, dtype=torch.bool)
    nb = max(len(b) for b in blocks)
    logical = torch.tensor([[lb for lb, _ in b] + [-1] * (nb - len(b)) for b in blocks], dtype=torch.long)
    phys = torch.tensor([[p for _, p in b] + [0] * (nb - len(b)) for b in blocks], dtype=torch.long)
    off = torch.arange(bs)
    slots = (phys[:, :, None] * bs + off).view(len(rows), nb * bs)
    pos = (logical[:, :, None] * bs + off).view(len(rows), nb * bs)
    valid = (pos <= torch.tensor(qpos, dtype=torch.long)[:, None]) & (pos >= 0)
    return torch.tensor(rows, dtype=torch.long), slots, valid[:, None, :]


def attend_plan(cache, layer: int, plan: AttnPlan, q: torch.Tensor, d_c: int,
                scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Run latent attention for every row of `plan` on this rank's cache.

    q [num_rows, H, D] -> (õ [num_rows, H, d_c], LSE [num_rows, H])."""
    from splash.attention.mla import attend_latent

    n, H = q.shape[0], q.shape[1]
    nd = plan.decode_rows.numel()
    if nd == n and not plan.prefill:  # pure decode step: rows are 0..n-1 in order, no scatter needed
        c, kpe = cache.read(layer, plan.decode_slots)
        return attend_latent(q, c, kpe, plan.decode_valid, scale)
    o = q.new_zeros(n, H, d_c, dtype=torch.float32)
    lse = torch.full((n, H), float("-inf"), dtype=torch.float32)
    if nd:
        c, kpe = cache.read(layer, plan.decode_slots)
        o[plan.decode_rows], lse[plan.decode_rows] = attend_latent(q[plan.decode_rows], c, kpe, plan.decode_valid,
                                                                   scale)
    for rows, slots, valid in plan.prefill:
        c, kpe = cache.read(layer, slots)
        # one query row per (token, head) against the request's keys: a batch of 1 (explicit sizes: S may be 0)
        nr, s = rows.numel(), slots.numel()
        per_head = valid[:, :, None, :].expand(1, nr, H, s).reshape(1, nr * H, s)
        oo, ll = attend_latent(q[rows].reshape(1, nr * H, q.shape[-1]), c[None], kpe[None], per_head, scale)
        o[rows], lse[rows] = oo.view(nr, H, d_c), ll.view(nr, H)
    return o, lse
