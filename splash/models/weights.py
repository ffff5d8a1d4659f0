"""Per-rank weight containers for the DeepSeek-V3 family and how a rank takes its shard.

Attention projections (Q-B, KV-B, O) are held for a range of heads; KV-B as W_UK [H, d_nope, d_c] and W_UV
transposed for the absorbed MLA form, or, quantised (splash.models.qweight), whole as the local heads' rows
(`kv_b`, dequantised per use by `uk()` / `uv_t()`). FFN/MoE weights are TP-sharded along the intermediate
dimension, identically in every layout.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from splash.models.config import ModelConfig
from splash.models.indexer import IndexerWeights, indexer_shapes
from splash.native.packed import PackedExperts, PackedLinear, pack_attention, pack_experts, pack_linear
from splash.models.qweight import ExpertStack, QuantWeight, RowStack, is_quantized, owned, take_cols, take_rows


@dataclass
class AttnWeights:
    q_a: torch.Tensor | None       # [q_lora, hidden] (None when q_lora_rank is None)
    q_a_norm: torch.Tensor | None  # [q_lora]
    q_b: torch.Tensor              # [H_l * qk_head_dim, q_lora or hidden]  (local heads)
    kv_a: torch.Tensor             # [d_c + d_r, hidden]
    kv_a_norm: torch.Tensor        # [d_c]
    w_uk: torch.Tensor | None      # [H_l, d_nope, d_c] (None when KV-B is quantised: see kv_b)
    w_uv: torch.Tensor | None      # W_UV transposed, [H_l, d_c, d_v] (each head's d_v columns contiguous)
    o: torch.Tensor                # [hidden, H_l * d_v]
    heads: range
    # [Q-A ; KV-A] stacked [q_lora + d_c + d_r, hidden] for one GEMM (q_a / kv_a are views into it when built by
    # attention_from_full, a RowStack when quantised); a switch carries it over (never a second copy)
    qkv_a: torch.Tensor | None = field(default=None, repr=False, compare=False)
    kv_b: QuantWeight | None = None  # quantised KV-B rows of the local heads [H_l * (d_nope + d_v), d_c]
    d_nope: int = 0                  # qk_nope_head_dim, to split kv_b into W_UK / W_UV

    def uk(self) -> torch.Tensor:   # W_UK [H_l, d_nope, d_c] in the compute dtype
        if self.kv_b is None:
            return self.w_uk
        return self.kv_b.dequant().view(len(self.heads), -1, self.kv_b.shape[1])[:, :self.d_nope]

    def uv_t(self) -> torch.Tensor:   # W_UV transposed, [H_l, d_c, d_v], in the compute dtype
        if self.kv_b is None:
            return self.w_uv
        return self.kv_b.dequant().view(len(self.heads), -1, self.kv_b.shape[1])[:, self.d_nope:].transpose(1, 2)


@dataclass
class MLPWeights:
    gate: torch.Tensor | None  # [I_l, hidden] (None when packed)
    up: torch.Tensor | None    # [I_l, hidden]
    down: torch.Tensor  # [hidden, I_l]
    # [gate ; up] stacked [2 * I_l, hidden] for one GEMM (gate / up are views into it, or its RowStack's parts)
    gate_up: torch.Tensor = field(repr=False, compare=False)


@dataclass
class MoEWeights:
    router: torch.Tensor       # [E, hidden] fp32
    bias: torch.Tensor         # [E] fp32 e_score_correction_bias
    gate_up: torch.Tensor      # [E, 2 * I_l, hidden]
    down: torch.Tensor         # [E, hidden, I_l]
    shared: MLPWeights | None


@dataclass
class LayerWeights:
    input_norm: torch.Tensor
    post_norm: torch.Tensor
    attn: AttnWeights
    ffn: MLPWeights | MoEWeights
    indexer: IndexerWeights | None = None  # DSA lightning indexer (common state); None: no DSA or a shared layer


@dataclass
class ModelWeights:
    embed: torch.Tensor    # [V, hidden]
    norm: torch.Tensor     # [hidden]
    lm_head: torch.Tensor  # [V, hidden]
    layers: list[LayerWeights]   # glm5_next: HybridLayerWeights (splash.models.glm5_next)


def shard_rows(w, shard: int, shards: int):
    n = w.shape[0] // shards
    return take_rows(w, shard * n, (shard + 1) * n)


def shard_cols(w, shard: int, shards: int):
    n = w.shape[-1] // shards
    return take_cols(w, shard * n, (shard + 1) * n)


def attention_from_full(cfg: ModelConfig, get, prefix: str, heads: range) -> AttnWeights:
    """A rank's attention weights for `heads` from a getter of full tensors; quantised projections stay in stored
    form, as the row / column ranges of the local heads."""
    H, dn, dv, dc = cfg.num_attention_heads, cfg.qk_nope_head_dim, cfg.v_head_dim, cfg.kv_lora_rank
    qh, h0, h1 = cfg.qk_head_dim, heads.start, heads.stop
    kv_b, kv_a = get(prefix + "kv_b_proj.weight"), get(prefix + "kv_a_proj_with_mqa.weight")
    quant, q_a, q_a_norm, qkv_a = isinstance(kv_b, QuantWeight), None, None, None
    if cfg.q_lora_rank is None:
        q_b = get(prefix + "q_proj.weight")
    else:
        q_a, q_a_norm = get(prefix + "q_a_proj.weight"), get(prefix + "q_a_layernorm.weight")
        q_b = get(prefix + "q_b_proj.weight")
        if quant or is_quantized(q_a) or is_quantized(kv_a):
            qkv_a = RowStack([q_a, kv_a])
        elif q_a.dtype == kv_a.dtype:  # one [Q-A ; KV-A] weight; the split weights are row views of it (no copy)
            qkv_a = torch.cat([q_a, kv_a], dim=0)
            q_a, kv_a = qkv_a[:q_a.shape[0]], qkv_a[q_a.shape[0]:]
    o = get(prefix + "o_proj.weight")
    if quant:
        for name, w in (("o_proj", o), ("q_b_proj", q_b)):
            if not isinstance(w, QuantWeight):
                raise ValueError(f"{prefix}{name}.weight: the attention projections must all be quantised or none "
                                 f"(got {type(w).__name__} beside quantised ones)")
        return AttnWeights(q_a=q_a, q_a_norm=q_a_norm, q_b=q_b.rows(h0 * qh, h1 * qh), kv_a=kv_a,
                           kv_a_norm=get(prefix + "kv_a_layernorm.weight"), w_uk=None, w_uv=None,
                           o=o.cols(h0 * dv, h1 * dv), heads=heads, qkv_a=qkv_a,
                           kv_b=kv_b.rows(h0 * (dn + dv), h1 * (dn + dv)), d_nope=dn)
    kv_b, o = kv_b.view(H, dn + dv, dc), o.view(cfg.hidden_size, H, dv)
    return pack_attention(AttnWeights(
        q_a=q_a, q_a_norm=q_a_norm, q_b=owned(q_b.view(H, qh, -1)[h0:h1].reshape((h1 - h0) * qh, -1)),
        kv_a=kv_a, kv_a_norm=get(prefix + "kv_a_layernorm.weight"),
        w_uk=kv_b[h0:h1, :dn].contiguous(), w_uv=kv_b[h0:h1, dn:].transpose(1, 2).contiguous(),
        o=o[:, h0:h1].reshape(cfg.hidden_size, (h1 - h0) * dv).contiguous(), heads=heads, qkv_a=qkv_a))


def mlp_from_full(get, prefix: str, shard: int, shards: int, pack: bool = True) -> MLPWeights:
    """A dense MLP's TP shard; with `pack`, fp32 weights are packed for the native GEMM where it runs (then `gate`
    and `up` are None and `gate_up` / `down` are PackedLinear)."""
    gate = shard_rows(get(prefix + "gate_proj.weight"), shard, shards)
    up = shard_rows(get(prefix + "up_proj.weight"), shard, shards)
    if is_quantized(gate) or is_quantized(up):
        return MLPWeights(gate=gate, up=up, down=shard_cols(get(prefix + "down_proj.weight"), shard, shards),
                          gate_up=RowStack([gate, up]))
    gate_up = torch.cat([gate, up], dim=0)
    down = shard_cols(get(prefix + "down_proj.weight"), shard, shards)
    if pack:
        pg, pd = pack_linear(gate_up), pack_linear(down)
        if isinstance(pg, PackedLinear) and isinstance(pd, PackedLinear):
            return MLPWeights(gate=None, up=None, down=pd, gate_up=pg)
    return MLPWeights(gate=gate_up[:gate.shape[0]], up=gate_up[gate.shape[0]:], down=down, gate_up=gate_up)


def moe_from_full(cfg: ModelConfig, get, prefix: str, shard: int, shards: int) -> MoEWeights:
    gate_up, down = [], []
    for e in range(cfg.n_routed_experts):
        m = mlp_from_full(get, f"{prefix}experts.{e}.", shard, shards, pack=False)
        gate_up.append(m.gate_up)
        down.append(m.down)
    shared = mlp_from_full(get, prefix + "shared_experts.", shard, shards) if cfg.n_shared_experts else None
    quant = any(is_quantized(w) for w in gate_up + down)
    return MoEWeights(router=get(prefix + "gate.weight").float(),
                      bias=get(prefix + "gate.e_score_correction_bias").float(),
                      gate_up=ExpertStack(gate_up) if quant else pack_experts(torch.stack(gate_up)),
                      down=ExpertStack(down) if quant else pack_experts(torch.stack(down)), shared=shared)


def weight_tensors(obj):
    """Every tensor reachable from a weight container (QuantWeight data + scales, stacks, dataclass fields)."""
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, QuantWeight):
        yield from obj.tensors()
    elif isinstance(obj, (PackedExperts, PackedLinear)):
        yield obj.packed
    elif isinstance(obj, RowStack):
        for p in obj.parts:
            yield from weight_tensors(p)
    elif isinstance(obj, (ExpertStack, list, tuple)):
        for p in obj:
            yield from weight_tensors(p)
    elif hasattr(obj, "__dataclass_fields__"):
        for name in obj.__dataclass_fields__:
            yield from weight_tensors(getattr(obj, name))


def resident_bytes(weights) -> int:
    """Bytes of memory a rank's weights hold: each distinct storage once, whole (a view keeps its base alive)."""
    seen: dict[int, int] = {}
    for t in weight_tensors(weights):
        st = t.untyped_storage()
        seen[st.data_ptr()] = st.nbytes()
    return sum(seen.values())


