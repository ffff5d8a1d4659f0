"""The computation of the candidate mechanisms for DOP's lead (splash/sim/prefill_mechanisms.py): each from the
model's and hardware's bytes and FLOPs. What they predict at the paper's positions is in docs/benchmarks.md."""
import pytest

from splash.costmodel import load_profile
from splash.costmodel.work import Piece, Shapes, layer_rows, rows_work
from splash.layouts.memory import kv_bytes_per_token_layer
from splash.sim import prefill_mechanisms as pm
from splash.sim.presets import load_sim_model
from splash.sim.serving import SimSetup, capacities

GLM = load_sim_model("glm-5.3")


@pytest.fixture(scope="module")
def rows_16k():
    return pm.mechanism_rows("b200", points=((16, 16_000),))


def test_transient_bytes_of_a_prefill_chunk():
    """2,048 rows over 512,000 keys: fp32 logits [rows × keys], the BF16 latent history (512 + 64) × 2 bytes a
    key, int32 top-k indices [rows × 2,048]; the largest chunk that fits a room is the inverse."""
    cfg = GLM.cfg
    t = pm.prefill_transient_bytes(cfg, 2048, 512_000)
    assert t == {"indexer_logits": 2048 * 512_000 * 4, "dequant_kv": 512_000 * 576 * 2,
                 "topk_indices": 2048 * 2048 * 4}
    room = 26.75 * (1 << 30)
    n = pm.largest_chunk_rows(cfg, 512_000, room)
    assert sum(pm.prefill_transient_bytes(cfg, n, 512_000).values()) <= room
    assert sum(pm.prefill_transient_bytes(cfg, n + 1, 512_000).values()) > room
    assert pm.largest_chunk_rows(cfg, 512_000, 1.0) == 0


def test_activation_room_is_what_the_pool_leaves_in_every_layout(rows_16k):
    """The pool is sized at the memory fraction; what a layout replicates comes out of its pool (DOP's is the
    larger), so the room for transients is (1 − f) × memory whatever the layout."""
    s = SimSetup(GLM, load_profile("b200"), 8, mem_fraction=0.85)
    assert pm.activation_room(s) == pytest.approx(0.15 * s.profile.memory_bytes)
    caps = capacities(s)
    assert caps["dop"].room_bytes_per_rank > caps["dp_attn"].room_bytes_per_rank
    assert {r["room_gib"] for r in rows_16k} == {pm.activation_room(s) / (1 << 30)}


def test_wave_handoff_is_exposed_only_with_one_request_resident_per_unit():
    """An owner that holds one request waits for its KV to leave (one NIC) before its next; with two resident it
    prefills the other meanwhile; CP's unit is the group (13 resident: hidden)."""
    s = SimSetup(GLM, load_profile("b200"), 8)
    n = 512_000
    one = n * kv_bytes_per_token_layer(GLM.cfg, GLM.kv_dtype) * GLM.cfg.num_hidden_layers / 50e9
    assert pm.request_handoff_seconds(s, "dp_attn", n) == pytest.approx(one)
    assert pm.request_handoff_seconds(s, "cp", n) == pytest.approx(one / 8)
    assert pm.exposed_wave_handoff_seconds(s, "dp_attn", 16, 8, n) == pytest.approx(one)
    assert pm.exposed_wave_handoff_seconds(s, "dp_attn", 24, 8, n) == pytest.approx(2 * one)
    assert pm.exposed_wave_handoff_seconds(s, "dop", 16, 16, n) == 0.0
    assert pm.exposed_wave_handoff_seconds(s, "cp", 16, 13, n) == 0.0
    assert pm.exposed_wave_handoff_seconds(s, "dp_attn", 8, 8, n) == 0.0   # one wave: nothing waits


