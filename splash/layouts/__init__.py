"""Attention layouts as data: the ownership model (who holds projections and KV) and its memory model. No torch."""
from splash.layouts.layout import Layout, parse_layout
from splash.layouts.memory import (KV_DTYPES, CapacityReport, LayoutMemory, common_params, kv_block_bytes,
                                   kv_bytes_per_token_layer, kv_capacity_tokens, per_rank_memory,
                                   projection_bytes_per_rank, projection_params, switch_receive_bytes)
from splash.layouts.ownership import (NoCapacity, assign_owners, cp_block_rank, head_range, kv_holders,
                                      num_blocks, rebalance_owners)

__all__ = [
    "KV_DTYPES", "CapacityReport", "Layout", "LayoutMemory", "NoCapacity", "assign_owners", "common_params",
    "cp_block_rank", "head_range", "kv_block_bytes", "kv_bytes_per_token_layer", "kv_capacity_tokens",
    "kv_holders", "num_blocks", "parse_layout", "per_rank_memory", "projection_bytes_per_rank",
    "projection_params", "rebalance_owners", "switch_receive_bytes",
]
