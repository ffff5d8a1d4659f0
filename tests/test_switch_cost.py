"""Switch primitives priced from bytes and the link (per-primitive efficiencies fitted on B200 only), the logical
KV volume behind the paper's flat KV costs, the pipelined live switch, and where each profile number comes from."""
import dataclasses

import pytest

from splash.costmodel.profile import load_profile, profile_from_dict
from splash.costmodel.step_cost import CostModel
from splash.costmodel.switch_cost import live_exposed_seconds
from splash.models.config import ConfigError
from splash.sim.paper_data import FIGURES
from splash.sim.presets import load_sim_model
from splash.switching.manifest import ReqState, plan_switch

KV_DIRECTIONS = [("dp_attn", "tp"), ("cp", "tp"), ("dop", "tp"), ("cp", "dp_attn"), ("dp_attn", "cp"),
                 ("cp", "dop"), ("dop", "cp")]
GPU = ("b200", "h200", "bw1000")


def _kv_layer_ms(profile, batch=16, tokens=32_000):
    m = load_sim_model("glm-5.3")
    cm = CostModel(m.cfg, 8, profile, m.weight_dtype, m.kv_dtype, 64)
    reqs = {f"r{i}": ReqState(tokens, i % 8) for i in range(batch)}
    return {d: cm.switch(plan_switch(*d, m.cfg, 8, reqs, 64, 1, m.kv_dtype), "blocking").kv_layer_seconds * 1e3
            for d in KV_DIRECTIONS}


def test_logical_kv_volume_gives_the_papers_flat_kv_costs():
    """The paper's seven B200 KV directions lie within 1.10x of each other; priced by the bytes each rank
    receives they would spread > 4x (an all-gather into TP receives 7/8 of the layer, CP<->DOP 1/8 of that);
    priced at the layer's logical volume they are one cost."""
    by = {f.key: f.paper for f in FIGURES}
    assert by["b200.prim.kv.max"] / by["b200.prim.kv.min"] < 1.10
    b200 = load_profile("b200")
    logical = _kv_layer_ms(b200)
    received = _kv_layer_ms(dataclasses.replace(b200, switch_kv_volume="received"))
    assert max(logical.values()) / min(logical.values()) < 1.01
    assert max(received.values()) / min(received.values()) > 4.0
    # a KV cost follows B·s (H200's "linear Bs context trend"): twice the batch, twice the per-layer cost
    twice = _kv_layer_ms(b200, batch=32)
    alpha = b200.collective("all_to_all").alpha_s * 1e3
    assert twice[("dop", "cp")] - alpha == pytest.approx(2 * (logical[("dop", "cp")] - alpha), rel=1e-3)


def test_profiles_carry_the_b200_fit_unchanged():
    """b200.yaml's fitted numbers are what splash/sim/fit.py computes from the paper's B200 figures, and the
    held-out profiles carry the very same numbers (only their spec-sheet rates differ)."""
    from splash.sim.fit import blocking_factor, live_switch, switch_efficiencies
    b200 = load_profile("b200")
    fit = {**switch_efficiencies(b200), **live_switch(b200), **blocking_factor(b200)}
    for k, v in fit.items():
        assert getattr(b200, k) == pytest.approx(v, rel=0.01), k
    for hw in ("h200", "bw1000"):
        p = load_profile(hw)
        for k in (*fit, "switch_kv_volume", "switch_overlap", "switch_contention_on"):
            assert getattr(p, k) == getattr(b200, k), (hw, k)
        assert p.link_bytes_per_s != b200.link_bytes_per_s


HELD_OUT_SOURCES = ("H200", "DCU", "BW1000", "App. H", "App. I", "Table 8")


def _numbers(raw) -> list[str]:
    """Every number a profile file sets: its keys but name, source and provenance (zeros included: a 0 says "not
    modelled", itself a choice), and each key of ``extra`` as ``extra.<key>``."""
    keys = [k for k in raw if k not in ("name", "source", "provenance", "extra")]
    return keys + [f"extra.{k}" for k in raw.get("extra") or {}]


