"""Cost model: profiles, stage-wise step predictions, switch cost. Pure (no torch)."""
import dataclasses
import re

import pytest

from splash.costmodel import CostModel, RowLoad, load_profile, profile_from_dict
from splash.costmodel.op_counts import ops
from splash.costmodel.work import cp_keys_here, expected_active_experts
from splash.layouts.layout import Layout
from splash.models.config import ConfigError, model_config_from_dict
from splash.switching.manifest import ReqState, plan_switch

SMALL = dict(model_type="deepseek_v3", vocab_size=320, hidden_size=512, intermediate_size=1024,
             moe_intermediate_size=256, num_hidden_layers=4, num_attention_heads=16, q_lora_rank=384,
             kv_lora_rank=256, qk_rope_head_dim=32, qk_nope_head_dim=64, v_head_dim=64, n_routed_experts=8,
             n_shared_experts=1, num_experts_per_tok=2, n_group=2, topk_group=1, first_k_dense_replace=1)
LAYOUTS = ("tp", "dp_attn", "cp", "dop")


@pytest.fixture
def cfg():
    return model_config_from_dict(SMALL)


@pytest.fixture
def cpu():
    return load_profile("cpu")


def test_shipped_profiles_load():
    for name in ("cpu", "b200", "h200", "bw1000"):
        p = load_profile(name)
        assert p.name == name and p.source
        assert set(p.collectives) == {"all_reduce", "all_gather", "all_to_all", "broadcast"}
    assert load_profile("b200").memory_bytes == 1.915e11  # 178.35 GiB, what a B200 reports (b200.yaml)


def test_profile_errors_name_the_key(tmp_path, cpu):
    raw = cpu.to_dict()
    with pytest.raises(ConfigError, match="'bogus'"):
        profile_from_dict({**raw, "bogus": 1})
    bad = dict(raw, collectives={k: v for k, v in raw["collectives"].items() if k != "broadcast"})
    with pytest.raises(ConfigError, match="broadcast"):
        profile_from_dict(bad)
    with pytest.raises(ConfigError, match="overlap_fraction"):
        profile_from_dict({**raw, "overlap_fraction": 2.0})
    with pytest.raises(ConfigError, match="device_arch' = 'hopper'"):
        profile_from_dict({**raw, "device_arch": "hopper"})
    assert profile_from_dict({**raw, "device_arch": "sm_90"}).device_arch == "sm_90"
    for changes, message in (
            ({"memory_bytes_per_s": "fast"}, "field 'memory_bytes_per_s' must be a number, got 'fast'"),
            ({"memory_bytes_per_s": True}, "field 'memory_bytes_per_s' must be a number, got True"),
            ({"collectives": [1]}, "field 'collectives' must be a mapping, got list"),
            ({"gemm_flops_per_s": {"int8": 1e12}}, "gemm_flops_per_s needs at least float32 or bfloat16"),
            ({"collectives": {**raw["collectives"], "broadcast": {"alpha_s": 1e-5}}},
             "collectives.broadcast needs alpha_s and bytes_per_s"),
            ({"switch_kv_efficiency": 1.5}, "field 'switch_kv_efficiency' must be <= 1, got 1.5")):
        with pytest.raises(ConfigError, match=re.escape(f"p.yaml: {message}")):
            profile_from_dict({**raw, **changes}, "p.yaml")
    with pytest.raises(ConfigError, match="p.yaml: required field 'source' is missing"):
        profile_from_dict({k: v for k, v in raw.items() if k != "source"}, "p.yaml")
    assert profile_from_dict({**raw, "memory_bytes_per_s": "1.5e11"}).memory_bytes_per_s == 1.5e11  # YAML 1.1
    with pytest.raises(ValueError, match="has no GEMM rate for 'int8' \\(has: float32"):
        cpu.gemm_rate("int8")
    with pytest.raises(ConfigError, match="unknown hardware profile 'nope'"):
        load_profile("nope")
    import yaml
    f = tmp_path / "p.yaml"
    f.write_text(yaml.safe_dump({**raw, "name": "mine"}))
    assert load_profile(str(f)).name == "mine"


