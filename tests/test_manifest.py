import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from splash.layouts.layout import Layout
from splash.layouts.memory import kv_bytes_per_token_layer, switch_receive_bytes
from splash.layouts.ownership import kv_holders, num_blocks
from splash.models.config import model_config_from_dict
from splash.switching.block_plan import BlockMove
from splash.switching.manifest import ReqState, plan_switch

TP, DP, CP, DOP = Layout.TP, Layout.DP_ATTN, Layout.CP, Layout.DOP
GLM = model_config_from_dict(dict(
    model_type="glm_moe_dsa", vocab_size=1000, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
    num_attention_heads=8, kv_lora_rank=128, q_lora_rank=64, qk_rope_head_dim=32, qk_nope_head_dim=64,
    v_head_dim=64, index_n_heads=4, index_head_dim=32), allow_planned=True)
DSV3 = model_config_from_dict(dict(
    model_type="deepseek_v3", vocab_size=129280, hidden_size=7168, intermediate_size=18432,
    num_hidden_layers=61, num_attention_heads=128, kv_lora_rank=512, q_lora_rank=1536, qk_rope_head_dim=64,
    qk_nope_head_dim=128, v_head_dim=128))

# (dst, src) -> (W action, KV action): the paper's table
TABLE = {
    (TP, DP): ("discard", "all_gather"), (TP, CP): ("discard", "all_gather"), (TP, DOP): ("keep", "all_gather"),
    (DP, TP): ("all_gather", "discard"), (DP, CP): ("keep", "all_to_all"), (DP, DOP): ("all_gather", "keep"),
    (CP, TP): ("all_gather", "discard"), (CP, DP): ("keep", "all_to_all"), (CP, DOP): ("all_gather", "all_to_all"),
    (DOP, TP): ("keep", "discard"), (DOP, DP): ("discard", "keep"), (DOP, CP): ("discard", "all_to_all"),
}
BS = 16


def requests_for(src: Layout, world: int, sizes=(100, 37, 300, 16, 0, 64)):
    owner = src in (DP, DOP)
    return {f"r{i}": ReqState(n, i % world if owner else None) for i, n in enumerate(sizes)}


def plan(src, dst, world=4, cfg=GLM, reqs=None, kv_dtype="bfloat16", wbytes=2):
    return plan_switch(src, dst, cfg, world, reqs or requests_for(src, world), BS, wbytes, kv_dtype)


@pytest.mark.parametrize("dst,src", list(TABLE))
def test_actions_match_paper_table(dst, src):
    m = plan(src, dst)
    w, kv = TABLE[(dst, src)]
    assert m.action("proj") == w and m.action("kv") == kv
    assert m.action("indexer_keys") == kv
    for k in ("block_table", "owner_map", "positions"):
        assert m.action(k) == "rebuild"
    with pytest.raises(KeyError):
        m.action("recurrent")
    assert "indexer_keys" not in dict(plan(src, dst, cfg=DSV3, world=8).actions)


def test_counts_of_collectives():
    plans = [plan(src, dst) for dst, src in TABLE]
    assert len(plans) == 12
    assert sum(m.action("proj") == "all_gather" for m in plans) == 4
    assert sum(m.action("kv") in ("all_gather", "all_to_all") for m in plans) == 7
    assert sum(bool(m.moves) for m in plans) == 7
    for m in plans:
        assert bool(m.moves) == (m.action("kv") in ("all_gather", "all_to_all"))
        assert any(m.weight_recv_bytes) == (m.action("proj") == "all_gather")


@pytest.mark.parametrize("layout", list(Layout))
def test_same_layout_raises(layout):
    with pytest.raises(ValueError, match="itself"):
        plan(layout, layout)