def test_every_shipped_profile_number_says_where_it_comes_from():
    """Every number a shipped profile file sets has a provenance entry (spec / fitted / measured / assumed). On the
    GPU profiles every fitted one names a B200 figure and no held-out one, and a held-out profile carries B200's
    value of it; the cpu profile's are what `splash-bench calibrate` writes (splash/bench/calib_provenance.py)."""
    from splash.bench.calib_provenance import calibrated_provenance
    from splash.config.yaml_loader import read_yaml_mapping
    from splash.costmodel.profile import hardware_dir, profile_names
    b200 = load_profile("b200")
    assert set(GPU) | {"cpu"} <= set(profile_names())
    for hw in profile_names():
        raw = read_yaml_mapping(hardware_dir() / f"{hw}.yaml")
        missing = [k for k in _numbers(raw) if k not in (raw.get("provenance") or {})]
        assert not missing, (hw, missing)
        p = load_profile(hw)
        if hw not in GPU:
            continue
        for k, v in p.provenance.items():
            if v.startswith("fitted"):
                assert "paper" in v and "B200" in v, (hw, k, v)
                assert not any(h in v for h in HELD_OUT_SOURCES), (hw, k, v)
                assert getattr(p, k) == getattr(b200, k), (hw, k)
    cpu = read_yaml_mapping(hardware_dir() / "cpu.yaml")
    assert load_profile("cpu").provenance == calibrated_provenance(cpu)
    assert load_profile("cpu").switch_overlap == "budget" and load_profile("cpu").link_bytes_per_s == 0


def test_gpu_collectives_are_the_link_rate_through_the_ring_factors():
    """A GPU profile's in-step collectives are its one-direction link rate (spec sheet; the DCU's assumed) at one
    share every GPU profile carries (80%, assumed, fitted on no figure) through the ring factors at its group size:
    all-gather and all-to-all put (T-1)/T of their counted bytes on a link, all-reduce 2(T-1)/T, broadcast all of
    them. No hardware's collectives carry a rate of their own; a decode instance over two nodes scales them by the
    NIC (tests/test_sim_deploy.py::test_decode_instance_over_two_nodes_pays_the_inter_node_link)."""
    for hw in GPU:
        p = load_profile(hw)
        T, bus = p.extra["world"], 0.8 * p.link_bytes_per_s
        want = {"all_gather": bus * T / (T - 1), "all_to_all": bus * T / (T - 1),
                "all_reduce": bus * T / (2 * (T - 1)), "broadcast": bus}
        for k, v in want.items():
            assert p.collective(k).bytes_per_s == pytest.approx(v, rel=3e-3), (hw, k)


def test_provenance_may_name_a_number_of_extra():
    base = {"name": "x", "source": "y", "gemm_flops_per_s": {"bfloat16": 1e12}, "memory_bytes_per_s": 1e11,
            "attention_flops_per_s": 1e12, "kv_read_bytes_per_s": 1e11, "extra": {"world": 8},
            "collectives": {k: {"alpha_s": 0, "bytes_per_s": 1e9}
                            for k in ("all_reduce", "all_gather", "all_to_all", "broadcast")}}
    assert profile_from_dict({**base, "provenance": {"extra.world": "spec: 8 a node"}}).provenance
    with pytest.raises(ConfigError, match="extra.nope"):
        profile_from_dict({**base, "provenance": {"extra.nope": "spec: x"}})


