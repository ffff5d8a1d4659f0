"""Paper-scale model presets for splash-sim (public config.json values) and a loader for any config.json. No torch.

Hybrid models (glm5_next: KDA linear-attention layers interleaved with MLA layers) are split into the MLA layers,
which the cost model and the memory model see as the model, and a count of layout-independent linear layers.
"""
from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from splash.models.config import ConfigError, ModelConfig, model_config_from_dict

_DSV3 = dict(model_type="deepseek_v3", vocab_size=129280, hidden_size=7168, intermediate_size=18432,
             moe_intermediate_size=2048, num_hidden_layers=61, num_attention_heads=128, kv_lora_rank=512,
             q_lora_rank=1536, qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128, n_routed_experts=256,
             n_shared_experts=1, num_experts_per_tok=8, n_group=8, topk_group=4, first_k_dense_replace=3,
             routed_scaling_factor=2.5, max_position_embeddings=163840)
_GLM5 = dict(model_type="glm_moe_dsa", vocab_size=154880, hidden_size=6144, intermediate_size=12288,
             moe_intermediate_size=2048, num_hidden_layers=78, num_attention_heads=64, kv_lora_rank=512,
             q_lora_rank=2048, qk_rope_head_dim=64, qk_nope_head_dim=192, v_head_dim=256, n_routed_experts=256,
             n_shared_experts=1, num_experts_per_tok=8, n_group=1, topk_group=1, first_k_dense_replace=3,
             routed_scaling_factor=2.5, max_position_embeddings=202752, index_n_heads=32, index_head_dim=128,
             index_topk=2048)
_FLASH = dict(model_type="glm5_next", vocab_size=154880, hidden_size=4096, intermediate_size=12288,
              moe_intermediate_size=2048, num_hidden_layers=45, num_attention_heads=64, kv_lora_rank=512,
              q_lora_rank=1536, qk_rope_head_dim=0, qk_nope_head_dim=256, v_head_dim=256, n_routed_experts=288,
              n_shared_experts=1, num_experts_per_tok=8, n_group=1, topk_group=1, first_k_dense_replace=3,
              routed_scaling_factor=2.5, max_position_embeddings=1048576, index_n_heads=32, index_head_dim=128,
              index_topk=2048, linear_num_heads=64, linear_head_dim=128)

# name -> (config, default weight dtype, default KV dtype, where the numbers come from)
PRESETS: dict[str, tuple[dict[str, Any], str, str, str]] = {
    "glm-5.3": (_GLM5, "fp8_e4m3", "fp8_e4m3",
                "GLM-5 public config (transformers GlmMoeDsaConfig defaults = zai-org/GLM-5 config.json); the "
                "paper's GLM-5.3 runs use it with FP8 weights and FP8 E4M3 KV"),
    "glm-5.3-flash": (_FLASH, "int8", "fp8_e4m3",
                      "transformers Glm5NextTextConfig defaults (design.md §11): 45 layers, NoPE MLA+DSA where "
                      "idx % 4 == 3 (11), KDA elsewhere (34); the paper runs it with INT8 weights, FP8 KV"),
    "deepseek-v3.2": ({**_DSV3, "model_type": "deepseek_v32", "index_n_heads": 64, "index_head_dim": 128,
                       "index_topk": 2048}, "fp8_e4m3", "fp8_e4m3",
                      "deepseek-ai/DeepSeek-V3.2 config.json (V3 shapes + DSA indexer 64 × 128, top-k 2048)"),
    "deepseek-v3": (_DSV3, "fp8_e4m3", "bfloat16", "deepseek-ai/DeepSeek-V3 config.json"),
}


@dataclass(frozen=True)
class SimModel:
    """What splash-sim models: ``cfg`` holds the MLA layers only; the ``linear_layers`` (KDA) are placed the same
    way in every layout (an assumption: the ownership model covers the MLA state): their projections are
    head-sharded, their recurrent state (heads · head_dim² fp32 a request) is read and written once a decode token,
    their FFN/MoE is sharded like every FFN."""
    name: str
    cfg: ModelConfig
    full: ModelConfig
    weight_dtype: str
    kv_dtype: str
    source: str
    linear_layers: int = 0
    linear_dense_layers: int = 0
    linear_heads: int = 0
    linear_head_dim: int = 0

    @property
    def linear_params(self) -> float:
        """Attention weights of one linear layer (q, k, v, gate, o projections)."""
        return 5.0 * self.full.hidden_size * self.linear_heads * self.linear_head_dim


def _hybrid(raw: dict[str, Any], cfg: ModelConfig) -> tuple[ModelConfig, int, int]:
    """(MLA-only view, linear layers, linear layers with a dense FFN) of a glm5_next config."""
    n = cfg.num_hidden_layers
    types = raw.get("layer_types") or ["full_attention" if i % 4 == 3 else "linear_attention" for i in range(n)]
    mla = [i for i, t in enumerate(types) if t != "linear_attention"]
    linear = [i for i in range(n) if i not in mla]
    dense_mla = sum(1 for i in mla if i < cfg.first_k_dense_replace)
    # the view is a plain MLA(-DSA) model of the MLA layers: no hybrid fields (their per-layer lists are the
    # full model's)
    view = dataclasses.replace(cfg, num_hidden_layers=len(mla), first_k_dense_replace=dense_mla, hybrid=None)
    return view, len(linear), sum(1 for i in linear if i < cfg.first_k_dense_replace)


def sim_model(raw: dict[str, Any], name: str, weight_dtype: str, kv_dtype: str, source: str) -> SimModel:
    raw = raw.get("text_config", raw) if isinstance(raw.get("text_config"), dict) else raw
    full = model_config_from_dict(raw, name, allow_planned=True)
    if full.model_type == "glm5_next":
        view, lin, lin_dense = _hybrid(raw, full)
        return SimModel(name, view, full, weight_dtype, kv_dtype, source, lin, lin_dense,
                        int(raw.get("linear_num_heads", 64)), int(raw.get("linear_head_dim", 128)))
    return SimModel(name, full, full, weight_dtype, kv_dtype, source)


def load_sim_model(name_or_path: str, weight_dtype: str | None = None, kv_dtype: str | None = None) -> SimModel:
    """A preset by name, or a model directory / config.json path (dtypes default to bfloat16 there)."""
    if name_or_path in PRESETS:
        raw, wd, kd, src = PRESETS[name_or_path]
        return sim_model(dict(raw), name_or_path, weight_dtype or wd, kv_dtype or kd, src)
    p = Path(name_or_path)
    if p.is_dir():
        p = p / "config.json"
    if not p.is_file():
        raise ConfigError(f"unknown model {name_or_path!r}: not a preset ({', '.join(PRESETS)}) and no "
                          f"config.json there")
    try:
        raw = json.loads(p.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ConfigError(f"{p}: not valid JSON ({e})") from None
    return sim_model(raw, str(p), weight_dtype or "bfloat16", kv_dtype or "bfloat16", str(p))