def test_received_bytes_equal_block_moves():
    blk = kv_bytes_per_token_layer(GLM, "bfloat16") * BS
    for dst, src in TABLE:
        m = plan(src, dst)
        for r in range(4):
            assert m.kv_recv_bytes[r] == blk * sum(mv.dst_rank == r for mv in m.moves)
            assert m.kv_sent_bytes[r] == blk * sum(mv.src_rank == r for mv in m.moves)
            assert m.kv_recv_total[r] == m.kv_recv_bytes[r] * GLM.num_hidden_layers
        assert sum(m.kv_recv_bytes) == sum(m.kv_sent_bytes)
        assert sum(m.weight_recv_bytes) == pytest.approx(sum(m.weight_sent_bytes))


def test_weight_bytes_deepseek_v3():
    m = plan(TP, DP, world=8, cfg=DSV3, reqs={})
    assert m.weight_recv_bytes == (switch_receive_bytes(DSV3, TP, DP, 8, 2),) * 8
    assert m.weight_recv_bytes[0] / (1 << 20) == pytest.approx(287, abs=0.5)
    assert m.weight_recv_total[0] == pytest.approx(m.weight_recv_bytes[0] * 61)
    assert not m.moves and m.kv_recv_bytes == (0,) * 8


def test_tp_to_cp_discards_nonlocal_and_cp_to_tp_gathers():
    reqs = {"a": ReqState(5 * BS + 1)}  # 6 blocks
    m = plan(TP, CP, reqs=reqs)
    assert not m.moves
    assert m.keep[1] == (("a", 1), ("a", 5)) and len(m.discard[1]) == 4
    back = plan(CP, TP, reqs=reqs)
    assert len(back.moves) == 6 * 3
    assert all(mv.src_rank == mv.block_idx % 4 for mv in back.moves)


def test_dp_to_dop_keeps_owners_and_tp_to_dop_rebalances():
    reqs = {"a": ReqState(100, 3), "b": ReqState(50, 3)}
    m = plan(DP, DOP, reqs=reqs)
    assert m.owners == {"a": 3, "b": 3} and not m.moves and not any(m.discard)
    m = plan(TP, DOP, reqs={"a": ReqState(100), "b": ReqState(50), "c": ReqState(10)})
    assert m.owners == {"a": 0, "b": 1, "c": 2}
    assert m.keep[0] == tuple(("a", b) for b in range(num_blocks(100, BS)))
    assert m.keep[3] == () and not m.moves


def test_explicit_reowner_between_owner_layouts_moves():
    m = plan(DP, DOP, reqs={"a": ReqState(40, 0, 2), "b": ReqState(40, 1)})
    assert m.owners == {"a": 2, "b": 1}
    assert m.moves == tuple(BlockMove("a", b, 0, 2) for b in range(3))
    assert m.action("kv") == "all_to_all"


def test_partial_dst_owners_are_completed_around_given_ones():
    m = plan(CP, DP, reqs={"a": ReqState(100, None, 0), "b": ReqState(100), "c": ReqState(10)})
    assert m.owners["a"] == 0 and m.owners["b"] != 0


def test_errors():
    with pytest.raises(ValueError, match="'x'"):
        plan(DP, TP, reqs={"x": ReqState(10)})  # owner-based source needs src_owner
    with pytest.raises(ValueError, match="does not divide"):
        plan(TP, DP, world=3, reqs={"x": ReqState(10)})


@pytest.mark.parametrize("dst,src", list(TABLE))
def test_world_one_moves_nothing(dst, src):
    m = plan(src, dst, world=1)
    assert not m.moves and not any(m.discard)
    assert m.kv_recv_bytes == (0,) and m.weight_recv_bytes == (0.0,) and m.weight_sent_bytes == (0.0,)


@settings(max_examples=150, deadline=None)
@given(st.sampled_from(list(TABLE)), st.sampled_from([1, 2, 4, 8]),
       st.lists(st.tuples(st.integers(0, 200), st.integers(0, 7)), max_size=12))
