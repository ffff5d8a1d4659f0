"""glm5_next in the memory model: the weight bytes every rank holds (splash.models.weights.resident_bytes, each
storage once) equal rank_weight_bytes in every layout at 1, 2 and 4 ranks, for plain weights, ``--quantization``
fp8/int8 (KDA gates dense) and an INT8 checkpoint that stores the KDA gates quantised too. KDA head_dim 48: the
head shards of q/k/v rows and O columns start inside 128-blocks at 2 and 4 ranks, so FP8 shards carry the scale
blocks they share with a neighbour. Ranks are built one after another in this process (the loader's per-rank
weights: MLA heads and KDA heads of the layout, FFN shard of the rank); the 1-rank case through the runner."""
from __future__ import annotations

import pytest
from hf_glm5_next import QUANT_KEEP, make_tiny_glm5_next
from quant_ckpt import write_quantized

from splash.distributed.communicator import SingleRankCommunicator
from splash.engine.runner import ModelRunner
from splash.layouts.memory import common_bytes, projection_bytes_per_rank, rank_weight_bytes
from splash.layouts.ownership import head_range
from splash.models.glm5_next import build_hybrid_weights
from splash.models.loader import open_checkpoint
from splash.models.weights import resident_bytes
from splash.switching.manifest import ReqState, plan_switch

CASES = {"plain": (None, None), "fp8": (None, "fp8"), "int8": (None, "int8"), "int8_gates": ("w8a16", None)}


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    d = tmp_path_factory.mktemp("glm5_mem")
    src = make_tiny_glm5_next(d / "src", index_topk=8, linear_head_dim=48)
    gates_q = write_quantized(src, d, "w8a16", keep=QUANT_KEEP[:1])[0]  # KDA gates quantised as well
    return {None: src, "w8a16": gates_q}


@pytest.mark.parametrize("case", sorted(CASES))
def test_resident_weight_bytes_equal_memory_model(case, ckpts):
    scheme, at_load = CASES[case]
    cfg, get = open_checkpoint(ckpts[scheme], quantization=at_load)
    wq = at_load or cfg.quantization
    assert cfg.hybrid.quantized_gates == (case == "int8_gates")
    r = ModelRunner(cfg, get, SingleRankCommunicator(), "tp", "float32", 4, 8)
    assert r.weight_quant == wq
    assert resident_bytes(r.weights) == rank_weight_bytes(cfg, "tp", 1, 0, 4, wq)
    H, HL = cfg.num_attention_heads, cfg.hybrid.linear_num_heads
    for world in (2, 4):
        for layout in ("tp", "dp_attn", "cp", "dop"):
            held = [resident_bytes(build_hybrid_weights(cfg, get, head_range(H, world, k, layout),
                                                        head_range(HL, world, k, layout), k, world))
                    for k in range(world)]
            assert held == [rank_weight_bytes(cfg, layout, world, k, 4, wq) for k in range(world)], (layout, world)
            model = common_bytes(cfg, world, 4, wq) + projection_bytes_per_rank(cfg, layout, world, 4, wq)
            assert model >= max(held)


@pytest.mark.parametrize("src,dst", [("tp", "dp_attn"), ("dop", "cp"), ("dp_attn", "tp")])
def test_manifest_weight_totals_plain(src, dst, ckpts):
    """Plain weights have no shared scale blocks: what a sharded→replicated switch gathers on each rank is the
    replicated rank's weights minus its own shard (KDA and MLA projections; common weights stay), else nothing."""
    cfg, _ = open_checkpoint(ckpts[None])
    m = plan_switch(src, dst, cfg, 2, {"a": ReqState(10, 0)}, 4, 4, "float32")
    gathered = [rank_weight_bytes(cfg, dst, 2, r, 4) - rank_weight_bytes(cfg, src, 2, r, 4) for r in range(2)]
    assert m.weight_recv_total == tuple(max(0, g) for g in gathered)
    assert m.weight_sent_total == m.weight_recv_total
