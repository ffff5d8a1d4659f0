import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from splash.layouts.layout import Layout
from splash.layouts.ownership import kv_holders, num_blocks
from splash.layouts.memory import (common_bytes, common_params, kv_block_bytes, kv_bytes_per_token_layer,
                                   kv_capacity_tokens, matrix_bytes, projection_bytes_per_rank, projection_params,
                                   projection_recv_bytes, projection_shard_bytes, rank_weight_bytes,
                                   switch_receive_bytes)
from splash.models.config import model_config_from_dict

MiB, GiB = 1 << 20, 1 << 30
DSV3 = dict(model_type="deepseek_v3", vocab_size=129280, hidden_size=7168, intermediate_size=18432,
            num_hidden_layers=61, num_attention_heads=128, kv_lora_rank=512, q_lora_rank=1536,
            qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128, moe_intermediate_size=2048,
            n_routed_experts=256, n_shared_experts=1, num_experts_per_tok=8, n_group=8, topk_group=4,
            first_k_dense_replace=3)
GLM = dict(model_type="glm_moe_dsa", vocab_size=154880, hidden_size=6144, intermediate_size=12288,
           num_hidden_layers=78, num_attention_heads=64, kv_lora_rank=512, q_lora_rank=2048,
           qk_rope_head_dim=64, qk_nope_head_dim=192, v_head_dim=256, moe_intermediate_size=2048,
           n_routed_experts=256, n_shared_experts=1, num_experts_per_tok=8, first_k_dense_replace=3,
           index_n_heads=32, index_head_dim=128, index_topk=2048)
LAYOUTS = list(Layout)


@pytest.fixture
def dsv3():
    return model_config_from_dict(DSV3)


@pytest.fixture
def glm():
    return model_config_from_dict(GLM, allow_planned=True)


def test_deepseek_v3_projection_bytes_per_layer(dsv3):
    assert projection_params(dsv3) == 1536 * 128 * 192 + 512 * 128 * 256 + 128 * 128 * 7168
    assert projection_params(dsv3) * 2 / MiB == pytest.approx(328, abs=0.5)


def test_deepseek_v3_switch_receive_bytes(dsv3):
    for src in (Layout.TP, Layout.DOP):
        for dst in (Layout.DP_ATTN, Layout.CP):
            assert switch_receive_bytes(dsv3, src, dst, 8, 2) / MiB == pytest.approx(287, abs=0.5)
            assert switch_receive_bytes(dsv3, src, dst, 8, 1) / MiB == pytest.approx(143.5, abs=0.25)
    for src, dst in [(Layout.DP_ATTN, Layout.TP), (Layout.CP, Layout.DOP), (Layout.TP, Layout.DOP),
                     (Layout.CP, Layout.DP_ATTN)]:
        assert switch_receive_bytes(dsv3, src, dst, 8, 2) == 0


def test_deepseek_v3_total_params_plausible(dsv3):
    total = common_params(dsv3) + projection_params(dsv3) * dsv3.num_hidden_layers
    assert 670e9 < total < 672e9  # published: 671B main model (+14B MTP module, not counted here)


def test_kv_bytes_formats(glm, dsv3):
    assert kv_bytes_per_token_layer(glm, "fp8_e4m3") == 656 + 132 == 788
    assert kv_bytes_per_token_layer(glm, "int8") == 788
    assert kv_bytes_per_token_layer(glm, "bfloat16") == 2 * 576 + 2 * 128
    assert kv_bytes_per_token_layer(glm, "float32") == 4 * 576 + 4 * 128
    assert kv_bytes_per_token_layer(dsv3, "bfloat16") == 1152
    assert kv_bytes_per_token_layer(dsv3, "fp8_e4m3") == 656
    assert kv_bytes_per_token_layer(glm, "fp8_e4m3") * 78 == 61464
    with pytest.raises(ValueError, match="fp16"):
        kv_bytes_per_token_layer(glm, "fp16")


def test_common_params_ffn_sharding_and_tied(dsv3):
    import dataclasses
    full, sharded = common_params(dsv3, 1), common_params(dsv3, 8)
    emb = 2 * 129280 * 7168
    assert full > sharded > emb
    tied = dataclasses.replace(dsv3, tie_word_embeddings=True)
    assert common_params(tied) == full - 129280 * 7168


def test_indexer_weights_counted(glm):
    import dataclasses
    no_dsa = dataclasses.replace(glm, index_head_dim=0, index_n_heads=0)
    per_layer = 2048 * 32 * 128 + 6144 * 128 + 2 * 128 + 6144 * 32
    assert common_params(glm) - common_params(no_dsa) == per_layer * 78


