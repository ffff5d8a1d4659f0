"""Online correction of the `layout: auto` scheduler's predictions — pure Python, no torch.

Two things are learnt from the run:

- **Step time** (`StepCorrection`): measured over predicted seconds of the executed steps, per layout and per
  regime (steps that carry prefill chunks, decode-only steps), as a ratio of exponentially weighted *sums* — so a
  step counts in proportion to its predicted time, and a few short steps (a 64-token prompt, whose fixed costs the
  model misses most) do not set the factor that scales a batch's long ones. The first measurements are blended
  with the prior (the factor it borrowed, as one pseudo-step) with weight 1/(n + 1), so one noisy step — e.g. the
  first one after a switch — does not set a layout's factor by itself. A layout not visited yet in a
  regime borrows the visited layouts' mean, and with it an *uncertainty* (log-space): the spread of the visited
  layouts' factors around that mean, at least BORROW_UNCERTAINTY, shrinking as 1/(1 + n) with the layout's own
  measurements. The scheduler inflates a candidate's prediction by exp(uncertainty), so a layout is entered on a
  borrowed factor only when its lead survives the uncertainty.
- **Shape** (the same `StepCorrection`): a whole-step factor is the average of its stages' errors weighted by the
  stages' shares of the steps it was learnt on (its *stage mix*: the same exponentially weighted sums, per stage of
  the prediction), and a stage's error need not be the step's — in one layout the FFN may run 1.4x its model and
  the attention 0.4x. On a batch of another shape (fewer rows: the FFN's share falls; longer contexts: the
  attention's rises) the same stage errors add up to another factor, by at most STAGE_SPREAD (how far, in log, one
  stage's error may sit from the step's) x the L1 distance between the two mixes (Σ_g Δshare_g · e_g with |e_g| ≤
  STAGE_SPREAD). When the caller says the mix of the steps the factor is for, a measured factor's uncertainty is at
  least that bound: a layout measured on 128 short requests is uncertain again on 13 long ones — the steps of the
  layout in use keep its mix where the batch is, a layout left behind keeps the mix it was measured at — so the
  scheduler can measure it again there (probe it) instead of trusting a factor the batch has moved away from. At
  least, not on top: while a layout has few measurements its factor is still mostly the borrowed prior, whose
  spread (of the layouts' whole-step factors around their mean, at any mix) already bounds what a mix adds; once
  its own measurements dominate, what they miss is the batch having moved.
  The same holds for a factor borrowed from the other regime (no layout has run this one yet): a layout's prefill
  factor is learnt on steps whose mix may be far from its decode steps' (long chunks: indexer, attention and the
  exchange; decode: the FFN), so, given the mix of the steps it is for, it counts by the *overlap* of the two mixes
  (Σ_g min(share_g, share'_g) = 1 − L1/2: the share of the step's time in stages weighted as where it was learnt)
  and the rest is the other regime's mean over the layouts — what a layout borrows where it has learnt nothing.
- **Switch cost** (`SwitchCorrection`): the measured added time of each executed switch step (its time less the
  step's corrected prediction) over the switch's predicted exposed cost, per direction (src → dst), likewise
  in log space. The prediction is floored at SWITCH_FLOOR_S (a switch that moves nothing still rebuilds state and
  synchronises). A direction not observed yet takes the observed directions' geometric mean, and before any switch
  was observed the conservative SWITCH_PRIOR_RATIO; ratios are clamped to SWITCH_BOUNDS.
"""
from __future__ import annotations

import math
import statistics
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

FACTOR_ALPHA = 0.2          # weight of the newest measurement once a factor has 1/FACTOR_ALPHA - 1 samples
FACTOR_BOUNDS = (0.05, 20.0)
BORROW_UNCERTAINTY = 0.25   # log-space uncertainty of a borrowed step factor at least (x1.28)
STAGE_SPREAD = 0.5          # how far (log) one stage's error may sit from its step's: splash-sim's held-out tokens/s
                            # and per-layer primitive rows against the paper miss by -9% ... +72% (log 0.54)
SWITCH_FLOOR_S = 0.005      # a switch's predicted exposed cost is taken as at least this
SWITCH_PRIOR_RATIO = 10.0   # measured / predicted switch cost before any switch was observed (conservative)
SWITCH_BOUNDS = (0.5, 200.0)
REGIMES = ("decode", "prefill")


def _ema(level: float | None, prior: float, x: float, n: int) -> float:
    """Next log level after the n-th (1-based) measurement x: the prior counts as one sample at first."""
    base = prior if level is None else level
    w = max(FACTOR_ALPHA, 1.0 / (n + 1))
    return (1 - w) * base + w * x


