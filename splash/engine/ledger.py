"""Rank 0's mirror of every rank's KV block usage under the current layout — pure Python, no torch.

Which ranks hold a logical block is the ownership model's answer (`splash.layouts.ownership.block_holders`,
`blocks_held`), so the scheduler admits against exactly the blocks each rank's real pool will allocate.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from splash.layouts.ownership import block_holders, blocks_held


def _blocks(tokens: int, bs: int) -> int:
    return -(-tokens // bs)


@dataclass
class KVLedger:
    world: int
    blocks_per_rank: int
    block_size: int
    layout: str
    capacity: dict[str, int] = field(default_factory=dict)  # usable blocks per rank per layout (default: all)
    used: list[int] = field(default_factory=list)
    reqs: dict[str, list[int]] = field(default_factory=dict)  # req -> [tokens, owner]
    final: dict[str, int] = field(default_factory=dict)       # req -> tokens it may reach (prompt + max_tokens)

    def __post_init__(self) -> None:
        self.used = [0] * self.world

    def cap(self, layout: str | None = None) -> int:
        """Blocks per rank the KV may use under `layout`: the physical pool less what that layout's
        projections take beyond the most compact layout's (replicated projections eat KV room)."""
        return self.capacity.get(layout or self.layout, self.blocks_per_rank)

    def holders(self, block: int, owner: int, layout: str | None = None) -> list[int]:
        return list(block_holders(layout or self.layout, block, owner, self.world))

    def _need(self, owner: int, b0: int, b1: int, layout: str | None = None) -> list[int]:
        """Blocks each rank holds of logical blocks [b0, b1) of a request."""
        return blocks_held(layout or self.layout, owner, b0, b1, self.world)

    def growth(self, req: str, new_tokens: int, owner: int = 0) -> list[int]:
        tokens, own = self.reqs.get(req, [0, owner])
        return self._need(own, _blocks(tokens, self.block_size), _blocks(new_tokens, self.block_size))

    def can_grow(self, req: str, new_tokens: int, owner: int = 0) -> bool:
        return not self.short_ranks(req, new_tokens, owner)

    def short_ranks(self, req: str, new_tokens: int, owner: int = 0) -> list[int]:
        """The ranks without room for `req` to grow to `new_tokens`."""
        need = self.growth(req, new_tokens, owner)
        cap = self.cap()
        return [r for r in range(self.world) if self.used[r] + need[r] > cap]

    def holder_counts(self) -> list[int]:
        """Per rank, how many requests hold blocks there."""
        out = [0] * self.world
        for tokens, owner in self.reqs.values():
            for r, n in enumerate(self._need(owner, 0, _blocks(tokens, self.block_size))):
                out[r] += n > 0
        return out

    def holds(self, req: str, rank: int) -> bool:
        """Whether `rank` holds any block of `req`."""
        if req not in self.reqs:
            return False
        tokens, owner = self.reqs[req]
        return self._need(owner, 0, _blocks(tokens, self.block_size))[rank] > 0

    def grow(self, req: str, new_tokens: int, owner: int = 0, final: int | None = None) -> None:
        need = self.growth(req, new_tokens, owner)
        if final is not None and req not in self.reqs:
            self.final[req] = final
        entry = self.reqs.setdefault(req, [0, owner])
        entry[0] = max(entry[0], new_tokens)
        for r in range(self.world):
            self.used[r] += need[r]

    def release(self, req: str) -> None:
        if req not in self.reqs:
            return
        tokens, owner = self.reqs.pop(req)
        self.final.pop(req, None)
        need = self._need(owner, 0, _blocks(tokens, self.block_size))
        for r in range(self.world):
            self.used[r] -= need[r]

    def pick_owner(self) -> int:
        """Least-loaded rank: by the blocks its requests will hold at their end (tokens they may reach, prompt +
        max_tokens, as given to `grow`; their present tokens when more or not given), then blocks held now, then
        request count, then id. Balancing what requests hold now alone would let an RL rollout's long requests (the
        same prompt length as its short ones) pile up on one DOP owner, which must then preempt them (measured in
        docs/benchmarks.md, the rollout at capacity)."""
        counts, ends = [0] * self.world, [0] * self.world
        for req, (tokens, o) in self.reqs.items():
            counts[o] += 1
            ends[o] += _blocks(max(tokens, self.final.get(req, 0)), self.block_size)
        return min(range(self.world), key=lambda r: (ends[r], self.used[r], counts[r], r))

    def owner(self, req: str) -> int:
        return self.reqs[req][1]

    def usage_under(self, layout: str, owners: dict[str, int] | None = None) -> list[int]:
        """Per-rank blocks the live requests would use under `layout` (with optional new owners)."""
        used = [0] * self.world
        for req, (tokens, owner) in self.reqs.items():
            o = owners.get(req, owner) if owners else owner
            need = self._need(o, 0, _blocks(tokens, self.block_size), layout)
            used = [a + b for a, b in zip(used, need)]
        return used

    def relayout(self, layout: str, owners: dict[str, int] | None = None) -> None:
        self.used = self.usage_under(layout, owners)
        if owners:
            for req, o in owners.items():
                self.reqs[req][1] = o
        self.layout = layout
