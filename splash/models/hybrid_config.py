"""GLM-5.3-Flash (``glm5_next``) architecture fields beyond the MLA family's — pure data, no torch.

The text model interleaves KDA linear-attention layers (``layer_types`` "linear_attention": short causal conv +
gated delta-rule recurrence, per-request state) with NoPE MLA layers carrying a DSA indexer with KPool selection
("indexed_attention"; ``indexer_types`` "shared" reuses the previous full layer's selection), wraps every block
in mHC residual streams (``hc_mult`` streams, Sinkhorn-normalised mixing) and clamps SwiGLU at ``swiglu_limit``.
``mlp_layer_types`` says which layers are dense ("dense") and which MoE ("sparse").
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from splash.errors import ConfigError

LINEAR, INDEXED = "linear_attention", "indexed_attention"


@dataclass(frozen=True)
class HybridConfig:
    layer_types: tuple[str, ...]
    indexer_types: tuple[str, ...]
    mlp_layer_types: tuple[str, ...]
    swiglu_limit: float = 10.0
    linear_num_heads: int = 64
    linear_head_dim: int = 128
    linear_conv_kernel_dim: int = 4
    linear_lower_bound: float | None = -5.0
    hc_mult: int = 4
    hc_eps: float = 1e-6
    hc_sinkhorn_iters: int = 20
    index_kpool: int = 16
    index_kpool_always_select_tail: bool = True
    # a quantised checkpoint stores KDA's gate projections (f_a/f_b/g_a/g_b/b_proj) quantised too: its
    # quantization_config does not exclude them (`--quantization` and most releases keep them dense)
    quantized_gates: bool = False


def flatten_glm5_next(raw: dict[str, Any], where: str) -> dict[str, Any]:
    """The text model's fields of a ``Glm5NextConfig`` dict (``text_config``), with the top-level model_type."""
    text = raw.get("text_config")
    if text is None:
        return raw
    if not isinstance(text, dict):
        raise ConfigError(f"{where}: field 'text_config' must be an object, got {type(text).__name__}")
    out = {**text, "model_type": "glm5_next"}
    for k in ("tie_word_embeddings", "quantization_config"):
        if k in raw and k not in text:
            out[k] = raw[k]
    return out


def _per_layer(raw: dict[str, Any], name: str, n: int, allowed: tuple[str, ...], default: list[str],
               where: str) -> tuple[str, ...]:
    vals = raw.get(name)
    if vals is None:
        vals = default
    if not isinstance(vals, list) or len(vals) < n:
        raise ConfigError(f"{where}: field {name!r} must list one of {allowed} for each of the {n} layers")
    vals = ["indexed_attention" if v == "full_attention" else v for v in vals[:n]]
    for i, v in enumerate(vals):
        if v not in allowed:
            raise ConfigError(f"{where}: field '{name}[{i}]' = {v!r} is not one of {', '.join(allowed)}")
    return tuple(vals)


def _quantizes_gates(qc: Any, layer_types: tuple[str, ...]) -> bool:
    """A quantization_config whose exclusions (fp8 ``modules_to_not_convert``, compressed-tensors ``ignore``; exact
    names, ``re:`` patterns or name fragments) leave the first KDA layer's f_a_proj quantised."""
    if not isinstance(qc, dict) or LINEAR not in layer_types:
        return False
    i = layer_types.index(LINEAR)
    names = [f"{pre}layers.{i}.self_attn.f_a_proj" for pre in ("model.language_model.", "model.")]
    for entry in (qc.get("modules_to_not_convert") or []) + (qc.get("ignore") or []):
        pat = str(entry)[3:] if str(entry).startswith("re:") else str(entry)
        if any(pat in n or _fullmatch(pat, n) for n in names):
            return False
    return True


def _fullmatch(pattern: str, name: str) -> bool:
    try:
        return re.fullmatch(pattern, name) is not None
    except re.error:
        return False


def hybrid_from_hf(raw: dict[str, Any], where: str) -> HybridConfig:
    """HybridConfig from the (flattened) text config; ConfigError naming the field when it cannot run."""
    n = raw["num_hidden_layers"]
    layer_types = _per_layer(raw, "layer_types", n, (LINEAR, INDEXED),
                             [LINEAR if i % 4 != 3 else INDEXED for i in range(n)], where)
    mlp = _per_layer(raw, "mlp_layer_types", n, ("dense", "sparse"),
                     ["dense"] * min(3, n) + ["sparse"] * max(0, n - 3), where)
    idx = _per_layer(raw, "indexer_types", n, ("full", "shared"), ["full"] * n, where)
    prev_full = False
    for i, t in enumerate(layer_types):
        if t != INDEXED:
            prev_full = False  # transformers passes a selection only to the very next layer
            continue
        if idx[i] == "shared" and not prev_full:
            raise ConfigError(f"{where}: field 'indexer_types[{i}]' = 'shared' needs layer {i - 1} to be an "
                              "indexed_attention layer whose selection it reuses")
        prev_full = True
    kw = {k: raw[k] for k in ("swiglu_limit", "linear_num_heads", "linear_head_dim", "linear_conv_kernel_dim",
                              "linear_lower_bound", "hc_mult", "hc_eps", "hc_sinkhorn_iters", "index_kpool",
                              "index_kpool_always_select_tail") if k in raw}
    h = HybridConfig(layer_types=layer_types, indexer_types=idx, mlp_layer_types=mlp,
                     quantized_gates=_quantizes_gates(raw.get("quantization_config"), layer_types), **kw)
    if raw.get("qk_rope_head_dim", 0):
        raise ConfigError(f"{where}: field 'qk_rope_head_dim' must be 0 for glm5_next (NoPE MLA layers)")
    if raw.get("q_lora_rank") is None:
        raise ConfigError(f"{where}: field 'q_lora_rank' is required for glm5_next (the DSA indexer reads Q-A)")
    topk = raw.get("index_topk", 0)
    if h.index_kpool < 1 or topk % h.index_kpool:
        raise ConfigError(f"{where}: field 'index_topk' = {topk} must be a multiple of index_kpool "
                          f"({h.index_kpool})")
    if raw.get("hidden_act", "silu") != "silu":
        raise ConfigError(f"{where}: field 'hidden_act' = {raw.get('hidden_act')!r} is not supported (only silu)")
    return h
