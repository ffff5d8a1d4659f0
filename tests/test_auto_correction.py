"""Online correction of the scheduler's step and switch-cost predictions (pure; splash.engine.layout_policy.correction)."""
from __future__ import annotations

import math
import subprocess
import sys

from splash.engine.layout_policy.correction import (BORROW_UNCERTAINTY, SWITCH_BOUNDS, SWITCH_FLOOR_S, SWITCH_PRIOR_RATIO,
                                           StepCorrection, SwitchCorrection)

L = ("tp", "dp_attn", "cp", "dop")


def test_one_noisy_first_step_does_not_set_a_factor():
    c = StepCorrection(L)
    for _ in range(40):
        c.learn("tp", "decode", 1.0, 3.0)
    assert abs(c.factor("tp") - 3.0) < 0.01 and abs(c.factor("dop") - 3.0) < 0.01   # borrowed by dop
    c.learn("dop", "decode", 1.0, 30.0)          # e.g. the first step after a switch, 10x slow
    assert 3.0 * 1.5 < c.factor("dop") < 30.0 / 2   # blended with the prior it had (3.0) at weight 1/2
    for _ in range(40):
        c.learn("dop", "decode", 1.0, 6.0)
    assert abs(c.factor("dop") - 6.0) < 0.05


def test_a_borrowed_factor_is_uncertain_and_an_own_one_less_so():
    c = StepCorrection(L)
    assert c.uncertainty("cp") == BORROW_UNCERTAINTY                     # nothing seen
    for _ in range(3):
        c.learn("tp", "decode", 1.0, 4.0)
        c.learn("dp_attn", "decode", 1.0, 1.0)
    lv = [c.by_regime["decode"][k].level for k in ("tp", "dp_attn")]
    spread = abs(lv[0] - lv[1]) / 2                                       # each this far from their mean
    assert spread > BORROW_UNCERTAINTY
    assert abs(c.uncertainty("cp") - spread) < 1e-9                       # borrowed: the visited spread
    assert abs(c.uncertainty("tp") - spread / 4) < 1e-9                   # own, 3 samples: / (1 + 3)
    assert c.uncertainty("cp", "prefill") == BORROW_UNCERTAINTY           # no prefill step anywhere yet


def test_switch_cost_is_conservative_until_observed_then_learnt_per_direction():
    s = SwitchCorrection()
    assert math.isclose(s.corrected("tp", "dop", 0.0), SWITCH_FLOOR_S * SWITCH_PRIOR_RATIO)   # moves nothing
    r, seen = s.ratio("tp", "cp")
    assert math.isclose(r, SWITCH_PRIOR_RATIO) and not seen
    for _ in range(30):
        rec = s.learn(1, "tp", "dp_attn", 0.01, 0.3)                     # 30x the prediction
    assert abs(s.ratio("tp", "dp_attn")[0] - 30.0) < 0.1 and s.ratio("tp", "dp_attn")[1]
    assert rec["error"] < 0.01 and rec["corrected_s"] > 0.29
    assert abs(s.ratio("cp", "tp")[0] - 30.0) < 0.1                      # unobserved: the observed mean
    for _ in range(30):
        s.learn(2, "dp_attn", "tp", 0.01, 0.02)
    assert abs(s.ratio("dp_attn", "tp")[0] - 2.0) < 0.01
    assert abs(s.ratio("cp", "tp")[0] - math.sqrt(60.0)) < 0.1           # geometric mean of both directions
    s.learn(3, "tp", "cp", 1e-9, 1e6)                                    # clamped
    assert s.ratio("tp", "cp")[0] <= SWITCH_BOUNDS[1]
    s.learn(4, None, "tp", None, 0.5)                                    # a pinned switch: recorded, not learnt
    assert len(s.records) == 32 and s.records[-1]["predicted_s"] is None
    summ = s.summary()["directions"]["tp->dp_attn"]
    assert summ["observed"] == 30 and summ["last_measured_s"] == 0.3 and summ["median_error"] is not None


def test_auto_correction_imports_no_torch():
    code = "import sys; sys.modules['torch'] = None; import splash.engine.layout_policy.correction"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr


def test_a_step_counts_by_its_predicted_time():
    c = StepCorrection(L)
    c.learn("tp", "prefill", 0.01, 0.08)         # a 64-token prompt: 8x its (tiny) prediction
    for _ in range(3):
        c.learn("tp", "prefill", 0.3, 0.6)       # full 2048-token chunks: 2x
    assert c.factor("tp", "prefill") < 2.2       # a per-step log average would give 2.8


