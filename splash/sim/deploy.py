"""Prefill/decode-disaggregated serving for splash-sim: the swept layout runs prefill on its own instance, the KV
of each prefilled request is handed off over the inter-node link, and a separate decode instance (``decode_world``
ranks over ``decode_nodes`` nodes, in ``decode_layout``) generates the output. Pure, no torch.

The model (stated, not measured):
- the prefill instance holds a request's KV from its first chunk until its handoff, so its KV capacity in the
  swept layout sets how many requests prefill at once (waves, as in co-located serving);
- the handoff of a wave's KV (input tokens × KV bytes per token, every MLA layer) leaves the prefill ranks in
  parallel, each over its own NIC (``inter_node_bytes_per_s``: different instances are different nodes), while the
  next wave prefills; only what the prefill of the rest does not cover is exposed;
- the decode instance runs all requests' output in its own layout, as many at once as its KV holds; its collectives
  cross the inter-node link when it spans nodes (their rates scaled by inter-node / intra-node link rate);
- throughput = all input + output tokens over prefill + exposed handoff + decode (a batch's end-to-end time, as
  the paper's sweeps report it).
"""
from __future__ import annotations

import dataclasses

from splash.costmodel.profile import Collective
from splash.costmodel.step_cost import CostModel, RowLoad
from splash.layouts.memory import kv_bytes_per_token_layer
from splash.sim.serving import (DECODE_SAMPLES, SimSetup, capacities, concurrency, prefill_seconds, step_seconds,
                                wave_seconds)

# id(SimSetup) -> (setup, decode SimSetup, CostModel, capacities): a sweep prices thousands of points of a few
# setups, and building a decode instance (capacities, cost-model shapes) is most of a point's cost
_DECODE: dict[int, tuple] = {}
_DECODE_KEEP = 8


def inter_node_profile(profile):
    """``profile`` with its collectives slowed to the inter-node link (their intra-node efficiency kept)."""
    if not profile.inter_node_bytes_per_s or not profile.link_bytes_per_s:
        raise ValueError(f"hardware profile {profile.name!r} has no link_bytes_per_s / inter_node_bytes_per_s: "
                         f"a multi-node instance cannot be priced")
    f = profile.inter_node_bytes_per_s / profile.link_bytes_per_s
    return dataclasses.replace(profile, collectives={k: Collective(c.alpha_s, c.bytes_per_s * f)
                                                     for k, c in profile.collectives.items()})


def decode_instance(s):
    """(decode SimSetup, its CostModel, its capacities), cached per prefill setup."""
    hit = _DECODE.get(id(s))
    if hit is not None and hit[0] is s:
        return hit[1:]
    prof = inter_node_profile(s.profile) if s.decode_nodes > 1 else s.profile
    d = dataclasses.replace(s, profile=prof, world=s.decode_world, deployment="colocated")
    m = s.model
    cm = CostModel(m.cfg, d.world, prof, m.weight_dtype, m.kv_dtype, d.block_size)
    out = (d, cm, capacities(d))
    if len(_DECODE) >= _DECODE_KEEP:
        _DECODE.clear()
    _DECODE[id(s)] = (s, *out)
    return out


def kv_bytes_per_request_token(s) -> float:
    cfg = s.model.cfg
    return kv_bytes_per_token_layer(cfg, s.model.kv_dtype) * cfg.num_hidden_layers


def handoff_seconds(s, requests: int, input_len: int) -> float:
    """Moving ``requests`` prompts' KV from the prefill ranks (each its share, over its own NIC) to decode."""
    return requests * input_len * kv_bytes_per_request_token(s) / (s.world * s.profile.inter_node_bytes_per_s)


def decode_seconds(s, batch: int, input_len: int, output_len: int) -> float:
    """The decode instance generating ``output_len`` tokens for ``batch`` requests of ``input_len`` prompts."""
    if output_len <= 0:
        return 0.0
    d, cm, caps = decode_instance(s)
    k = min(batch, concurrency(d, caps, s.decode_layout, input_len + output_len))
    if k == 0:
        raise ValueError(f"the decode instance ({d.world} ranks, {s.decode_layout}) holds no request of "
                         f"{input_len + output_len} tokens")
    full, rest = divmod(batch, k)
    t = 0.0
    for n_req, waves in ((k, full), (rest, 1 if rest else 0)):
        if not waves:
            continue
        n = min(DECODE_SAMPLES, output_len)
        per = output_len / n
        wave = sum(per * step_seconds(cm, s.model, s.decode_layout,
                                      [RowLoad(1, input_len + int((i + 0.5) * per), j % d.world)
                                       for j in range(n_req)]) for i in range(n))
        t += waves * wave
    return t


def disaggregated_parts(cm, s, layout: str, batch: int, input_len: int, output_len: int, k: int) -> dict[str, float]:
    """{"prefill_s", "handoff_s" (exposed), "decode_s"} of ``batch`` requests, ``k`` at once on the prefill
    instance in ``layout``; their sum is the batch's end-to-end time."""
    full, rest = divmod(batch, k)
    waves = [k] * full + ([rest] if rest else [])
    prefill = [prefill_seconds(cm, s, layout, n, input_len) for n in waves]
    handoff = [handoff_seconds(s, n, input_len) for n in waves]
    # each wave's handoff runs while the later waves prefill; the last wave's is all exposed
    t, free_at = 0.0, 0.0
    for p, h in zip(prefill, handoff):
        t += p
        free_at = max(free_at, t) + h
    return {"prefill_s": t, "handoff_s": free_at - t,
            "decode_s": decode_seconds(s, batch, input_len, output_len)}


def throughput(cm: CostModel, s: SimSetup, caps: dict, layout: str, batch: int, input_len: int,
               output_len: int) -> dict[str, object]:
    """{"tokens_per_s", "feasible", "concurrency"} of serving ``batch`` requests in ``layout``."""
    infeasible = {"tokens_per_s": 0.0, "feasible": False, "concurrency": 0}
    try:
        cm.step(layout, [RowLoad(1, 1, 0)])
    except ValueError:
        return infeasible
    disaggregated = s.deployment == "disaggregated"
    # a disaggregated deployment's prefill instance holds prompts only
    k = min(batch, concurrency(s, caps, layout, input_len if disaggregated else input_len + output_len))
    if k == 0:
        return infeasible
    if disaggregated:
        try:
            total = sum(disaggregated_parts(cm, s, layout, batch, input_len, output_len, k).values())
        except ValueError:   # the decode instance holds none of these requests
            return infeasible
    else:
        full, rest = divmod(batch, k)
        total = full * wave_seconds(cm, s, layout, k, input_len, output_len)
        if rest:
            total += wave_seconds(cm, s, layout, rest, input_len, output_len)
    return {"tokens_per_s": batch * (input_len + output_len) / total, "feasible": True, "concurrency": k}
