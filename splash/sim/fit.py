"""The numbers of the GPU profiles that are fitted, and what they are fitted to: the paper's B200 figures only.
Pure, no torch.

``switch_efficiencies``: the share of the B200 link rate (spec sheet) that a switch's per-layer KV collective and
projection all-gather reach, from the paper's B200 per-layer costs (§5.4: KV 3.471-3.807 ms, weights 0.292-0.302
ms at B = 16 x 256K) and the manifest planner's bytes for those switches. The geometric middle of each published
range is the target. H200 and DCU use these shares unchanged (``tests/test_switch_cost.py`` checks the profiles
carry them).
"""
from __future__ import annotations

import math

from splash.sim.paper_data import FIGURES


def _paper_range(key: str) -> tuple[float, float]:
    by = {f.key: f.paper for f in FIGURES}
    return float(by[f"{key}.min"]), float(by[f"{key}.max"])


def switch_efficiencies(profile=None, batch: int = 16, tokens: int = 256_000) -> dict[str, float]:
    """{"switch_kv_efficiency", "switch_weight_efficiency"} fitted on B200 (``profile``: b200 by default)."""
    from splash.costmodel.profile import load_profile
    from splash.costmodel.switch_cost import logical_kv_bytes_layer
    from splash.sim.presets import load_sim_model
    from splash.switching.manifest import ReqState, plan_switch
    prof = profile or load_profile("b200")
    m, T = load_sim_model("glm-5.3"), 8
    reqs = {f"r{i}": ReqState(tokens, i % T) for i in range(batch)}
    # DOP->CP moves both: its KV all-to-all and its projection all-gather
    man = plan_switch("dop", "cp", m.cfg, T, reqs, 64, 1, m.kv_dtype)
    kv_bytes = (T - 1) / T * logical_kv_bytes_layer(man)
    w_bytes = max(man.weight_recv_bytes)
    out = {}
    for name, nbytes, key, coll in (("switch_kv_efficiency", kv_bytes, "b200.prim.kv", "all_to_all"),
                                    ("switch_weight_efficiency", w_bytes, "b200.prim.weight", "all_gather")):
        lo, hi = _paper_range(key)
        t = math.sqrt(lo * hi) * 1e-3 - prof.collective(coll).alpha_s
        out[name] = nbytes / (t * prof.link_bytes_per_s)
    return out


def live_switch(profile=None, batch: int = 16, tokens: int = 256_000, chunk: int = 16384) -> dict[str, float]:
    """{"switch_handoff_s", "switch_contention"} fitted on B200 (Table 1): the handoff is the smallest p50 (a
    discard-only switch moves nothing); the contention coefficient makes DOP->CP's pipelined live cost its p50,
    with the B200 efficiencies (``switch_efficiencies``) in place."""
    import dataclasses

    from splash.costmodel.profile import load_profile
    from splash.costmodel.step_cost import CostModel
    from splash.sim.presets import load_sim_model
    from splash.sim.switch_table import step_link_share, switch_step_rows
    from splash.switching.manifest import ReqState, plan_switch
    by = {f.key: f.paper for f in FIGURES}
    prof = profile or load_profile("b200")
    prof = dataclasses.replace(prof, **switch_efficiencies(prof, batch, tokens), switch_overlap="pipeline",
                               switch_handoff_s=0.0, switch_contention=0.0)
    m, T = load_sim_model("glm-5.3"), 8
    cm = CostModel(m.cfg, T, prof, m.weight_dtype, m.kv_dtype, 64, cp_prefill="split")
    man = plan_switch("dop", "cp", m.cfg, T, {f"r{i}": ReqState(tokens, i % T) for i in range(batch)}, 64, 1,
                      m.kv_dtype)
    pred = cm.step("cp", switch_step_rows("cp", batch, tokens, chunk, T))
    share = step_link_share(pred)
    t = cm.switch(man, "blocking").per_layer_seconds
    L = man.num_layers
    handoff = float(by["b200.switch.live.min"]) * 1e-3
    hidden = min(t, pred.seconds / L)
    exposed_no_contention = handoff + t + (L - 1) * (t - hidden)
    target = float(by["b200.switch.dop_cp.live"]) * 1e-3
    kappa = max(0.0, target - exposed_no_contention) / ((L - 1) * hidden * share) if hidden * share else 0.0
    return {"switch_handoff_s": handoff, "switch_contention": kappa}
