"""Rank 0's mirror of every rank's KV block usage under the current layout — pure Python, no torch.

Which ranks hold a logical block is the ownership model's answer (`splash.layouts.ownership.block_holders`,
`blocks_held`), so the scheduler admits against exactly the blocks each rank's real pool will allocate.

With the prefix cache on, it is also the one truth of what every rank caches (per rank: prefix hash -> requests
referencing it; unreferenced ones are evictable, oldest first). `used` counts blocks requests hold, a shared one
once. Every hit, registration and eviction is decided here and travels in the step message, so the ranks' block
managers never decide one themselves. A switch keeps the cache as its manifest plans it (`relayout`).
"""
from __future__ import annotations

import copy
import functools
import itertools
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from splash.engine.state_snapshots import StateSnapshots
from splash.layouts.layout import KV_POSITION, kv_ownership_of
from splash.layouts.ownership import block_holders, blocks_held


# The ownership model's answer per (layout, block, owner, world), remembered: the prefix cache asks it for every
# shared block a request attaches, registers or releases (~60k times over the built-in mix's forecasts), and
# answering it parses the layout each time. It depends on nothing else, so the cached answer is the answer.
_block_holders = functools.lru_cache(maxsize=1 << 14)(block_holders)


def _blocks(tokens: int, bs: int) -> int:
    return -(-tokens // bs)


@dataclass(slots=True)
class Entry:
    """One request on the ledger: the tokens its blocks hold, its owner (DP-attn/DOP owner, CP anchor) and the tokens
    it may reach (prompt + max_tokens; 0 when not given)."""
    tokens: int
    owner: int
    final: int = 0


@dataclass
class KVLedger:
    world: int
    blocks_per_rank: int
    block_size: int
    layout: str
    capacity: dict[str, int] = field(default_factory=dict)  # usable blocks per rank per layout (default: all)
    used: list[int] = field(default_factory=list)
    reqs: dict[str, Entry] = field(default_factory=dict)
    prefix: bool = False                                      # the prefix cache is on
    shared: dict[str, list[int]] = field(default_factory=dict)   # req -> hashes of its leading cached blocks
    snapshots: StateSnapshots | None = None   # a hybrid model's KDA state snapshots (a hit must end at one)

    def __post_init__(self) -> None:
        self.used = [0] * self.world
        self._clear_cache()

    def _clear_cache(self) -> None:
        self.refs: list[dict[int, int]] = [{} for _ in range(self.world)]        # per rank: hash -> references
        # per rank: evictable hashes, oldest first, each with the tick it became evictable (one clock for all ranks)
        self.lru: list[OrderedDict[int, int]] = [OrderedDict() for _ in range(self.world)]
        self.shared = {}
        self.block_of: dict[int, int] = {}   # hash -> its logical block index (a prefix hash fixes its position)
        self._tick = itertools.count()

    def cap(self, layout: str | None = None) -> int:
        """Blocks per rank the KV may use under `layout`: the physical pool less what that layout's
        projections take beyond the most compact layout's (replicated projections eat KV room)."""
        return self.capacity.get(layout or self.layout, self.blocks_per_rank)

    def holders(self, block: int, owner: int, layout: str | None = None) -> tuple[int, ...]:
        return _block_holders(layout or self.layout, block, owner, self.world)

    def blocks_needed(self, owner: int, b0: int, b1: int, layout: str | None = None) -> list[int]:
        """Blocks each rank holds of logical blocks [b0, b1) of a request."""
        return blocks_held(layout or self.layout, owner, b0, b1, self.world)

    def growth(self, req: str, new_tokens: int, owner: int = 0) -> list[int]:
        e = self.reqs.get(req)
        tokens, own = (e.tokens, e.owner) if e is not None else (0, owner)
        return self.blocks_needed(own, _blocks(tokens, self.block_size), _blocks(new_tokens, self.block_size))

    def short_ranks(self, req: str, new_tokens: int, owner: int = 0) -> list[int]:
        """The ranks without room for `req` to grow to `new_tokens`."""
        need = self.growth(req, new_tokens, owner)
        cap = self.cap()
        return [r for r in range(self.world) if self.used[r] + need[r] > cap]

    def holder_counts(self) -> list[int]:
        """Per rank, how many requests hold blocks there."""
        out = [0] * self.world
        for e in self.reqs.values():
            for r, n in enumerate(self.blocks_needed(e.owner, 0, _blocks(e.tokens, self.block_size))):
                out[r] += n > 0
        return out

    def grow(self, req: str, new_tokens: int, owner: int = 0, final: int | None = None) -> None:
        need = self.growth(req, new_tokens, owner)
        e = self.reqs.get(req)
        if e is None:
            e = self.reqs[req] = Entry(0, owner, final or 0)
        e.tokens = max(e.tokens, new_tokens)
        for r in range(self.world):
            self.used[r] += need[r]

    def frees(self, req: str) -> list[int]:
        """Per rank, the blocks `release(req)` would give back: those of its blocks no other request references (its
        own, and cached ones only it uses; the latter become evictable)."""
        e, shared = self.reqs[req], self.shared.get(req, ())
        owner, out = e.owner, self.blocks_needed(e.owner, len(shared), _blocks(e.tokens, self.block_size))
        for i, h in enumerate(shared):
            for r in self.holders(i, owner):
                out[r] += self.refs[r].get(h) == 1
        return out

    def fork(self, layout: str, blocks_per_rank: int) -> "KVLedger":
        """A copy to plan on (the auto forecast): the same requests and cache under a pool of `blocks_per_rank`,
        switched to `layout` as `relayout` switches (without new owners, keeping no idle cached block) when it is not
        this ledger's."""
        led = KVLedger(self.world, blocks_per_rank, self.block_size, self.layout, prefix=self.prefix)
        led.used, led.reqs = list(self.used), {r: Entry(e.tokens, e.owner, e.final) for r, e in self.reqs.items()}
        led.shared = {r: list(v) for r, v in self.shared.items()}
        led.refs = [dict(d) for d in self.refs]
        led.lru = [OrderedDict(d) for d in self.lru]
        led.block_of, led._tick = dict(self.block_of), copy.copy(self._tick)
        if layout != self.layout:   # as a switch without idle cached blocks kept would leave it
            led.relayout(layout, kept=[()] * self.world if self.prefix else None)
        return led

    def release(self, req: str) -> None:
        if req not in self.reqs:
            return
        self.used = [u - n for u, n in zip(self.used, self.frees(req))]
        owner = self.reqs.pop(req).owner
        for i, h in enumerate(self.shared.pop(req, ())):
            for r in self.holders(i, owner):
                self.refs[r][h] -= 1
                if not self.refs[r][h]:   # no request uses it now: evictable
                    self.lru[r][h] = next(self._tick)

    # ---- prefix cache (rank 0's mirror of every rank's) --------------------------------------------------------
    def lookup(self, hashes: list[int], owner: int) -> tuple[int, list[int]]:
        """How many leading blocks of `hashes` are cached where a request with `owner` would hold them, and per rank
        how many of those are evictable now (taking them puts them back in use). With KDA state snapshots the run
        ends at its last block that has one where the request would run."""
        k = 0
        while k < len(hashes) and all(hashes[k] in self.refs[r] for r in self.holders(k, owner)):
            k += 1
        snaps = self.snapshots
        while snaps is not None and k and not snaps.usable(hashes[k - 1], owner):
            k -= 1
        revive = [0] * self.world
        for i in range(k):
            for r in self.holders(i, owner):
                revive[r] += not self.refs[r][hashes[i]]
        return k, revive

    def attach(self, req: str, owner: int, hashes: list[int], final: int | None = None) -> None:
        """A new request starts on the cached blocks `hashes` (its first len(hashes) blocks), by reference."""
        self.reqs[req] = Entry(len(hashes) * self.block_size, owner, final or 0)
        self.shared[req] = list(hashes)
        if self.snapshots is not None and hashes:
            self.snapshots.touch(hashes[-1], owner)
        for i, h in enumerate(hashes):
            self.block_of[h] = i
            for r in self.holders(i, owner):
                refs = self.refs[r]
                if not refs[h]:
                    del self.lru[r][h]
                    self.used[r] += 1
                refs[h] += 1

    def register(self, req: str, block: int, h: int) -> bool:
        """`req`'s full block `block` (its next after its cached ones) becomes cached under `h`, unless `h` is
        cached already; -> whether it did (then the ranks register it too)."""
        tokens, owner = self.reqs[req].tokens, self.reqs[req].owner
        shared = self.shared.setdefault(req, [])
        if block != len(shared) or (block + 1) * self.block_size > tokens:
            return False
        holders = self.holders(block, owner)
        if any(h in self.refs[r] for r in holders):
            return False
        for r in holders:
            self.refs[r][h] = 1      # was the request's own block, held already: `used` does not change
        shared.append(h)
        self.block_of[h] = block
        return True

    def evictions(self) -> list[list[int]]:
        """Per rank, the oldest evictable blocks to give up so that its blocks in use and cached fit its capacity
        (forgotten here; the ranks free them before the step allocates)."""
        return self._evict([self.used[r] + len(self.lru[r]) - self.cap() for r in range(self.world)])

    def _evict(self, counts: list[int]) -> list[list[int]]:
        """Per rank, forget its `counts[r]` oldest evictable blocks (as many as it has) -> their hashes."""
        out = []
        for r, n in enumerate(counts):
            out.append([self.lru[r].popitem(last=False)[0] for _ in range(min(n, len(self.lru[r])))])
            for h in out[-1]:
                del self.refs[r][h]
        if self.snapshots is not None:
            self.snapshots.blocks_gone([h for gone in out for h in gone], self.cached_anywhere)
        return out

    def cached_anywhere(self, h: int) -> bool:
        """Some rank's prefix cache names `h`."""
        return any(h in refs for refs in self.refs)

    def evict_unused(self) -> list[list[int]]:
        """Every evictable block on every rank (POST /reset_prefix_cache), forgotten here; blocks requests use stay."""
        return self._evict([len(lru) for lru in self.lru])

    def cached_blocks(self) -> list[int]:
        """Per rank, the blocks its prefix cache names (in use or evictable)."""
        return [len(refs) for refs in self.refs]

    def pick_owner(self, saved: dict[int, int] | None = None, end_blocks: int = 0) -> int:
        """Least-loaded rank: by the blocks its requests will hold at their end less the blocks `saved` there (a
        cached prefix the new request would start on), then blocks held now, request count, id. Balancing only what
        requests hold now would pile an RL rollout's long requests onto one DOP owner, which must then preempt them
        (docs/benchmarks.md, the rollout at capacity)."""
        counts, ends = [0] * self.world, [0] * self.world
        for e in self.reqs.values():
            counts[e.owner] += 1
            ends[e.owner] += _blocks(max(e.tokens, e.final), self.block_size)
        room = self.cap()
        if kv_ownership_of(self.layout) == KV_POSITION:
            # CP deals every request's blocks over all ranks: no anchor carries more load, only a saving differs
            ends, room = [sum(ends)] * self.world, room * self.world
        # a saving counts only where the request also fits to its end (else a preempted request's own cache would
        # send it back to the owner that ran out of room)
        saved = {r: n for r, n in (saved or {}).items() if ends[r] + end_blocks <= room}
        return min(range(self.world), key=lambda r: (ends[r] - saved.get(r, 0), self.used[r], counts[r], r))

    def owner(self, req: str) -> int | None:
        """`req`'s owner (DP-attn/DOP owner, CP anchor); None when it holds nothing here."""
        e = self.reqs.get(req)
        return None if e is None else e.owner

    def usage_under(self, layout: str, owners: dict[str, int] | None = None, shared: bool = False) -> list[int]:
        """Per-rank blocks the live requests would use under `layout` (with optional new owners); `shared`: a cached
        block several of them reference counts once (as a switch leaves it), else once per request."""
        used = [0] * self.world
        for req, e in self.reqs.items():
            o = owners.get(req, e.owner) if owners else e.owner
            need = self.blocks_needed(o, 0, _blocks(e.tokens, self.block_size), layout)
            used = [a + b for a, b in zip(used, need)]
        if shared:
            refs = self._refs_under(layout, owners)
            used = [u - sum(refs[r].values()) + len(refs[r]) for r, u in enumerate(used)]
        return used

    def _refs_under(self, layout: str, owners: dict[str, int] | None) -> list[dict[int, int]]:
        """Per rank, how many live requests reference each cached block they share under `layout`."""
        refs: list[dict[int, int]] = [{} for _ in range(self.world)]
        for req, hashes in self.shared.items():
            if req not in self.reqs:
                continue
            o = owners.get(req, self.reqs[req].owner) if owners else self.reqs[req].owner
            for i, h in enumerate(hashes):
                for r in self.holders(i, o, layout):
                    refs[r][h] = refs[r].get(h, 0) + 1
        return refs

    def idle_blocks(self) -> list[tuple[int, int, int]]:
        """Every evictable cached block as (hash, logical block, rank), oldest first (what a switch plans with)."""
        out = [(t, h, r) for r in range(self.world) for h, t in self.lru[r].items()]
        return [(h, self.block_of[h], r) for _, h, r in sorted(out)]

    def relayout(self, layout: str, owners: dict[str, int] | None = None,
                 kept: Sequence[Iterable[int]] | None = None) -> None:
        """Mirror a switch to `layout` (with the new owners). With `kept` (the prefix cache on: per rank, the idle
        cached blocks the switch's manifest keeps there, `Manifest.cached_kept`) the cache survives as the manifest
        plans it — blocks running requests share stay shared; without, it is forgotten (the ranks clear theirs too)."""
        if self.snapshots is not None:   # KDA state snapshots do not travel: a hit after the switch starts anew
            self.snapshots.relayout(layout)
        if kept is None or not self.prefix:
            self._clear_cache()
            self.used = self.usage_under(layout, owners)
        else:
            ticks: dict[int, int] = {}
            for per in self.lru:
                for h, t in per.items():
                    ticks[h] = max(t, ticks.get(h, t))
            self.used = self.usage_under(layout, owners, shared=True)
            self.refs = self._refs_under(layout, owners)
            self.lru = [OrderedDict(sorted(((h, ticks.get(h, 0)) for h in per_rank), key=lambda x: x[1]))
                        for per_rank in kept]
            for r, per in enumerate(self.lru):
                for h in per:
                    self.refs[r][h] = 0
            live = {h for refs in self.refs for h in refs}
            self.block_of = {h: b for h, b in self.block_of.items() if h in live}
        if owners:
            for req, o in owners.items():
                self.reqs[req].owner = o
        self.layout = layout
