"""splash-sim's prefill/decode-disaggregated deployment (splash/sim/deploy.py): the swept layout prefills, the KV
is handed off over the inter-node link, a fixed decode instance generates."""
import dataclasses

import pytest

from splash.costmodel import load_profile
from splash.costmodel.step_cost import CostModel
from splash.sim import deploy
from splash.sim.presets import load_sim_model
from splash.sim.deploy import throughput
from splash.sim.serving import SimSetup, capacities, concurrency, prefill_seconds


def _setup(**kw):
    m = load_sim_model("glm-5.3")
    s = SimSetup(m, load_profile("b200"), 8, deployment="disaggregated", **kw)
    cm = CostModel(m.cfg, 8, s.profile, m.weight_dtype, m.kv_dtype, s.block_size, cp_prefill="split")
    return s, cm, capacities(s)


def test_disaggregated_time_is_prefill_handoff_decode():
    s, cm, caps = _setup()
    B, n, out = 4, 2000, 8
    for lay in ("tp", "dp_attn"):
        r = throughput(cm, s, caps, lay, B, n, out)
        total = B * (n + out) / r["tokens_per_s"]
        want = (prefill_seconds(cm, s, lay, B, n) + deploy.handoff_seconds(s, B, n)
                + deploy.decode_seconds(s, B, n, out))
        assert total == pytest.approx(want, rel=1e-9)
    # the handoff: every MLA layer's KV of the prompts, each prefill rank its share over its own NIC
    assert deploy.handoff_seconds(s, B, n) == pytest.approx(B * n * 61_464 / (8 * 5.0e10), rel=0.01)


def test_later_waves_hide_the_earlier_handoffs():
    s, cm, caps = _setup()
    t2 = sum(deploy.disaggregated_parts(cm, s, "dp_attn", 16, 2000, 0, 8).values())   # two waves of 8
    p = prefill_seconds(cm, s, "dp_attn", 8, 2000)
    h = deploy.handoff_seconds(s, 8, 2000)
    assert h < p and t2 == pytest.approx(2 * p + h)   # the first wave's handoff runs under the second's prefill


def test_decode_instance_over_two_nodes_pays_the_inter_node_link():
    s1, _, _ = _setup(decode_world=16, decode_nodes=1)
    s2, _, _ = _setup(decode_world=16, decode_nodes=2)
    assert deploy.decode_seconds(s2, 16, 4000, 64) > deploy.decode_seconds(s1, 16, 4000, 64)
    p = load_profile("b200")
    slow = deploy.inter_node_profile(p)
    f = p.inter_node_bytes_per_s / p.link_bytes_per_s
    assert slow.collective("all_reduce").bytes_per_s == pytest.approx(p.collective("all_reduce").bytes_per_s * f)
    with pytest.raises(ValueError, match="inter_node_bytes_per_s"):
        deploy.inter_node_profile(load_profile("cpu"))


def test_prefill_capacity_holds_prompts_only():
    """The prefill instance hands requests off: its waves are set by the prompt, not prompt + output."""
    s, cm, caps = _setup(decode_world=16)     # the decode instance's 16 ranks hold prompt + output
    col = dataclasses.replace(s, deployment="colocated")
    n = caps["dp_attn"].tokens_per_rank - 100      # one prompt per owner fits, prompt + 1,024 output does not
    assert throughput(cm, s, caps, "dp_attn", 8, n, 1024)["concurrency"] == 8
    assert not throughput(cm, col, caps, "dp_attn", 8, n, 1024)["feasible"]
    assert not throughput(cm, dataclasses.replace(s, decode_world=8), caps, "dp_attn", 8, n, 1024)["feasible"]


def test_a_tp_decode_instance_decodes_in_waves_when_its_replicated_kv_binds():
    """TP keeps every request's whole latent KV on every rank, so a TP decode instance holds one rank's pool of
    requests at once however many ranks it has; a batch beyond that decodes in waves, one after another (the
    B200 setup's decode: splash/sim/paper_data.py). DP-attn over the same ranks spreads requests over owners."""
    s, _, _ = _setup(decode_layout="tp", decode_world=16, decode_nodes=2)
    d, _, caps = deploy.decode_instance(s)
    n, out = 256_000, 4
    blocks = -(-(n + out) // s.block_size)
    k = concurrency(d, caps, "tp", n + out)
    assert k == caps["tp"].blocks_per_rank // blocks and 1 <= k < 16
    full, rest = divmod(16, k)
    want = full * deploy.decode_seconds(s, k, n, out) + (deploy.decode_seconds(s, rest, n, out) if rest else 0.0)
    assert deploy.decode_seconds(s, 16, n, out) == pytest.approx(want, rel=1e-9)
    dp = dataclasses.replace(s, decode_layout="dp_attn")
    assert concurrency(deploy.decode_instance(dp)[0], deploy.decode_instance(dp)[2], "dp_attn", n + out) >= 16
