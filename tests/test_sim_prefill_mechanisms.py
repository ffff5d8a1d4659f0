"""The computation of the candidate mechanisms for DOP's lead (splash/sim/prefill_mechanisms.py): each from the
model's and hardware's bytes and FLOPs. What they predict at the paper's positions is in docs/benchmarks.md."""
import pytest

from splash.costmodel import load_profile
from splash.costmodel.work import Piece, Shapes, layer_work
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
    a2a = sum(T * e[1] for e in layer_work(s, "dop", pieces, 0, moe=True)["exchange"].exch if e[0] == "all_to_all")
    ar = sum(e[1] for e in layer_work(s, "dop", pieces, 0, moe=True)["exchange"].exch if e[0] == "all_reduce")
    assert (a2a + ar) / N == pytest.approx(pm.exchange_bytes_per_row(cfg, "dop"))
    gather = layer_work(s, "dp_attn", pieces, 0, moe=True)["exchange"].exch
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


def test_mechanisms_cli_names_an_unknown_hardware(capsys):
    from splash.sim.cli import main
    assert main(["mechanisms", "--only", "b200,a100"]) == 2
    assert "unknown hardware a100" in capsys.readouterr().out


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
