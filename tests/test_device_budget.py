"""The device memory budget (splash.layouts.device_budget): pure arithmetic over the scheduler's memory model."""
from __future__ import annotations

import pytest

from splash.engine.build import kv_blocks_per_layout
from splash.layouts.device_budget import device_memory_budget
from splash.layouts.memory import common_bytes, kv_block_bytes, kv_capacity_tokens, projection_bytes_per_rank
from splash.sim.presets import load_sim_model

GIB = 1 << 30


@pytest.fixture(scope="module")
def glm():
    return load_sim_model("glm-5.3").cfg


def test_parts_add_up_and_pool_is_whole_blocks(glm):
    b = device_memory_budget(glm, 8, 180 * 10**9, 0.85, 1, "fp8_e4m3", 64, 16384, 512, in_use_bytes=GIB,
                             weight_quant="fp8")
    assert b.usable_bytes == int(180e9 * 0.85) - GIB
    assert b.kv_pool_bytes % kv_block_bytes(glm, "fp8_e4m3", 64) == 0 and b.kv_blocks > 0
    spent = b.weight_bytes + b.scratch_bytes + b.graph_bytes + b.switch_headroom_bytes + b.kv_pool_bytes
    assert b.usable_bytes - b.block_bytes * 2 <= spent <= b.usable_bytes   # only rounding to blocks is left over
    # the weights are the memory model's: common + the most compact (head-sharded) layout's projections
    want = common_bytes(glm, 8, 1, "fp8") + projection_bytes_per_rank(glm, "dop", 8, 1, "fp8")
    assert b.weight_bytes == pytest.approx(want)
    assert [name for name, _ in b.rows()][-1] == "KV pool"


def test_same_model_as_the_scheduler(glm):
    """The pool fed to kv_blocks_per_layout gives each layout the capacity kv_capacity_tokens gives a rank whose
    memory is the pool + weights: DOP (projections sharded, KV once) holds the most distinct tokens, by the
    projection memory DP-attn replicates (the paper's +27.3% at T=8 on B200)."""
    b = device_memory_budget(glm, 8, 180 * 10**9, 0.85, 1, "fp8_e4m3", 64, 16384, 512, weight_quant="fp8")
    per = kv_blocks_per_layout(glm, 8, "fp8_e4m3", 64, b.kv_pool_bytes, 1, weight_quant="fp8")
    rank = b.kv_pool_bytes + b.weight_bytes
    for lay, blocks in per.items():
        assert blocks == kv_capacity_tokens(glm, lay, 8, rank, 1, "fp8_e4m3", 64, weight_quant="fp8").blocks_per_rank
    assert per["dop"] == b.kv_blocks
    gain = per["dop"] / per["dp_attn"] - 1
    assert 0.2 < gain < 0.35, gain


def test_more_utilization_more_kv_and_errors(glm):
    lo = device_memory_budget(glm, 8, 180 * 10**9, 0.80, 1, "fp8_e4m3", 64, weight_quant="fp8")
    hi = device_memory_budget(glm, 8, 180 * 10**9, 0.90, 1, "fp8_e4m3", 64, weight_quant="fp8")
    assert hi.kv_blocks > lo.kv_blocks and hi.weight_bytes == lo.weight_bytes
    with pytest.raises(ValueError, match="leaves no KV room"):
        device_memory_budget(glm, 1, 180 * 10**9, 0.9, 1, "fp8_e4m3", 64, weight_quant="fp8")   # 1 GPU: too big
    with pytest.raises(ValueError, match="gpu_memory_utilization"):
        device_memory_budget(glm, 8, 180 * 10**9, 1.5, 1, "fp8_e4m3", 64)
