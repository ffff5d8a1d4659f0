"""Who holds what: head shards, KV block holders and request owners — pure data, no torch."""
from __future__ import annotations

from collections.abc import Mapping

from splash.layouts.layout import KV_ALL, KV_OWNER, Layout, check_heads, kv_ownership_of, parse_layout


class NoCapacity(RuntimeError):
    """A request cannot be placed on any rank without exceeding the per-rank KV capacity."""

    def __init__(self, request: str, tokens: int, capacity: int, loads: tuple[int, ...]):
        self.request, self.tokens, self.capacity, self.loads = request, tokens, capacity, loads
        super().__init__(f"request {request!r} ({tokens} KV tokens) fits on no rank: capacity "
                         f"{capacity} tokens/rank, current loads {list(loads)}")


def _check_world(world: int) -> None:
    if not isinstance(world, int) or world < 1:
        raise ValueError(f"world must be a positive integer, got {world!r}")


def num_blocks(tokens: int, block_size: int) -> int:
    """Whole paged-cache blocks needed for ``tokens`` tokens (last partial block counts whole)."""
    if block_size < 1:
        raise ValueError(f"block_size must be positive, got {block_size}")
    if tokens < 0:
        raise ValueError(f"token count must be non-negative, got {tokens}")
    return -(-tokens // block_size)


def head_range(num_heads: int, world: int, rank: int, layout: Layout | str) -> range:
    """Attention heads whose projections ``rank`` holds: a contiguous slice when sharded, all when replicated."""
    layout = parse_layout(layout)
    _check_world(world)
    if not 0 <= rank < world:
        raise ValueError(f"rank {rank} out of range for world {world}")
    if not layout.shards_projections:
        return range(num_heads)
    check_heads(layout, num_heads, world)
    per = num_heads // world
    return range(rank * per, (rank + 1) * per)


def cp_block_rank(block_idx: int, world: int) -> int:
    """Home rank of logical KV block ``block_idx`` under CP: round-robin over blocks, so every request's history,
    decode tail included, stays balanced at every length and a block's home never changes as it grows. Callers
    pass ``block_idx + anchor`` (the request's least-loaded-first owner), so short requests do not all start on 0."""
    _check_world(world)
    return block_idx % world


def _owner_rank(layout: Layout, owner: int | None, world: int) -> int:
    if owner is None or not 0 <= owner < world:
        raise ValueError(f"{layout.value}: a request needs an owner rank in [0, {world}), got {owner!r}")
    return owner


def block_holders(layout: Layout | str, block_idx: int, owner: int | None, world: int) -> tuple[int, ...]:
    """Ranks holding logical KV block ``block_idx`` of a request whose owner (CP: anchor) is ``owner``: TP every
    rank, DP-attn/DOP the owner, CP the block's home rank."""
    layout = parse_layout(layout)
    _check_world(world)
    if layout.kv_ownership == KV_ALL:
        return tuple(range(world))
    if layout.kv_ownership == KV_OWNER:
        return (_owner_rank(layout, owner, world),)
    return (cp_block_rank(block_idx + (owner or 0), world),)  # CP rotates the round-robin by the anchor


def kv_holders(layout: Layout | str, num_blocks: int, owner: int | None, world: int) -> tuple[frozenset[int], ...]:
    """Ranks holding each logical KV block of one request: `block_holders` of blocks 0 … num_blocks − 1."""
    layout = parse_layout(layout)
    _check_world(world)
    if layout.owner_based:
        _owner_rank(layout, owner, world)   # names a missing owner even for a request holding no block yet
    # the holders repeat every `world` blocks (CP's round-robin; the others hold every block alike)
    period = [frozenset(block_holders(layout, b, owner, world)) for b in range(min(num_blocks, world))]
    return tuple((period * -(-num_blocks // world))[:num_blocks])


def blocks_held(layout: Layout | str, owner: int | None, b0: int, b1: int, world: int) -> list[int]:
    """Per rank, how many of a request's logical blocks [b0, b1) it holds: `kv_holders`' count in O(world), so the
    scheduler does no per-step work proportional to context."""
    kind, n = kv_ownership_of(layout), max(0, b1 - b0)
    if kind == KV_ALL:
        return [n] * world
    if kind == KV_OWNER:
        out = [0] * world
        if owner is None or not 0 <= owner < world:
            _owner_rank(parse_layout(layout), owner, world)   # raises, naming the layout
        out[owner] = n
        return out
    # CP: block b lives on rank (b + anchor) % world: count x in [b0 + anchor, b1 + anchor) with x ≡ r (mod world)
    lo = b0 + (owner or 0)
    hi = lo + n
    return [-(-(hi - r) // world) - -(-(lo - r) // world) for r in range(world)]


def kv_copies(layout: Layout | str, world: int) -> int:
    """How many ranks store each KV token: every rank under TP (MLA's latent is read by every head), one otherwise."""
    return world if parse_layout(layout).kv_ownership == KV_ALL else 1


def distinct_kv_tokens(layout: Layout | str, blocks_per_rank: int, block_size: int, world: int) -> int:
    """Distinct KV tokens ``world`` ranks of ``blocks_per_rank`` usable blocks hold in ``layout``."""
    return blocks_per_rank * block_size * world // kv_copies(layout, world)


def _placement_cost(tokens: int, block_size: int) -> int:
    return num_blocks(tokens, block_size) * block_size


def assign_owners(new_requests: Mapping[str, int], existing: Mapping[str, tuple[int, int]], world: int,
                  capacity_tokens_per_rank: int | None, *, block_size: int = 1) -> dict[str, int]:
    """Owner ranks for ``new_requests`` (request -> KV tokens) given ``existing`` (request -> (owner, tokens)):
    greedy, largest first, each to the least-loaded rank (whole blocks) where it fits; NoCapacity names the first
    that fits nowhere (a different packing might still exist)."""
    _check_world(world)
    loads = [0] * world
    counts = [0] * world
    for req, (owner, tokens) in existing.items():
        if not 0 <= owner < world:
            raise ValueError(f"existing request {req!r} has owner {owner} outside [0, {world})")
        loads[owner] += _placement_cost(tokens, block_size)
        counts[owner] += 1
    placed: dict[str, int] = {}
    for req, tokens in sorted(new_requests.items(), key=lambda kv: (-kv[1], kv[0])):
        need = _placement_cost(tokens, block_size)
        fits = [r for r in range(world)
                if capacity_tokens_per_rank is None or loads[r] + need <= capacity_tokens_per_rank]
        if not fits:
            raise NoCapacity(req, tokens, capacity_tokens_per_rank or 0, tuple(loads))
        best = min(fits, key=lambda r: (loads[r], counts[r], r))
        placed[req] = best
        loads[best] += need
        counts[best] += 1
    return placed

