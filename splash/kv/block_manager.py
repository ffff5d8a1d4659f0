"""Block manager for one rank's paged KV pool — pure Python, no torch.

Physical block ids are rank-local. Each request maps logical block index -> physical block; under CP a rank
holds only some logical blocks of a request, so the table is a dict, not a list.
"""
from __future__ import annotations

from collections import deque
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

    def __post_init__(self) -> None:
        if self.num_blocks < 0 or self.block_size <= 0:
            raise ValueError(f"bad pool shape: num_blocks={self.num_blocks}, block_size={self.block_size}")
        # pop() from the end hands out low ids first
        self._free = list(range(self.num_blocks - 1, -1, -1))

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self._free)

    def table(self, req: str) -> dict[int, int]:
        return self._tables.get(req, {})

    def has(self, req: str) -> bool:
        return req in self._tables

    def requests(self) -> list[str]:
        return list(self._tables)

    def missing(self, req: str, logical: list[int]) -> list[int]:
        t = self._tables.get(req, {})
        return [b for b in logical if b not in t]

    def ensure(self, req: str, logical: list[int]) -> list[tuple[int, int]]:
        """Make sure `req` holds every logical block in `logical`; returns newly allocated (logical, physical).
        All-or-nothing: raises OutOfBlocks without allocating anything if the pool is short."""
        need = [b for b in dict.fromkeys(logical) if b not in self._tables.get(req, {})]
        if len(need) > len(self._free):
            raise OutOfBlocks(len(need), len(self._free))
        table = self._tables.setdefault(req, {})
        new = []
        for b in need:
            phys = self._free.pop()
            table[b] = phys
            new.append((b, phys))
        return new

    def ensure_many(self, needs: list[tuple[str, list[int]]]) -> list[tuple[str, list[tuple[int, int]]]]:
        """`ensure` for one step's requests at once: [(req, logical blocks)] -> [(req, new (logical, physical))]
        for the requests that got blocks, handing out the ids `ensure` would in turn. All-or-nothing over the
        whole list (OutOfBlocks allocates nothing). O(requests + blocks), one pass."""
        tables, free, out = self._tables, self._free, []
        for req, logical in needs:
            t = tables.get(req)
            if t is None:
                t = tables[req] = {}
            new = []
            for b in logical:
                if b not in t:
                    if not free:
                        self._undo(out + [(req, new)])
                        raise OutOfBlocks(sum(len(self.missing(r, list(dict.fromkeys(lg)))) for r, lg in needs),
                                          len(free))
                    t[b] = p = free.pop()
                    new.append((b, p))
            if new:
                out.append((req, new))
        return out

    def append_blocks(self, reqs: list[str], blocks: list[int]) -> list[int] | None:
        """The decode case of `ensure_many`: request reqs[i] (distinct requests) gets logical block blocks[i],
        which it does not hold yet; returns the physical ids (those `ensure` would hand out in turn), or None
        (nothing allocated) when the case does not apply — a repeated request or an already held block: use
        `ensure_many`. O(requests) in C loops (map over the tables), no per-request python."""
        tables, free, k = self._tables, self._free, len(reqs)
        tabs = list(map(tables.get, reqs))
        if None in tabs or len(set(reqs)) != k or any(map(dict.__contains__, tabs, blocks)):
            return None
        if k > len(free):
            raise OutOfBlocks(k, len(free))
        phys = free[len(free) - k:][::-1]
        del free[len(free) - k:]
        deque(map(dict.__setitem__, tabs, blocks, phys), maxlen=0)
        return phys

    def _undo(self, allocated: list[tuple[str, list[tuple[int, int]]]]) -> None:
        """Give back what a failed `ensure_many` handed out, restoring the free list's order."""
        for req, new in reversed(allocated):
            t = self._tables[req]
            for b, p in reversed(new):
                del t[b]
                self._free.append(p)
        for req in [r for r, t in self._tables.items() if not t]:
            del self._tables[req]

    def discard(self, req: str, logical: list[int]) -> list[int]:
        """Free the given logical blocks of `req` (those it holds); returns the freed physical ids."""
        table = self._tables.get(req)
        if table is None:
            return []
        freed = [table.pop(b) for b in logical if b in table]
        self._free.extend(freed)
        if not table:
            del self._tables[req]
        return freed

    def detach(self, req: str, logical: list[int]) -> list[int]:
        """Remove blocks from `req`'s table without freeing them (their data may still be sent); returns the
        physical ids, to be given back with `free_physical` once nothing reads them."""
        table = self._tables.get(req)
        if table is None:
            return []
        out = [table.pop(b) for b in logical if b in table]
        if not table:
            del self._tables[req]
        return out

    def free_physical(self, phys: list[int]) -> None:
        self._free.extend(phys)

    def release(self, req: str) -> list[int]:
        """Free every block of `req`."""
        table = self._tables.pop(req, {})
        freed = list(table.values())
        self._free.extend(freed)
        return freed


def blocks_for_tokens(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)
