"""The computation of `splash-sim gap` (splash/sim/tps_gap.py): what one stage of a disaggregated batch's time
would need, alone, to make the total the paper's. Made-up values; the paper's numbers are in docs/benchmarks.md."""
from types import SimpleNamespace

import pytest

from splash.costmodel import load_profile
from splash.costmodel.step_cost import CostModel
from splash.sim import deploy
from splash.sim import tps_gap as g
from splash.sim.presets import load_sim_model
from splash.sim.serving import SimSetup, prefill_seconds


def test_each_stage_alone_closes_the_gap():
    parts = {"prefill_s": 100.0, "handoff_s": 2.0, "decode_s": 30.0}
    tokens = 1_000_000.0
    # a paper total where prefill ran 1.5x: prefill_factor recovers 1.5
    total = 150.0 + 2.0 + 30.0
    paper_tps = tokens / total
    assert g.paper_seconds(paper_tps, tokens) == pytest.approx(total)
    assert g.prefill_factor(total, parts) == pytest.approx(1.5)
    # the decode step that alone makes the same total: (total - prefill - handoff) / output positions
    assert g.decode_step_needed(total, parts, 1000) == pytest.approx((total - 102.0) / 1000)
    # the per-NIC rate whose exposed handoff makes it: bytes / (total - prefill - decode)
    assert g.handoff_rate_needed(total, parts, 5.2e10) == pytest.approx(5.2e10 / 52.0)
    # no time left for the handoff: no rate does it
    assert g.handoff_rate_needed(120.0, parts, 1e9) == float("inf")
    with pytest.raises(ValueError):
        g.paper_seconds(0.0, tokens)


def test_indexer_epilogue_bound_and_topk_read():
    cfg = SimpleNamespace(index_n_heads=32, index_head_dim=128, index_topk=2048, num_hidden_layers=10)
    # 32 heads × 4 FP32 FLOPs at 1e13 against 2 × 32 × 128 FLOPs at 1e15
    assert g.indexer_bound_ratio(cfg, 1e15, 1e13) == pytest.approx((32 * 4 / 1e13) / (2 * 32 * 128 / 1e15))
    # an owner holds ceil(B / T) requests' rows; a CP rank 1/T of every request's; n² / 2 causal pairs each
    n = 1000
    own = g.topk_read_seconds(cfg, 9, n, 8, True, 1e12)
    assert own == pytest.approx(2 * n * n / 2 * 10 * 4 / 1e12)
    assert g.topk_read_seconds(cfg, 9, n, 8, False, 1e12) == pytest.approx(9 * n * n / 2 / 8 * 10 * 4 / 1e12)
    assert g.topk_read_seconds(SimpleNamespace(index_topk=0), 9, n, 8, True, 1e12) == 0.0


def test_targets_merge_a_published_range_and_keep_exact_points():
    t = {x["figure"]: x for x in g.tps_targets("b200")}
    assert t["b200.tps.dop.long"]["paper"] == (21_059, 23_470)          # the range's two rows, one target
    assert len(t["b200.tps.dop.long"]["points"]) == 2
    assert t["b200.tps.cp.128K.B256"]["paper"] == (27_677, 27_677)
    assert t["b200.tps.cp.128K.B256"]["points"] == ((256, 128_000),)
    assert g.tps_targets("bw1000") and all(x["figure"].startswith("bw1000.tps") for x in g.tps_targets("bw1000"))


def test_disaggregated_parts_sum_to_the_batch_time():
    m = load_sim_model("glm-5.3")
    s = SimSetup(m, load_profile("b200"), 8, deployment="disaggregated")
    cm = CostModel(m.cfg, 8, s.profile, m.weight_dtype, m.kv_dtype, s.block_size, cp_prefill="split")
    parts = deploy.disaggregated_parts(cm, s, "dp_attn", 16, 2000, 4, 8)   # two waves of 8
    assert sum(parts.values()) == pytest.approx(2 * prefill_seconds(cm, s, "dp_attn", 8, 2000)
                                                + deploy.handoff_seconds(s, 8, 2000)
                                                + deploy.decode_seconds(s, 16, 2000, 4))
    assert parts["handoff_s"] == pytest.approx(deploy.handoff_seconds(s, 8, 2000))   # only the last wave's shows


def test_the_b200_decode_instance_binds_at_the_long_inputs():
    """The B200 setup's decode (TP over 16 GPUs, splash/sim/paper_data.py) holds fewer than the sweep's 16 requests
    at 256K and 512K, so its decode runs in waves there; at 64K all 16 fit."""
    from splash.sim.paper import Evaluator
    from splash.sim.paper_data import SETUPS
    from splash.sim.serving import concurrency
    st = SETUPS["b200"]
    d, _, caps = deploy.decode_instance(Evaluator(st).sim)
    held = {n: concurrency(d, caps, st.decode_layout, n + st.output_len) for n in (64_000, 256_000, 512_000)}
    assert held[64_000] >= 16 and held[256_000] < 16 and held[512_000] < held[256_000]


def test_gap_cli_writes_rows(tmp_path, capsys):
    out = tmp_path / "gap.json"
    assert g.main(["--only", "bw1000", "--json", str(out)]) == 0
    import json
    data = json.loads(out.read_text())
    assert data["rows"] and {"prefill_factor", "decode_step_needed_s", "handoff_rate_needed"} <= set(data["rows"][0])
    assert set(data["implied_link_rates"]["bw1000"]) == {"kv", "weight"} and data["b200_blocking"] is None
    assert g.main(["--only", "a100"]) == 2
    assert "unknown hardware a100" in capsys.readouterr().out
