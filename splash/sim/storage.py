"""How the deployment being simulated stores its weights and state, per layout — the part of the capacity
reading that depends on the serving stack, not on the model. Pure, no torch.

``splash.layouts.memory`` counts what this engine stores (embedding and LM head replicated on every rank, W_UK /
W_UV read in place from KV-B). The paper's capacity figures come from SGLang deployments (its
``mem_fraction_static`` is the paper's "memory fraction 0.85", DP-attention is SGLang's ``--enable-dp-attention``,
the FP8 KV is the FlashMLA layout of SGLang's NSA pool). ``STORAGE = "sglang"`` adds, per rank, what SGLang stores
differently (each item from SGLang's model code, none fitted):

- **vocabulary-parallel embedding and LM head** (``VocabParallelEmbedding`` / ``ParallelLMHead``): 1/T of the
  vocabulary per rank, BF16 — except that under DP-attention the embedding is replicated
  (``VocabParallelEmbedding(..., enable_tp=not is_dp_attention_enabled())`` in its DeepSeek/GLM models; the LM head
  stays vocabulary-parallel, ``enable_dp_lm_head`` being off by default);
- **BF16 W_UK / W_UV copies** of KV-B (``post_load_weights``: on Blackwell an FP8 block-quantised ``kv_b_proj`` is
  dequantised into BF16 ``w_kc`` / ``w_vc`` for the absorbed decode BMMs, INT8 likewise; ``kv_b_proj`` itself is
  kept for the MHA prefill path): H × d_c × (d_nope + d_v) × 2 bytes per layer, head-sharded with the projections
  (TP, DOP) or replicated (DP-attn, CP);
- **recurrent-state pool** of hybrid (KDA) models: ``mamba_full_memory_ratio`` (0.9 by default) gives the state
  pool ratio / (1 + ratio) of the memory left after the weights, the full-attention KV pool the rest.

``RUNTIME_RESERVE_BYTES``: memory the runtime holds when it sizes the pool that is not weights (CUDA/HIP context,
communicator and GEMM workspaces, allocator slack; SGLang measures free memory after loading, so it all comes out of
the memory fraction). No source gives it; it is the one figure derived from the paper: B200's budget
(0.85 × 178.35 GiB) − GLM-5.3's DOP weights stored as above − the paper's DOP pool (8,271,360 / 8 tokens ×
61,464 B) = 3.44e9 B, rounded to 3.2 GiB. GLM-5.3-Flash on BW1000 then checks it (docs/benchmarks.md).
"""
from __future__ import annotations

from splash.layouts.layout import Layout, parse_layout

STORAGES = ("sglang", "engine")
STATE_POOL_RATIO = 0.9          # SGLang ServerArgs.mamba_full_memory_ratio default
RUNTIME_RESERVE_BYTES = float(3.2 * (1 << 30))
_BF16 = 2.0


def absorb_copy_bytes(cfg) -> float:
    """BF16 W_UK / W_UV of one MLA layer, all heads."""
    return cfg.num_attention_heads * cfg.kv_lora_rank * (cfg.qk_nope_head_dim + cfg.v_head_dim) * _BF16


def storage_delta_bytes(cfg, layout: str, world: int, storage: str) -> float:
    """Bytes per rank ``storage`` holds beyond (negative: below) what splash.layouts.memory counts for ``cfg``
    (the MLA layers' model) in ``layout``."""
    if storage not in STORAGES:
        raise ValueError(f"unknown storage {storage!r} (allowed: {', '.join(STORAGES)})")
    if storage == "engine":
        return 0.0
    T = world
    emb = cfg.vocab_size * cfg.hidden_size * _BF16
    tables = 1 if cfg.tie_word_embeddings else 2
    delta = -tables * emb * (T - 1) / T                      # vocabulary-parallel embedding and LM head
    lay = parse_layout(layout)
    if lay is Layout.DP_ATTN:
        delta += emb * (T - 1) / T                           # ... but DP-attention replicates the embedding
    absorb = absorb_copy_bytes(cfg) * cfg.num_hidden_layers
    delta += absorb / T if lay.shards_projections else absorb
    return delta


def kv_share(storage: str, hybrid: bool) -> float:
    """Share of the room left after the fixed state that goes to the paged KV pool."""
    return 1.0 / (1.0 + STATE_POOL_RATIO) if storage == "sglang" and hybrid else 1.0
