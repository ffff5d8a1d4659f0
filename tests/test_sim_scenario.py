"""The DCU scenario of App. B.1 (splash.sim.scenario): the table's accounting, and the readings tested against the
paper's four limits — the mechanisms docs/benchmarks.md ("DCU rows") names for what the limits say."""
import pytest

from splash.costmodel import load_profile
from splash.costmodel.step_cost import CostModel, RowLoad
from splash.layouts.memory import common_bytes, kv_block_bytes, projection_bytes_per_rank
from splash.sim.paper_data import FIGURES, SCENARIO
from splash.sim.presets import load_sim_model
from splash.sim.scenario import (GIB, implied_fixed_bytes, kv_tokens_per_input_token, owner_factor,
                                 resident_fixed_bytes, sampled_owner_factor, scenario_limit)
from splash.sim.serving import SimSetup, prefill_seconds, step_seconds, stored_weights

LAYS = ("tp", "dp_attn", "cp", "dop")
PAPER = {lay: next(f.paper for f in FIGURES if f.key == f"bw1000.scenario.{lay}") for lay in LAYS}


@pytest.fixture(scope="module")
def flash():
    return load_sim_model("glm-5.3-flash")


def test_scenario_limit_fills_the_budget_with_resident_state_and_bf16_kv(flash):
    """At its limit a rank's resident state (the whole stored model, projections by layout, W_UK/W_UV copies,
    the 1 GiB reserve) and its requests' BF16 latent KV add up to the 52.8 GiB."""
    per_token = kv_block_bytes(flash.cfg, "bfloat16", 1)
    for lay in LAYS:
        kv = kv_tokens_per_input_token(lay, 16, 8) * scenario_limit(flash, lay) * per_token
        assert resident_fixed_bytes(flash, lay) + kv == pytest.approx(SCENARIO["budget_gib"] * GIB)
    # the layout-dependent part is the attention projections (and their BF16 copies): replicated minus sharded
    elem, quant = stored_weights(flash.weight_dtype)
    proj = (projection_bytes_per_rank(flash.full, "dp_attn", 8, elem, quant)
            - projection_bytes_per_rank(flash.full, "dop", 8, elem, quant))
    assert proj < resident_fixed_bytes(flash, "cp") - resident_fixed_bytes(flash, "tp") < proj + 0.5 * GIB
    assert resident_fixed_bytes(flash, "tp") > common_bytes(flash.full, 8, elem, quant) + SCENARIO["reserve_gib"] * GIB
    assert scenario_limit(flash, "tp", budget_gib=1.0) == 0.0     # nothing fits when the model does not


def test_owner_factor_is_the_fullest_owner_over_the_mean():
    assert owner_factor([1.0] * 16, 8) == 1.0
    assert owner_factor([2.0, 1.0, 1.0, 0.0], 2) == pytest.approx(3.0 / 2.0)   # owner 0: 2 + 1 of a mean 2
    assert sampled_owner_factor(16, 8, 0.0, samples=10) == 1.0
    lo, hi = sampled_owner_factor(16, 8, 0.1, 500), sampled_owner_factor(16, 8, 0.3, 500)
    assert 1.0 < lo < hi
    with pytest.raises(ValueError):
        sampled_owner_factor(16, 8, 1.0)
    with pytest.raises(ValueError):
        owner_factor([], 8)


def test_sampled_lengths_give_both_scenario_ratios_one_factor(flash):
    """Lengths drawn around the nominal one bind DP-attn and DOP by their fullest owner and TP and CP by the
    mean: the TP/DOP and CP/DP-attn ratios both move by the same owner factor, whatever the bytes. The paper's
    two are 1.170 and 1.185 of the balanced ones (1.3% apart), and uniform lengths within about ±30% give that."""
    f = sampled_owner_factor(16, 8, 0.3, 2000)
    bal = {lay: scenario_limit(flash, lay) for lay in LAYS}
    sampled = {lay: bal[lay] / (f if lay in ("dp_attn", "dop") else 1.0) for lay in LAYS}
    assert (sampled["dop"] / sampled["tp"]) / (bal["dop"] / bal["tp"]) == pytest.approx(1 / f)
    assert (sampled["dp_attn"] / sampled["cp"]) / (bal["dp_attn"] / bal["cp"]) == pytest.approx(1 / f)
    paper_tp = 16 * PAPER["tp"] / (2 * PAPER["dop"])      # the owner factor each paper ratio asks for
    paper_cp = PAPER["cp"] / PAPER["dp_attn"]
    assert paper_tp == pytest.approx(paper_cp, rel=0.015)
    assert min(paper_tp, paper_cp) < sampled_owner_factor(16, 8, 0.32, 2000)
    assert sampled_owner_factor(16, 8, 0.28, 2000) < max(paper_tp, paper_cp)
    # the table's accounting leaves DP-attn and DOP high by that same factor (TP and CP within 2%)
    for lay in ("dp_attn", "dop"):
        assert bal[lay] / PAPER[lay] == pytest.approx((paper_tp + paper_cp) / 2, rel=0.01)
    for lay in ("tp", "cp"):
        assert bal[lay] / PAPER[lay] == pytest.approx(1.0, abs=0.02)


def test_papers_limits_imply_the_models_resident_bytes(flash):
    """Invert the paper's limits at BF16 latent KV with the common owner factor: the fixed bytes they leave per
    rank agree with the model's resident state in the sharded layouts (TP, DOP) and in the replicated ones
    (DP-attn, CP) to 0.12 GiB, and each pair agrees with itself, as ownership requires."""
    f = (16 * PAPER["tp"] / (2 * PAPER["dop"]) + PAPER["cp"] / PAPER["dp_attn"]) / 2
    implied = implied_fixed_bytes(PAPER, kv_block_bytes(flash.cfg, "bfloat16", 1), SCENARIO["budget_gib"] * GIB, f)
    for lay in LAYS:
        assert implied[lay] == pytest.approx(resident_fixed_bytes(flash, lay), abs=0.12 * GIB)
    # FP8 KV would need 46-50 GiB resident: 6-10 GiB more than the model holds
    fp8 = implied_fixed_bytes(PAPER, kv_block_bytes(flash.cfg, "fp8_e4m3", 1), SCENARIO["budget_gib"] * GIB, f)
    assert min(fp8[lay] - resident_fixed_bytes(flash, lay) for lay in LAYS) > 3 * GIB


def test_no_latency_budget_binds_at_the_papers_limits(flash):
    """The other reading of "conditional latency and capacity limits": each layout stops where a common step
    latency is reached. Decode steps hardly grow with context (op overhead dominates), and CP's at TP's limit
    already exceeds TP's there, so no budget gives CP a 4.7x longer limit; the B = 16 prefill at each paper
    limit spans 6x (TP 40 s, DOP 255 s in the sim), so no common prefill budget either."""
    prof = load_profile("bw1000")
    cm = CostModel(flash.cfg, 8, prof, flash.weight_dtype, flash.kv_dtype, 64, cp_prefill="split")
    sim = SimSetup(flash, prof, 8)

    def decode(lay, n):
        return step_seconds(cm, flash, lay, [RowLoad(1, n, j % 8) for j in range(16)])

    assert decode("cp", PAPER["tp"]) > decode("tp", PAPER["tp"])
    assert decode("cp", PAPER["cp"]) - decode("cp", PAPER["tp"]) < 0.05 * decode("cp", PAPER["tp"])
    pre = {lay: prefill_seconds(cm, sim, lay, 16, int(PAPER[lay])) for lay in LAYS}
    assert max(pre.values()) > 4 * min(pre.values())
