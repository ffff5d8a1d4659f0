"""Tiny random DeepSeek-V3 checkpoints written with transformers' ``save_pretrained`` — the reference models.

Shared by the single-rank tests, the distributed tests (workers import this file) and the benchmarks, so it only
depends on torch + transformers (+ splash.tokenizer for the tokenizer) and takes every knob as a keyword:

    from hf_models import VARIANTS, make_tiny_deepseek, load_hf, hf_greedy, hf_logits, random_prompts
    # (tests/ is on sys.path under pytest; elsewhere: sys.path.insert(0, "<repo>/tests"))
    path = make_tiny_deepseek(tmp / "moe", **VARIANTS["moe_yarn"])   # -> Path: config.json, safetensors, tokenizer
    path = make_tiny_deepseek(tmp / "big", hidden_size=256, num_hidden_layers=4, max_shard_size="200KB")
    hf = load_hf(path)                                                 # DeepseekV3ForCausalLM, fp32, eval
    ref_tokens = hf_greedy(hf, prompts, 32)                            # HF generate, greedy, EOS never stops
    ref_logits = hf_logits(hf, prompt)                                 # [len, vocab] full forward, no cache

Defaults (``BASE``): 8 heads (so 1/2/4/8 ranks divide them), 2 layers, intermediate sizes divisible by 8,
vocab 260 (the byte tokenizer's), ``initializer_range=0.1`` so logits are well separated. The same `seed` gives
the same weights whatever the config's non-shape fields (e.g. ``eos_token_id``). Norm weights and
``e_score_correction_bias`` are perturbed after init (HF initialises them to 1 / 0) so a model that ignored them
would fail the comparisons. Variants (``VARIANTS``): dense (no q-LoRA, no YaRN, half-split rope), moe_yarn
(group-limited routing, YaRN, interleaved rope), moe_plain (all layers MoE, 2 shared experts), dense_yarn_tied
(tied embeddings). DSA variants (``DSA_VARIANTS``, with ``arch``): v32_sparse (DeepSeek-V3.2, top-k 8),
glm_sparse (GLM-5.x, shared indexer layer, YaRN, top-k 8), glm_dense (top-k above every test context).
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

BASE: dict[str, Any] = dict(
    vocab_size=260,  # the byte tokenizer's vocabulary (256 bytes + 4 specials), see splash.tokenizer
    hidden_size=64,
    intermediate_size=128,
    moe_intermediate_size=32,
    num_hidden_layers=2,
    num_attention_heads=8,
    num_key_value_heads=8,
    q_lora_rank=48,
    kv_lora_rank=32,
    qk_rope_head_dim=8,
    qk_nope_head_dim=16,
    v_head_dim=16,
    n_routed_experts=8,
    n_shared_experts=1,
    num_experts_per_tok=2,
    n_group=4,
    topk_group=2,
    first_k_dense_replace=1,
    routed_scaling_factor=2.5,
    norm_topk_prob=True,
    max_position_embeddings=1024,
    initializer_range=0.1,
    rms_norm_eps=1e-6,
    rope_interleave=True,
    tie_word_embeddings=False,
    bos_token_id=256,
    eos_token_id=257,
    pad_token_id=258,
)

YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 256,
        "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0}
NO_ROPE_SCALING = {"rope_type": "default", "rope_theta": 10000.0}

# Named variants covering the code paths the loader/model must get right. Values are overrides of BASE.
VARIANTS: dict[str, dict[str, Any]] = {
    # dense only, yarn off, rope_interleave off, no q-LoRA (q_proj instead of q_a/q_b)
    "dense": dict(first_k_dense_replace=2, rope_parameters=NO_ROPE_SCALING, rope_interleave=False,
                  q_lora_rank=None),
    # MoE with group-limited routing (n_group 4, topk_group 2), yarn on, interleaved rope
    "moe_yarn": dict(rope_parameters=YARN, rope_interleave=True),
    # MoE, yarn off, non-interleaved rope, every layer MoE, two shared experts
    "moe_plain": dict(first_k_dense_replace=0, rope_parameters=NO_ROPE_SCALING, rope_interleave=False,
                      n_shared_experts=2, n_group=2, topk_group=1),
    # dense, yarn on, non-interleaved rope, tied embeddings
    "dense_yarn_tied": dict(first_k_dense_replace=2, rope_parameters=YARN, rope_interleave=False,
                            tie_word_embeddings=True),
}


# DSA architectures (model_type -> transformers config / model class names). Their variants (DSA_VARIANTS) set
# `arch`; 16 indexer heads keep exact index-score ties (all heads' ReLU zero) out of the tiny models, except at
# the pad token (258), whose zero embedding row makes layer 0 score every key exactly 0 (test_switching feeds it).
ARCHS = {"deepseek_v3": ("DeepseekV3Config", "DeepseekV3ForCausalLM"),
         "deepseek_v32": ("DeepseekV32Config", "DeepseekV32ForCausalLM"),
         "glm_moe_dsa": ("GlmMoeDsaConfig", "GlmMoeDsaForCausalLM")}
DSA = dict(index_n_heads=16, index_head_dim=16, num_hidden_layers=3, rope_parameters=NO_ROPE_SCALING)
DSA_VARIANTS: dict[str, dict[str, Any]] = {
    # DeepSeek-V3.2: an indexer in every layer (half-split indexer rope); top-k 8 < context: sparse
    "v32_sparse": dict(arch="deepseek_v32", index_topk=8, **DSA),
    # GLM-5.x: indexer_types full/shared/full (layer 1 reuses layer 0's top-k), interleaved indexer rope, YaRN
    "glm_sparse": dict(arch="glm_moe_dsa", index_topk=8, **{**DSA, "rope_parameters": YARN},
                       indexer_types=["full", "shared", "full"]),
    # top-k above every context the tests reach: the selection is everything visible (dense)
    "glm_dense": dict(arch="glm_moe_dsa", index_topk=4096, indexer_types=["full", "shared", "full"], **DSA),
}


def hf_config(arch: str = "deepseek_v3", **overrides: Any):
    """A transformers config of `arch` (DeepseekV3Config by default) from BASE + overrides (``rope_parameters``
    defaults to no scaling)."""
    import transformers

    kw = {**BASE, "rope_parameters": dict(NO_ROPE_SCALING), **overrides}
    return getattr(transformers, ARCHS[arch][0])(**kw)


def _perturb(model, seed: int) -> None:
    """Randomise weights HF initialises to constants (norms = 1, router bias = 0) so they are exercised."""
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=g))
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(0.05 * torch.randn(b.shape, generator=g))
        for name, p in model.named_parameters():
            if name.endswith("e_score_correction_bias"):
                p.copy_(0.05 * torch.randn(p.shape, generator=g))
        for name, p in model.named_parameters():
            if name.endswith("k_norm.bias"):  # the DSA indexer's LayerNorm bias
                p.copy_(0.1 * torch.randn(p.shape, generator=g))


def build_hf_model(seed: int = 0, arch: str = "deepseek_v3", **overrides: Any):
    """A random model of `arch` (fp32, eval mode) — seeded, so the same call gives the same weights."""
    import transformers

    torch.manual_seed(seed)
    model = getattr(transformers, ARCHS[arch][1])(hf_config(arch, **overrides)).eval()
    _perturb(model, seed)
    return model


def make_tiny_deepseek(directory: str | Path, *, seed: int = 0, tokenizer: bool = True,
                       max_shard_size: str | int | None = None, dtype: torch.dtype = torch.float32,
                       **overrides: Any) -> Path:
    """Write a tiny random DeepSeek-V3 checkpoint (config.json + safetensors [+ byte tokenizer]) to `directory`.

    `overrides` are DeepseekV3Config fields replacing BASE (e.g. ``num_hidden_layers=4, hidden_size=256``, or
    ``**VARIANTS["moe_yarn"]``). `max_shard_size` (e.g. ``"20KB"``) writes a sharded checkpoint with
    ``model.safetensors.index.json``; `dtype` (e.g. ``torch.bfloat16``) casts the stored weights. Returns the dir.
    """
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    model = build_hf_model(seed, **overrides)
    if dtype != torch.float32:
        model = model.to(dtype)
    kw = {} if max_shard_size is None else {"max_shard_size": max_shard_size}
    model.save_pretrained(d, **kw)
    if tokenizer:
        save_tokenizer(d)
    return d


def save_tokenizer(directory: str | Path) -> Path:
    """Add splash's byte tokenizer (tokenizer.json + tokenizer_config.json) to a model directory."""
    from splash.tokenizer import save_byte_tokenizer

    return save_byte_tokenizer(directory)