def test_cp_placement_counts_match_ownership():
    from splash.layouts.ownership import kv_holders
    for end, anchor, world, bs in [(1, 0, 2, 16), (100, 1, 2, 16), (4097, 3, 4, 16), (64, 2, 4, 64)]:
        nb = -(-end // bs)
        holders = kv_holders("cp", nb, anchor, world)
        for r in range(world):
            keys, blocks = cp_keys_here(end, anchor, r, world, bs)
            assert blocks == sum(1 for h in holders if r in h)
            assert keys == sum(min(bs, end - b * bs) for b, h in enumerate(holders) if r in h)
        assert sum(cp_keys_here(end, anchor, r, world, bs)[0] for r in range(world)) == end
    # a chunk's new positions [10, 50) are written on their blocks' home ranks, once each
    assert sum(cp_keys_here(50, 1, r, 4, 16)[0] - cp_keys_here(10, 1, r, 4, 16)[0] for r in range(4)) == 40


def test_prediction_shape_and_stages(cfg, cpu):
    cm = CostModel(cfg, 2, cpu, "float32", "float32", 16)
    rows = [RowLoad(1, 1000, i % 2) for i in range(8)]
    for lay in LAYOUTS:
        p = cm.step(lay, rows)
        assert p.layout == lay and p.seconds > 0 and len(p.per_rank) == 2
        assert p.seconds == max(p.per_rank)
        for st in ("qkv_a", "q_b_absorb", "attention", "uv_o", "exchange", "ffn", "ffn_all_reduce", "lm_head"):
            assert st in p.stages
        assert sum(p.stages.values()) == pytest.approx(p.seconds)
        assert p.work["attention"]["kv_bytes"] > 0
    assert cm.step("tp", rows).work["exchange"]["collectives"] == 4  # one all-reduce per layer
    assert cm.step("dop", rows).work["exchange"]["collectives"] == 12  # two all-to-all + all-reduce per layer


def test_tp_reads_every_history_on_every_rank(cfg, cpu):
    cm = CostModel(cfg, 2, cpu, "float32", "float32", 16)
    rows = [RowLoad(1, 4096, i % 2) for i in range(16)]
    tp, dop, dp = (cm.step(x, rows).work["attention"]["kv_bytes"] for x in ("tp", "dop", "dp_attn"))
    assert tp == pytest.approx(2 * dop) and dop == dp
    # long histories, many requests: request-owned layouts beat TP, as measured (docs/benchmarks.md)
    assert cm.step("dop", rows).seconds < cm.step("tp", rows).seconds


def test_owner_imbalance_sets_the_step(cfg, cpu):
    cm = CostModel(cfg, 2, cpu, "float32", "float32", 16)
    balanced = [RowLoad(1, 2048, i % 2) for i in range(8)]
    skewed = [RowLoad(1, 2048, 0) for _ in range(8)]
    for lay in ("dp_attn", "dop"):
        b, s = cm.step(lay, balanced), cm.step(lay, skewed)
        assert s.seconds > b.seconds and s.per_rank[0] > s.per_rank[1]
    auto = cm.step("dop", [RowLoad(1, 2048) for _ in range(8)])
    assert auto.seconds == pytest.approx(cm.step("dop", balanced).seconds)


def test_more_work_costs_more(cfg, cpu):
    cm = CostModel(cfg, 2, cpu, "float32", "float32", 16)
    for lay in LAYOUTS:
        short = cm.step(lay, [RowLoad(1, 256, i % 2) for i in range(4)]).seconds
        longer = cm.step(lay, [RowLoad(1, 4096, i % 2) for i in range(4)]).seconds
        wider = cm.step(lay, [RowLoad(1, 256, i % 2) for i in range(16)]).seconds
        prefill = cm.step(lay, [RowLoad(512, 0, 0)]).seconds
        assert longer > short and wider > short and prefill > short


def test_heads_must_divide(cfg, cpu):
    cm = CostModel(cfg, 3, cpu, "float32", "float32", 16)
    with pytest.raises(ValueError, match="divide"):
        cm.step("tp", [RowLoad(1, 10, 0)])
    assert set(cm.predict([RowLoad(1, 10, 0)])) == {"dp_attn", "cp"}


def test_overlap_budget_caps_hiding(cfg, cpu):
    rows = [RowLoad(1, 2048, i % 2) for i in range(8)]
    none = CostModel(cfg, 2, cpu, "float32", "float32", 16).step("dop", rows)
    full = CostModel(cfg, 2, dataclasses.replace(cpu, overlap_fraction=1.0), "float32", "float32", 16).step("dop", rows)
    exch = none.stages["exchange"] + none.stages["ffn_all_reduce"]
    hidden = none.seconds - full.seconds
    assert 0 < hidden <= min(exch, none.stages["attention"]) + 1e-12
    assert full.stages["overlap"] == pytest.approx(-hidden)


def test_expected_active_experts():
    assert expected_active_experts(8, 2, 0) == 0
    assert expected_active_experts(8, 2, 1) == pytest.approx(2)
    assert 7.9 < expected_active_experts(8, 2, 64) <= 8


def _manifest(cfg, src, dst):
    reqs = {f"r{i}": ReqState(1024, i % 2) for i in range(8)}
    return plan_switch(src, dst, cfg, 2, reqs, 16, 4, "float32")


def test_switch_cost(cfg, cpu):
    cm = CostModel(cfg, 2, cpu, "float32", "float32", 16)
    free = cm.switch(_manifest(cfg, "tp", "dop"), "live")
    assert free.seconds == 0 and free.exposed_seconds == 0
    moved = _manifest(cfg, "dop", "tp")
    b, live = cm.switch(moved, "blocking"), cm.switch(moved, "live", step_seconds=0.05)
    assert b.seconds > 0 and b.exposed_seconds == b.seconds
    assert live.exposed_seconds == pytest.approx(b.seconds)  # cpu: overlap_fraction 0 hides nothing
    overlapped = CostModel(cfg, 2, dataclasses.replace(cpu, overlap_fraction=1.0), "float32", "float32", 16)
    lv = overlapped.switch(moved, "live", step_seconds=1e3)
    assert lv.exposed_seconds == pytest.approx(lv.per_layer_seconds)  # only layer 0 waits
    with pytest.raises(ValueError, match="mode"):
        cm.switch(moved, "drain")


def test_cp_split_prefill_exchanges_the_history_not_the_partials(cfg):
    """cp_prefill="split": a prefill chunk's rows are split over the ranks and the history all-gathered, so CP's
    exchange scales with the context, not with rows × heads; the attention work is TP's, spread by rows; decode
    steps are the same in both modes; an unknown mode is an error."""
    prof = load_profile("b200")
    part, split = (CostModel(cfg, 4, prof, "bfloat16", "bfloat16", 16, cp_prefill=m) for m in ("partials", "split"))
    rows = [RowLoad(4096, 8192, 0, samples=False)]
    a, b = part.step("cp", rows), split.step("cp", rows)
    s = split._shapes["cp"]
    L = cfg.num_hidden_layers
    hist = (8192 + 4096) * (s.kv_tok + s.idx_tok) * L
    assert b.work["exchange"]["exch_bytes"] == pytest.approx(hist + 4096 * cfg.hidden_size * 2 * L)
    assert a.work["exchange"]["exch_bytes"] > 10 * b.work["exchange"]["exch_bytes"]
    assert b.seconds < a.seconds
    # every rank does a quarter of the rows for all heads: TP's per-rank attention FLOPs (a quarter of the heads)
    tp = split.step("tp", rows)
    assert b.work["attention"]["attn_flops"] == pytest.approx(tp.work["attention"]["attn_flops"])
    dec = [RowLoad(1, 5000, i % 4) for i in range(8)]
    assert part.step("cp", dec).seconds == split.step("cp", dec).seconds
    with pytest.raises(ValueError, match="cp_prefill"):
        CostModel(cfg, 4, prof, "bfloat16", "bfloat16", 16, cp_prefill="ring")


def _bare(cpu, **kw):
    """The cpu profile without the split-KV, row-kernel, row-rate and per-layout terms (what a profile lacking them
    means)."""
    raw = dict(cpu.to_dict(), attention_merge_bytes_per_s=0.0, attention_cache_bytes=0.0,
               attention_spill_bytes_per_s=0.0, gemm_rows_flops_per_s={}, step_overhead_layout_s={},
               collective_sync_s=0.0, attention_row_kernel=False)
    return profile_from_dict({**raw, **kw})


def test_kernel_structure_terms_default_off(cfg, cpu):
    """Profiles without the new keys predict as before; each key only adds its own term."""
    bare = _bare(cpu)
    rows = [RowLoad(512, 1536, 0)]   # a prefill chunk whose all-head attention runs in several chunks
    base = CostModel(cfg, 2, bare, "float32", "float32").step("dp_attn", rows)
    merged = CostModel(cfg, 2, _bare(cpu, attention_merge_bytes_per_s=1e9), "float32", "float32").step("dp_attn", rows)
    assert merged.stages["attention"] > base.stages["attention"]
    for k in base.stages:   # nothing else moves
        if k != "attention":
            assert merged.stages[k] == pytest.approx(base.stages[k])
    # one decode row over a short history runs in one chunk: no merge to pay
    short = [RowLoad(1, 64, 0)]
    assert (CostModel(cfg, 2, _bare(cpu, attention_merge_bytes_per_s=1e9), "float32", "float32")
            .step("dp_attn", short).seconds == pytest.approx(CostModel(cfg, 2, bare, "float32", "float32")
                                                             .step("dp_attn", short).seconds))


def test_spill_only_beyond_the_cache_share(cfg, cpu):
    big = [RowLoad(1, 2048, i % 2) for i in range(16)]
    small = [RowLoad(1, 64, i % 2) for i in range(2)]
    kw = dict(attention_cache_bytes=float(4 << 20), attention_spill_bytes_per_s=1e9)
    for rows, grows in ((big, True), (small, False)):
        a = CostModel(cfg, 2, _bare(cpu), "float32", "float32").step("dp_attn", rows).seconds
        b = CostModel(cfg, 2, _bare(cpu, **kw), "float32", "float32").step("dp_attn", rows).seconds
        assert (b > a) if grows else b == pytest.approx(a)


def test_gemm_rate_by_rows(cfg, cpu):
    p = _bare(cpu, gemm_rows_flops_per_s={"float32": {1: 1e9, 100: 1e11}})
    assert p.gemm_rate_at("float32", 1) == 1e9 and p.gemm_rate_at("float32", 1000) == 1e11
    assert p.gemm_rate_at("float32", 10) == pytest.approx(1e10)          # log-linear in rows
    assert p.gemm_rate_at("bfloat16", 10) == p.gemm_rate("bfloat16")     # no table: the flat rate
    slow = CostModel(cfg, 2, p, "float32", "float32").step("tp", [RowLoad(1, 64, 0)])
    flat = CostModel(cfg, 2, _bare(cpu), "float32", "float32").step("tp", [RowLoad(1, 64, 0)])
    assert slow.stages["q_b_absorb"] >= flat.stages["q_b_absorb"]
    with pytest.raises(ConfigError, match="row count"):
        _bare(cpu, gemm_rows_flops_per_s={"float32": {0: 1e9}})


def test_layout_step_overhead(cfg, cpu):
    rows = [RowLoad(1, 64, 0)]
    a = CostModel(cfg, 2, _bare(cpu), "float32", "float32").step("dop", rows).seconds
    b = CostModel(cfg, 2, _bare(cpu, step_overhead_layout_s={"dop": 0.01}), "float32", "float32")
    assert b.step("dop", rows).seconds == pytest.approx(a + 0.01)
    assert b.step("tp", rows).seconds == pytest.approx(CostModel(cfg, 2, _bare(cpu), "float32", "float32")
                                                       .step("tp", rows).seconds)
    with pytest.raises(ConfigError, match="'pp'"):
        _bare(cpu, step_overhead_layout_s={"pp": 0.1})


def test_collective_sync_per_collective(cfg, cpu):
    """collective_sync_s adds its wait once per collective of the step (DOP's all-to-alls included), nothing else."""
    rows = [RowLoad(1, 256, i % 2) for i in range(4)]
    for lay in ("tp", "dop"):
        a = CostModel(cfg, 2, _bare(cpu), "float32", "float32").step(lay, rows)
        b = CostModel(cfg, 2, _bare(cpu, collective_sync_s=1e-3), "float32", "float32").step(lay, rows)
        n = sum(w["collectives"] for w in a.work.values())
        assert n > 0 and b.seconds == pytest.approx(a.seconds + n * 1e-3)


def test_large_collective_first_touches_its_result(cfg, cpu):
    """A collective whose result is a fresh allocation (>= alloc_threshold_bytes) also pays first-touching it,
    in steps and in switches; smaller ones, and profiles without an allocation rate, do not."""
    p = _bare(cpu, alloc_threshold_bytes=32e6, alloc_bytes_per_s=2e9)
    base = p.collective("all_gather")
    assert p.collective_seconds("all_gather", 4e6) == base.seconds(4e6)
    assert p.collective_seconds("all_gather", 64e6) == pytest.approx(base.seconds(64e6) + 64e6 / 2e9)
    assert _bare(cpu, alloc_bytes_per_s=0.0).collective_seconds("all_gather", 64e6) == base.seconds(64e6)
    moved = _manifest(cfg, "dop", "tp")
    small, big = (CostModel(cfg, 2, _bare(cpu, alloc_threshold_bytes=t, alloc_bytes_per_s=2e9), "float32", "float32",
                            16).switch(moved, "blocking") for t in (1e12, 1.0))
    assert big.seconds > small.seconds


def test_collective_wait_once_per_step(cfg, cpu):
    """collective_wait_fraction charges the wait for the slower peer once per step, as a share of the time outside
    collectives: DOP's extra all-to-alls do not multiply it (collective_sync_s would); one rank waits for nobody."""
    rows = [RowLoad(1, 256, i % 2) for i in range(4)]
    free = dataclasses.replace(_bare(cpu), collectives={k: dataclasses.replace(c, alpha_s=0.0, bytes_per_s=1e30)
                                                        for k, c in cpu.collectives.items()})
    for lay in ("dp_attn", "dop"):
        a = CostModel(cfg, 2, _bare(cpu), "float32", "float32").step(lay, rows)
        b = CostModel(cfg, 2, _bare(cpu, collective_wait_fraction=0.1), "float32", "float32").step(lay, rows)
        outside = CostModel(cfg, 2, free, "float32", "float32").step(lay, rows).seconds
        assert b.stages["sync"] == pytest.approx(0.1 * outside, rel=1e-6)
        assert b.seconds == pytest.approx(a.seconds + 0.1 * outside, rel=1e-6)
    one = [RowLoad(1, 256, 0)]
    assert (CostModel(cfg, 1, _bare(cpu, collective_wait_fraction=0.1), "float32", "float32").step("tp", one).seconds
            == pytest.approx(CostModel(cfg, 1, _bare(cpu), "float32", "float32").step("tp", one).seconds))
    with pytest.raises(ConfigError, match="collective_wait_fraction"):
        _bare(cpu, collective_wait_fraction=-0.1)


def test_in_step_split_of_collectives():
    """calibrate --in-step-collectives: a collective's own time is its time on the last rank to arrive,
    the slowest rank's excess over that is its wait for the peer (pure: no MPI, no torch)."""
    from splash.bench.calib_sync import split_wait
    early = {"total": 10.0, "seq": [3.0, 0.5, 2.0]}   # arrived first at every collective: waited
    late = {"total": 9.0, "seq": [1.0, 0.5, 0.25]}
    got = split_wait([early, late])
    assert got["own"] == pytest.approx(1.75) and got["count"] == 3
    assert got["wait"] == pytest.approx(5.5 - 1.75) and got["outside"] == pytest.approx(10.0 - 5.5)
    assert split_wait([late, early])["total"] == 10.0


def test_attention_refit_drops_uninformative_step_points():
    """calibrate's attention refit: an in-step point whose residual is not positive, or a sliver of its step,
    must not decide the 1/seconds-weighted fit; a fit that still fails keeps the isolated calls' rates."""
    from splash.bench.calib_attention import refit_attention
    bw, rate = 2e10, 5e10
    iso = [[kv, fl, 0.0, 0.0, kv / bw + fl / rate] for kv, fl in ((1e6, 8e6), (4e6, 6e7), (2e7, 1e8), (8e7, 9e8))]
    step = [[4e6, 5e7, 0.0, 0.0, 4e6 / bw + 5e7 / rate, 0.02]]
    raw = {"kv_read_bytes_per_s": 1.0, "attention_flops_per_s": 1.0, "extra": {}}
    bad = [[3e6, 4e7, 0.0, 0.0, -1e-4, 0.02], [3e6, 4e7, 0.0, 0.0, 1e-5, 0.02]]  # negative; 0.05% of its step
    got = refit_attention(raw, iso + step + bad)
    assert got["kv_read_bytes_per_s"] == pytest.approx(bw, rel=1e-3)
    assert got["attention_flops_per_s"] == pytest.approx(rate, rel=1e-3)
    assert got["extra"]["attention_fit_dropped"] == 2
    noise = [[kv, fl, 0.0, 0.0, t, 1.0] for kv, fl, t in ((1e6, 1e9, 0.9), (1e9, 1e6, 0.05), (5e8, 5e8, 0.9))]
    kept = refit_attention(raw, [[1e6, 1e9, 0.0, 0.0, 0.04]] + noise)
    assert kept["kv_read_bytes_per_s"] == 1.0 and "not used" in kept["extra"]["attention_refit"]


def test_prefill_attention_factor_scales_prefill_pieces_only(cfg, cpu):
    """A layout's measured prefill-attention factor scales the attention of its prefill chunks, not decode rows'
    and not the other layouts'; a factor that is not positive is an error naming the key."""
    plain = dataclasses.replace(cpu, prefill_attention_factor={})
    two = dataclasses.replace(cpu, prefill_attention_factor={"cp": 2.0})
    a, b = (CostModel(cfg, 2, p, "float32", "float32", 16) for p in (plain, two))
    pre, dec = [RowLoad(512, 0, 0)], [RowLoad(1, 1024, i % 2) for i in range(8)]
    assert b.step("cp", pre).stages["attention"] > 1.5 * a.step("cp", pre).stages["attention"]
    assert b.step("cp", dec).stages["attention"] == a.step("cp", dec).stages["attention"]
    assert b.step("tp", pre).stages["attention"] == a.step("tp", pre).stages["attention"]
    with pytest.raises(ConfigError, match="prefill_attention_factor.cp"):
        profile_from_dict({**cpu.to_dict(), "prefill_attention_factor": {"cp": 0}})


def test_row_kernel_counts_each_rows_own_keys(cfg, cpu):
    """attention_row_kernel (SPLASH's CPU kernel): decode rows are not padded to the longest history, a fresh
    prefill chunk's rows see a causal triangle, and the step makes one attention call a layer."""
    rows = profile_from_dict({**cpu.to_dict(), "attention_row_kernel": True})
    chunked = profile_from_dict({**cpu.to_dict(), "attention_row_kernel": False})
    a, b = (CostModel(cfg, 1, p, "float32", "float32", 16) for p in (rows, chunked))
    per_key = 2.0 * (2 * cfg.kv_lora_rank + cfg.qk_rope_head_dim) * cfg.num_attention_heads * cfg.num_hidden_layers
    ragged = [RowLoad(1, 15, 0), RowLoad(1, 1023, 0)]
    got = a.step("tp", ragged).work["attention"]["attn_flops"]
    assert got == pytest.approx((16 + 1024) * per_key)
    assert b.step("tp", ragged).work["attention"]["attn_flops"] == pytest.approx(2 * 1024 * per_key)  # padded
    fresh = [RowLoad(512, 0, 0)]
    assert a.step("tp", fresh).work["attention"]["attn_flops"] == pytest.approx(512 * (512 + 1) / 2 * per_key)
    many = [RowLoad(32, 0, 0) for _ in range(8)]
    assert a.step("tp", many).work["attention"]["ops"] < b.step("tp", many).work["attention"]["ops"]
    with pytest.raises(ConfigError, match="attention_row_kernel"):
        profile_from_dict({**cpu.to_dict(), "attention_row_kernel": "yes"})


def test_row_kernel_cp_chunk_sees_its_own_positions_homed_here(cfg, cpu):
    """CP's rank holds about half of a fresh chunk's positions: its rows see the causal triangle of those (all
    heads), the same FLOPs in total as TP's half of the heads over the whole triangle — not nearly none (the count
    once subtracted the whole chunk's triangle from the keys held here)."""
    rows = profile_from_dict({**cpu.to_dict(), "attention_row_kernel": True})
    m = CostModel(cfg, 2, rows, "float32", "float32", 16)
    for ctx in (0, 1024):
        load = [RowLoad(2048, ctx, 0)]
        tp = m.step("tp", load).work["attention"]["attn_flops"]
        cp = m.step("cp", load).work["attention"]["attn_flops"]
        assert cp == pytest.approx(tp, rel=0.01)


def test_fused_kernels_count_the_fused_paths_ops(cfg, cpu):
    """fused_kernels (SPLASH's fused CPU kernels): the projections, W_UV / O and FFN stages charge the fused path's
    op counts (splash/costmodel/op_counts.py), every layout fewer ops there; the work itself is unchanged."""
    fused, eager = (CostModel(cfg, 2, profile_from_dict({**cpu.to_dict(), "fused_kernels": f}), "float32", "float32")
                    for f in (True, False))
    rows = [RowLoad(1, 256, 0), RowLoad(1, 300, 1)]
    for lay in ("tp", "dp_attn", "cp", "dop"):
        a, b = fused.step(lay, rows), eager.step(lay, rows)
        for st in ("qkv_a", "q_b_absorb", "uv_o", "ffn"):
            assert a.work[st]["ops"] < b.work[st]["ops"], (lay, st)
            assert a.work[st]["gemm_flops"] == b.work[st]["gemm_flops"]
        assert a.work["exchange"]["ops"] == b.work["exchange"]["ops"]
        assert a.seconds < b.seconds


# the op-count table as it was when keyed by layout names: stage -> (eager, fused), each per layout in the order
# tp, dp_attn, cp, dop
NAME_KEYED_OPS = {"qkv_a": ((12, 15, 14, 17), (5, 8, 8, 11)), "q_b_absorb": ((16,) * 4, (0,) * 4),
                  "attention": ((22,) * 4,) * 2, "uv_o": ((7, 7, 7, 9), (4, 4, 4, 6)), "exchange": ((1, 4, 12, 14),) * 2,
                  "ffn_dense": ((6,) * 4, (2,) * 4), "moe_fixed": ((40,) * 4, (14,) * 4),
                  "moe_per_expert": ((2,) * 4, (0,) * 4), "other": ((20,) * 4,) * 2, "indexer": ((12,) * 4,) * 2}


def test_op_counts_per_layout_are_the_name_keyed_tables():
    """The op counts, keyed by Layout rather than by name, are every stage's and layout's old numbers."""
    for stage, (eager, fused) in NAME_KEYED_OPS.items():
        assert [ops(False, stage, lay) for lay in Layout] == list(eager), stage
        assert [ops(True, stage, lay) for lay in Layout] == list(fused), stage


def test_dop_projects_the_indexer_for_its_own_rows_only(cpu):
    """DOP's owner scores and selects for its own requests' rows (splash/attention/dop.py: the indexer takes the
    owner's rows), so its indexer work at balanced owners is DP-attn's; only Q-A and the head-sharded Q-B run on
    every row."""
    cfg = model_config_from_dict({**SMALL, "model_type": "deepseek_v32", "index_n_heads": 4, "index_head_dim": 32,
                                  "index_topk": 64})
    m = CostModel(cfg, 4, cpu, "float32", "float32")
    rows = [RowLoad(32, 200, o) for o in range(4)]
    dop, dp = m.step("dop", rows).work, m.step("dp_attn", rows).work
    assert dop["indexer"]["gemm_flops"] == pytest.approx(dp["indexer"]["gemm_flops"])
    assert dop["indexer"]["attn_flops"] == pytest.approx(dp["indexer"]["attn_flops"])
    assert dop["qkv_a"]["gemm_flops"] > dp["qkv_a"]["gemm_flops"]


def test_ranks_doing_the_same_work_share_one_count_and_a_prediction_is_kept(cfg, cpu, monkeypatch):
    """`step` counts a rank's work once per `rank_key` (TP: once; DP-attn/DOP: once per distinct owned pieces; CP:
    per rank) and keeps its last predictions — the same floats as counting every rank, every time."""
    import random

    from splash.costmodel import step_cost

    cm = CostModel(cfg, 4, cpu, "bfloat16", "bfloat16", block_size=16)
    rng = random.Random(7)
    counted = []
    real = CostModel._rank_stages
    monkeypatch.setattr(CostModel, "_rank_stages", lambda self, lay, pieces, r: counted.append(r) or
                        real(self, lay, pieces, r))
    for lay in LAYOUTS:
        for trial in range(12):
            rows = [RowLoad(rng.choice([1, 1, 40]), rng.randrange(0, 3000), rng.choice([None, 0, 1, 2, 3]),
                            rng.random() < 0.8) for _ in range(rng.choice([1, 3, 9]))]
            counted.clear()
            p = cm.step(lay, rows)
            pieces = cm.pieces(rows)
            every = [real(cm, lay, pieces, r) for r in range(4)]
            assert p.per_rank == tuple(sum(s.values()) for s, _ in every)
            assert p.stages == every[p.per_rank.index(p.seconds)][0] and p.seconds == max(p.per_rank)
            owned = {tuple((q.new, q.context) for q in pieces if q.owner == r) for r in range(4)}
            assert len(counted) == {"tp": 1, "cp": 4}.get(lay, len(owned))
            counted.clear()
            assert cm.step(lay, list(rows)) is p and not counted   # asked again: kept, not counted again
    assert len(cm._memo) == 48
    monkeypatch.setattr(step_cost, "STEP_MEMO", 5)
    cm.step("tp", [RowLoad(1, 10, 0)])
    assert len(cm._memo) == 5
