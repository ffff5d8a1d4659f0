"""The random-weight presets' model configs (`tiny-mla` is the embedded default model) — pure, no torch, so the
simulator and config checks can read them; `splash.models.presets` makes their weights."""
from __future__ import annotations

from splash.models.config import ModelConfig, model_config_from_dict

PRESETS: dict[str, dict] = {
    "tiny-mla": {
        "model_type": "deepseek_v3", "architectures": ["DeepseekV3ForCausalLM"],
        "vocab_size": 320, "hidden_size": 128, "intermediate_size": 256, "moe_intermediate_size": 64,
        "num_hidden_layers": 4, "num_attention_heads": 8, "num_key_value_heads": 8,
        "q_lora_rank": 96, "kv_lora_rank": 64, "qk_rope_head_dim": 16, "qk_nope_head_dim": 32, "v_head_dim": 32,
        "n_routed_experts": 8, "n_shared_experts": 1, "num_experts_per_tok": 2, "n_group": 2, "topk_group": 1,
        "first_k_dense_replace": 1, "norm_topk_prob": True, "routed_scaling_factor": 2.5,
        "max_position_embeddings": 4096, "rms_norm_eps": 1e-6, "rope_interleave": True,
        "rope_parameters": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                            "original_max_position_embeddings": 1024, "beta_fast": 32, "beta_slow": 1,
                            "mscale": 1.0, "mscale_all_dim": 1.0},
        "tie_word_embeddings": False, "attention_bias": False, "hidden_act": "silu",
        "bos_token_id": 256, "eos_token_id": 257,
    },
}
# A larger random model for CPU benchmarks: per-token latent KV (256 + 32) like a scaled-down DeepSeek-V3.
PRESETS["small-mla"] = {**PRESETS["tiny-mla"], "hidden_size": 512, "intermediate_size": 1024,
                        "moe_intermediate_size": 256, "num_attention_heads": 16, "num_key_value_heads": 16,
                        "q_lora_rank": 384, "kv_lora_rank": 256, "qk_rope_head_dim": 32, "qk_nope_head_dim": 64,
                        "v_head_dim": 64}
# the vendor kernels' shapes (512 latent + 64 rope, 16 heads) in a small model: scripts/gpu-check.sh's serve smoke
PRESETS["gpu-smoke-mla"] = {**PRESETS["tiny-mla"], "hidden_size": 256, "num_hidden_layers": 2,
                            "num_attention_heads": 16, "num_key_value_heads": 16, "q_lora_rank": 192,
                            "kv_lora_rank": 512, "qk_rope_head_dim": 64, "qk_nope_head_dim": 64, "v_head_dim": 64}


def preset_config(name: str) -> ModelConfig:
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r} (available: {', '.join(sorted(PRESETS))})")
    return model_config_from_dict(PRESETS[name], f"preset {name}")