def test_applying_moves_reaches_destination_placement(pair, world, reqs):
    dst, src = pair
    requests = {f"q{i}": ReqState(n, o % world if src.owner_based else None) for i, (n, o) in enumerate(reqs)}
    m = plan_switch(src, dst, GLM, world, requests, BS, 1, "fp8_e4m3")
    held = {}
    for req, s in requests.items():
        for b, ranks in enumerate(kv_holders(src, num_blocks(s.num_tokens, BS), s.src_owner, world)):
            held[(req, b)] = set(ranks)
    for mv in m.moves:  # sources send what they hold before discarding it
        assert mv.src_rank in held[(mv.req, mv.block_idx)] and mv.dst_rank not in held[(mv.req, mv.block_idx)]
    for r in range(world):
        for key in m.keep[r] + m.discard[r]:
            assert r in held[key]
        assert not set(m.keep[r]) & set(m.discard[r])
        for key in m.discard[r]:
            held[key].remove(r)
    for mv in m.moves:
        held[(mv.req, mv.block_idx)].add(mv.dst_rank)
    for req, s in requests.items():
        want = kv_holders(dst, num_blocks(s.num_tokens, BS), m.owners.get(req), world)
        assert tuple(frozenset(held[(req, b)]) for b in range(len(want))) == want
    blk = kv_bytes_per_token_layer(GLM, "fp8_e4m3") * BS
    assert sum(m.kv_recv_bytes) == blk * len(m.moves)
    if world == 1:
        assert not m.moves


# ---- KV format: reuse only when dtype/scales/positions match, else convert ---------------------------------
def _fmt_plan(src, dst, src_kv, dst_kv, world=4):
    return plan_switch(src, dst, GLM, world, requests_for(src, world), BS, 2, src_kv,
                       src_kv_dtype=src_kv, dst_kv_dtype=dst_kv)


def test_kv_format_keep_or_convert():
    same = plan(TP, DOP)
    assert same.action("kv_format") == "keep" and not same.converts_kv
    m = _fmt_plan(TP, DOP, "float32", "fp8_e4m3")
    assert m.action("kv_format") == "convert" and m.converts_kv
    assert (m.src_kv_dtype, m.dst_kv_dtype) == ("float32", "fp8_e4m3")
    # every other action and the placement do not depend on the format
    ref = plan(TP, DOP, kv_dtype="float32")
    assert [a for a in m.actions if a[0] != "kv_format"] == [a for a in ref.actions if a[0] != "kv_format"]
    assert (m.moves, m.keep, m.discard, m.dst_owners) == (ref.moves, ref.keep, ref.discard, ref.dst_owners)


@pytest.mark.parametrize("dst,src", [(CP, DP), (TP, DOP), (DOP, CP)])
def test_moved_blocks_are_counted_in_the_source_format(dst, src):
    m = _fmt_plan(src, dst, "fp8_e4m3", "float32")
    assert m.moves and m.kv_block_bytes_layer == kv_bytes_per_token_layer(GLM, "fp8_e4m3") * BS
    assert m.dst_kv_block_bytes_layer == kv_bytes_per_token_layer(GLM, "float32") * BS
    assert sum(m.kv_recv_bytes) == sum(m.kv_sent_bytes) == len(m.moves) * m.kv_block_bytes_layer
    assert plan_switch(src, dst, GLM, 4, requests_for(src, 4), BS, 2, "int8").action("kv_format") == "keep"


