"""Which KV blocks a switch moves, keeps, re-shares and drops, planned per physical block. Pure, no torch.

A rank's pool holds one physical block per prefix hash, shared by the requests that start on it, so the unit a
switch moves is the physical block: a private block is (request, logical block); a hash-named one is its hash on
the rank holding it, and a rank that already holds that hash lets the request take it by reference (``attach``),
so k requests sharing a prefix cost one block per receiving rank, not k.

Idle cached blocks (``CachedBlock``), newest first, are kept where the destination layout would look them up (the
owner / CP anchor that cached them; under TP every rank) when they fit under ``cap`` less the blocks running
requests reference there, and when a copy is already there or ``move_cached`` (the cost model's verdict that a
transfer costs less than the recompute it saves) lets them move; a block TP needs on several ranks is kept on all
or none (docs/layouts.md, "Prefix cache across a switch").
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from splash.layouts.layout import KV_ALL, Layout
from splash.layouts.ownership import block_holders, cp_block_rank, kv_holders, num_blocks


@dataclass(frozen=True)
class CachedBlock:
    """An idle cached block: hash ``h`` of logical block ``block_idx`` on ``rank`` (listed oldest first)."""
    h: int
    block_idx: int
    rank: int


@dataclass(frozen=True)
class BlockMove:
    """KV block ``block_idx`` travels ``src_rank`` → ``dst_rank`` (all layers): ``req``'s private block, or (``h``
    set) the block named ``h`` (``req``: the first request sharing it, "" for an idle one)."""
    req: str
    block_idx: int
    src_rank: int
    dst_rank: int
    h: int | None = None


@dataclass
class BlockPlan:
    moves: list[BlockMove]
    keep: list[list[tuple[str, int]]]             # per rank: (req, block) referenced and still needed there
    discard: list[list[tuple[str, int]]]          # per rank: (req, block) referenced and no longer needed there
    attach: list[list[tuple[str, int, int]]]      # per rank: (req, block, hash) it takes by reference there
    named: list[list[int]]                        # per rank: every hash its pool names after the switch
    cached_kept: list[list[int]]                  # per rank: idle hashes kept, oldest first
    dropped: list[list[int]]                      # per rank: hashes it named before and forgets
    in_use: list[int]                             # per rank: physical blocks running requests reference after
    logical_blocks: int                           # distinct blocks of KV in the switch (a shared one once)


def _pick_source(holders, block_idx: int, world: int) -> int:
    """Sender of a missing block: its CP home rank if that holds it (spreads senders), else the lowest holder."""
    home = cp_block_rank(block_idx, world)
    return home if home in holders else min(holders)


def _cache_owner(src: Layout, cb: CachedBlock, world: int) -> int:
    """The owner (CP: anchor) a lookup would use to find `cb` where it lies in the source layout."""
    if src.kv_ownership == KV_ALL or src.owner_based:
        return cb.rank
    return (cb.rank - cb.block_idx) % world   # CP: block b of anchor a lives on (b + a) % world


def _holdings(src: Layout, dst: Layout, world: int, requests: Mapping, owners: Mapping[str, int], block_size: int,
              cached: Sequence[CachedBlock]) -> tuple[dict, list[set[int]]]:
    """Per request its blocks' holders before and after, and its hashes; per rank the hashes it names before."""
    had: list[set[int]] = [set() for _ in range(world)]
    for cb in cached:
        had[cb.rank].add(cb.h)
    layouts = {}
    for req in sorted(requests):
        st = requests[req]
        nb = num_blocks(st.num_tokens, block_size)
        hashes = tuple(st.hashes)[:nb]
        try:
            layouts[req] = (kv_holders(src, nb, st.src_owner, world), kv_holders(dst, nb, owners.get(req), world),
                            hashes)
        except ValueError as e:
            raise ValueError(f"request {req!r}: {e}") from None
        for b, h in enumerate(hashes):
            for r in layouts[req][0][b]:
                had[r].add(h)
    return layouts, had


def plan_blocks(src: Layout, dst: Layout, world: int, requests: Mapping, owners: Mapping[str, int],
                block_size: int, cached: Sequence[CachedBlock] = (), cap: Sequence[int] | None = None,
                move_cached: bool = True) -> BlockPlan:
    """Moves (one per block and destination rank), keeps, discards, re-shares and idle blocks kept or dropped, by
    the module's rule. ``requests``: req -> ReqState; ``owners``: destination owners / CP anchors."""
    moves: list[BlockMove] = []
    keep = [[] for _ in range(world)]
    discard = [[] for _ in range(world)]
    attach = [[] for _ in range(world)]
    layouts, had = _holdings(src, dst, world, requests, owners, block_size, cached)
    holders_of: dict[int, set[int]] = {}
    for r in range(world):
        for h in had[r]:
            holders_of.setdefault(h, set()).add(r)
    named: list[dict[int, None]] = [{} for _ in range(world)]   # ordered sets
    arriving: set[tuple[int, int]] = set()
    private = 0
    in_use = [0] * world

    def bring(h: int, b: int, r: int, req: str) -> None:
        if h not in had[r] and (h, r) not in arriving:
            arriving.add((h, r))
            moves.append(BlockMove(req, b, _pick_source(holders_of[h], b, world), r, h))

    for req in sorted(requests):
        before, after, hashes = layouts[req]
        for b, (have, need) in enumerate(zip(before, after)):
            h = hashes[b] if b < len(hashes) else None
            for r in sorted(have):
                (keep if r in need else discard)[r].append((req, b))
            if h is None:
                private += 1
                for r in need:
                    in_use[r] += 1
                moves += [BlockMove(req, b, _pick_source(have, b, world), r) for r in sorted(need - have)]
                continue
            for r in sorted(need):
                named[r][h] = None
            for r in sorted(need - have):
                bring(h, b, r, req)
                attach[r].append((req, b, h))
    shared = {h for per in named for h in per}
    in_use = [n + len(named[r]) for r, n in enumerate(in_use)]
    room = None if cap is None else [c - n for c, n in zip(cap, in_use)]
    kept = _keep_idle(src, dst, world, cached, room, move_cached, had, named, bring)
    moved_idle = {mv.h for mv in moves if mv.req == "" and mv.h is not None}
    dropped = [sorted(had[r] - set(named[r])) for r in range(world)]
    return BlockPlan(moves, keep, discard, attach, [list(n) for n in named], kept, dropped, in_use,
                     private + len(shared) + len(moved_idle - shared))


def _keep_idle(src: Layout, dst: Layout, world: int, cached: Sequence[CachedBlock], room: Sequence[int] | None,
               move_cached: bool, had: list[set[int]], named: list[dict[int, None]], bring) -> list[list[int]]:
    """The idle cached blocks kept, per destination rank (oldest first); adds them to `named`, plans their moves."""
    left = list(room) if room is not None else [None] * world
    kept: list[list[int]] = [[] for _ in range(world)]
    for cb in reversed(cached):   # newest first
        where = block_holders(dst, cb.block_idx, _cache_owner(src, cb, world), world)
        new = [r for r in where if cb.h not in named[r]]
        if any(left[r] is not None and left[r] < 1 for r in new):
            continue
        if not move_cached and any(cb.h not in had[r] for r in new):
            continue
        for r in new:
            bring(cb.h, cb.block_idx, r, "")
            named[r][cb.h] = None
            kept[r].append(cb.h)
            if left[r] is not None:
                left[r] -= 1
    return [k[::-1] for k in kept]