@dataclass
class LayoutStats:
    """Online correction and prediction error of one layout in one regime."""
    level: float | None = None            # log(Σ measured / Σ predicted), weighted sums; None until a step ran
    n: int = 0                            # measurements that trained it
    sum_pred: float = 0.0                 # the weighted sums
    sum_meas: float = 0.0
    sum_stages: dict = field(default_factory=dict)   # stage -> weighted sum of its predicted seconds (the mix)
    last_predicted: float | None = None   # raw model seconds of the last executed step in this layout
    last_measured: float | None = None
    errors: deque = field(default_factory=lambda: deque(maxlen=64))   # |corrected − measured| / measured

    @property
    def median_error(self) -> float | None:
        return statistics.median(self.errors) if self.errors else None

    @property
    def mix(self) -> dict[str, float] | None:
        """Each stage's share of the predicted seconds the factor was learnt on (None: no stages were given)."""
        if not self.sum_stages or self.sum_pred <= 0:
            return None
        return {k: v / self.sum_pred for k, v in self.sum_stages.items()}


def stage_mix(stages: Mapping[str, float] | None) -> dict[str, float] | None:
    """A prediction's stage seconds as shares of their sum (a stage may be negative: time hidden by overlap);
    None when there are none to share."""
    total = sum(stages.values()) if stages else 0.0
    return {k: v / total for k, v in stages.items()} if total > 0 else None


def mix_distance(a: Mapping[str, float], b: Mapping[str, float]) -> float:
    """L1 distance between two stage mixes (a stage missing from one has share 0 there)."""
    return sum(abs(a.get(k, 0.0) - b.get(k, 0.0)) for k in a.keys() | b.keys())


class StepCorrection:
    """Per layout and regime step-time factors; see the module docstring."""

    def __init__(self, layouts: Sequence[str]):
        self.by_regime = {reg: {lay: LayoutStats() for lay in layouts} for reg in REGIMES}

    def _seen(self, regime: str) -> list[float]:
        return [s.level for s in self.by_regime[regime].values() if s.level is not None]

    def _mean(self, regime: str) -> float | None:
        seen = self._seen(regime)
        return sum(seen) / len(seen) if seen else None

    def _level(self, layout: str, regime: str) -> float | None:
        other = "prefill" if regime == "decode" else "decode"
        for reg in (regime, other):
            lvl = self.by_regime[reg][layout].level
            if lvl is None:
                lvl = self._mean(reg)
            if lvl is not None:
                return lvl
        return None

    def factor(self, layout: str, regime: str = "decode", mix: Mapping[str, float] | None = None) -> float:
        """measured / predicted for `layout` in `regime`; the visited layouts' mean when not visited yet; the
        other regime's when no layout has run in this one; 1 when nothing has run. With `mix` (the stage mix of the
        steps the factor is for), a factor borrowed from the layout's own in the other regime counts by the overlap
        of the two mixes (see the module docstring)."""
        lvl = self._level(layout, regime)
        other = "prefill" if regime == "decode" else "decode"
        own = self.by_regime[other][layout]
        if mix and lvl is not None and own.level is not None and own.mix and not self._seen(regime):
            # Σ_g min(share_g, share'_g) where no share is negative (time hidden by overlap can be)
            overlap = max(0.0, 1.0 - mix_distance(own.mix, mix) / 2)
            lvl = overlap * own.level + (1.0 - overlap) * self._mean(other)
        return 1.0 if lvl is None else math.exp(lvl)

    def uncertainty(self, layout: str, regime: str = "decode", mix: Mapping[str, float] | None = None) -> float:
        """Log-space uncertainty of `factor(layout, regime)`: the visited layouts' spread (at least
        BORROW_UNCERTAINTY) over 1 + the layout's own measurements in the regime; with `mix` (the stage mix of
        the steps the factor is for, `stage_mix`), at least STAGE_SPREAD x its distance from the mix the layout's
        own factor was learnt at (see the module docstring)."""
        seen, mean = self._seen(regime), self._mean(regime) or 0.0
        spread = max([BORROW_UNCERTAINTY] + [abs(x - mean) for x in seen])
        st = self.by_regime[regime][layout]
        learnt = st.mix if st.n and mix else None
        return max(spread / (1 + st.n), STAGE_SPREAD * mix_distance(learnt, mix) if learnt else 0.0)

    def learn(self, layout: str, regime: str, predicted: float, measured: float,
              stages: Mapping[str, float] | None = None) -> None:
        """One executed step: its predicted (raw model) and measured seconds, and the prediction's seconds per
        stage where the model gives them (they carry the factor's stage mix)."""
        st = self.by_regime[regime][layout]
        st.errors.append(abs(predicted * self.factor(layout, regime) - measured) / measured)
        st.last_predicted, st.last_measured = predicted, measured
        lo, hi = FACTOR_BOUNDS
        meas = predicted * min(hi, max(lo, measured / predicted))
        if st.level is None:     # the prior as one pseudo-step of this size (none: nothing to blend with)
            prior = self._level(layout, regime)
            st.sum_pred, st.sum_meas = (0.0, 0.0) if prior is None else (predicted, predicted * math.exp(prior))
        st.n += 1
        w = 1.0 if st.sum_pred == 0 else max(FACTOR_ALPHA, 1.0 / (st.n + 1))
        share = stage_mix(stages)
        if share is None:    # a model without stages: the mix is not known from here on
            st.sum_stages = {}
        else:                # the prior pseudo-step (when there is one) counts at this step's mix
            base = st.sum_stages or {k: st.sum_pred * v for k, v in share.items()}
            st.sum_stages = {k: (1 - w) * base.get(k, 0.0) + w * predicted * share.get(k, 0.0)
                             for k in base.keys() | share.keys()}
        st.sum_pred = (1 - w) * st.sum_pred + w * predicted
        st.sum_meas = (1 - w) * st.sum_meas + w * meas
        st.level = math.log(st.sum_meas / st.sum_pred)


