"""Layout name -> attention executor, and which heads a rank holds in a layout."""
from __future__ import annotations


def head_range_for(layout: str, num_heads: int, world: int, rank: int) -> range:
    if layout in ("tp", "dop"):
        if num_heads % world:
            raise ValueError(f"num_attention_heads={num_heads} is not divisible by world size {world}")
        n = num_heads // world
        return range(rank * n, (rank + 1) * n)
    return range(num_heads)


def make_executor(layout: str, runner):
    from splash.attention.tp import TPAttention

    table = {"tp": TPAttention}
    if layout not in table:
        raise ValueError(f"layout {layout!r} not available")
    return table[layout](runner)
