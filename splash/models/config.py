"""Model architecture description parsed from an HF ``config.json`` — pure data, no torch.

The same ``ModelConfig`` feeds the torch model, the memory model and the simulator, so it imports
nothing heavy. Errors name the file and the field.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any

from splash.errors import ConfigError

if TYPE_CHECKING:
    from splash.models.hybrid_config import HybridConfig

SUPPORTED_MODEL_TYPES = ("deepseek_v3", "deepseek_v32", "glm_moe_dsa", "glm5_next")
DSA_MODEL_TYPES = ("deepseek_v32", "glm_moe_dsa")  # MLA + DSA lightning indexer (splash.models.indexer)
INDEXER_TYPES = ("full", "shared")


@dataclass(frozen=True)
class RopeConfig:
    rope_type: str = "default"  # "default" or "yarn"
    theta: float = 10000.0
    factor: float = 1.0
    original_max_position_embeddings: int = 4096
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float = 1.0
    mscale_all_dim: float = 0.0
    attention_factor: float | None = None
    truncate: bool = True


@dataclass(frozen=True)
class ModelConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    kv_lora_rank: int
    q_lora_rank: int | None
    qk_rope_head_dim: int
    qk_nope_head_dim: int
    v_head_dim: int
    moe_intermediate_size: int = 0
    n_routed_experts: int = 0
    n_shared_experts: int = 0
    num_experts_per_tok: int = 0
    n_group: int = 1
    topk_group: int = 1
    first_k_dense_replace: int = 0
    norm_topk_prob: bool = True
    routed_scaling_factor: float = 1.0
    max_position_embeddings: int = 4096
    rms_norm_eps: float = 1e-6
    rope: RopeConfig = field(default_factory=RopeConfig)
    rope_interleave: bool = True
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    hidden_act: str = "silu"
    bos_token_id: int | None = None
    eos_token_id: int | tuple[int, ...] | None = None
    # DSA indexer (deepseek_v32 / glm_moe_dsa); 0 when the model has none
    index_n_heads: int = 0
    index_head_dim: int = 0
    index_topk: int = 0
    # per layer "full" (runs its indexer) or "shared" (reuses the previous full layer's top-k); () without DSA
    indexer_types: tuple[str, ...] = ()
    index_rope_interleave: bool = False  # indexer rope: interleaved pairs (GLM-5.x) or halves (DeepSeek-V3.2)
    mlp_layer_types: tuple[str, ...] | None = None  # per layer "dense" / "sparse" (MoE); None: first_k_dense_replace
    # GLM-5.3-Flash (glm5_next): KDA / NoPE MLA-DSA hybrid with mHC (splash.models.hybrid_config); None otherwise
    hybrid: "HybridConfig | None" = None
    # weights stored quantised (config.json quantization_config): "fp8" (FP8 E4M3, fp32 scale per 128×128 block,
    # DeepSeek/GLM weight_scale_inv) or "int8" (compressed-tensors INT8, per-output-channel scale); None: plain
    quantization: str | None = None

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def softmax_scale(self) -> float:
        """1/sqrt(qk_head_dim), times YaRN mscale(factor, mscale_all_dim)^2 when scaled (DeepSeek convention)."""
        scale = self.qk_head_dim ** -0.5
        r = self.rope
        if r.rope_type != "default" and r.mscale_all_dim:
            m = yarn_mscale(r.factor, r.mscale_all_dim)
            scale = scale * m * m
        return scale

    def is_moe_layer(self, layer: int) -> bool:
        if self.mlp_layer_types is not None:
            return self.n_routed_experts > 0 and self.mlp_layer_types[layer] == "sparse"
        if self.hybrid is not None:
            return self.n_routed_experts > 0 and self.hybrid.mlp_layer_types[layer] == "sparse"
        return self.n_routed_experts > 0 and layer >= self.first_k_dense_replace

    def is_linear_layer(self, layer: int) -> bool:
        """A KDA linear-attention layer (glm5_next): per-request recurrent + conv state, no KV blocks."""
        return self.hybrid is not None and self.hybrid.layer_types[layer] == "linear_attention"

    @property
    def has_dsa(self) -> bool:
        """The model's MLA layers select their keys with a DSA lightning indexer."""
        return bool(self.indexer_types)

    def has_indexer(self, layer: int) -> bool:
        """Layer `layer` runs its own indexer (holds indexer weights and a per-token indexer key cache)."""
        return bool(self.indexer_types) and self.indexer_types[layer] == "full"

    def indexer_source(self, layer: int) -> int:
        """The layer whose top-k selection `layer` uses: itself when full, else the previous full layer."""
        while self.indexer_types[layer] != "full":
            layer -= 1
        return layer

    @property
    def eos_ids(self) -> tuple[int, ...]:
        if self.eos_token_id is None:
            return ()
        if isinstance(self.eos_token_id, int):
            return (self.eos_token_id,)
        return tuple(self.eos_token_id)


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    if scale <= 1:
        return 1.0
    return 0.1 * mscale * math.log(scale) + 1.0