def load_hf(directory: str | Path, dtype: torch.dtype = torch.float32):
    """Load a checkpoint back with transformers (the reference implementation, its class from config.json's
    model_type), in eval mode."""
    import json

    import transformers

    arch = json.loads((Path(directory) / "config.json").read_text())["model_type"]
    return getattr(transformers, ARCHS[arch][1]).from_pretrained(directory, dtype=dtype).eval()


@torch.no_grad()
def hf_greedy(model, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """HF greedy continuation of each prompt (one at a time: no padding), not stopping at EOS.

    EOS is disabled in the generation config rather than with ``min_new_tokens`` (which masks the EOS logit and
    so changes the argmax); this matches ``SamplingParams(ignore_eos=True)``."""
    import copy

    gen_cfg = copy.deepcopy(model.generation_config)
    gen_cfg.eos_token_id = []  # None would fall back to config.json's EOS
    gen_cfg.pad_token_id = model.config.get_text_config().pad_token_id
    outs = []
    for p in prompts:
        ids = torch.tensor([p], dtype=torch.long)
        y = model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=gen_cfg, do_sample=False,
                           max_new_tokens=max_new_tokens)
        assert y.shape[1] == len(p) + max_new_tokens
        outs.append(y[0, len(p):].tolist())
    return outs


@torch.no_grad()
def hf_logits(model, prompt: list[int]) -> torch.Tensor:
    """Full-sequence logits [len(prompt), vocab] from a no-cache forward."""
    ids = torch.tensor([prompt], dtype=torch.long)
    return model(ids, use_cache=False).logits[0].float()


def random_prompts(lengths: list[int], seed: int = 0, vocab: int = 256) -> list[list[int]]:
    """Deterministic random prompts of the given lengths (byte-range ids by default: no special tokens)."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lengths]