def _kv_blocks(layout, world, live, block_size):
    """Per rank, the KV blocks of `live` (request -> (tokens, owner)) it holds in `layout`."""
    blocks = [0] * world
    for tokens, owner in live.values():
        for held in kv_holders(layout, num_blocks(tokens, block_size), owner, world):
            for r in held:
                blocks[r] += 1
    return tuple(blocks)


def test_per_rank_memory_kv_placement(glm):
    live = {"a": (1000, 0), "b": (64, 1), "c": (65, 1)}
    blk = 788 * 64 * 78
    assert kv_block_bytes(glm, "fp8_e4m3", 64) == blk
    tp = _kv_blocks(Layout.TP, 4, live, 64)
    assert tp == (16 + 1 + 2,) * 4
    dop = _kv_blocks(Layout.DOP, 4, live, 64)
    assert dop == (16, 3, 0, 0)
    assert _kv_blocks(Layout.DP_ATTN, 4, live, 64) == dop
    cp = _kv_blocks(Layout.CP, 4, live, 64)
    # CP: block round-robin rotated by each request's anchor rank (its owner): a from 0, b and c from 1
    assert cp == (4, 4 + 1 + 1, 4 + 1, 4)
    assert sum(cp) == sum(dop) == tp[0]
    proj = {lay: projection_bytes_per_rank(glm, lay, 4, 1) for lay in Layout}
    assert proj[Layout.DP_ATTN] == pytest.approx(4 * proj[Layout.DOP])
    assert proj[Layout.TP] == proj[Layout.DOP] and proj[Layout.DP_ATTN] == proj[Layout.CP]
    assert common_bytes(glm, 4, 1, None) == common_params(glm, 4)


def test_capacity_ordering_glm_fp8_t8(glm):
    budget = 0.85 * 180 * GiB
    caps = {l: kv_capacity_tokens(glm, l, 8, budget, 1, "fp8_e4m3", 64, reserve_bytes=GiB) for l in Layout}
    dop = caps[Layout.DOP].distinct_tokens
    assert dop > caps[Layout.DP_ATTN].distinct_tokens
    assert dop > caps[Layout.CP].distinct_tokens
    assert dop > caps[Layout.TP].distinct_tokens
    assert caps[Layout.TP].distinct_tokens == caps[Layout.TP].tokens_per_rank
    assert caps[Layout.TP].blocks_per_rank == caps[Layout.DOP].blocks_per_rank
    assert caps[Layout.DP_ATTN].distinct_blocks == caps[Layout.CP].distinct_blocks
    # DOP's extra room per rank is exactly the projection memory it does not replicate
    freed = caps[Layout.DOP].room_bytes_per_rank - caps[Layout.DP_ATTN].room_bytes_per_rank
    assert freed == pytest.approx(projection_params(glm) * 78 * 7 / 8)
    extra_blocks = caps[Layout.DOP].blocks_per_rank - caps[Layout.DP_ATTN].blocks_per_rank
    assert abs(extra_blocks - freed / caps[Layout.DOP].block_bytes) <= 1
    for c in caps.values():
        assert c.distinct_tokens == c.distinct_blocks * 64


def test_capacity_negative_room_is_zero(glm):
    for l in Layout:
        c = kv_capacity_tokens(glm, l, 8, 1 * GiB, 1, "fp8_e4m3", 64)
        assert c.distinct_tokens == 0 and c.blocks_per_rank == 0 and c.room_bytes_per_rank == 0


cfg_strategy = st.builds(
    lambda heads_mult, world, hidden, kv_lora, rope, nope, v, q_lora, layers, idx: (world, model_config_from_dict(dict(
        model_type="deepseek_v32", vocab_size=1000, hidden_size=hidden, intermediate_size=2 * hidden,
        num_hidden_layers=layers, num_attention_heads=heads_mult * world, kv_lora_rank=kv_lora,
        q_lora_rank=q_lora, qk_rope_head_dim=rope, qk_nope_head_dim=nope, v_head_dim=v,
        index_n_heads=4 if idx else 0, index_head_dim=idx), allow_planned=True)),
    st.integers(1, 16), st.sampled_from([1, 2, 4, 8]), st.sampled_from([64, 256, 1024, 7168]),
    st.sampled_from([64, 128, 512]), st.sampled_from([0, 32, 64]), st.sampled_from([64, 128, 192]),
    st.sampled_from([64, 128, 256]), st.one_of(st.none(), st.sampled_from([128, 1536])), st.integers(1, 80),
    st.sampled_from([0, 64, 128]))


@settings(max_examples=150, deadline=None)
@given(cfg_strategy, st.floats(1e6, 2e11), st.sampled_from([1, 2]), st.sampled_from(["bfloat16", "fp8_e4m3",
       "int8", "float32"]), st.sampled_from([1, 16, 64]))
