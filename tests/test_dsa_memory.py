"""DSA in the memory model: the pool a DSA runner allocates (latent + rope + scales + indexer keys, the keys only
in layers that run an indexer) equals the analytic per-block bytes for every KV dtype, the weights a rank holds
equal rank_weight_bytes, and per-layout capacity is computed from those same bytes."""
from __future__ import annotations

import pytest

from splash.distributed.communicator import SingleRankCommunicator
from splash.engine.llm import LLM
from splash.engine.runner import ModelRunner
from splash.layouts.memory import kv_block_bytes, kv_bytes_per_token_layer, rank_weight_bytes
from splash.models.loader import open_checkpoint
from splash.models.weights import resident_bytes


@pytest.mark.parametrize("kv_dtype", ["float32", "bfloat16", "fp8_e4m3", "int8"])
def test_dsa_pool_equals_memory_model(kv_dtype, tiny_ckpt):
    cfg, get = open_checkpoint(tiny_ckpt("glm_sparse"))
    assert cfg.indexer_types == ("full", "shared", "full")
    r = ModelRunner(cfg, get, SingleRankCommunicator(), "tp", kv_dtype, 4, 23)
    assert r.cache.nbytes() == kv_block_bytes(cfg, kv_dtype, 4) * 23
    for i in range(cfg.num_hidden_layers):
        assert r.cache.block_bytes(i) == kv_bytes_per_token_layer(cfg, kv_dtype, i) * 4
    key = {"float32": 16 * 4, "bfloat16": 16 * 2, "fp8_e4m3": 16 + 4, "int8": 16 + 4}[kv_dtype]
    assert kv_bytes_per_token_layer(cfg, kv_dtype, 0) - kv_bytes_per_token_layer(cfg, kv_dtype, 1) == key
    assert resident_bytes(r.weights) == rank_weight_bytes(cfg, "tp", 1, 0, 4)


def test_indexer_key_bytes_per_token():
    """FP8 keys: 1 byte each + one fp32 scale (DeepSeek-V3.2's 128 + 4); plain: the cache's element size."""
    import dataclasses

    from splash.models.presets import preset_config
    cfg = dataclasses.replace(preset_config("small-mla"), index_head_dim=128, index_n_heads=4, index_topk=64,
                              indexer_types=("full", "shared") * (preset_config("small-mla").num_hidden_layers // 2))
    base = dataclasses.replace(cfg, index_head_dim=0, indexer_types=())
    for kv, key in (("float32", 512), ("bfloat16", 256), ("fp8_e4m3", 132), ("int8", 132)):
        assert kv_bytes_per_token_layer(cfg, kv, 0) - kv_bytes_per_token_layer(base, kv, 0) == key
        assert kv_bytes_per_token_layer(cfg, kv, 1) == kv_bytes_per_token_layer(base, kv, 1)
        assert kv_block_bytes(cfg, kv, 16) - kv_block_bytes(base, kv, 16) == 16 * key * cfg.indexer_types.count("full")


def test_dsa_engine_capacity_counts_indexer_keys(tiny_ckpt):
    llm = LLM(str(tiny_ckpt("glm_sparse")), layout="dop", kv_cache_memory_bytes=1 << 20, block_size=4,
              comm=SingleRankCommunicator())
    blk = kv_block_bytes(llm.runner.cfg, "float32", 4)
    assert blk == llm.runner.cache.nbytes() // llm.runner.cache.num_blocks
    assert llm.runner.cache.num_blocks == (1 << 20) // blk


@pytest.mark.parametrize("quant", ["fp8", "int8"])
def test_dsa_quantized_weights_match_memory_model(quant, tiny_ckpt):
    """--quantization keeps the indexer's wq_b / wk quantised (as DeepSeek-V3.2's FP8 checkpoint stores them);
    weights_proj stays fp32. The rank's resident bytes equal the memory model's, and the model runs (its logits
    are not compared with full precision here: the top-k selection is discrete, so weight rounding moves it)."""
    import torch
    from hf_models import random_prompts

    from splash.attention.batch import StepBatch, StepRequest
    cfg, get = open_checkpoint(tiny_ckpt("v32_sparse"), quantization=quant)
    r = ModelRunner(cfg, get, SingleRankCommunicator(), "tp", "float32", 4, 32)
    assert type(r.weights.layers[0].indexer.wq_b).__name__ == "QuantWeight"
    assert r.weights.layers[0].indexer.weights_proj.dtype == torch.float32
    assert resident_bytes(r.weights) == rank_weight_bytes(cfg, "tp", 1, 0, 4, quant)
    prompt = random_prompts([6], seed=9)[0]
    n = len(prompt)
    ours = r.step(StepBatch([StepRequest("a", 0, n)], torch.tensor(prompt), torch.arange(n), list(range(n))))
    assert ours.shape == (n, cfg.vocab_size) and torch.isfinite(ours).all()
