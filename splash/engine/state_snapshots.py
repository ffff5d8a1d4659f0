"""Rank 0's record of the KDA state snapshots every rank keeps for the prefix cache — pure Python, no torch.

A hybrid model (glm5_next) can start a request on cached KV blocks only from its KDA layers' state at the end of
those blocks, so, as vLLM (Mamba state on the block grid) and SGLang (MambaRadixCache) do, a copy of a request's state
is taken at chosen block boundaries, named by the prefix hash of the block ending there, and a hit is cut back to
its last block with one. At most three per running request: the block before its prompt's last token's (where a
repeat of the prompt resumes), the end of its prompt's already-cached leading run (a shared system prompt), and its
latest full block past the prompt (the next turn of a conversation), replacing its previous one. They live on the
ranks that run the request's KDA layers (`state_holders`), `per_rank` slots each, counted in the KV budget as
splash.layouts.memory counts KDA states; a full rank drops its least recently used one not taken this step.
A snapshot survives its step only if its block is then cached (`settle`), goes when no rank caches its block any
more (`blocks_gone`), and all go at a layout switch. Every take and drop travels in the step message.
"""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

from splash.engine.messages import BlockHash, StepItem
from splash.layouts.layout import parse_layout
from splash.layouts.memory import states_per_rank

if TYPE_CHECKING:   # the scheduler imports the ledger, which holds this record
    from splash.engine.scheduler import Request


def state_holders(layout: str, owner: int, world: int) -> list[int]:
    """Ranks holding (a part of) a request's KDA state in `layout`: all (heads sharded: TP, DOP) or its owner
    (owner-run: DP-attn, CP anchor). splash.attention.hybrid places the state this way."""
    return list(range(world)) if parse_layout(layout).shards_projections else [owner]


class StateSnapshots:
    def __init__(self, world: int, block_size: int, layout: str, slots: int):
        self.world, self.block_size, self.slots = world, block_size, slots
        self.relayout(layout)

    def relayout(self, layout: str) -> None:
        """A layout switch: every rank forgets its snapshots (the ranks do so as they apply the switch)."""
        self.layout = layout
        self.per_rank = states_per_rank(layout, self.slots, self.world)
        self.held: list[OrderedDict[int, None]] = [OrderedDict() for _ in range(self.world)]   # LRU, oldest first
        self.pending: dict[int, None] = {}           # taken in the step being run, not settled (in order)
        self.latest: dict[str, int] = {}             # running request -> hash of its newest past-prompt snapshot
        self.drops: list[list[int]] = [[] for _ in range(self.world)]   # per rank, for the next step message

    def holders(self, owner: int) -> list[int]:
        return state_holders(self.layout, owner, self.world)

    def usable(self, h: int, owner: int) -> bool:
        """A request with `owner` can resume from the snapshot `h` (every rank that will hold its state has it)."""
        return all(h in self.held[r] and h not in self.pending for r in self.holders(owner))

    def touch(self, h: int, owner: int) -> None:
        """A hit resumed from `h`: most recently used."""
        for r in self.holders(owner):
            self.held[r].move_to_end(h)

    # ---- taking snapshots (rank 0 decides which, before the step) ---------------------------------------------
    def points(self, start: int, end: int, prompt_len: int) -> list[int]:
        """Blocks whose end boundary a step piece [start, end) of a request with `prompt_len` prompt tokens crosses
        and that get a snapshot: the block before its prompt's last token's block, and the last full block it
        reaches past that one."""
        bs = self.block_size
        first = (prompt_len - 1) // bs * bs      # boundary a repeat of the prompt resumes at
        out = [first // bs - 1] if first and start < first <= end else []
        last = end // bs * bs
        if last > max(first, start):
            out.append(last // bs - 1)
        return out

    def take(self, req: str, h: int, owner: int, latest: bool) -> bool:
        """Whether the ranks should snapshot `req`'s state at the boundary named `h` during this step: not when its
        holders have it already or have no slot to spare (every one taken in this step). A `latest` snapshot
        replaces the request's previous one."""
        ranks = [r for r in self.holders(owner) if h not in self.held[r]]
        if not ranks or h in self.pending:
            return False
        for r in ranks:
            if len(self.held[r]) >= self.per_rank and not self._make_room(r):
                return False
        for r in ranks:
            self.held[r][h] = None
        self.pending[h] = None
        if latest:
            prev = self.latest.get(req)
            if prev is not None and prev not in self.pending:
                self._drop(prev, self.holders(owner))
            self.latest[req] = h
        return True

    def junction(self, start: int, end: int, prompt_len: int, hash_of, cached) -> int | None:
        """The block a prefill piece [start, end) ends that is the last of a run of cached blocks (`cached(hash)`)
        the next block leaves — where the request's prompt parts from prompts seen before (a shared system prompt): a
        snapshot there lets later requests sharing only that part resume after it (vLLM's shared-prefix checkpoint).
        Only within the blocks a repeat could hit (before the prompt's last token's block)."""
        bs = self.block_size
        hit = (prompt_len - 1) // bs                   # blocks a repeat could hit
        for b in range(start // bs, min(end // bs, hit)):   # blocks ending inside the piece
            if (b + 1) * bs > start and cached(hash_of(b)) and (b + 1 == hit or not cached(hash_of(b + 1))):
                return b
        return None

    def plan(self, items: Sequence[StepItem], requests: Mapping[str, Request],
             cached=lambda h: False) -> list[BlockHash]:
        """The step's snapshots for its pieces `items` (of `requests`), in piece order: `points`, and the `junction`
        of a prompt with the blocks `cached` names."""
        out, bs = [], self.block_size
        for it in items:
            req = requests[it.req_id]
            start, end, plen = it.start_pos, it.end_pos, len(req.prompt)
            hash_of = lambda b, q=req: q.block_hash(b, bs)  # noqa: E731
            first = (plen - 1) // bs - 1
            points = self.points(start, end, plen)
            j = self.junction(start, end, plen, hash_of, cached) if end - start > 1 else None
            for b in sorted({*points, *([] if j is None else [j])}):
                h = hash_of(b)
                if self.take(it.req_id, h, it.owner, latest=b in points and b != first):
                    out.append(BlockHash(it.req_id, b, h))
        return out

    def _make_room(self, r: int) -> bool:
        for h in self.held[r]:
            if h not in self.pending:
                self._drop(h, [r])
                return True
        return False

    def _drop(self, h: int, ranks: list[int] | None = None) -> None:
        for r in range(self.world) if ranks is None else ranks:
            if h in self.held[r]:
                del self.held[r][h]
                self.drops[r].append(h)

    # ---- after the step --------------------------------------------------------------------------------------
    def settle(self, cached, running) -> None:
        """After the step's blocks were registered: keep its snapshots whose block `cached(h)` is cached on some
        rank, drop the others; forget which snapshot is the newest of requests no longer `running`."""
        self.blocks_gone(self.pending, cached)
        self.pending = {}
        self.latest = {q: h for q, h in self.latest.items() if q in running}

    def blocks_gone(self, hashes, cached) -> None:
        """Cached blocks `hashes` were evicted on some rank: their snapshots go once no rank caches them."""
        for h in hashes:
            if not cached(h):
                self._drop(h)

    def take_drops(self) -> list[list[int]]:
        out, self.drops = self.drops, [[] for _ in range(self.world)]
        return out
