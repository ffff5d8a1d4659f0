"""The four attention layouts as data: where projections live and who holds a request's KV history.

A layout is two independent choices (the ownership model of the paper):
- ``projections``: the shardable projections Q-B, KV-B, O are head-``sharded`` over the group or ``replicated``;
- ``kv_ownership``: a request's latent KV history lives on ``all`` ranks (TP under MLA: every head reads the
  whole latent), on its ``owner`` rank (DP-attn, DOP), or is split by ``position`` over all ranks (CP).
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from enum import Enum

SHARDED = "sharded"
REPLICATED = "replicated"
KV_ALL = "all"
KV_OWNER = "owner"
KV_POSITION = "position"


class Layout(str, Enum):
    TP = "tp"
    DP_ATTN = "dp_attn"
    CP = "cp"
    DOP = "dop"

    def __str__(self) -> str:
        return self.value

    @property
    def projections(self) -> str:
        """"sharded" (TP, DOP) or "replicated" (DP-attn, CP)."""
        return SHARDED if self in (Layout.TP, Layout.DOP) else REPLICATED

    @property
    def kv_ownership(self) -> str:
        """"all" (TP), "owner" (DP-attn, DOP) or "position" (CP)."""
        return _KV_OWNERSHIP[self]

    @property
    def shards_projections(self) -> bool:
        return self.projections == SHARDED

    @property
    def owner_based(self) -> bool:
        """True when every request's history lives on one owner rank (DP-attn, DOP)."""
        return self.kv_ownership == KV_OWNER


_KV_OWNERSHIP = {Layout.TP: KV_ALL, Layout.DP_ATTN: KV_OWNER, Layout.CP: KV_POSITION, Layout.DOP: KV_OWNER}

_ALIASES = {"tp": Layout.TP, "dp_attn": Layout.DP_ATTN, "dp-attn": Layout.DP_ATTN, "dp": Layout.DP_ATTN,
            "dpattn": Layout.DP_ATTN, "cp": Layout.CP, "dop": Layout.DOP}


def parse_layout(name: str | Layout) -> Layout:
    """Layout from a name (case-insensitive, aliases allowed); ValueError naming the allowed names."""
    if isinstance(name, Layout):
        return name
    if isinstance(name, str):
        found = _ALIASES.get(name.strip().lower())
        if found is not None:
            return found
    allowed = ", ".join(sorted(_ALIASES))
    raise ValueError(f"unknown attention layout {name!r} (allowed: {allowed})")


# The layout names in their canonical order: the one list every other module uses.
LAYOUT_NAMES: tuple[str, ...] = tuple(lay.value for lay in Layout)
# How tables, figures and logs print each layout (the paper's spelling).
LAYOUT_LABELS: dict[str, str] = {"tp": "TP", "dp_attn": "DP-attn", "cp": "CP", "dop": "DOP"}


def kv_ownership_of(layout: str | Layout) -> str:
    """`parse_layout(layout).kv_ownership`, without parsing a canonical name (the ledger asks per request per step)."""
    return _KV_OWNERSHIP.get(layout) or parse_layout(layout).kv_ownership


def heads_fit(layout: str | Layout, num_heads: int, world: int) -> bool:
    """A head-sharded layout (TP, DOP) needs the world size to divide the attention heads; the others always fit."""
    return not parse_layout(layout).shards_projections or num_heads % world == 0


@dataclass(frozen=True)
class RankAttention:
    """What one rank's attention kernel is handed under a layout (`position_split`: CP's every T-th block, which
    vendor kernels' causal masks do not take)."""
    heads: int
    kv_dtype: str
    position_split: bool


def rank_attention(layouts, num_heads: int, world: int, kv_dtypes: Mapping[str, str]) -> tuple[RankAttention, ...]:
    """RankAttention of each of `layouts` that fits (`kv_dtypes`: layout name → its KV dtype)."""
    out = []
    for lay in map(parse_layout, layouts):
        if heads_fit(lay, num_heads, world):
            heads = num_heads // world if lay is Layout.TP else num_heads
            out.append(RankAttention(heads, kv_dtypes[lay.value], lay.kv_ownership == KV_POSITION))
    return tuple(out)


def check_heads(layout: str | Layout, num_heads: int, world: int) -> None:
    """ValueError when ``layout`` shards the heads and ``world`` does not divide ``num_heads``."""
    if not heads_fit(layout, num_heads, world):
        raise ValueError(f"{parse_layout(layout).value}: world {world} does not divide num_heads {num_heads} "
                         "(a head-sharded layout needs the world size to divide num_attention_heads)")


def start_layout(allowed, num_heads: int | None, world: int) -> Layout:
    """Where `auto` starts: TP when allowed and its heads fit the world, else the first allowed layout that fits (the
    first allowed one when none does: the caller's head check then names the problem). `num_heads` None: any fits."""
    lays = [parse_layout(a) for a in allowed]
    usable = [a for a in lays if num_heads is None or heads_fit(a, num_heads, world)] or lays
    return Layout.TP if Layout.TP in usable else usable[0]
