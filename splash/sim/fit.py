"""The numbers of the GPU profiles that are fitted, and what they are fitted to: the paper's B200 figures only.
Pure, no torch.

``switch_efficiencies``: the share of the B200 link rate (spec sheet) that a switch's per-layer KV collective and
projection all-gather reach, at the geometric middle of the paper's B200 per-layer ranges (§5.4, B = 16 x 256K),
with the manifest planner's bytes; H200 and DCU use these shares unchanged (``tests/test_switch_cost.py``).
``implied_link_rates``: the inverse for held-out hardware, a check rather than a fit: the link rate at which the
B200 shares reproduce that hardware's published primitives. ``paper_blocking_bound``: the largest blocking DOP->CP
time any model pricing a blocking switch as its per-layer primitives back to back can reach from the paper's own
B200 figures, and the live / blocking ratio that leaves. ``live_switch``, ``blocking_factor``: the live handoff and
contention and the blocking factor, fitted on B200's Table 1; ``blocking_candidates``: the forms of blocking cost
that were weighed against the paper's live / blocking band.
"""
from __future__ import annotations

import math

from splash.sim.paper_data import FIGURES

PAPER = {f.key: f.paper for f in FIGURES}


def _paper_range(key: str) -> tuple[float, float]:
    return float(PAPER[f"{key}.min"]), float(PAPER[f"{key}.max"])


def _dop_to_cp(m, batch: int, tokens: int, T: int = 8):
    """The manifest of DOP->CP (which moves both KV and projections) for ``batch`` requests of ``tokens``."""
    from splash.switching.manifest import ReqState, plan_switch
    reqs = {f"r{i}": ReqState(tokens, i % T) for i in range(batch)}
    return plan_switch("dop", "cp", m.cfg, T, reqs, 64, {"float32": 4, "bfloat16": 2}.get(m.weight_dtype, 1),
                       m.kv_dtype)


def _primitive_bytes(model: str, batch: int, tokens: int, T: int = 8) -> tuple[float, float]:
    """(KV, projection) bytes of one layer's switch collectives on the busiest rank, as the profiles price them:
    the KV at (T-1)/T of the layer's logical live KV, the projections as received."""
    from splash.costmodel.switch_cost import logical_kv_bytes_layer
    from splash.sim.presets import load_sim_model
    man = _dop_to_cp(load_sim_model(model), batch, tokens, T)
    return (T - 1) / T * logical_kv_bytes_layer(man), float(max(man.weight_recv_bytes))


def implied_link_rate(seconds: float, nbytes: float, efficiency: float, alpha_s: float) -> float:
    """The one-direction link rate at which ``nbytes`` at ``efficiency`` of it, plus ``alpha_s``, take ``seconds``
    (the inverse of splash.costmodel.switch_cost's per-primitive pricing)."""
    if seconds <= alpha_s:
        raise ValueError(f"{seconds} s is not above the collective's latency {alpha_s} s")
    return nbytes / (efficiency * (seconds - alpha_s))


def implied_link_rates(hardware: str) -> dict[str, tuple[float, float]]:
    """{"kv", "weight"}: the (low, high) link rate that the B200 efficiencies in ``hardware``'s profile would need
    to reproduce its published per-layer primitive range (the range's high end gives the low rate)."""
    from splash.costmodel.profile import load_profile
    from splash.sim.paper_data import SETUPS
    prof = load_profile(SETUPS[hardware].hardware)
    _, _, batch, tokens, _ = next(f.probe for f in FIGURES if f.key == f"{hardware}.prim.kv.min")
    kv, w = _primitive_bytes(SETUPS[hardware].model, batch, tokens)
    out = {}
    for what, nbytes, eff, coll in (("kv", kv, prof.switch_kv_efficiency, "all_to_all"),
                                    ("weight", w, prof.switch_weight_efficiency, "all_gather")):
        lo, hi = _paper_range(f"{hardware}.prim.{what}")
        a = prof.collective(coll).alpha_s
        out[what] = (implied_link_rate(hi * 1e-3, nbytes, eff, a), implied_link_rate(lo * 1e-3, nbytes, eff, a))
    return out


def switch_efficiencies(profile=None, batch: int = 16, tokens: int = 256_000) -> dict[str, float]:
    """{"switch_kv_efficiency", "switch_weight_efficiency"} fitted on B200 (``profile``: b200 by default)."""
    from splash.costmodel.profile import load_profile
    prof = profile or load_profile("b200")
    kv_bytes, w_bytes = _primitive_bytes("glm-5.3", batch, tokens)
    out = {}
    for name, nbytes, key, coll in (("switch_kv_efficiency", kv_bytes, "b200.prim.kv", "all_to_all"),
                                    ("switch_weight_efficiency", w_bytes, "b200.prim.weight", "all_gather")):
        lo, hi = _paper_range(key)
        t = math.sqrt(lo * hi) * 1e-3 - prof.collective(coll).alpha_s
        out[name] = nbytes / (t * prof.link_bytes_per_s)
    return out


def _b200_dop_to_cp(profile, batch: int, tokens: int, chunk: int):
    """(cost model at the B200 efficiencies with no live-switch fit yet, DOP->CP manifest, CP's switch step)."""
    import dataclasses

    from splash.costmodel.step_cost import CostModel
    from splash.sim.presets import load_sim_model
    from splash.sim.switch_table import switch_step_rows
    prof = dataclasses.replace(profile, **switch_efficiencies(profile, batch, tokens), switch_overlap="pipeline",
                               switch_handoff_s=0.0, switch_contention=0.0, switch_blocking_factor=1.0)
    m, T = load_sim_model("glm-5.3"), 8
    cm = CostModel(m.cfg, T, prof, m.weight_dtype, m.kv_dtype, 64, cp_prefill="split")
    return cm, _dop_to_cp(m, batch, tokens, T), cm.step("cp", switch_step_rows("cp", batch, tokens, chunk, T))