def test_exchange_bytes_per_row_match_the_cost_models_counts():
    """DOP's per-row exchange (absorbed query of every head out, latent output back, hidden state all-reduced)
    is what splash.costmodel.work counts over the group for a balanced step; DP-attn's is its hidden state."""
    cfg, T, ab = GLM.cfg, 8, 2.0
    s = Shapes(cfg, T, 1.0, ab, 656.0, 132.0, 64)
    N = 16_384
    pieces = [Piece(N // T, 100_000, o) for o in range(T)]
    exchange = lambda lay: rows_work(s, lay, layer_rows(s, lay, pieces, 0)[0], moe=True)["exchange"].exch  # noqa: E731
    a2a = sum(T * e[1] for e in exchange("dop") if e[0] == "all_to_all")
    ar = sum(e[1] for e in exchange("dop") if e[0] == "all_reduce")
    assert (a2a + ar) / N == pytest.approx(pm.exchange_bytes_per_row(cfg, "dop"))
    gather = exchange("dp_attn")
    assert gather[0][1] / N == pytest.approx(pm.exchange_bytes_per_row(cfg, "dp_attn"))
    assert pm.exchange_bytes_per_row(cfg, "dop") / pm.exchange_bytes_per_row(cfg, "dp_attn") > 10


def test_history_reread_is_linear_in_keys_and_scoring_in_rows_too():
    """A chunk re-reads its history once (bytes ∝ keys); its indexer scores rows × keys: the ratio falls as 1/rows
    and does not depend on the history's length."""
    cfg = GLM.cfg
    r = [pm.history_reread_seconds(cfg, GLM.kv_dtype, k, 8e12) / pm.indexer_scoring_seconds(cfg, rows, k, 1e15)
         for k, rows in ((100_000, 2048), (400_000, 2048), (100_000, 256))]
    assert r[0] == pytest.approx(r[1]) and r[2] == pytest.approx(8 * r[0])


def test_mechanism_rows_on_one_point(rows_16k):
    """Every layout gets a row; a wave handoff never speeds a layout up; 2,048 rows fit the room at 16K."""
    rows = rows_16k
    assert [r["layout"] for r in rows] == list(pm.LAYOUTS)
    for r in rows:
        assert r["tokens_per_s_serial_waves"] <= r["tokens_per_s"]
        assert r["fit_rows"] >= r["rank_chunk_rows"]
    assert set(pm.leaders(rows, "tokens_per_s").values()) <= set(pm.LAYOUTS)
    # B200's decode instance runs TP: swept into TP it is the same setup; the others decode differently
    by = {r["layout"]: r for r in rows}
    assert by["tp"]["tokens_per_s_swept_decode"] == pytest.approx(by["tp"]["tokens_per_s"])
    assert by["dop"]["tokens_per_s_swept_decode"] != pytest.approx(by["dop"]["tokens_per_s"])
    assert all(r["tokens_per_s_pd_gated"] > 0 and r["tokens_per_s_pd_overlap"] > 0 for r in rows)


def test_mechanisms_cli_names_an_unknown_hardware(capsys):
    from splash.sim.cli import main
    assert main(["mechanisms", "--only", "b200,a100"]) == 2
    assert "unknown hardware a100" in capsys.readouterr().out


def test_pd_makespan_serial_is_all_prefill_then_decode_waves():
    # 16 requests on 8 units (2 each, 10 s apiece), handoff 1 s, 6 decode slots of 30 s: 20 + 1 + 3 waves
    assert pm.pd_makespan(16, 8, 10.0, 30.0, 6, "serial", 1.0) == pytest.approx(20 + 1 + 90)
    assert pm.pd_makespan(0, 8, 10.0, 30.0, 6, "gated") == 0.0
    with pytest.raises(ValueError, match="mode"):
        pm.pd_makespan(4, 1, 1.0, 1.0, 1, "eager")
    with pytest.raises(ValueError, match="slots"):
        pm.pd_makespan(4, 1, 1.0, 1.0, 0, "gated")


def test_pd_makespan_gated_holds_a_slot_from_prefill_start():
    """Pre-allocation: with one decode slot every request prefills only after the previous one decoded; one unit
    and one slot make the pipeline fully serial per request."""
    assert pm.pd_makespan(3, 1, 2.0, 5.0, 1, "gated", 0.5) == pytest.approx(3 * (2 + 0.5 + 5))
    # two units, two slots: both prefill at once, then both decode; the third waits for a slot
    assert pm.pd_makespan(3, 2, 2.0, 5.0, 2, "gated") == pytest.approx(2 + 5 + 2 + 5)


def test_pd_makespan_overlap_decodes_while_later_requests_prefill():
    """One unit delivering a request every 2 s into one slot of 5 s: the decode chain sets the end (2 + 3 × 5);
    the group-wide sequential delivery of CP beats eight owners delivering all at once when slots are few."""
    assert pm.pd_makespan(3, 1, 2.0, 5.0, 1, "overlap") == pytest.approx(2 + 3 * 5)
    assert pm.pd_makespan(3, 1, 2.0, 5.0, 3, "overlap") == pytest.approx(6 + 5)
    seq = pm.pd_makespan(16, 1, 1.0, 10.0, 4, "overlap")       # one unit, 1 s a request
    own = pm.pd_makespan(16, 8, 2 * 8 * 1.0 / 2, 10.0, 4, "overlap")   # eight owners, the same prefill work
    assert seq < own
    for mode in ("gated", "overlap"):   # never shorter than the decode chain, never longer than serial
        t = pm.pd_makespan(16, 8, 4.0, 10.0, 6, mode)
        assert -(-16 // 6) * 10.0 <= t
        assert mode == "gated" or t <= pm.pd_makespan(16, 8, 4.0, 10.0, 6, "serial")


def test_dop_step_is_never_below_dp_attn_at_balanced_owners_whatever_the_shared_rates():
    """Per step at balanced owners, DOP runs DP-attn's attention, indexer and FFN work plus Q-A and the indexer's
    projections on every row and the q̃/õ exchange; it saves only replicated weight reads, which a 2,048-row owner
    chunk's compute-bound GEMMs hide. So scaling any rate both layouts share (here each by 1/4…4×, seeded) keeps
    DOP's prefill step at or above DP-attn's: an outright DOP lead needs a per-layout term, not a shared one."""
    import dataclasses
    import random

    from splash.costmodel.profile import Collective
    from splash.costmodel.step_cost import CostModel, RowLoad
    base = load_profile("b200")
    rows = [RowLoad(2048, 256_000 - 2048, o) for o in range(8)]
    rng = random.Random(29)
    for _ in range(6):
        f = {k: 4 ** rng.uniform(-1, 1) for k in ("gemm", "mem", "attn", "kv", "coll")}
        prof = dataclasses.replace(
            base, gemm_flops_per_s={k: v * f["gemm"] for k, v in base.gemm_flops_per_s.items()},
            memory_bytes_per_s=base.memory_bytes_per_s * f["mem"],
            attention_flops_per_s=base.attention_flops_per_s * f["attn"],
            kv_read_bytes_per_s=base.kv_read_bytes_per_s * f["kv"],
            collectives={k: Collective(c.alpha_s, c.bytes_per_s * f["coll"]) for k, c in base.collectives.items()},
            overlap_fraction=rng.uniform(0.0, 1.0))
        cm = CostModel(GLM.cfg, 8, prof, GLM.weight_dtype, GLM.kv_dtype, 64, cp_prefill="split")
        ex = pm.step_excess(cm, "dop", "dp_attn", rows)
        assert sum(ex.values()) >= 0.0
        assert ex["qkv_a"] > 0 and ex["exchange"] > 0 and ex["indexer"] >= 0


def test_admission_waves_do_not_change_an_owner_layouts_prefill_work():
    """Owners prefill their requests one after another at a fixed chunk share, so B = 16 requests prefilled at once
    (two resident an owner) take the same steps, row for row, as two waves of eight (one resident an owner): a
    larger pool changes admission, not the prefill's work (at a prompt that is not a whole number of shares, one step
    a wave). What a wave adds is its handoff wait (mechanism 3)."""
    from splash.sim.serving import _prefill_steps
    chunk = 16_384
    shape = lambda steps: [sorted((r.new_tokens, r.context) for r in rows) for rows in steps]
    n = 20 * chunk // 8
    wave = _prefill_steps(8, n, chunk, 8, per_owner=True)
    assert shape(_prefill_steps(16, n, chunk, 8, per_owner=True)) == shape(wave) + shape(wave)
    n = 40_000
    at_once, wave = _prefill_steps(16, n, chunk, 8, True), _prefill_steps(8, n, chunk, 8, True)
    assert sum(r.new_tokens for rows in at_once for r in rows) == 2 * sum(r.new_tokens for rows in wave for r in rows)
    assert 0 <= 2 * len(wave) - len(at_once) <= 1


def test_mechanisms_cli_prints_the_table_and_writes_the_rows(tmp_path, capsys, monkeypatch):
    import json

    from splash.sim.cli import main
    monkeypatch.setitem(pm.POINTS, "b200", ((16, 16_000),))   # one position: seconds, not the paper's four
    out = tmp_path / "m.json"
    assert main(["mechanisms", "--only", "b200", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    rows = json.loads(out.read_text())["rows"]
    assert [r["layout"] for r in rows] == list(pm.LAYOUTS) and {r["input_len"] for r in rows} == {16_000}
    lead = pm.leaders(rows, "tokens_per_s")[("b200", 16, 16_000)]
    assert f"leaders by tokens_per_s: b200 16x16K {lead}" in text
    assert "candidate mechanisms for DOP's lead" in text
    assert all(pm._fmt(r["tokens_per_s"]) in text for r in rows)     # each row's tokens/s as the table shows it
    assert [pm._fmt(v) for v in ("dop", 3, float("inf"), 1234.4, 0.01234)] == ["dop", "3", "inf", "1,234", "0.0123"]