_REQUIRED = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
             "kv_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim")


def _rope_from_hf(raw: dict[str, Any], where: str) -> RopeConfig:
    params = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
    if not isinstance(params, dict):
        raise ConfigError(f"{where}: field 'rope_parameters' must be an object, got {type(params).__name__}")
    rope_type = params.get("rope_type", params.get("type", "default")) or "default"
    if rope_type not in ("default", "yarn"):
        raise ConfigError(f"{where}: field 'rope_parameters.rope_type' = {rope_type!r} is not supported "
                          "(supported: default, yarn)")
    theta = float(params.get("rope_theta", raw.get("rope_theta", 10000.0)))
    if rope_type == "default":
        return RopeConfig(theta=theta)
    return RopeConfig(
        rope_type="yarn", theta=theta, factor=float(params["factor"]),
        original_max_position_embeddings=int(params.get("original_max_position_embeddings",
                                                        raw.get("max_position_embeddings", 4096))),
        beta_fast=float(params.get("beta_fast") or 32), beta_slow=float(params.get("beta_slow") or 1),
        mscale=float(params.get("mscale") or 0.0), mscale_all_dim=float(params.get("mscale_all_dim") or 0.0),
        attention_factor=params.get("attention_factor"), truncate=bool(params.get("truncate", True)))


def _quantization_from_hf(raw: dict[str, Any], where: str) -> str | None:
    """The weight format a checkpoint declares in ``quantization_config``; ConfigError naming the field for any
    format the loader cannot keep in stored form."""
    qc = raw.get("quantization_config")
    if qc is None:
        return None
    f = "quantization_config"
    if not isinstance(qc, dict):
        raise ConfigError(f"{where}: field {f!r} must be an object, got {type(qc).__name__}")
    method = qc.get("quant_method")
    supported = "supported: fp8 with weight_block_size [128, 128], compressed-tensors INT8 per-channel"
    if method == "fp8":
        if qc.get("weight_block_size") != [128, 128]:
            raise ConfigError(f"{where}: field '{f}.weight_block_size' = {qc.get('weight_block_size')!r}: only "
                              f"FP8 block-scaled weights with 128×128 blocks are supported ({supported})")
        if qc.get("fmt", "e4m3") != "e4m3":
            raise ConfigError(f"{where}: field '{f}.fmt' = {qc.get('fmt')!r} is not supported (only e4m3)")
        return "fp8"
    if method == "compressed-tensors":
        _check_compressed_tensors(qc, where, supported)
        return "int8"
    raise ConfigError(f"{where}: field '{f}.quant_method' = {method!r} is not supported ({supported})")


def _check_compressed_tensors(qc: dict[str, Any], where: str, supported: str) -> None:
    f = "quantization_config"
    fmt = qc.get("format")
    if fmt not in ("int-quantized", "naive-quantized"):
        raise ConfigError(f"{where}: field '{f}.format' = {fmt!r} is not supported (compressed-tensors formats "
                          f"int-quantized and naive-quantized store INT8 values as they are; {supported})")
    groups = qc.get("config_groups")
    if not isinstance(groups, dict) or not groups:
        raise ConfigError(f"{where}: field '{f}.config_groups' must be a non-empty object")
    for gname, g in groups.items():
        w = (g or {}).get("weights") or {}
        got = (w.get("num_bits"), w.get("type"), w.get("symmetric"), w.get("strategy"))
        if got[:3] != (8, "int", True) or got[3] not in ("channel", "tensor"):
            raise ConfigError(f"{where}: field '{f}.config_groups.{gname}.weights' = (num_bits, type, symmetric, "
                              f"strategy) {got} is not supported (only 8-bit symmetric int, channel or tensor)")


