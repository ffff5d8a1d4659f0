"""Per-rank memory model of the four layouts — analytic, usable at paper scale with no tensors.

Per-rank memory = common + projections(layout) + KV(layout) + scratch + reserve. Common (embeddings, LM head, norms,
Q-A, KV-A, DSA indexer, and FFN/MoE, sharded alike in every layout) is layout-independent; Q-B/KV-B/O are divided
by the group when sharded (TP, DOP), whole when replicated (DP-attn, CP); KV is whole blocks where the ownership
model places them. Weights are ``params × weight_bytes``, or with ``weight_quant`` (fp8: a scale per 128×128 block,
int8: per output row) their stored bytes, including the scale blocks a shard shares with its neighbour when it does
not start on a 128 boundary (GLM-5.x KV-B: 448 rows per head). ``rank_weight_bytes`` is what
``splash.models.weights.resident_bytes`` measures. What a model family adds (KDA layers, indexers, extra weights)
comes from its description (splash.models.family), never from testing which family a config is.
"""
from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

from splash.layouts.layout import Layout, check_heads, parse_layout
from splash.layouts.ownership import head_range, kv_copies
from splash.models.config import ModelConfig
from splash.models.family import DENSE, FP32, Weight, describe

KV_DTYPES = ("float32", "bfloat16", "fp8_e4m3", "int8")   # the one list of KV storage dtypes
_PLAIN_BYTES = {"float32": 4, "bfloat16": 2}
QUANT_GROUP = 128  # elements of the latent sharing one fp32 scale (per token)
WEIGHT_QUANTS = ("fp8", "int8")
WEIGHT_BLOCK = 128  # fp8 weights: one fp32 scale per 128×128 block
SCALE_BYTES = 4
FP32_BYTES = 4
CONVERT_CHUNK_SLOTS = 4096  # tokens a KV format conversion dequantises at once (bounds its fp32 scratch)


def layer_has_indexer_keys(cfg: ModelConfig, layer: int | None) -> bool:
    """Layer `layer` (None: the widest) keeps DSA indexer keys: it runs its own indexer (`ModelFamily.index_layers`;
    a "shared" layer reuses another's selection and stores none)."""
    if cfg.index_head_dim <= 0:
        return False
    return layer is None or layer in describe(cfg).index_layers


ROPE_FP8_DTYPES = ("fp8_e4m3",)   # KV dtypes whose rope key a `rope_fp8` pool stores in e4m3 (1 byte a value)
# Attention kernels whose FP8 MLA reads an e4m3 rope key, by compute capability major: FlashInfer 0.7.4's FP8 MLA
# is SM90 only and reads the rope cache in fp8 at one per-tensor scale.
ROPE_FP8_SM_MAJOR = {"flashinfer": 9}


def rope_fp8_pool(kernel: str, arch: str) -> bool:
    """Whether `kernel`'s pools on an `arch` device ("sm_90", "gfx942", "cpu"; "" unknown) store an fp8_e4m3
    layer's rope key in e4m3: the one decision every byte count of the pool follows (they are handed `rope_fp8`)."""
    major = ROPE_FP8_SM_MAJOR.get(kernel)
    digits = arch.removeprefix("sm_")
    return major is not None and arch.startswith("sm_") and digits.isdigit() and int(digits) // 10 == major


def kv_bytes_per_token_layer(cfg: ModelConfig, kv_dtype: str, layer: int | None = None,
                             rope_fp8: bool = False) -> int:
    """Bytes of KV per token of one layer (default: the widest MLA layer) with scales and DSA indexer keys; 0 for
    a KDA layer. Quantised: the FlashMLA FP8 layout (d_c bytes + an fp32 scale per 128 + d_r rope values in bf16,
    or e4m3 in a `rope_fp8` pool); indexer keys (glm5_next keeps two vectors) 1 byte each + a scale per 128."""
    if kv_dtype not in KV_DTYPES:
        raise ValueError(f"unknown kv_dtype {kv_dtype!r} (allowed: {', '.join(KV_DTYPES)})")
    fam = describe(cfg)
    if layer is not None and fam.pool_layer(layer) is None:
        return 0
    dc, dr, di = cfg.kv_lora_rank, cfg.qk_rope_head_dim, cfg.index_head_dim
    keys = fam.index_vectors if layer_has_indexer_keys(cfg, layer) else 0
    if kv_dtype in _PLAIN_BYTES:
        elem = _PLAIN_BYTES[kv_dtype]
        return elem * (dc + dr) + keys * elem * di
    latent = dc + 4 * math.ceil(dc / QUANT_GROUP) + (1 if rope_fp8 and kv_dtype in ROPE_FP8_DTYPES else 2) * dr
    return latent + keys * (di + 4 * math.ceil(di / QUANT_GROUP))