def test_conversion_needs_one_layer_of_headroom():
    """Converting a layer keeps its old and new tensors at once: a switch that fits in the same format is
    deferred when the conversion's transient does not fit, and the reason says so."""
    from splash.engine.layout_policy.control import LayoutController
    from splash.engine.ledger import KVLedger
    from splash.kv.paged_cache import CONVERT_CHUNK_SLOTS

    fp8_dop = {"tp": "float32", "dp_attn": "float32", "cp": "float32", "dop": "fp8_e4m3"}
    conv = LayoutController(GLM, 2, BS, 2, fp8_dop)
    m = _fmt_plan(TP, DOP, "float32", "fp8_e4m3", world=2)
    scratch = min(10 * BS, CONVERT_CHUNK_SLOTS) * (GLM.kv_lora_rank + GLM.qk_rope_head_dim) * 12
    assert conv.convert_bytes(m, 100, 10) == 100 * m.dst_kv_block_bytes_layer + scratch
    assert conv.convert_bytes(_fmt_plan(TP, DOP, "float32", "float32", world=2), 100, 10) == 0
    # a pool sized for float32 has room for an fp8 <-> int8 conversion's new layer: only the scratch remains
    q = LayoutController(GLM, 2, BS, 2, {**fp8_dop, "cp": "int8"})
    assert q.convert_bytes(_fmt_plan(DOP, CP, "fp8_e4m3", "int8", world=2), 100, 10) == scratch

    def decide(ctl: LayoutController, cap: int):
        ledger = KVLedger(2, cap, BS, "tp")
        for i in range(5):
            ledger.grow(f"r{i}", 160)  # 10 blocks each, on both ranks (TP)
        ctl.request("dop")
        return ctl.decide("tp", ledger, {f"r{i}": 160 for i in range(5)}, 0)

    assert decide(LayoutController(GLM, 2, BS, 2, "float32"), 50) is not None
    assert decide(conv, 50) is None and "float32 -> fp8_e4m3 conversion included" in conv.last_deferral
    assert decide(LayoutController(GLM, 2, BS, 2, fp8_dop), 200) is not None


def test_discards_sent_nowhere_leave_room_for_the_handoff_step():
    """TP -> DOP with TP's pool full (5 requests x 10 blocks on both ranks of 52): each rank discards the 20 or 30
    blocks of the requests the other owner gets, before the handoff step appends its 10 blocks, so the switch
    fits (counting TP's whole footprint under the step deferred it). CP -> DP-attn sends blocks it then discards:
    those stay resident through the step."""
    from splash.engine.layout_policy.control import LayoutController
    from splash.engine.ledger import KVLedger

    ledger = KVLedger(2, 52, BS, "tp")
    for i in range(5):
        ledger.grow(f"r{i}", 160)
    ctl = LayoutController(GLM, 2, BS, 2, "float32")
    ctl.request("dop")
    d = ctl.decide("tp", ledger, {f"r{i}": 160 for i in range(5)}, 10)
    assert d is not None and ctl.last_deferral is None
    assert sorted(len(d.manifest.freed_at_handoff(r)) for r in range(2)) == [20, 30]
    m = _fmt_plan(CP, DP, "float32", "float32", world=2)
    assert all(len(m.freed_at_handoff(r)) < len(m.discard[r]) for r in range(2) if m.discard[r])


def test_rope_fp8_pool_blocks_are_moved_and_converted_in_their_bytes():
    """An SM90 FlashInfer pool keeps an fp8 layer's rope key in e4m3 (splash.layouts.memory.rope_fp8_pool): its
    blocks travel and convert in those bytes — DeepSeek-V3 fp8: 512 latent + 16 scale + 64 rope = 592 B a token a
    layer, not the 656 of a bf16 rope key (11 % over). Other dtypes keep their rope key as it was."""
    reqs = requests_for(TP, 4)
    fp8 = plan(TP, DOP, cfg=DSV3, reqs=reqs, kv_dtype="fp8_e4m3")
    e4m3 = plan_switch(TP, DOP, DSV3, 4, reqs, BS, 2, "fp8_e4m3", rope_fp8=True)
    assert (fp8.kv_block_bytes_layer, e4m3.kv_block_bytes_layer) == (656 * BS, 592 * BS)
    assert e4m3.kv_block_bytes_total == 592 * BS * DSV3.num_hidden_layers
    assert [b * 656 for b in e4m3.kv_recv_bytes] == [b * 592 for b in fp8.kv_recv_bytes]
    conv = plan_switch(TP, DOP, DSV3, 4, reqs, BS, 2, "bfloat16", dst_kv_dtype="fp8_e4m3", rope_fp8=True)
    assert (conv.kv_block_bytes_layer, conv.dst_kv_block_bytes_layer) == (1152 * BS, 592 * BS)