def model_config_from_dict(raw: dict[str, Any], where: str = "config.json", allow_planned: bool = False) -> ModelConfig:
    """Build a ModelConfig from an HF config dict; raise ConfigError naming the bad field. ``allow_planned``: the
    shape is for analysis only (memory model, simulator), which may leave a DSA model's indexer fields out."""
    mt = raw.get("model_type")
    if mt == "glm5_next":
        from splash.models.hybrid_config import flatten_glm5_next
        raw = flatten_glm5_next(raw, where)
    if mt not in SUPPORTED_MODEL_TYPES:
        raise ConfigError(f"{where}: field 'model_type' = {mt!r} is not supported "
                          f"(supported: {', '.join(SUPPORTED_MODEL_TYPES)})")
    for name in _REQUIRED:
        if name not in raw:
            raise ConfigError(f"{where}: required field {name!r} is missing")
        if not isinstance(raw[name], int) or isinstance(raw[name], bool) or raw[name] < 0:
            raise ConfigError(f"{where}: field {name!r} must be a non-negative integer, got {raw[name]!r}")
    known = {f.name for f in fields(ModelConfig)} - {"rope", "model_type", "indexer_types", "index_rope_interleave",
                                                     "mlp_layer_types", "hybrid"}
    kwargs: dict[str, Any] = {k: raw[k] for k in known if k in raw and raw[k] is not None}
    if "n_routed_experts" not in raw and "num_local_experts" in raw:
        kwargs["n_routed_experts"] = raw["num_local_experts"]
    kwargs["q_lora_rank"] = raw.get("q_lora_rank")
    if isinstance(kwargs.get("eos_token_id"), list):
        kwargs["eos_token_id"] = tuple(kwargs["eos_token_id"])
    heads = raw["num_attention_heads"]
    if heads == 0:
        raise ConfigError(f"{where}: field 'num_attention_heads' must be positive")
    n_exp = kwargs.get("n_routed_experts", 0)
    if n_exp and n_exp % max(1, kwargs.get("n_group", 1)):
        raise ConfigError(f"{where}: field 'n_group' must divide n_routed_experts ({n_exp})")
    kwargs["quantization"] = _quantization_from_hf(raw, where)
    try:
        kwargs.update(_dsa_from_hf(raw, mt, where))
    except ConfigError:
        if not allow_planned:
            raise
        # analysis-only shapes (memory model, simulator) may leave the indexer out: keep their fields as given
    if mt == "glm5_next":
        from splash.models.hybrid_config import hybrid_from_hf
        kwargs["hybrid"] = hybrid_from_hf(raw, where)
    return ModelConfig(model_type=mt, rope=_rope_from_hf(raw, where), **kwargs)


def _layer_list(raw: dict[str, Any], name: str, allowed: tuple[str, ...], where: str) -> tuple[str, ...] | None:
    v = raw.get(name)
    if v is None:
        return None
    n = raw["num_hidden_layers"]
    if not isinstance(v, list) or len(v) != n or any(t not in allowed for t in v):
        raise ConfigError(f"{where}: field {name!r} must be a list of {n} values among {', '.join(allowed)}, "
                          f"got {v!r}")
    return tuple(v)


_DSA_DEFAULTS = {"deepseek_v32": {"index_n_heads": 64, "index_head_dim": 128, "index_topk": 2048},
                 "glm_moe_dsa": {"index_n_heads": 32, "index_head_dim": 128, "index_topk": 2048}}


def _dsa_from_hf(raw: dict[str, Any], mt: str, where: str) -> dict[str, Any]:
    """DSA fields: indexer_types (GLM-5.x's own, or its index_topk_freq / index_skip_topk_offset pattern, as
    transformers derives it; every layer "full" for DeepSeek-V3.2), the indexer's rope convention, and the MLP
    layer pattern. DSA models always use interleaved rope in MLA (transformers ignores rope_interleave there)."""
    out: dict[str, Any] = {}
    mlp = _layer_list(raw, "mlp_layer_types", ("dense", "sparse"), where)
    if mlp is not None:
        out["mlp_layer_types"] = mlp
    if mt not in DSA_MODEL_TYPES:
        return out
    n = raw["num_hidden_layers"]
    for name, default in _DSA_DEFAULTS[mt].items():  # transformers' defaults when config.json leaves them out
        v = out[name] = raw.get(name, default)
        if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
            raise ConfigError(f"{where}: field {name!r} must be a positive integer for {mt}, got {v!r}")
    if raw.get("q_lora_rank") is None:
        raise ConfigError(f"{where}: field 'q_lora_rank' is required for {mt} (the indexer reads the Q-A output)")
    if out["index_head_dim"] < raw["qk_rope_head_dim"]:
        raise ConfigError(f"{where}: field 'index_head_dim' must be at least qk_rope_head_dim")
    types = _layer_list(raw, "indexer_types", INDEXER_TYPES, where) if mt == "glm_moe_dsa" else None
    if types is None and mt == "glm_moe_dsa":
        freq, off = max(int(raw.get("index_topk_freq", 1)), 1), int(raw.get("index_skip_topk_offset", 2))
        types = tuple("full" if max(i - off + 1, 0) % freq == 0 else "shared" for i in range(n))
    types = types or ("full",) * n
    if n and types[0] != "full":
        raise ConfigError(f"{where}: field 'indexer_types' must start with 'full' (a shared layer reuses the "
                          f"previous full layer's selection)")
    out.update(indexer_types=types, index_rope_interleave=(mt == "glm_moe_dsa"), rope_interleave=True)
    return out


def load_model_config(model_dir: str | Path) -> ModelConfig:
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        raise ConfigError(f"{path}: config.json not found (is {model_dir} a model directory?)")
    try:
        raw = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ConfigError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: top level must be a JSON object")
    return model_config_from_dict(raw, str(path))