def projection_params(cfg: ModelConfig) -> int:
    """Parameters of the shardable projections of one layer: Q-B + KV-B + O."""
    h = cfg.num_attention_heads
    q_in = cfg.q_lora_rank if cfg.q_lora_rank else cfg.hidden_size
    q_b = q_in * h * cfg.qk_head_dim
    kv_b = cfg.kv_lora_rank * h * (cfg.qk_nope_head_dim + cfg.v_head_dim)
    o = h * cfg.v_head_dim * cfg.hidden_size
    return q_b + kv_b + o


def recurrent_state_bytes(cfg: ModelConfig, layout: Layout | str, world: int) -> int:
    """Bytes of one request's KDA state (every KDA layer, fp32) on a rank holding it in `layout`: a head slice
    where projections are sharded, all heads on the owner otherwise; 0 without KDA layers."""
    kda = describe(cfg).linear
    if kda is None:
        return 0
    heads = kda.heads // world if parse_layout(layout).shards_projections else kda.heads
    return heads * kda.state_bytes_per_head


def states_per_rank(layout: Layout | str, states: int, world: int) -> int:
    """KDA states a rank keeps when the group keeps `states`: a slice of each where projections are sharded, else
    ⌈states / world⌉ whole ones (balanced owners)."""
    return states if parse_layout(layout).shards_projections else -(-states // world)


def state_snapshot_slots(cfg: ModelConfig, max_num_seqs: int, prefix_caching: bool) -> int:
    """Prefix-cache snapshots of KDA state the group keeps: as many as running requests (so twice the state)."""
    return max_num_seqs if describe(cfg).recurrent and prefix_caching else 0


def _indexer_params(cfg: ModelConfig) -> int:
    if cfg.index_head_dim <= 0:
        return 0
    q_in = cfg.q_lora_rank if cfg.q_lora_rank else cfg.hidden_size
    hid, ih, idim = cfg.hidden_size, cfg.index_n_heads, cfg.index_head_dim
    return q_in * ih * idim + hid * idim + 2 * idim + hid * ih + _params(describe(cfg).index_extra)


def _ffn_params(cfg: ModelConfig, layer: int) -> int:
    hid = cfg.hidden_size
    if not cfg.is_moe_layer(layer):
        return 3 * hid * cfg.intermediate_size
    mi, nr = cfg.moe_intermediate_size, cfg.n_routed_experts
    return 3 * hid * mi * nr + 3 * hid * mi * cfg.n_shared_experts + nr * hid + nr


def _attn_common_params(cfg: ModelConfig) -> int:
    """Per-layer non-shardable attention weights and norms: q_a (+norm), kv_a (+norm), 2 block norms."""
    hid = cfg.hidden_size
    q_a = hid * cfg.q_lora_rank + cfg.q_lora_rank if cfg.q_lora_rank else 0
    kv_a = hid * (cfg.kv_lora_rank + cfg.qk_rope_head_dim) + cfg.kv_lora_rank
    return q_a + kv_a + 2 * hid


def common_params(cfg: ModelConfig, ffn_shards: int = 1) -> float:
    """Parameters per rank of the layout-independent state (FFN/MoE divided by ``ffn_shards``)."""
    if ffn_shards < 1:
        raise ValueError(f"ffn_shards must be positive, got {ffn_shards}")
    fam = describe(cfg)
    emb = cfg.vocab_size * cfg.hidden_size
    total: float = emb + (0 if cfg.tie_word_embeddings else emb) + cfg.hidden_size
    kda = 2 * cfg.hidden_size + _params(fam.linear.common_weights()) if fam.linear is not None else 0
    for layer in range(cfg.num_hidden_layers):
        if fam.is_recurrent(layer):  # KDA: no Q-A/KV-A, its common weights instead
            attn = kda
        else:
            attn = _attn_common_params(cfg) + (_indexer_params(cfg) if layer_has_indexer_keys(cfg, layer) else 0)
        total += attn + _params(fam.layer_extra) + _ffn_params(cfg, layer) / ffn_shards
    return total


def common_bytes(cfg: ModelConfig, shards: int, weight_bytes: float, weight_quant: str | None) -> float:
    """Common state per rank: params × weight_bytes, or (quantised) the largest rank's exact stored bytes."""
    if weight_quant is None and not describe(cfg).exact_weights:
        return common_params(cfg, shards) * weight_bytes
    return max(common_bytes_per_rank(cfg, r, shards, weight_bytes, weight_quant) for r in range(shards))


def projection_bytes_per_rank(cfg: ModelConfig, layout: Layout | str, world: int, weight_bytes: float,
                              weight_quant: str | None = None) -> float:
    """Bytes of Q-B/KV-B/O over all layers on the rank holding the most (shards may share a scale block)."""
    layout = parse_layout(layout)
    check_heads(layout, cfg.num_attention_heads, world)
    if weight_quant is not None or describe(cfg).exact_weights:
        return max(rank_projection_bytes(cfg, layout, world, r, weight_bytes, weight_quant) for r in range(world))
    total = projection_params(cfg) * cfg.num_hidden_layers * weight_bytes
    return total / world if layout.shards_projections else total


def switch_receive_bytes(cfg: ModelConfig, src: Layout | str, dst: Layout | str, world: int,
                         weight_bytes: float, weight_quant: str | None = None) -> float:
    """Projection bytes per layer the rank receiving the most gets on src→dst: sharded→replicated all-gathers the
    (world-1)/world it lacks; every other direction receives nothing."""
    if weight_quant is not None:
        return max(projection_recv_bytes(cfg, src, dst, world, r, weight_bytes, weight_quant) for r in range(world))
    src, dst = parse_layout(src), parse_layout(dst)
    if src.shards_projections and not dst.shards_projections:
        return projection_params(cfg) * weight_bytes * (world - 1) / world
    return 0.0


def kv_block_bytes(cfg: ModelConfig, kv_dtype: str, block_size: int, rope_fp8: bool = False) -> int:
    """Bytes of one paged-cache block over all layers (KDA layers hold none)."""
    return block_size * sum(kv_bytes_per_token_layer(cfg, kv_dtype, i, rope_fp8)
                            for i in range(cfg.num_hidden_layers))


@dataclass(frozen=True)
class CapacityReport:
    """KV capacity of one layout under a per-rank budget."""
    layout: Layout
    world: int
    block_size: int
    block_bytes: int          # one block, all layers
    room_bytes_per_rank: float  # budget left for KV (0 when negative)
    blocks_per_rank: int
    distinct_blocks: int      # distinct logical blocks the whole group can hold
    distinct_tokens: int

    @property
    def tokens_per_rank(self) -> int:
        return self.blocks_per_rank * self.block_size


def kv_capacity_tokens(cfg: ModelConfig, layout: Layout | str, world: int, budget_bytes_per_rank: float,
                       weight_bytes: float, kv_dtype: str, block_size: int, scratch_bytes: int = 0,
                       reserve_bytes: int = 0, ffn_shards: int | None = None,
                       weight_quant: str | None = None, state_requests: int = 0,
                       rope_fp8: bool = False) -> CapacityReport:
    """Distinct KV tokens (whole blocks) the group can hold in ``layout`` under a per-rank byte budget, with room
    for ``state_requests`` KDA states (running requests' and snapshots)."""
    layout = parse_layout(layout)
    per_rank_reqs = states_per_rank(layout, state_requests, world)
    fixed = (common_bytes(cfg, ffn_shards or world, weight_bytes, weight_quant)
             + projection_bytes_per_rank(cfg, layout, world, weight_bytes, weight_quant) + scratch_bytes
             + reserve_bytes + per_rank_reqs * recurrent_state_bytes(cfg, layout, world))
    room = max(0.0, budget_bytes_per_rank - fixed)
    per_block = kv_block_bytes(cfg, kv_dtype, block_size, rope_fp8)
    per_rank = int(room // per_block) if per_block > 0 else 0
    distinct = world * per_rank // kv_copies(layout, world)
    return CapacityReport(layout, world, block_size, per_block, room, per_rank, distinct, distinct * block_size)


# ---- exact stored bytes (quantised weights + their scales) -------------------------------------------------
def _touched(start: int, n: int) -> int:
    """128-blocks touched by elements [start, start + n)."""
    return -(-(start + n) // WEIGHT_BLOCK) - start // WEIGHT_BLOCK if n else 0


def matrix_bytes(rows: int, cols: int, elem_bytes: float, weight_quant: str | None = None, row0: int = 0,
                 col0: int = 0) -> float:
    """Stored bytes of rows [row0, row0 + rows) × columns [col0, col0 + cols) of one linear weight: fp8 with the
    scale blocks the range touches, int8 with every row's scale."""
    if weight_quant is None:
        return rows * cols * elem_bytes
    if weight_quant == "fp8":
        return rows * cols + SCALE_BYTES * _touched(row0, rows) * _touched(col0, cols)
    if weight_quant == "int8":
        return rows * cols + SCALE_BYTES * rows
    raise ValueError(f"unknown weight_quant {weight_quant!r} (allowed: {', '.join(WEIGHT_QUANTS)})")


def projection_shard_bytes(cfg: ModelConfig, heads: range, elem_bytes: float,
                           weight_quant: str | None = None) -> float:
    """Stored bytes of one layer's Q-B/KV-B/O for a contiguous range of heads (a rank's shard, or all heads)."""
    q_in = cfg.q_lora_rank if cfg.q_lora_rank else cfg.hidden_size
    qh, kvh, dv = cfg.qk_head_dim, cfg.qk_nope_head_dim + cfg.v_head_dim, cfg.v_head_dim
    h0, n = heads.start, len(heads)
    return (matrix_bytes(n * qh, q_in, elem_bytes, weight_quant, row0=h0 * qh)
            + matrix_bytes(n * kvh, cfg.kv_lora_rank, elem_bytes, weight_quant, row0=h0 * kvh)
            + matrix_bytes(cfg.hidden_size, n * dv, elem_bytes, weight_quant, col0=h0 * dv))


def _ffn_bytes(cfg: ModelConfig, layer: int, shard: int, shards: int, e: float, wq: str | None) -> float:
    h = cfg.hidden_size

    def mlp(inter: int) -> float:
        n = inter // shards
        return (2 * matrix_bytes(n, h, e, wq, row0=shard * n)
                + matrix_bytes(h, n, e, wq, col0=shard * n))

    if not cfg.is_moe_layer(layer):
        return mlp(cfg.intermediate_size)
    E = cfg.n_routed_experts
    shared = mlp(cfg.moe_intermediate_size * cfg.n_shared_experts) if cfg.n_shared_experts else 0
    return 4 * (E * h + E) + E * mlp(cfg.moe_intermediate_size) + shared


def common_bytes_per_rank(cfg: ModelConfig, rank: int, world: int, elem_bytes: float,
                          weight_quant: str | None = None) -> float:
    """Exact stored bytes of the layout-independent state on `rank` (FFN/MoE sharded over `world`)."""
    fam, h, e, wq = describe(cfg), cfg.hidden_size, elem_bytes, weight_quant
    emb = cfg.vocab_size * h * e
    total = emb + (0 if cfg.tie_word_embeddings else emb) + h * e
    mla = matrix_bytes(cfg.kv_lora_rank + cfg.qk_rope_head_dim, h, e, wq) + cfg.kv_lora_rank * e
    if cfg.q_lora_rank:
        mla += matrix_bytes(cfg.q_lora_rank, h, e, wq) + cfg.q_lora_rank * e
    idx = 0.0
    if cfg.index_head_dim > 0:  # wq_b, wk in the compute dtype; k_norm (+ bias) and weights_proj kept in fp32
        q_in, ih, idim = cfg.q_lora_rank or h, cfg.index_n_heads, cfg.index_head_dim
        idx = (matrix_bytes(ih * idim, q_in, e, wq) + matrix_bytes(idim, h, e, wq) + FP32_BYTES * (2 * idim + h * ih)
               + stored_bytes(fam.index_extra, e, wq))
    kda = stored_bytes(fam.linear.common_weights(), e, wq) if fam.linear is not None else 0.0
    every = 2 * h * e + stored_bytes(fam.layer_extra, e, wq)
    for i in range(cfg.num_hidden_layers):
        attn = kda if fam.is_recurrent(i) else mla + (idx if layer_has_indexer_keys(cfg, i) else 0)
        total += every + attn + _ffn_bytes(cfg, i, rank, world, e, wq)
    return total


def rank_projection_bytes(cfg: ModelConfig, layout: Layout | str, world: int, rank: int, elem_bytes: float,
                          weight_quant: str | None = None) -> float:
    """`rank`'s layout-dependent weights over all layers as stored: its MLA heads' Q-B/KV-B/O and KDA heads'."""
    fam = describe(cfg)
    heads = head_range(cfg.num_attention_heads, world, rank, layout)
    total = projection_shard_bytes(cfg, heads, elem_bytes, weight_quant) * fam.num_pool_layers
    if fam.linear is not None:
        lin = head_range(fam.linear.heads, world, rank, layout)
        total += linear_shard_bytes(cfg, lin, elem_bytes, weight_quant) * fam.linear.num_layers
    return total


def rank_weight_bytes(cfg: ModelConfig, layout: Layout | str, world: int, rank: int, elem_bytes: float,
                      weight_quant: str | None = None) -> float:
    """Every weight byte `rank` holds in `layout` as stored (common + projections of all layers)."""
    return (common_bytes_per_rank(cfg, rank, world, elem_bytes, weight_quant)
            + rank_projection_bytes(cfg, layout, world, rank, elem_bytes, weight_quant))


def projection_recv_bytes(cfg: ModelConfig, src: Layout | str, dst: Layout | str, world: int, rank: int,
                          elem_bytes: float, weight_quant: str | None = None) -> float:
    """Projection bytes `rank` receives per layer on src→dst: the other ranks' shards as stored, or nothing."""
    src, dst = parse_layout(src), parse_layout(dst)
    if not (src.shards_projections and not dst.shards_projections):
        return 0.0
    return sum(projection_shard_bytes(cfg, head_range(cfg.num_attention_heads, world, s, src), elem_bytes,
                                      weight_quant) for s in range(world) if s != rank)


# ---- weights a model family adds (splash.models.family) -----------------------------------------------------------
def stored_bytes(weights: Iterable[Weight], elem_bytes: float, weight_quant: str | None = None) -> float:
    """Stored bytes of `weights`: fp32 ones 4 per element, dense ones in the compute dtype, linear ones as stored."""
    total: float = 0   # stays an int where every term is (quantised shards): as the manifest reports them
    for w in weights:
        if w.storage == FP32:
            total += FP32_BYTES * w.params
        else:
            total += matrix_bytes(w.rows, w.cols, elem_bytes, None if w.storage == DENSE else weight_quant,
                                  row0=w.row0, col0=w.col0)
    return total


def _params(weights: Iterable[Weight]) -> int:
    return sum(w.params for w in weights)


def linear_shard_bytes(cfg: ModelConfig, heads: range, e: float, wq: str | None = None) -> float:
    """Stored bytes of one KDA layer's head-shardable weights for a contiguous range of KDA heads."""
    kda = describe(cfg).linear
    return stored_bytes(kda.shard_weights(heads), e, wq) if kda is not None else 0.0