def test_pipelined_live_switch():
    p = dataclasses.replace(load_profile("b200"), switch_handoff_s=1e-4, switch_contention=0.5,
                            switch_contention_on="link")
    assert live_exposed_seconds(p, 0.0, 78, 1.0) == pytest.approx(1e-4)            # a discard: the handoff
    t, L = 1e-3, 10
    # the step's layers (2 ms) hide every later layer; the hidden part delays its collectives (20% of it)
    assert live_exposed_seconds(p, t, L, 2e-3 * L, 0.2) == pytest.approx(1e-4 + t + (L - 1) * 0.5 * t * 0.2)
    # a short step (0.4 ms a layer) exposes the rest of each layer's transfer
    short = live_exposed_seconds(p, t, L, 4e-4 * L, 0.0)
    assert short == pytest.approx(1e-4 + t + (L - 1) * (t - 4e-4))
    # memory: the hidden share of the layer's bytes crosses HBM while the step computes, whatever its collectives
    mem = dataclasses.replace(p, switch_contention_on="memory", memory_bytes_per_s=1e12)
    nbytes = 4e8                                                                   # 0.4 ms at the HBM rate
    assert live_exposed_seconds(mem, t, L, 2e-3 * L, 0.2, nbytes) == pytest.approx(1e-4 + t + (L - 1) * 0.5 * 4e-4)
    assert live_exposed_seconds(mem, t, L, 2e-3 * L, 0.9, nbytes) == live_exposed_seconds(mem, t, L, 5e-3 * L, 0.0,
                                                                                           nbytes)
    # half the transfer hidden (0.5 ms a layer of compute): half its bytes slow the step, the rest is exposed
    assert live_exposed_seconds(mem, t, L, 5e-4 * L, 0.0, nbytes) == pytest.approx(
        1e-4 + t + (L - 1) * (t - 5e-4 + 0.5 * 0.5 * 4e-4))
    budget = dataclasses.replace(p, switch_overlap="budget", overlap_fraction=0.3)
    assert live_exposed_seconds(budget, t, L, 2e-3 * L) == pytest.approx(t + (L - 1) * (t - 0.3 * 2e-3))


def test_a_blocking_switch_pays_its_factor_on_the_primitives():
    """blocking = switch_blocking_factor x the per-layer primitives back to back; the live price does not use it."""
    m = load_sim_model("glm-5.3")
    reqs = {f"r{i}": ReqState(32_000, i % 8) for i in range(16)}
    man = plan_switch("dop", "cp", m.cfg, 8, reqs, 64, 1, m.kv_dtype)
    b200 = load_profile("b200")
    cms = {k: CostModel(m.cfg, 8, dataclasses.replace(b200, switch_blocking_factor=k), m.weight_dtype, m.kv_dtype,
                        64) for k in (1.0, 2.5)}
    one, more = (cms[k].switch(man, "blocking") for k in (1.0, 2.5))
    assert one.exposed_seconds == pytest.approx(one.seconds)
    assert one.seconds == pytest.approx(78 * one.per_layer_seconds)
    assert more.exposed_seconds == pytest.approx(2.5 * one.exposed_seconds)
    assert cms[2.5].switch(man, "live", 0.5).exposed_seconds == cms[1.0].switch(man, "live", 0.5).exposed_seconds
    assert load_profile("cpu").switch_blocking_factor == 1.0


def test_switch_profile_fields_are_validated():
    base = {"name": "x", "source": "y", "gemm_flops_per_s": {"bfloat16": 1e12}, "memory_bytes_per_s": 1e11,
            "attention_flops_per_s": 1e12, "kv_read_bytes_per_s": 1e11,
            "collectives": {k: {"alpha_s": 0, "bytes_per_s": 1e9}
                            for k in ("all_reduce", "all_gather", "all_to_all", "broadcast")}}
    assert profile_from_dict({**base, "provenance": {"memory_bytes_per_s": "spec: sheet"}}).provenance
    with pytest.raises(ConfigError, match="switch_kv_volume"):
        profile_from_dict({**base, "switch_kv_volume": "bytes"})
    with pytest.raises(ConfigError, match="link_bytes_per_s"):
        profile_from_dict({**base, "switch_kv_efficiency": 0.8})
    with pytest.raises(ConfigError, match="switch_contention_on"):
        profile_from_dict({**base, "switch_contention_on": "hbm"})
    with pytest.raises(ConfigError, match="switch_blocking_factor"):
        profile_from_dict({**base, "switch_blocking_factor": 0})
    with pytest.raises(ConfigError, match="provenance.memory_bytes_per_s"):
        profile_from_dict({**base, "provenance": {"memory_bytes_per_s": "guess"}})
    with pytest.raises(ConfigError, match="nope"):
        profile_from_dict({**base, "provenance": {"nope": "spec: x"}})
