"""The mechanisms docs/benchmarks.md names for splash-sim's remaining misses against the paper, each tested here
(`splash-sim paper` reports the misses themselves)."""
import pytest

from splash.costmodel import load_profile
from splash.costmodel.step_cost import CostModel
from splash.sim.paper_data import FIGURES, SETUPS
from splash.sim.presets import load_sim_model
from splash.layouts.memory import (common_bytes, kv_block_bytes, kv_capacity_tokens, projection_bytes_per_rank,
                                   recurrent_state_bytes, states_per_rank)
from splash.sim.scenario import GIB, kv_tokens_per_input_token, scenario_limit
from splash.sim.serving import (SimSetup, capacities, concurrency, prefill_seconds, stored_weights,
                                wave_seconds)
from splash.sim import deploy

PAPER = {f.key: f.paper for f in FIGURES}


def resident_limit(model, layout: str, batch: int = 16, world: int = 8, budget_gib: float = 52.8,
                   kv_dtype: str | None = None) -> float:
    """The other reading of the DCU scenario (docs/benchmarks.md): the longest nominal input of ``batch`` balanced
    requests when the budget holds everything a rank keeps resident, as splash.layouts.memory counts it for the
    whole model: every weight (FFN/MoE sharded over the group, the MLA and KDA projections sharded or replicated by
    layout, embeddings, norms), the ``batch`` requests' KDA state, and their KV in ``kv_dtype`` (default the
    model's)."""
    elem, quant = stored_weights(model.weight_dtype)
    cap = kv_capacity_tokens(model.full, layout, world, budget_gib * GIB, elem, kv_dtype or model.kv_dtype, 1,
                             weight_quant=quant, state_requests=batch)
    return cap.room_bytes_per_rank / (cap.block_bytes * kv_tokens_per_input_token(layout, batch, world))


def fingerprint(limits: dict[str, float], batch: int = 16, world: int = 8) -> dict[str, float]:
    """What four nominal-input limits (layout -> tokens) say about the per-rank accounting behind them, whatever
    its bytes. Write a layout's budget as fixed(layout) + k(layout) × limit × b(layout), with k the KV tokens a
    rank holds per input token (``kv_tokens_per_input_token``) and b the bytes of one request-token:

    - ``tp_vs_dop``: b(TP) / b(DOP) when TP and DOP hold the same weights (both shard the projections). 1 in
      every ownership accounting;
    - ``cp_vs_dp``: b(CP) / b(DP-attn) when CP and DP-attn hold the same weights (both replicate them). 1 in every
      ownership accounting;
    - ``gap_tokens``: what DP-attn's replicas take beyond DOP's shards, in request-tokens (b(DOP) = b(DP-attn));
    - ``replicated_share``: the share of the budget the replicated layout-dependent weights W take if the budget
      holds nothing else than them and KV (W / T in TP/DOP): from DOP = W/T + k n_dop b and DP-attn = W + k n_dp b.
    """
    k_own = kv_tokens_per_input_token("dop", batch, world)
    n = {lay: float(limits[lay]) for lay in ("tp", "dp_attn", "cp", "dop")}
    gap = n["dop"] - n["dp_attn"]
    if gap <= 0:
        raise ValueError(f"DOP's limit ({n['dop']}) must exceed DP-attn's ({n['dp_attn']}): DOP shards what "
                         "DP-attn replicates")
    return {
        "tp_vs_dop": k_own * n["dop"] / (kv_tokens_per_input_token("tp", batch, world) * n["tp"]),
        "cp_vs_dp": n["dp_attn"] / n["cp"],
        "gap_tokens": k_own * gap,
        "replicated_share": world / (1.0 + (world - 1) * n["dop"] / gap),
    }


def test_papers_resident_count_is_distinct_capacity_over_length():
    """'At 512K, DOP keeps 16 requests resident rather than 12 for DP-attention': 12 is the DP-attn pool's
    distinct tokens over one request (6.47 M / 513K = 12.6), but a request lives on one owner and an owner's
    809K tokens hold one 513K request: 8 resident. DOP's 16 is both (two per owner)."""
    m = load_sim_model("glm-5.3")
    s = SimSetup(m, load_profile("b200"), 8)
    caps = capacities(s)
    tok = 512_000 + 1024
    assert caps["dp_attn"].distinct_tokens // tok == PAPER["b200.resident.512K.dp"] == 12
    assert concurrency(s, caps, "dp_attn", tok) == 8
    assert caps["dop"].distinct_tokens // tok == concurrency(s, caps, "dop", tok) == PAPER["b200.resident.512K.dop"]