def live_switch(profile=None, batch: int = 16, tokens: int = 256_000, chunk: int = 16384,
                on: str | None = None) -> dict[str, float]:
    """{"switch_handoff_s", "switch_contention"} fitted on B200 (Table 1): the handoff is the smallest p50 (a
    discard-only switch moves nothing); the contention coefficient makes DOP->CP's pipelined live cost its p50,
    with the B200 efficiencies (``switch_efficiencies``) in place, for the contention form ``on`` ("link" or
    "memory"; default: the profile's ``switch_contention_on``)."""
    import dataclasses

    from splash.costmodel.profile import load_profile
    from splash.costmodel.switch_cost import contention_seconds, kv_layer_bytes, weight_layer_bytes
    from splash.sim.switch_table import step_link_share
    prof = profile or load_profile("b200")
    on = on or prof.switch_contention_on
    cm, man, pred = _b200_dop_to_cp(dataclasses.replace(prof, switch_contention_on=on), batch, tokens, chunk)
    t = cm.switch(man, "blocking").per_layer_seconds
    nbytes = max(kv_layer_bytes(cm.profile, man, r) + weight_layer_bytes(man, r) for r in range(man.world))
    L = man.num_layers
    handoff = float(PAPER["b200.switch.live.min"]) * 1e-3
    hidden = min(t, pred.seconds / L)
    exposed_no_contention = handoff + t + (L - 1) * (t - hidden)
    target = float(PAPER["b200.switch.dop_cp.live"]) * 1e-3
    unit = contention_seconds(dataclasses.replace(cm.profile, switch_contention=1.0), hidden, t,
                              step_link_share(pred), nbytes)   # the slowdown a layer at coefficient 1
    kappa = max(0.0, target - exposed_no_contention) / ((L - 1) * unit) if unit else 0.0
    return {"switch_handoff_s": handoff, "switch_contention": kappa}


def blocking_factor(profile=None, batch: int = 16, tokens: int = 256_000) -> dict[str, float]:
    """{"switch_blocking_factor"} fitted on B200 (Table 1): the paper's DOP->CP blocking time over the sim's
    DOP->CP primitives back to back (B200 efficiencies)."""
    from splash.costmodel.profile import load_profile
    cm, man, _ = _b200_dop_to_cp(profile or load_profile("b200"), batch, tokens, 16384)
    back_to_back = cm.switch(man, "blocking").seconds
    return {"switch_blocking_factor": float(PAPER["b200.switch.dop_cp.blocking"]) * 1e-3 / back_to_back}


def blocking_candidates(rows: list[dict], layers: int, blocking_s: float,
                        anchor: tuple[str, str] = ("dop", "cp")) -> dict[str, dict[str, float]]:
    """Three ways a blocking switch could cost ``blocking_s`` in the ``anchor`` direction, each fitted on that one
    direction from per-direction rows {src, dst, transfer_s (the primitives back to back), live_s, recv_bytes}:
    "factor" (the primitives × k: an extra that scales with the bytes), "per_layer" (+ c a layer: a host sync or
    launch per layer) and "per_switch" (+ C once: a drain, a barrier, rebuilding a pool). For each: the fitted
    value, the anchor's blocking, and the lowest / highest live / blocking over the directions that move state."""
    a = next(r for r in rows if (r["src"], r["dst"]) == anchor)
    k = blocking_s / a["transfer_s"]
    c = (blocking_s - a["transfer_s"]) / layers
    C = blocking_s - a["transfer_s"]
    price = {"factor": (k, lambda x: k * x), "per_layer": (c, lambda x: x + layers * c),
             "per_switch": (C, lambda x: x + C)}
    out = {}
    for name, (value, f) in price.items():
        ratios = [r["live_s"] / f(r["transfer_s"]) for r in rows if r["recv_bytes"] > 0]
        out[name] = {"value": value, "anchor_blocking_s": f(a["transfer_s"]), "saving_min": min(ratios),
                     "saving_max": max(ratios)}
    return out


def blocking_from_primitives(live_s: float, layers: int, kv_layer_s: float, weight_layer_s: float) -> dict[str, float]:
    """{"blocking_s", "live_over_blocking"}: a blocking switch priced as ``layers`` × (KV + projection primitive)
    and the live / blocking ratio that leaves for a live cost of ``live_s``."""
    blocking = layers * (kv_layer_s + weight_layer_s)
    return {"blocking_s": blocking, "live_over_blocking": live_s / blocking}


def paper_blocking_bound() -> dict[str, float]:
    """``blocking_from_primitives`` for B200 DOP->CP from the paper's figures alone (78 layers of GLM-5.3; the
    primitives' high ends), beside the paper's blocking time and live / blocking high end."""
    from splash.sim.presets import load_sim_model
    out = blocking_from_primitives(PAPER["b200.switch.dop_cp.live"] * 1e-3,
                                   load_sim_model("glm-5.3").cfg.num_hidden_layers,
                                   PAPER["b200.prim.kv.max"] * 1e-3, PAPER["b200.prim.weight.max"] * 1e-3)
    return {**out, "paper_blocking_s": PAPER["b200.switch.dop_cp.blocking"] * 1e-3,
            "paper_live_over_blocking_max": PAPER["b200.switch.saving.max"]}
