"""Block manager for one rank's paged KV pool — pure Python, no torch.

A request's table maps logical -> physical block (a dict: under CP a rank holds only some blocks). A full block
may be named by its prefix hash; requests share it by reference count (`attach`), and with no reference left it
stays cached until rank 0 says `evict` (rank 0 decides every hit and eviction, so every rank agrees).
"""
from __future__ import annotations

from collections import deque
from itertools import repeat
from dataclasses import dataclass, field


class OutOfBlocks(RuntimeError):
    """The pool cannot provide the requested blocks; the caller queues, preempts or defers."""

    def __init__(self, needed: int, free: int):
        super().__init__(f"KV pool exhausted: need {needed} blocks, {free} free")
        self.needed, self.free = needed, free


@dataclass
class BlockManager:
    num_blocks: int
    block_size: int
    _free: list[int] = field(default_factory=list)
    _tables: dict[str, dict[int, int]] = field(default_factory=dict)
    _ref: list[int] = field(default_factory=list)             # physical block -> tables referencing it
    _cached: dict[int, int] = field(default_factory=dict)     # prefix hash -> physical block
    _hash_of: dict[int, int] = field(default_factory=dict)    # physical block -> its prefix hash

    def __post_init__(self) -> None:
        if self.num_blocks < 0 or self.block_size <= 0:
            raise ValueError(f"bad pool shape: num_blocks={self.num_blocks}, block_size={self.block_size}")
        # pop() from the end hands out low ids first
        self._free = list(range(self.num_blocks - 1, -1, -1))
        self._ref = [0] * self.num_blocks

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self._free)

    def table(self, req: str) -> dict[int, int]:
        return self._tables.get(req, {})

    def requests(self) -> list[str]:
        return list(self._tables)

    def ensure(self, req: str, logical: list[int]) -> list[tuple[int, int]]:
        """Make sure `req` holds `logical`; -> newly allocated (logical, physical). All-or-nothing (OutOfBlocks)."""
        new = self.ensure_many([(req, logical)])
        return new[0][1] if new else []

    def ensure_many(self, needs: list[tuple[str, list[int]]]) -> list[tuple[str, list[tuple[int, int]]]]:
        """`ensure` for one step's requests: -> [(req, new pages)] for those that got any. All-or-nothing."""
        tables, free, out, created = self._tables, self._free, [], []
        for req, logical in needs:
            t = tables.get(req)
            if t is None:
                t = tables[req] = {}
                created.append(req)
            new = []
            for b in logical:
                if b not in t:
                    if not free:
                        self._undo(out + [(req, new)], created)
                        raise OutOfBlocks(sum(len(set(lg) - self.table(r).keys()) for r, lg in needs), len(free))
                    t[b] = p = free.pop()
                    self._ref[p] = 1
                    new.append((b, p))
            if new:
                out.append((req, new))
        return out

    def append_blocks(self, reqs: list[str], blocks: list[int]) -> list[int] | None:
        """The decode case of `ensure_many` (reqs[i], distinct, gets new logical block blocks[i]) in C loops: -> the
        physical ids `ensure` would hand out, or None (nothing allocated) when the case does not apply."""
        tables, free, k = self._tables, self._free, len(reqs)
        tabs = list(map(tables.get, reqs))
        if None in tabs or len(set(reqs)) != k or any(map(dict.__contains__, tabs, blocks)):
            return None
        if k > len(free):
            raise OutOfBlocks(k, len(free))
        phys = free[len(free) - k:][::-1]
        del free[len(free) - k:]
        deque(map(dict.__setitem__, tabs, blocks, phys), maxlen=0)
        deque(map(self._ref.__setitem__, phys, repeat(1)), maxlen=0)
        return phys

    def _undo(self, allocated: list[tuple[str, list[tuple[int, int]]]], created: list[str]) -> None:
        """Give back what a failed `ensure_many` handed out and created, restoring the free list's order."""
        for req, new in reversed(allocated):
            t = self._tables[req]
            for b, p in reversed(new):
                del t[b]
                self._ref[p] = 0
                self._free.append(p)
        for req in created:
            del self._tables[req]

    def _unref(self, phys: list[int]) -> list[int]:
        """Drop one reference from each block; -> those now referenced by nobody and named by no hash."""
        out = []
        for p in phys:
            self._ref[p] -= 1
            if self._ref[p] == 0 and p not in self._hash_of:
                out.append(p)
        return out

    def discard(self, req: str, logical: list[int]) -> list[int]:
        """Drop `req`'s `logical` blocks; -> the physical ids freed (shared or cached ones stay)."""
        freed = self.detach(req, logical)
        self._free.extend(freed)
        return freed

    def detach(self, req: str, logical: list[int]) -> list[int]:
        """Remove blocks from `req`'s table without freeing them (their data may still be sent); returns the
        physical ids nothing else references, to be given back with `free_physical` once nothing reads them."""
        table = self._tables.get(req)
        if table is None:
            return []
        out = self._unref([table.pop(b) for b in logical if b in table])
        if not table:
            del self._tables[req]
        return out

    def free_physical(self, phys: list[int]) -> None:
        self._free.extend(phys)

    def release(self, req: str) -> list[int]:
        """Drop every block of `req`; -> the physical ids freed."""
        return self.discard(req, list(self.table(req)))

    # ---- prefix cache ------------------------------------------------------------------------------------
    @property
    def num_cached(self) -> int:
        return len(self._cached)

    @property
    def num_evictable(self) -> int:
        """Cached blocks no request references: free for the pool once evicted."""
        return sum(1 for p in self._hash_of if not self._ref[p])

    def cached(self, h: int) -> bool:
        return h in self._cached

    def register(self, req: str, logical: int, h: int) -> bool:
        """Name `req`'s full block `logical` by prefix hash `h` unless `h` names one already; -> whether it did."""
        if h in self._cached:
            return False
        p = self._tables[req][logical]
        self._cached[h], self._hash_of[p] = p, h
        return True

    def attach(self, req: str, blocks: list[tuple[int, int]]) -> list[tuple[int, int]]:
        """Give `req` the cached blocks [(logical, hash)] by reference; -> their (logical, physical) pairs."""
        table = self._tables.setdefault(req, {})
        out = []
        for b, h in blocks:
            p = self._cached[h]
            self._ref[p] += 1
            table[b] = p
            out.append((b, p))
        return out

    def evict(self, hashes: list[int]) -> None:
        """Forget the cached blocks named `hashes` and free those no request references (the ledger evicts only
        those; one a request still references would stay with it, unnamed)."""
        self._free.extend(self.forget(hashes))

    def block_of(self, h: int) -> int:
        """The physical block cached under `h`."""
        return self._cached[h]

    def cached_hashes(self) -> list[int]:
        return list(self._cached)

    def receive(self, h: int) -> int:
        """A free block named `h`, referenced by no request yet (a layout switch brings its data): -> its id."""
        if h in self._cached:
            raise ValueError(f"prefix hash {h:#x} is cached here already")
        if not self._free:
            raise OutOfBlocks(1, 0)
        p = self._free.pop()
        self._cached[h], self._hash_of[p] = p, h
        return p

    def forget(self, hashes: list[int]) -> list[int]:
        """`evict` without freeing: -> the blocks no request references, for `free_physical` once a switch has sent
        them."""
        out = []
        for h in hashes:
            p = self._cached.pop(h)
            del self._hash_of[p]
            if not self._ref[p]:
                out.append(p)
        return out