def test_short_inputs_are_decode_bound_under_disaggregation():
    """B200's sweeps vary the prefill layout with decode on a fixed instance (TP over 16 GPUs): at 1K and 4K input
    and 1,024 output the prefill of 16 requests is under 5% of a batch's end-to-end time, so every layout's
    throughput is within 1% of the others and the leader there is set by effects below the model's resolution
    (TP in the paper at both)."""
    st = SETUPS["b200"]
    m = load_sim_model(st.model)
    s = SimSetup(m, load_profile(st.hardware), 8, deployment=st.deployment, decode_layout=st.decode_layout,
                 decode_world=st.decode_world, decode_nodes=st.decode_nodes)
    cm = CostModel(m.cfg, 8, s.profile, m.weight_dtype, m.kv_dtype, s.block_size, cp_prefill="split")
    for n in (1000, 4000):
        dec = deploy.decode_seconds(s, 16, n, st.output_len)
        pre = {k: prefill_seconds(cm, s, k, 16, n) for k in ("tp", "dp_attn", "cp", "dop")}
        assert max(pre.values()) < 0.05 * dec
        assert max(pre.values()) - min(pre.values()) < 0.01 * (dec + min(pre.values()))


def test_scenario_tp_to_dop_ratio_is_fixed_by_ownership():
    """In the ownership model TP and DOP shard the same projections, so under one per-rank budget TP's nominal
    limit is DOP's × ⌈B/T⌉/B (2/16) whatever the per-token bytes; the paper's scenario gives 58.9k / 402.8k =
    0.146, so its TP and DOP store different per-token state — which the summary does not give."""
    m = load_sim_model("glm-5.3-flash")
    ratio = scenario_limit(m, "tp") / scenario_limit(m, "dop")
    assert ratio == pytest.approx(2 / 16)
    assert PAPER["bw1000.scenario.tp"] / PAPER["bw1000.scenario.dop"] == pytest.approx(0.146, abs=0.001)