def test_a_factor_learnt_at_one_stage_mix_is_uncertain_at_another():
    from splash.engine.layout_policy.correction import STAGE_SPREAD
    c = StepCorrection(L)
    wide = {"ffn": 0.6, "attention": 0.4}            # many short requests: the FFN's share is large
    for _ in range(40):
        c.learn("tp", "decode", 1.0, 2.0, stages=wide)
    base = c.uncertainty("tp")
    assert math.isclose(c.uncertainty("tp", mix=wide), base)                  # where it was learnt: as before
    long_ = {"ffn": 0.3, "attention": 0.7}           # a few long ones: the attention's
    assert math.isclose(c.uncertainty("tp", mix=long_), STAGE_SPREAD * 0.6)   # L1 distance 0.6
    assert c.uncertainty("dop", mix=long_) == c.uncertainty("dop")            # borrowed: its spread covers it
    for _ in range(40):                               # measured where the batch is now: certain there again
        c.learn("tp", "decode", 1.0, 2.0, stages=long_)
    assert c.uncertainty("tp", mix=long_) - c.uncertainty("tp") < 0.01 < c.uncertainty("tp", mix=wide) - base
    c.learn("dop", "decode", 1.0, 2.0, stages=wide)   # measured once: its factor is half the borrowed prior, whose
    near = {"ffn": 0.55, "attention": 0.45}          # spread bounds a small move of the mix already
    assert c.uncertainty("dop", mix=near) == c.uncertainty("dop") > STAGE_SPREAD * 0.1
    c.learn("tp", "decode", 1.0, 2.0)                 # a model without stages: no mix to judge by
    assert c.uncertainty("tp", mix=wide) == c.uncertainty("tp")


def test_the_learnt_mix_weighs_steps_by_their_predicted_time_as_the_factor_does():
    c = StepCorrection(L)
    c.learn("tp", "decode", 1.0, 1.0, stages={"ffn": 1.0})
    c.learn("tp", "decode", 3.0, 3.0, stages={"attention": 3.0})
    st = c.by_regime["decode"]["tp"]
    w = 1 / 3                                         # the second measurement's weight (n = 2)
    assert math.isclose(st.mix["attention"], w * 3.0 / ((1 - w) * 1.0 + w * 3.0))
    assert math.isclose(sum(st.mix.values()), 1.0)


def test_a_gpu_step_is_timed_once_its_kernels_have_run(monkeypatch):
    """On a GPU the host returns from a step while its kernels still run: the time auto learns from is read after
    the device is synchronised (else it would learn launch times); on CPU nothing is synchronised."""
    import time
    from types import SimpleNamespace

    import torch

    from splash.engine.engine import step_seconds

    done = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: (time.sleep(0.05), done.append(device)))
    t0 = time.perf_counter()
    assert step_seconds(t0, SimpleNamespace(is_cuda=True, device="cuda:1")) >= 0.05 and done == ["cuda:1"]
    assert step_seconds(time.perf_counter(), torch.zeros(2)) < 0.05 and done == ["cuda:1"]


def test_a_factor_borrowed_from_the_other_regime_counts_by_the_overlap_of_the_mixes():
    c = StepCorrection(L)
    chunks = {"attention": 0.9, "ffn": 0.1}          # DOP's prefill steps: long chunks, attention-bound
    short = {"attention": 0.1, "ffn": 0.9}           # CP's: short prompts, FFN-bound — as a decode step is
    for _ in range(40):
        c.learn("dop", "prefill", 1.0, 0.5, stages=chunks)
        c.learn("cp", "prefill", 1.0, 1.5, stages=short)
    lvl = {k: c.by_regime["prefill"][k].level for k in ("dop", "cp")}
    mean = (lvl["dop"] + lvl["cp"]) / 2
    decode = {"attention": 0.1, "ffn": 0.9}
    assert math.isclose(c.factor("dop", "decode"), math.exp(lvl["dop"]))    # no mix given: the other regime's
    # L1 distance 1.6: 20% of a decode step's time lies where DOP's prefill factor was learnt, the rest is the mean
    assert math.isclose(c.factor("dop", "decode", decode), math.exp(0.2 * lvl["dop"] + 0.8 * mean))
    assert math.isclose(c.factor("cp", "decode", decode), math.exp(lvl["cp"]))   # the same mix: its own
    assert math.isclose(c.factor("tp", "decode", decode), math.exp(mean))       # nothing of its own: the mean
    assert math.isclose(c.factor("dop", "decode", {"overlap": -0.5, "ffn": 1.5}), math.exp(mean))   # at least 0
    c.learn("tp", "decode", 1.0, 1.0, stages=decode)  # a layout ran decode: the decode mean is borrowed, as before
    assert c.factor("dop", "decode", decode) == c.factor("dop", "decode")
