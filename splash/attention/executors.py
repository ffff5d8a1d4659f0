"""Layout -> attention executor, and which heads a rank holds in a layout."""
from __future__ import annotations


def head_range_for(layout: str, num_heads: int, world: int, rank: int) -> range:
    from splash.layouts.ownership import head_range
    return head_range(num_heads, world, rank, layout)


def make_executor(layout: str, runner):
    from splash.attention.cp import CPAttention
    from splash.attention.dop import DOPAttention
    from splash.attention.dp_attn import DPAttention
    from splash.attention.tp import TPAttention

    from splash.layouts.layout import Layout, parse_layout

    table = {Layout.TP: TPAttention, Layout.DP_ATTN: DPAttention, Layout.CP: CPAttention, Layout.DOP: DOPAttention}
    base = table[parse_layout(layout)](runner)
    if runner.cfg.hybrid is not None:  # glm5_next: KDA + MLA-DSA layers (splash.attention.hybrid)
        from splash.attention.hybrid import HybridAttention
        return HybridAttention(layout, base)
    return base
