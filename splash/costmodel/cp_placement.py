"""Where CP keeps a request's positions: blocks round-robin over the ranks from the request's anchor (its owner),
as splash/kv and splash/attention/cp.py place them — counted per rank for the cost model. Pure Python."""
from __future__ import annotations


def cp_keys_here(end: int, anchor: int, rank: int, world: int, bs: int) -> tuple[int, int]:
    """(positions < end, blocks) of one request held on ``rank`` under CP (block round-robin from ``anchor``)."""
    nb = -(-end // bs)
    full, rem = divmod(nb, world)
    first = (rank - anchor) % world  # first block index homed here
    blocks = full + (1 if first < rem else 0)
    if blocks == 0:
        return 0, 0
    last_block = first + (blocks - 1) * world
    tail = end - last_block * bs  # tokens of the last held block
    return (blocks - 1) * bs + min(bs, tail), blocks


def cp_new_rows_here(p, rank: int, world: int, bs: int) -> int:
    """New positions of ``p`` whose block is homed on ``rank`` (where CP writes their KV)."""
    if p.new <= 0:
        return 0
    lo, hi = p.context, p.end
    n = 0
    for b in range(lo // bs, (hi - 1) // bs + 1):
        if (b + p.owner) % world == rank:
            n += min(hi, (b + 1) * bs) - max(lo, b * bs)
    return n