@dataclass
class _Direction:
    level: float | None = None
    n: int = 0
    last: dict | None = None          # the latest record of a switch in this direction
    errors: deque = field(default_factory=lambda: deque(maxlen=32))   # |corrected − measured| / measured


class SwitchCorrection:
    """Per direction switch-cost ratios and the bounded record of executed switches; see the module docstring."""

    def __init__(self, prior_ratio: float = SWITCH_PRIOR_RATIO, keep: int = 32):
        self.prior = math.log(prior_ratio)
        self.dirs: dict[tuple[str, str], _Direction] = {}
        self.records: deque = deque(maxlen=keep)

    def ratio(self, src: str, dst: str) -> tuple[float, bool]:
        """(measured / predicted for src → dst, whether that direction was observed itself)."""
        d = self.dirs.get((src, dst))
        if d is not None and d.level is not None:
            return math.exp(d.level), True
        seen = [x.level for x in self.dirs.values() if x.level is not None]
        return math.exp(sum(seen) / len(seen) if seen else self.prior), False

    def corrected(self, src: str, dst: str, predicted_s: float) -> float:
        return max(SWITCH_FLOOR_S, predicted_s) * self.ratio(src, dst)[0]

    def learn(self, step: int | None, src: str | None, dst: str, predicted_s: float | None,
              measured_added_s: float) -> dict:
        """Record one executed switch (predicted None: not one the scheduler vetted, e.g. pinned) and, when its
        prediction is known, train the direction's ratio. Returns the record."""
        rec = {"step": step, "src": src, "dst": dst, "predicted_s": predicted_s,
               "measured_added_s": round(measured_added_s, 6)}
        if predicted_s is not None and src is not None:
            corr = self.corrected(src, dst, predicted_s)
            rec["corrected_s"] = round(corr, 6)
            added = max(measured_added_s, 1e-6)
            rec["error"] = round(abs(corr - added) / max(added, SWITCH_FLOOR_S), 4)   # of at least the floor
            d = self.dirs.setdefault((src, dst), _Direction())
            d.errors.append(rec["error"])
            lo, hi = SWITCH_BOUNDS
            x = math.log(min(hi, max(lo, added / max(SWITCH_FLOOR_S, predicted_s))))
            d.n += 1
            d.level = _ema(d.level, math.log(self.ratio(src, dst)[0]), x, d.n)
            d.last = rec
        self.records.append(rec)
        return rec

    def summary(self) -> dict:
        out = {}
        for (src, dst), d in sorted(self.dirs.items()):
            out[f"{src}->{dst}"] = {"ratio": round(math.exp(d.level), 4) if d.level is not None else None,
                                    "observed": d.n,
                                    "last_predicted_s": d.last["predicted_s"] if d.last else None,
                                    "last_corrected_s": d.last["corrected_s"] if d.last else None,
                                    "last_measured_s": d.last["measured_added_s"] if d.last else None,
                                    "median_error": statistics.median(d.errors) if d.errors else None}
        return {"directions": out, "default_ratio": round(self.ratio("", "")[0], 4)}
