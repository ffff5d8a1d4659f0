"""How many identical requests a layout keeps resident at once, counted two ways. Pure, no torch.

- **placed** (``splash.sim.serving.concurrency``): requests as the ownership model places them: on one owner each in
  DP-attn/DOP (an owner holds ⌊its pool / the request's blocks⌋), across the group in TP/CP;
- **pooled**: the layout's distinct KV tokens over one request's tokens, the arithmetic of the paper's §5.3
  sentence "at 512K context, DOP keeps 16 requests resident rather than 12 for DP-attention".

With identical requests on identical owners the placed count of a request-owned layout is a multiple of the owner
count (or the whole batch): every owner holds the same number. So a count such as the paper's 12 at T = 8, B = 16
is not a placement of any per-rank accounting (transients, reserve, scales): whatever shrinks or grows an owner's
pool moves the count in steps of T. ``owner_resident_counts`` lists the counts placement can give.
"""
from __future__ import annotations


def pooled_resident(distinct_tokens: int, request_tokens: int, batch: int) -> int:
    """Requests of ``request_tokens`` a pool of ``distinct_tokens`` holds, counted as one pool (at most ``batch``)."""
    if request_tokens <= 0:
        raise ValueError(f"request_tokens must be positive, got {request_tokens}")
    return min(batch, max(0, distinct_tokens) // request_tokens)


def owner_resident_counts(world: int, batch: int) -> list[int]:
    """Every resident count identical owners can give a batch of identical requests: ``world`` × c (c requests an
    owner) up to the whole batch."""
    if world < 1 or batch < 0:
        raise ValueError(f"world must be >= 1 and batch >= 0, got {world}, {batch}")
    return sorted({min(batch, world * c) for c in range(-(-batch // world) + 1)})
