"""What differs between the model families at run time, described once from the config (pure data, no torch).

A dense family (deepseek_v3 / v32, glm_moe_dsa) has MLA in every layer: layer l keeps its KV in pool layer l.
A hybrid family (glm5_next) interleaves KDA linear-attention layers with MLA layers: only the MLA layers hold
paged KV (pool layer j = the j-th MLA layer), each KDA layer holds per-request recurrent state instead (state
row j = the j-th KDA layer), and the KDA projections are sharded by KDA head exactly where the MLA projections
are sharded by attention head. The runner, the executors and the switch executor ask this description instead of
testing which family a config is.
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from splash.models.config import ModelConfig


@dataclass(frozen=True)
class ModelFamily:
    name: str                       # "dense" or "hybrid"
    pool_layers: Mapping[int, int]  # model layer -> paged-pool layer, for every layer holding KV blocks
    state_rows: Mapping[int, int]   # model layer -> recurrent-state row, for every layer holding per-request state
    attention_heads: int            # MLA heads (Q-B / KV-B / O shard by these)
    linear_heads: int = 0           # KDA heads (their projections and state shard by these); 0: no KDA layers

    @property
    def recurrent(self) -> bool:
        """Some layer keeps per-request recurrent state (it moves per request in a switch; a prefix-cache hit resumes
        it from a snapshot, splash.engine.state_snapshots)."""
        return bool(self.state_rows)

    @property
    def num_pool_layers(self) -> int:
        return len(self.pool_layers)

    def pool_layer(self, layer: int) -> int | None:
        """The pool layer holding model layer `layer`'s KV blocks; None for a layer that holds none (KDA)."""
        return self.pool_layers.get(layer)

    def state_row(self, layer: int) -> int | None:
        """Model layer `layer`'s row in the per-request recurrent state; None for a layer without state."""
        return self.state_rows.get(layer)

    def is_recurrent(self, layer: int) -> bool:
        return layer in self.state_rows


def describe(cfg: ModelConfig) -> ModelFamily:
    layers = range(cfg.num_hidden_layers)
    if cfg.hybrid is None:
        return ModelFamily("dense", {i: i for i in layers}, {}, cfg.num_attention_heads)
    mla = [i for i in layers if not cfg.is_linear_layer(i)]
    lin = [i for i in layers if cfg.is_linear_layer(i)]
    return ModelFamily("hybrid", {l: j for j, l in enumerate(mla)}, {l: j for j, l in enumerate(lin)},
                       cfg.num_attention_heads, cfg.hybrid.linear_num_heads)
