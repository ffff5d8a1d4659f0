"""The per-rank state an attention executor (and the switch executor) works on, passed in explicitly.

`RankContext` does not change with the layout (a switch changes the contents of its objects, never the objects);
`LayoutState` does: the layout, the MLA (and KDA) heads held in it, its KV dtype. The runner replaces the latter
whole when a switch hands off (`ModelRunner.adopt`).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from splash.attention.metadata import AttnMetadata, build_metadata
from splash.kv.page_table import ensure_step_pages
from splash.layouts.ownership import head_range
from splash.models.family import ModelFamily


@dataclass(frozen=True)
class LayoutState:
    layout: str                  # Layout value ("tp", "dp_attn", "cp", "dop")
    heads: range                 # MLA heads whose projections this rank holds
    kv_dtype: str                # the layout's KV dtype
    linear_heads: range = range(0)  # KDA heads whose projections and state this rank holds (hybrid models)


def layout_state(layout: str, family: ModelFamily, world: int, rank: int, kv_dtype: str) -> LayoutState:
    """This rank's layout-dependent state in `layout` (KDA heads follow the MLA heads' placement)."""
    lin = family.linear_heads
    return LayoutState(layout, head_range(family.attention_heads, world, rank, layout), kv_dtype,
                       head_range(lin, world, rank, layout) if lin else range(0))


@dataclass(frozen=True)
class RankContext:
    cfg: Any                     # splash.models.config.ModelConfig
    family: ModelFamily          # layer kinds: which layers hold KV blocks (pool layer), which recurrent state
    comm: Any                    # this rank's communicator (splash.distributed)
    weights: Any                 # ModelWeights: a switch replaces `layers[i].attn` in place
    cache: Any                   # splash.kv.paged_cache.PagedLatentCache (one pool layer per KV-holding layer)
    blocks: Any                  # splash.kv.block_manager.BlockManager of the pool
    tables: Any                  # splash.kv.page_table.PageTable: the block manager's tables as tensors
    attn: Any                    # attention kernel (splash.attention.kernels): plan once per step, run per layer
    rope: Any                    # rope tables of the model (None: NoPE)
    block_size: int
    states: Any = None           # splash.kv.recurrent.RecurrentStates (hybrid models' KDA layers), else None

    def plan_step(self, reqs, keep=None, cp: tuple[int, int] | None = None) -> AttnMetadata:
        """A layout executor's step set-up for the requests `reqs` it attends: allocate the blocks their new tokens
        touch (those `keep(q, block)` accepts), build the step's metadata and plan the kernel on it."""
        ensure_step_pages(self.blocks, self.tables, reqs, keep)
        meta = build_metadata(reqs, self.tables, cp)
        self.attn.plan(meta)
        return meta
