"""How the simulated deployment stores its weights and state, per layout — the part of the capacity reading that
depends on the serving stack, not on the model. Pure, no torch.

``splash.layouts.memory`` counts what this engine stores. The paper's capacity figures come from SGLang
deployments; ``"sglang"`` storage adds, per rank, what SGLang stores differently (each item read from SGLang's model
code, none fitted; docs/benchmarks.md names the sources): a vocabulary-parallel embedding and LM head (the embedding
replicated under DP-attention), BF16 W_UK / W_UV copies of KV-B (head-sharded with the projections), and for hybrid
(KDA) models a recurrent-state pool of ratio / (1 + ratio) of the memory left after the weights.

``RUNTIME_RESERVE_BYTES``: memory the runtime holds besides weights and KV (context, workspaces, allocator slack).
No source gives it; it is the one figure derived from the paper (B200's DOP pool of GLM-5.3, docs/benchmarks.md),
3.44e9 B rounded to 3.2 GiB, and GLM-5.3-Flash on BW1000 checks it.
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
