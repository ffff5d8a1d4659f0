"""Device memory budget of one rank from `cache.gpu_memory_utilization` — pure, no torch.

usable = device × utilization − memory in use at start; from it come the weights (common + the most compact
layout's projections: a replicating layout spends KV blocks on the rest), one step's scratch, graphs (none yet),
and the switch headroom — one layer's buffers on top of the footprint (design.md §4): the largest per-layer
projection all-gather plus one layer's share of the pool (what a layer moves or converts). The rest is the KV pool.
"""
from __future__ import annotations

from dataclasses import dataclass

from splash.layouts.layout import LAYOUT_NAMES, heads_fit
from splash.layouts.memory import (common_bytes, kv_block_bytes, projection_bytes_per_rank,
                                   switch_receive_bytes)
from splash.models.config import ModelConfig

ATTN_SCRATCH_BYTES = 32 << 20   # the attention kernels' per-chunk working set (splash.attention.kernels)


@dataclass(frozen=True)
class DeviceBudget:
    device_bytes: int
    utilization: float
    in_use_bytes: int
    usable_bytes: int          # device × utilization − in use
    weight_bytes: float        # common + the most compact layout's projections
    scratch_bytes: int         # one step's activations + attention scratch and kernel workspaces + logits
    graph_bytes: int           # captured CUDA/HIP graphs (none yet: 0)
    switch_headroom_bytes: float
    kv_pool_bytes: int         # whole blocks
    block_bytes: int

    @property
    def kv_blocks(self) -> int:
        return self.kv_pool_bytes // self.block_bytes if self.block_bytes else 0

    def rows(self) -> list[tuple[str, float]]:
        return [("device", self.device_bytes), ("in use before start", self.in_use_bytes),
                (f"usable (x {self.utilization:g})", self.usable_bytes), ("weights", self.weight_bytes),
                ("scratch + workspaces", self.scratch_bytes), ("graphs", self.graph_bytes),
                ("switch headroom", self.switch_headroom_bytes), ("KV pool", self.kv_pool_bytes)]


def scratch_bytes(cfg: ModelConfig, max_num_batched_tokens: int, max_num_seqs: int, elem_bytes: float) -> int:
    """Activations of one step (an estimate) + the attention kernels' scratch + fp32 logits of the sampled rows."""
    h = cfg.num_attention_heads
    attn = (cfg.q_lora_rank or 0) + cfg.kv_lora_rank + h * (cfg.qk_head_dim + cfg.kv_lora_rank + cfg.v_head_dim)
    inter = max(cfg.intermediate_size, cfg.moe_intermediate_size * max(1, cfg.num_experts_per_tok))
    per_token = elem_bytes * (6 * cfg.hidden_size + 2 * attn + 3 * inter)
    return int(max_num_batched_tokens * per_token + ATTN_SCRATCH_BYTES + 4 * max_num_seqs * cfg.vocab_size)


def device_memory_budget(cfg: ModelConfig, world: int, device_bytes: int, utilization: float, weight_bytes: float,
                         kv_dtype: str, block_size: int, max_num_batched_tokens: int = 2048, max_num_seqs: int = 256,
                         in_use_bytes: int = 0, graph_bytes: int = 0, layouts=LAYOUT_NAMES,
                         weight_quant: str | None = None, attention_workspace_bytes: int = 0,
                         rope_fp8: bool = False) -> DeviceBudget:
    """The per-rank budget (see the module doc); ValueError when the weights and buffers alone do not fit.
    `attention_workspace_bytes` (the vendor kernels' own workspaces) counts with the scratch."""
    if not 0 < utilization <= 1:
        raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {utilization}")
    usable = int(device_bytes * utilization) - in_use_bytes
    fit = [lay for lay in layouts if heads_fit(lay, cfg.num_attention_heads, world)]
    if not fit:
        raise ValueError(f"no layout of {list(layouts)} fits {cfg.num_attention_heads} heads on {world} rank(s)")
    weights = (common_bytes(cfg, world, weight_bytes, weight_quant)
               + min(projection_bytes_per_rank(cfg, lay, world, weight_bytes, weight_quant) for lay in fit))
    scratch = (scratch_bytes(cfg, max_num_batched_tokens, max_num_seqs, weight_bytes if weight_quant is None else 2)
               + attention_workspace_bytes)
    proj_recv = max((switch_receive_bytes(cfg, a, b, world, weight_bytes, weight_quant) for a in fit for b in fit),
                    default=0.0)
    room = usable - weights - scratch - graph_bytes - proj_recv
    layers = max(1, cfg.num_hidden_layers)
    block = kv_block_bytes(cfg, kv_dtype, block_size, rope_fp8)
    pool = int(room / (1 + 1 / layers)) if room > 0 else 0   # the pool + one layer's share of it as headroom
    pool = (pool // block) * block if block else 0
    if pool <= 0:
        raise ValueError(f"gpu_memory_utilization {utilization:g} of {device_bytes / 2**30:.1f} GiB leaves no KV "
                         f"room: weights {weights / 2**30:.2f} GiB + scratch {scratch / 2**30:.2f} GiB + switch "
                         f"headroom {proj_recv / 2**30:.2f} GiB exceed the usable {usable / 2**30:.2f} GiB")
    return DeviceBudget(device_bytes, utilization, in_use_bytes, usable, weights, scratch, graph_bytes,
                        proj_recv + pool / layers, pool, block)
