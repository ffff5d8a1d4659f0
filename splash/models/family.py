"""What differs between the model families at run time and in memory, described once from the config (pure data,
no torch). A dense family (deepseek_v3 / v32, glm_moe_dsa) has MLA in every layer (pool layer l = layer l). A hybrid
family (glm5_next) interleaves KDA layers, which hold per-request recurrent state (state row j = the j-th KDA
layer) and shard by KDA head where MLA shards by attention head, with MLA layers (pool layer j = the j-th MLA
layer) whose KPool indexer stores a second vector per token; every layer carries mHC weights. The runner,
executors, switch executor, memory model and manifest planner ask this instead of testing the family.
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from functools import lru_cache

from splash.models.config import ModelConfig

# how a weight is stored: a linear weight follows the checkpoint's (or --quantization's) format; a dense one stays
# in the compute dtype; an fp32 one in fp32 whatever the compute dtype
LINEAR, DENSE, FP32 = "linear", "dense", "fp32"
STATE_BYTES = 4   # recurrent state is fp32 (splash.kv.recurrent)


@dataclass(frozen=True)
class Weight:
    """A stored weight (or the slice a rank holds, from row0 / col0) as rows × cols; a vector is one column."""
    rows: int
    cols: int
    storage: str = LINEAR
    row0: int = 0
    col0: int = 0

    @property
    def params(self) -> int:
        return self.rows * self.cols


@dataclass(frozen=True)
class LinearAttention:
    """A hybrid family's KDA layers: weights held whole (`common_weights`) and sharded by KDA head
    (`shard_weights`, splash.models.kda.KDAWeights); per request, fp32 state per head in every KDA layer."""
    heads: int
    head_dim: int
    conv_kernel: int
    num_layers: int
    hidden: int
    quantized_gates: bool = False   # the checkpoint stores the gates quantised (most keep them dense)

    @property
    def gate_storage(self) -> str:
        return LINEAR if self.quantized_gates else DENSE

    @property
    def state_bytes_per_head(self) -> int:   # one request's, over every KDA layer
        d = self.head_dim
        return STATE_BYTES * (d * d + 3 * d * (self.conv_kernel - 1)) * self.num_layers

    def common_weights(self) -> tuple[Weight, ...]:
        d, g = self.head_dim, self.gate_storage
        return Weight(d, self.hidden, g), Weight(d, self.hidden, g), Weight(d, 1, DENSE)   # f_a, g_a, o_norm

    def shard_weights(self, heads: range) -> tuple[Weight, ...]:
        """One layer's weights of the contiguous KDA heads `heads` (a rank's shard, or all of them)."""
        d, h, g = self.head_dim, self.hidden, self.gate_storage
        n, r0 = len(heads), heads.start * self.head_dim
        nd = n * d
        return (Weight(nd, h, row0=r0), Weight(nd, h, row0=r0), Weight(nd, h, row0=r0),   # q, k, v
                Weight(h, nd, col0=r0),                                                     # o
                Weight(nd, d, g, row0=r0), Weight(nd, d, g, row0=r0),                      # f_b, g_b
                Weight(n, h, g, row0=heads.start),                                          # b
                Weight(3 * nd, self.conv_kernel, FP32), Weight(nd, 1, FP32), Weight(n, 1, FP32))  # conv, dt_bias, A_log


@dataclass(frozen=True)
class ModelFamily:
    name: str                       # "dense" or "hybrid"
    pool_layers: Mapping[int, int]  # model layer -> paged-pool layer, for every layer holding KV blocks
    state_rows: Mapping[int, int]   # model layer -> recurrent-state row, for every layer holding per-request state
    attention_heads: int            # MLA heads (Q-B / KV-B / O shard by these)
    linear: LinearAttention | None = None   # the KDA layers; None: no KDA layers
    index_layers: frozenset[int] = frozenset()   # layers running their own DSA indexer (its weights, its keys)
    index_vectors: int = 1          # indexer vectors kept per token: the key (DSA), key + pool gate logits (KPool)
    index_extra: tuple[Weight, ...] = ()    # weights an indexer layer adds to DSA's (KPool: pool ape and gate)
    layer_extra: tuple[Weight, ...] = ()    # weights every layer adds (mHC: both blocks' fn, base, scale, in fp32)
    # the memory model counts this family's weights exactly even when they are not quantised (its fp32 mHC and KDA
    # parameters are priced wrong by params × weight_bytes); a dense family is priced params × weight_bytes
    exact_weights: bool = False

    @property
    def linear_heads(self) -> int:   # KDA heads (their projections and state shard by these)
        return self.linear.heads if self.linear is not None else 0

    @property
    def recurrent(self) -> bool:   # some layer keeps per-request recurrent state
        return bool(self.state_rows)

    @property
    def num_pool_layers(self) -> int:
        return len(self.pool_layers)

    def pool_layer(self, layer: int) -> int | None:   # None: the layer holds no KV blocks (KDA)
        return self.pool_layers.get(layer)

    def state_row(self, layer: int) -> int | None:
        return self.state_rows.get(layer)

    def is_recurrent(self, layer: int) -> bool:
        return layer in self.state_rows


def describe(cfg: ModelConfig) -> ModelFamily:
    """The family of `cfg` (cached: the memory model asks per layer; the description is read-only)."""
    try:
        return _cached(cfg)
    except TypeError:   # a config built by hand with a list in it is unhashable: described each time
        return _describe(cfg)


def _describe(cfg: ModelConfig) -> ModelFamily:
    layers = range(cfg.num_hidden_layers)
    if cfg.hybrid is None:
        index = (frozenset() if cfg.index_head_dim <= 0 else
                 frozenset(i for i in layers if not cfg.indexer_types or cfg.has_indexer(i)))
        return ModelFamily("dense", {i: i for i in layers}, {}, cfg.num_attention_heads, index_layers=index)
    hy, hid, idim = cfg.hybrid, cfg.hidden_size, cfg.index_head_dim
    mla = [i for i in layers if not cfg.is_linear_layer(i)]
    lin = [i for i in layers if cfg.is_linear_layer(i)]
    kda = LinearAttention(hy.linear_num_heads, hy.linear_head_dim, hy.linear_conv_kernel_dim, len(lin), hid,
                          hy.quantized_gates)
    n = hy.hc_mult
    mhc = 2 * (Weight((2 + n) * n, n * hid, FP32), Weight((2 + n) * n, 1, FP32), Weight(3, 1, FP32))
    index = frozenset(i for i in mla if idim > 0 and hy.indexer_types[i] == "full")
    return ModelFamily("hybrid", {l: j for j, l in enumerate(mla)}, {l: j for j, l in enumerate(lin)},
                       cfg.num_attention_heads, kda, index, index_vectors=2,
                       index_extra=(Weight(hy.index_kpool, idim, DENSE), Weight(idim, hid, DENSE)),
                       layer_extra=mhc, exact_weights=True)


_cached = lru_cache(maxsize=32)(_describe)