def expected_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor name the loader reads, with the shape config.json implies."""
    h, H, qh, dc, dr = cfg.hidden_size, cfg.num_attention_heads, cfg.qk_head_dim, cfg.kv_lora_rank, cfg.qk_rope_head_dim
    s: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (cfg.vocab_size, h), "model.norm.weight": (h,)}
    if not cfg.tie_word_embeddings:
        s["lm_head.weight"] = (cfg.vocab_size, h)
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}."
        s[p + "input_layernorm.weight"] = (h,)
        s[p + "post_attention_layernorm.weight"] = (h,)
        a = p + "self_attn."
        if cfg.q_lora_rank is None:
            s[a + "q_proj.weight"] = (H * qh, h)
        else:
            s.update({a + "q_a_proj.weight": (cfg.q_lora_rank, h), a + "q_a_layernorm.weight": (cfg.q_lora_rank,),
                      a + "q_b_proj.weight": (H * qh, cfg.q_lora_rank)})
        s.update({a + "kv_a_proj_with_mqa.weight": (dc + dr, h), a + "kv_a_layernorm.weight": (dc,),
                  a + "kv_b_proj.weight": (H * (cfg.qk_nope_head_dim + cfg.v_head_dim), dc),
                  a + "o_proj.weight": (h, H * cfg.v_head_dim)})
        if cfg.has_indexer(i):
            s.update(indexer_shapes(a + "indexer.", h, cfg.q_lora_rank, cfg.index_n_heads, cfg.index_head_dim))
        s.update(_ffn_shapes(cfg, i, p + "mlp."))
    return s


def _ffn_shapes(cfg: ModelConfig, layer: int, p: str) -> dict[str, tuple[int, ...]]:
    h = cfg.hidden_size

    def mlp(prefix: str, inter: int) -> dict[str, tuple[int, ...]]:
        return {prefix + "gate_proj.weight": (inter, h), prefix + "up_proj.weight": (inter, h),
                prefix + "down_proj.weight": (h, inter)}

    if not cfg.is_moe_layer(layer):
        return mlp(p, cfg.intermediate_size)
    s = {p + "gate.weight": (cfg.n_routed_experts, h), p + "gate.e_score_correction_bias": (cfg.n_routed_experts,)}
    for e in range(cfg.n_routed_experts):
        s.update(mlp(f"{p}experts.{e}.", cfg.moe_intermediate_size))
    if cfg.n_shared_experts:
        s.update(mlp(p + "shared_experts.", cfg.moe_intermediate_size * cfg.n_shared_experts))
    return s
