"""One rank's block bookkeeping at a switch's boundary (pure; the switch executor moves the data).

Order: pick the blocks to send, drop the references and hashes the destination does not need here (freed now,
or once the step has sent them), allocate the arriving blocks, attach hash-named ones. Requests released at this
boundary (``gone``) move no private block; their hash-named blocks, idle now, travel like any other.
"""
from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field


@dataclass
class BlockHandoff:
    send: list[int] = field(default_factory=list)       # physical blocks to send, by destination rank
    send_counts: list[int] = field(default_factory=list)
    recv: list[int] = field(default_factory=list)       # physical blocks that receive, by source rank
    recv_counts: list[int] = field(default_factory=list)
    free_later: list[int] = field(default_factory=list)  # free once every send is done (the step's end)
    touched: set[str] = field(default_factory=set)       # requests whose page-table rows changed


def begin_blocks(bm, m, me: int, gone=frozenset()) -> BlockHandoff:
    """Apply manifest `m`'s block plan to rank `me`'s block manager `bm`; -> what to send and receive."""
    moves = [mv for mv in m.moves if mv.h is not None or mv.req not in gone]
    out = sorted((mv for mv in moves if mv.src_rank == me), key=lambda mv: mv.dst_rank)   # stable per peer
    inc = sorted((mv for mv in moves if mv.dst_rank == me), key=lambda mv: mv.src_rank)
    hs = BlockHandoff(send_counts=[0] * m.world, recv_counts=[0] * m.world)
    for mv in out:
        hs.send.append(bm.block_of(mv.h) if mv.h is not None else bm.table(mv.req)[mv.block_idx])
        hs.send_counts[mv.dst_rank] += 1
    sent = {(mv.req, mv.block_idx) for mv in out if mv.h is None}
    sent_h = {mv.h for mv in out if mv.h is not None}
    by_req: dict[str, list[int]] = defaultdict(list)
    for req, b in m.discard[me]:
        by_req[req].append(b)
    free_now: list[int] = []
    for req, blocks in by_req.items():
        free_now += bm.detach(req, [b for b in blocks if (req, b) not in sent])
        hs.free_later += bm.detach(req, [b for b in blocks if (req, b) in sent])
    named = set(m.named[me]) if m.named else set()
    drop = [h for h in bm.cached_hashes() if h not in named]
    free_now += bm.forget([h for h in drop if h not in sent_h])
    hs.free_later += bm.forget([h for h in drop if h in sent_h])
    bm.free_physical(free_now)
    for mv in inc:
        if mv.h is not None:
            hs.recv.append(bm.receive(mv.h))
        else:
            (_, p), = bm.ensure(mv.req, [mv.block_idx])
            hs.recv.append(p)
            hs.touched.add(mv.req)
        hs.recv_counts[mv.src_rank] += 1
    for req, b, h in (m.attach[me] if m.attach else ()):
        if req not in gone:
            bm.attach(req, [(b, h)])
            hs.touched.add(req)
    hs.touched |= set(by_req) - set(gone)
    return hs