def test_dop_capacity_is_largest(world_cfg, budget, wbytes, kv_dtype, block):
    world, cfg = world_cfg
    caps = {l: kv_capacity_tokens(cfg, l, world, budget, wbytes, kv_dtype, block) for l in Layout}
    dop = caps[Layout.DOP].distinct_tokens
    assert all(dop >= c.distinct_tokens for c in caps.values())
    assert caps[Layout.TP].distinct_tokens * world == dop
    for c in caps.values():
        used = c.blocks_per_rank * c.block_bytes
        assert used <= c.room_bytes_per_rank < used + c.block_bytes or c.room_bytes_per_rank == 0


# ---- quantised weights in real bytes (values + scales) -----------------------------------------------------
def test_app_a_fp8_payload_with_scales(dsv3):
    """App. A: 143.5 MiB per rank per layer on sharded→replicated at T=8 in FP8 "before scales"; with the 128×128
    block scales each of the 7 other shards carries (Q-B 24×12 + KV-B 32×4 + O 56×16 blocks, fp32) it is 36,736 B
    more: 143.535 MiB. INT8 per-channel carries one fp32 scale per output row (O's column shard: all 7168)."""
    plain = switch_receive_bytes(dsv3, Layout.TP, Layout.DP_ATTN, 8, 1)
    assert plain == 143.5 * MiB
    fp8 = switch_receive_bytes(dsv3, Layout.TP, Layout.DP_ATTN, 8, 1, weight_quant="fp8")
    assert fp8 - plain == 7 * 4 * (24 * 12 + 32 * 4 + 56 * 16) == 36736
    assert fp8 / MiB == pytest.approx(143.535, abs=5e-4)
    int8 = switch_receive_bytes(dsv3, Layout.DOP, Layout.CP, 8, 1, weight_quant="int8")
    assert int8 - plain == 7 * 4 * (16 * 192 + 16 * 256 + 7168)
    assert switch_receive_bytes(dsv3, Layout.DP_ATTN, Layout.TP, 8, 1, weight_quant="fp8") == 0


def test_unaligned_shards_carry_shared_blocks():
    """GLM-5.x KV-B at 64 ranks: one head = 448 rows = 3.5 blocks, so every shard touches 4 blocks and each pair
    of neighbours shares one; the replicated weight counts each block once (224), the shards 256."""
    cfg = model_config_from_dict(GLM, allow_planned=True)
    per_rank = [projection_shard_bytes(cfg, range(r, r + 1), 1, "fp8") for r in range(64)]
    full = projection_shard_bytes(cfg, range(64), 1, "fp8")
    kv_b_blocks = [-(-(448 * (r + 1)) // 128) - 448 * r // 128 for r in range(64)]
    assert set(kv_b_blocks) == {4} and sum(kv_b_blocks) == 224 + 32
    assert sum(per_rank) - full == 32 * 4 * 4  # 32 shared KV-B row blocks × 4 column blocks × 4 bytes
    assert projection_bytes_per_rank(cfg, Layout.DOP, 64, 1, "fp8") == max(per_rank) * 78
    recv = [projection_recv_bytes(cfg, Layout.DOP, Layout.DP_ATTN, 64, r, 1, "fp8") for r in range(64)]
    assert recv == [sum(per_rank) - per_rank[r] for r in range(64)]


def test_capacity_with_quantised_weights(glm):
    """Capacity with FP8/INT8 weights counts their scales (less room than params × 1 byte) and DOP still holds
    the most: the room it gains over DP-attn is exactly the stored projection bytes it does not replicate."""
    budget = 0.85 * 180 * GiB
    for q in ("fp8", "int8"):
        caps = {lay: kv_capacity_tokens(glm, lay, 8, budget, 2, "fp8_e4m3", 64, weight_quant=q) for lay in Layout}
        raw = kv_capacity_tokens(glm, Layout.DOP, 8, budget, 1, "fp8_e4m3", 64)
        assert caps[Layout.DOP].room_bytes_per_rank < raw.room_bytes_per_rank
        assert all(caps[Layout.DOP].distinct_tokens >= c.distinct_tokens for c in caps.values())
        freed = caps[Layout.DOP].room_bytes_per_rank - caps[Layout.DP_ATTN].room_bytes_per_rank
        assert freed == (projection_shard_bytes(glm, range(64), 2, q)
                         - projection_shard_bytes(glm, range(8), 2, q)) * 78
        model = common_bytes(glm, 8, 2, q) + projection_bytes_per_rank(glm, Layout.DOP, 8, 2, q)
        assert model == max(rank_weight_bytes(glm, Layout.DOP, 8, r, 2, q) for r in range(8))
    with pytest.raises(ValueError, match="nf4"):
        matrix_bytes(4, 4, 1, "nf4")
