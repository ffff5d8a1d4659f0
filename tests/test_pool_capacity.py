"""The KV pool the engine really allocates agrees with the pure memory model, and capacity is per layout:
replicated projections (DP-attn, CP) eat KV room that sharded ones (TP, DOP) leave free."""
from __future__ import annotations

import pytest

from splash.distributed.communicator import SingleRankCommunicator
from splash.engine.build import kv_blocks_per_layout
from splash.engine.llm import LLM
from splash.kv.paged_cache import PagedLatentCache
from splash.layouts.memory import kv_block_bytes, kv_bytes_per_token_layer, projection_bytes_per_rank
from splash.models.presets import preset_config


@pytest.mark.parametrize("kv_dtype", ["float32", "bfloat16", "fp8_e4m3", "int8"])
@pytest.mark.parametrize("rope_fp8", [False, True])
@pytest.mark.parametrize("fused", [False, True])
def test_allocated_pool_matches_memory_model(kv_dtype, rope_fp8, fused):
    """To the byte, in every pool layout a device builds: the GPU's fused bf16 pools, and SM90 FlashInfer pools
    (`rope_fp8`: an fp8 layer's rope key in e4m3, 1 byte a value, not bf16's 2)."""
    cfg = preset_config("small-mla")
    pool = PagedLatentCache(cfg.num_hidden_layers, 37, 16, cfg.kv_lora_rank, cfg.qk_rope_head_dim, kv_dtype,
                            fused=fused, rope_fp8=rope_fp8)
    assert pool.nbytes() == kv_block_bytes(cfg, kv_dtype, 16, rope_fp8) * 37
    assert pool.block_bytes(0) == kv_bytes_per_token_layer(cfg, kv_dtype, 0, rope_fp8) * 16


@pytest.mark.parametrize("world", [2, 4, 8])
def test_capacity_per_layout(world):
    cfg = preset_config("small-mla")
    budget = 256 << 20
    caps = kv_blocks_per_layout(cfg, world, "float32", 16, budget, 4)
    blk = kv_block_bytes(cfg, "float32", 16)
    assert caps["tp"] == caps["dop"] == budget // blk
    extra = projection_bytes_per_rank(cfg, "cp", world, 4) - projection_bytes_per_rank(cfg, "dop", world, 4)
    assert caps["dp_attn"] == caps["cp"] == budget // blk - -(-int(extra) // blk)
    distinct = {lay: c * (1 if lay == "tp" else world) for lay, c in caps.items()}
    assert distinct["dop"] > distinct["dp_attn"] and distinct["dop"] > distinct["cp"]
    assert distinct["dop"] > distinct["tp"]


def test_engine_reports_and_enforces_layout_capacity():
    llm = LLM(preset="tiny-mla", layout="tp", kv_cache_memory_bytes=1 << 20, comm=SingleRankCommunicator())
    caps = llm.engine.kv_capacity_tokens()
    assert set(caps) == {"tp", "dp_attn", "cp", "dop"}
    assert caps["dop"] >= caps["dp_attn"] > 0
    assert llm.engine.ledger.cap("tp") * llm.runner.block_size == caps["tp"]
    assert llm.runner.bm.num_blocks == max(llm.engine.ledger.capacity.values())


def test_pool_is_sized_in_the_widest_layout_kv_dtype():
    """Per-layout KV dtypes share one pool: it is sized in the widest format and keeps its block count, so a
    layout with a narrower format holds the same blocks with bytes spare."""
    comm = SingleRankCommunicator()
    kw = dict(preset="tiny-mla", layout="dop", kv_cache_memory_bytes=1 << 20, comm=comm)
    mixed = LLM(kv_cache_dtype="fp8_e4m3", layout_kv_dtypes={"tp": "float32"}, **kw)
    wide = LLM(kv_cache_dtype="float32", **kw)
    narrow = LLM(kv_cache_dtype="fp8_e4m3", **kw)
    assert mixed.runner.kv_dtype == "fp8_e4m3" and mixed.runner.layout_kv_dtypes["tp"] == "float32"
    assert mixed.runner.cache.num_blocks == wide.runner.cache.num_blocks < narrow.runner.cache.num_blocks
    assert mixed.runner.cache.nbytes() == narrow.runner.cache.nbytes() * mixed.runner.cache.num_blocks // (
        narrow.runner.cache.num_blocks)
    with pytest.raises(ValueError, match="layout_kv_dtypes: unknown layout 'dopp'"):
        LLM(layout_kv_dtypes={"dopp": "int8"}, **kw)
    with pytest.raises(ValueError, match=r"layout_kv_dtypes\['dop'\] = 'fp4'"):
        LLM(layout_kv_dtypes={"dop": "fp4"}, **kw)


def test_switch_plans_headroom_and_cost_model_count_the_pools_bytes(monkeypatch):
    """An SM90 FlashInfer pool (fp8 KV, rope key in e4m3), stood in on CPU by answering the one decision (the torch
    kernel reads such a pool): the controller's headroom unit, every switch plan (rank 0's and each executor's:
    LayoutController.plan) and the auto cost model's KV bytes (attention reads, a cached block's move) are the bytes
    the pool holds — not a bf16 rope key's."""
    from splash.attention import kernels
    from splash.costmodel.step_cost import RowLoad
    from splash.engine import build as build_module
    from splash.switching.manifest import ReqState
    monkeypatch.setattr(kernels, "kv_rope_fp8", lambda name, device: True)
    monkeypatch.setattr(build_module, "kv_rope_fp8", lambda name, device: True)
    llm = LLM(preset="tiny-mla", layout="auto", kv_cache_dtype="fp8_e4m3", kv_cache_memory_bytes=1 << 20,
              comm=SingleRankCommunicator())
    pool, eng, bs = llm.runner.cache, llm.engine, llm.runner.block_size
    assert pool.rope_fp8 and pool.kpe[0].element_size() == 1
    per_layer = pool.block_bytes(0)
    assert per_layer < kv_bytes_per_token_layer(llm.cfg, "fp8_e4m3") * bs          # a bf16 rope key is wider
    assert eng.control.pool_block_bytes_layer == per_layer
    m = eng.control.plan("tp", "dop", {"a": ReqState(5 * bs, 0)})
    assert m.kv_block_bytes_layer == m.dst_kv_block_bytes_layer == per_layer
    assert m.kv_block_bytes_total == pool.nbytes() // pool.num_blocks
    model = eng.auto.model
    context = 64 * bs
    kv_read = model.step("tp", [RowLoad(1, context)]).work["attention"]["kv_bytes"]
    assert kv_read == (context + 1) * llm.cfg.num_hidden_layers * per_layer / bs     # its history and itself
    assert model.rope_fp8 and model.kv_dtypes["dop"] == "fp8_e4m3"