def _limits_from(T, B, budget, weights, common, b, b_tp, b_cp):
    """Nominal limits of an accounting with known parts: layout-dependent weights replicated in DP-attn/CP and
    1/T in TP/DOP, ``common`` on every rank, b bytes per request-token (b_tp in TP, b_cp in CP)."""
    k = -(-B // T)
    shard, rep = budget - common - weights / T, budget - common - weights
    return {"dop": shard / (k * b), "tp": shard / (B * b_tp), "dp_attn": rep / (k * b), "cp": rep / (k * b_cp)}


def test_scenario_fingerprint_recovers_the_accounting_it_was_built_from():
    lim = _limits_from(8, 16, 1000.0, 400.0, 0.0, 0.5, 0.45, 0.4)
    fp = fingerprint(lim, 16, 8)
    assert fp["tp_vs_dop"] == pytest.approx(0.9) and fp["cp_vs_dp"] == pytest.approx(0.8)
    assert fp["gap_tokens"] == pytest.approx(400.0 * 7 / 8 / 0.5)   # DP-attn's replicas in request-tokens
    assert fp["replicated_share"] == pytest.approx(0.4)            # 400 of a 1000-byte budget
    with pytest.raises(ValueError):
        fingerprint({**lim, "dop": lim["dp_attn"]}, 16, 8)


def test_no_ownership_accounting_has_the_papers_scenario_fingerprint():
    """Every balanced reading splash-sim has of the DCU scenario (the table's, splash.sim.scenario; everything
    resident, as the engine counts it, with FP8 or BF16 KV) stores one request-token alike in TP and
    DOP and in DP-attn and CP: their fingerprints are exactly 1. The paper's limits need TP and CP to store
    ~15% less per request-token than DOP and DP-attn (or different weights), and, if 52.8 GiB holds only the
    layout-dependent weights and KV, 45.5% of it (24 GiB) to be replicated weights — GLM-5.3-Flash's MLA + KDA
    projections are 5.5 GiB in INT8 (10.9 GiB BF16)."""
    m = load_sim_model("glm-5.3-flash")
    lays = ("tp", "dp_attn", "cp", "dop")
    for limit in (lambda lay: scenario_limit(m, lay), lambda lay: resident_limit(m, lay),
                  lambda lay: resident_limit(m, lay, kv_dtype="bfloat16")):
        fp = fingerprint({lay: limit(lay) for lay in lays})
        assert fp["tp_vs_dop"] == pytest.approx(1.0, abs=2e-3) and fp["cp_vs_dp"] == pytest.approx(1.0)
    paper_fp = fingerprint({lay: PAPER[f"bw1000.scenario.{lay}"] for lay in lays})
    assert paper_fp["tp_vs_dop"] == pytest.approx(0.855, abs=1e-3)
    assert paper_fp["cp_vs_dp"] == pytest.approx(0.844, abs=1e-3)
    assert paper_fp["replicated_share"] * 52.8 == pytest.approx(24.0, abs=0.1)
    replicated = projection_bytes_per_rank(m.full, "dp_attn", 8, *stored_weights(m.weight_dtype)) / (1 << 30)
    assert 5.0 < replicated < 6.0


def test_resident_limit_fills_the_budget():
    """At resident_limit a rank's weights, its requests' KDA state and their KV add up to the budget."""
    m = load_sim_model("glm-5.3-flash")
    elem, quant = stored_weights(m.weight_dtype)
    cfg, budget = m.full, 52.8 * (1 << 30)
    for lay in ("tp", "dp_attn", "cp", "dop"):
        n = resident_limit(m, lay, 16, 8, 52.8, kv_dtype="bfloat16")
        states = states_per_rank(lay, 16, 8) * recurrent_state_bytes(cfg, lay, 8)
        fixed = common_bytes(cfg, 8, elem, quant) + projection_bytes_per_rank(cfg, lay, 8, elem, quant) + states
        kv = (16 if lay == "tp" else 2) * n * kv_block_bytes(cfg, "bfloat16", 1)
        assert fixed + kv == pytest.approx(budget)
        assert resident_limit(m, lay, 16, 8, 52.8) > n   # FP8 KV: more tokens in the same room


def test_burst_paper_times_are_the_sims_prefill_plus_a_per_wave_constant():
    """DCU burst (App. C.4, 32 x 240K, 1K output, co-located): the paper's input tokens/s give each layout's
    makespan (7.68 M / 14,846 = 517 s DOP, / 11,229 = 684 s DP-attn); with DP-attn's 24 + 8 waves and each wave's
    requests finishing together, its mean completion (477.09 s) puts the first wave's end at 408 s. Read as
    prefill rates, DP-attn's lone second wave ran at half the first's per-request rate (276 s for one request
    per owner vs 136 s) with nothing in the summary to slow it. Read against splash-sim's own prefill time of each
    wave (prefill_seconds), every wave — 32, 24 and 8 requests — is its prefill plus ~213-238 s that does not
    scale with the wave's size, 6-9x the sim's decode of 1,000 tokens (26-37 s); the sim lacks that per-wave
    cost, so DP-attn's second wave costs it little (ratio 0.99 instead of 1.32)."""
    st = SETUPS["bw1000_colocated"]
    m = load_sim_model(st.model)
    s = SimSetup(m, load_profile(st.hardware), 8)
    cm = CostModel(m.cfg, 8, s.profile, m.weight_dtype, m.kv_dtype, s.block_size, cp_prefill="split")
    total = 32 * 240_000
    end_dop = total / PAPER["bw1000.burst.input_tokens_per_s.dop"]
    end_dp = total / PAPER["bw1000.burst.input_tokens_per_s.dp_attn"]
    first_dp = (32 * PAPER["bw1000.burst.mean_completion_s.dp_attn"] - 8 * end_dp) / 24
    assert end_dop == pytest.approx(PAPER["bw1000.burst.mean_completion_s.dop"], rel=0.002)  # one wave
    assert (end_dp - first_dp) / (first_dp / 3) > 1.9            # the lone wave "at half rate"
    waves = {"dop": (32, end_dop), "dp_attn.1": (24, first_dp), "dp_attn.2": (8, end_dp - first_dp)}
    extra, decode = {}, {}
    for key, (n, seconds) in waves.items():
        lay = key.split(".")[0]
        pre = prefill_seconds(cm, s, lay, n, 240_000)
        extra[key] = seconds - pre
        decode[key] = wave_seconds(cm, s, lay, n, 240_000, 1000) - pre
    assert max(extra.values()) / min(extra.values()) < 1.15
    assert min(extra.values()) > 5 * max(decode.values())


def test_step_share_bounds_ask_for_a_longer_b200_interval_than_one_chunk():
    """'Largest p50 overhead / destination step' (B200 < 0.51%, H200 < 1.39%): with the paper's own largest p50
    (DOP->CP, 11.76 ms on B200; 9.65 ms on H200) the bounds need a destination interval of at least 2.31 s on
    B200 (B = 16 x 256K) and 0.69 s on H200 (x 128K). splash-sim's destination step — one 16,384-token prefill
    chunk at that context (switch_step_rows) — is long enough on H200 (within since the live switch's contention
    runs through HBM: 1.25%) and 5x too short on B200, more than B200's tokens/s gap (1.5-2.1x) covers."""
    from splash.sim.switch_table import switch_step_rows
    implied = {"b200": 11.76e-3 / 0.0051, "h200": 9.65e-3 / 0.0139}
    step = {}
    for hw, ctx in (("b200", 256_000), ("h200", 128_000)):
        st = SETUPS[hw]
        m = load_sim_model(st.model)
        s = SimSetup(m, load_profile(st.hardware), 8)
        cm = CostModel(m.cfg, 8, s.profile, m.weight_dtype, m.kv_dtype, s.block_size, cp_prefill="split")
        step[hw] = cm.step("cp", switch_step_rows("cp", 16, ctx, s.chunk, 8)).seconds
    assert step["h200"] >= implied["h200"]
    assert step["b200"] * 5 < implied["b200"]


# ---- explanations of the remaining misses that had no test (audit of issue 29, session 18) -------------------------

def _evaluator(hw: str):
    """The setup `splash-sim paper` evaluates ``hw``'s figures with (deployment, decode instance, output length)."""
    from splash.sim.paper import Evaluator
    return Evaluator(SETUPS[hw])


def _fixed_parts(ev, layout: str, batch: int, n: int, memo: dict) -> float:
    """Prefill + exposed handoff of ``batch`` prompts of ``n`` tokens in ``layout`` on the prefill instance: what
    the output length does not change (it holds prompts only; the decode instance is the same for every layout).
    ``memo`` keeps each wave size's prefill, which the batch's equal waves repeat."""
    def once(cm, s, lay, k, n_):
        if (lay, k, n_) not in memo:
            memo[(lay, k, n_)] = prefill_seconds(cm, s, lay, k, n_)
        return memo[(lay, k, n_)]
    k = min(batch, concurrency(ev.sim, ev.caps, layout, n))
    real, deploy.prefill_seconds = deploy.prefill_seconds, once
    try:
        p = deploy.disaggregated_parts(ev.cm, ev.sim, layout, batch, n, 0, k)
    finally:
        deploy.prefill_seconds = real
    return p["prefill_s"] + p["handoff_s"]


def test_no_output_length_puts_the_128k_deficits_and_cps_b256_tokens_within_together():
    """The summary gives no output length (1,024 assumed). A shorter one shrinks the fixed decode instance's share
    of a batch: the DOP / CP deficits at 128K, B = 1 / 4 (paper 0.578 / 0.649) come within below ~750 tokens,
    but CP's tokens/s at 128K, B = 256 (paper 27,677) is within only above ~850. Both move monotonically with the
    output length (the same decode is added to both layouts' times; CP's long batch is decode-heavy), so no
    output length puts all three within: the deficit rows' miss is not the assumed output length."""
    from splash.sim.paper import judge
    ev, n, memo = _evaluator("b200"), 128_000, {}
    fixed = {(lay, b): _fixed_parts(ev, lay, b, n, memo) for lay in ("dop", "cp") for b in (1, 4)}
    fixed[("cp", 256)] = _fixed_parts(ev, "cp", 256, n, memo)
    rows = {"b200.ratio.dop_cp.128K.B1": "ratio", "b200.ratio.dop_cp.128K.B4": "ratio",
            "b200.tps.cp.128K.B256": "tokens_per_s"}
    grid = list(range(448, 1281, 64))
    sims = {k: [] for k in rows}
    for out in grid:
        d = {b: deploy.decode_seconds(ev.sim, b, n, out) for b in (1, 4, 256)}
        for b in (1, 4):
            sims[f"b200.ratio.dop_cp.128K.B{b}"].append((fixed[("cp", b)] + d[b]) / (fixed[("dop", b)] + d[b]))
        sims["b200.tps.cp.128K.B256"].append(256 * (n + out) / (fixed[("cp", 256)] + d[256]))
    within = {k: [judge(kind, PAPER[k], v)[1] for v in sims[k]] for k, kind in rows.items()}
    for k in ("b200.ratio.dop_cp.128K.B1", "b200.ratio.dop_cp.128K.B4"):
        assert sims[k] == sorted(sims[k])                                     # rises with the output length
    assert sims["b200.tps.cp.128K.B256"] == sorted(sims["b200.tps.cp.128K.B256"], reverse=True)
    deficits = [a and b for a, b in zip(within["b200.ratio.dop_cp.128K.B1"], within["b200.ratio.dop_cp.128K.B4"])]
    cp = within["b200.tps.cp.128K.B256"]
    assert any(deficits) and any(cp) and not any(a and b for a, b in zip(deficits, cp))
    last_deficit, first_cp = max(i for i, x in enumerate(deficits) if x), min(i for i, x in enumerate(cp) if x)
    assert last_deficit + 1 < first_cp            # an output length between them misses all three
    at_1024 = grid.index(1024)
    assert not deficits[at_1024] and cp[at_1024]   # the shipped assumption: the table's misses


def test_b200_cp_and_dp_attn_are_within_two_percent_at_128k():
    """The paper's B200 leader at 16 x 128K is CP; in splash-sim CP and DP-attn are within 2% there (DP-attn leads
    by ~1.3%), a lead below the model's resolution, as at 1K and 4K."""
    ev = _evaluator("b200")
    cp, dp = ev.tps("cp", 16, 128_000), ev.tps("dp_attn", 16, 128_000)
    assert abs(cp / dp - 1.0) < 0.02


def test_dcu_primitives_imply_one_link_rate_above_the_assumed_one():
    """BW1000's link rate has no datasheet (the profile assumes 100 GB/s each way). Inverting the B200-fitted shares
    on the DCU's published per-layer KV and weight ranges gives one rate for both families (their ranges overlap)
    above 1.3x the assumption: the four DCU primitive rows miss by that one unknown number. The same inversion on
    H200, whose NVLink rate is on its datasheet, comes within 5% of it for both families."""
    from splash.sim.fit import implied_link_rates
    dcu = implied_link_rates("bw1000")
    lo, hi = max(r[0] for r in dcu.values()), min(r[1] for r in dcu.values())
    assert lo < hi and lo > 1.3 * load_profile("bw1000").link_bytes_per_s
    spec = load_profile("h200").link_bytes_per_s
    for a, b in implied_link_rates("h200").values():
        assert 0.95 * a < spec < 1.05 * b


@pytest.mark.parametrize("hw", ["b200", "h200", "bw1000"])
def test_dop_prefill_steps_are_never_below_dp_attns_at_the_papers_dop_positions(hw):
    """At every position where the paper names DOP the leader, with the hardware's own model and profile, a DOP
    prefill step (every owner its chunk share) is at least DP-attn's at the start, middle and end of the prompt. The
    swept layouts share the decode instance and (test_admission_waves_do_not_change_an_owner_layouts_prefill_work)
    an owner layout's prefill work does not depend on admission, so DOP cannot lead DP-attn there."""
    from splash.costmodel.step_cost import RowLoad
    from splash.sim.serving import step_seconds
    ev = _evaluator(hw)
    share = ev.sim.chunk // ev.sim.world
    positions = [f.probe[1:] for f in FIGURES if f.hardware == hw and f.kind == "leader" and f.paper == "dop"]
    assert positions
    for _, n in positions:
        for ctx in (0, n // 2, n - share):
            rows = [RowLoad(share, ctx, o) for o in range(ev.sim.world)]
            assert step_seconds(ev.cm, ev.model, "dop", rows) >= step_seconds(ev.cm, ev.model, "dp_attn", rows), (n, ctx)


@pytest.mark.parametrize("hw, n", [("b200", 256_000), ("h200", 64_000), ("bw1000", 256_000)])
def test_the_papers_dop_over_cp_at_the_long_inputs_needs_a_dop_prefill_below_dp_attns(hw, n):
    """At a long-input position of each hardware (B = 16), with CP's time, DOP's handoff and the shared decode as
    priced, the paper's lowest DOP / CP at the long inputs (B200 1.034, H200 1.042, DCU 1.101: so at least that
    at every long input) needs DOP to prefill faster than DP-attn does, which no DOP step allows (the test
    above): reaching it needs a per-layout term the summary does not give."""
    ev, memo = _evaluator(hw), {}
    decode = deploy.decode_seconds(ev.sim, 16, n, ev.setup.output_len)
    cp = _fixed_parts(ev, "cp", 16, n, memo) + decode
    dop, dp = (deploy.disaggregated_parts(ev.cm, ev.sim, lay, 16, n, 0,
                                          min(16, concurrency(ev.sim, ev.caps, lay, n))) for lay in ("dop", "dp_attn"))
    need = cp / PAPER[f"{hw}.ratio.dop_cp.long.min"] - dop["handoff_s"] - decode
    assert need < dp["prefill_s"] <= dop["prefill_s"], (need, dp["prefill_s"], dop["prefill_s"])
