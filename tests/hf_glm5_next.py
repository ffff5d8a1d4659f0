"""Tiny random GLM-5.3-Flash (``glm5_next``) checkpoints written by transformers' ``save_pretrained``.

Text model: 4 layers — KDA, MLA-DSA (full indexer), MLA-DSA (shared: reuses layer 1's selection), KDA; layer 0
dense, the rest MoE; mHC with 4 streams; KPool 4. Variants: ``topk_low`` (index_topk 8 = 2 pools, below every
context the tests use past 8 tokens: the selection matters) and ``topk_high`` (index_topk 256, above every
context: every complete pool is selected). A tiny vision tower is part of the checkpoint (transformers needs
it); splash loads only the text model. Weights HF initialises to constants (norms, KPool gate / ape, router
bias) are perturbed so a model that ignored them would fail the comparisons.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

TEXT: dict[str, Any] = dict(
    vocab_size=260, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=4,
    num_attention_heads=8, num_key_value_heads=8, q_lora_rank=48, kv_lora_rank=32, qk_rope_head_dim=0,
    qk_nope_head_dim=16, v_head_dim=16, n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2, n_group=1,
    topk_group=1, index_head_dim=16, index_n_heads=8, index_kpool=4, linear_head_dim=8, linear_num_heads=8,
    linear_conv_kernel_dim=4, hc_mult=4, initializer_range=0.1, swiglu_limit=3.0,
    mlp_layer_types=["dense", "sparse", "sparse", "sparse"],
    layer_types=["linear_attention", "indexed_attention", "indexed_attention", "linear_attention"],
    indexer_types=["full", "full", "shared", "full"], bos_token_id=256, eos_token_id=257, pad_token_id=258,
    max_position_embeddings=1024)
VISION: dict[str, Any] = dict(depth=1, hidden_size=32, num_heads=2, intermediate_size=32, out_hidden_size=64,
                              projection_intermediate_size=32)
VARIANTS: dict[str, dict[str, Any]] = {"topk_low": dict(index_topk=8), "topk_high": dict(index_topk=256)}
# modules a quantised checkpoint leaves unquantised (tests/quant_ckpt.py `keep`), beside lm_head, embeddings, norms,
# the router and the non-linear KDA / mHC parameters: the vision tower and KDA's gate projections
QUANT_KEEP = (r"model\.visual\..*", r".*\.self_attn\.(f_a|f_b|g_a|g_b|b)_proj")


def build_hf_glm5_next(seed: int = 0, **overrides: Any):
    from transformers import Glm5NextConfig, Glm5NextForConditionalGeneration

    torch.manual_seed(seed)
    cfg = Glm5NextConfig(text_config={**TEXT, **overrides}, vision_config=VISION)
    model = Glm5NextForConditionalGeneration(cfg).eval()
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "visual" in name:
                continue
            if name.endswith(("norm.weight", "o_norm.weight")):
                p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=g))
            elif name.endswith(("index_kpool_compress_ape", "index_kpool_compress_gate", "k_norm.bias")):
                p.copy_(0.3 * torch.randn(p.shape, generator=g))
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(0.05 * torch.randn(b.shape, generator=g))
    return model


def make_tiny_glm5_next(directory: str | Path, *, seed: int = 0, **overrides: Any) -> Path:
    """Write a tiny random glm5_next checkpoint (config.json + safetensors + byte tokenizer) to `directory`."""
    from hf_models import save_tokenizer

    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    build_hf_glm5_next(seed, **overrides).save_pretrained(d)
    save_tokenizer(d)
    return d


def load_hf_glm5_next(directory: str | Path):
    from transformers import Glm5NextForConditionalGeneration

    return Glm5NextForConditionalGeneration.from_pretrained(directory, dtype=torch.float32).eval()
