"""Layout -> attention executor, built on this rank's state (splash.attention.context)."""
from __future__ import annotations

from splash.attention.context import LayoutState, RankContext


def make_executor(state: LayoutState, ctx: RankContext):
    from splash.attention.cp import CPAttention
    from splash.attention.dop import DOPAttention
    from splash.attention.dp_attn import DPAttention
    from splash.attention.tp import TPAttention

    from splash.layouts.layout import Layout, parse_layout

    table = {Layout.TP: TPAttention, Layout.DP_ATTN: DPAttention, Layout.CP: CPAttention, Layout.DOP: DOPAttention}
    base = table[parse_layout(state.layout)](ctx)
    if ctx.family.recurrent:  # KDA + MLA-DSA layers (splash.attention.hybrid)
        from splash.attention.hybrid import HybridAttention
        return HybridAttention(state, base)
    return base
