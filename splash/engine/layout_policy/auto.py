"""The transition-aware layout choice of `layout: auto` (paper §4.2) — pure Python, no torch.

At a step boundary rank 0 describes what the engine holds (each running request's cached tokens, pending prefill
and remaining output; the waiting queue) and asks a cost model how long each allowed layout would take to finish
that work. Every layout is charged for the same requests as the engine's own scheduler would run them under its
KV pool (`forecast` replays the engine's `Scheduler` and `KVLedger` on clones: admission, chunked
prefill, owner placement and preemption as they will happen), and layouts are compared by predicted seconds per
output token. The controller then switches only when

1. the best feasible layout beats the current one by ``margin`` (no flapping at a crossover), and
2. its gain over the batch's remaining work exceeds the predicted cost of the switch (``vet``, once the
   switch manifest is planned: what a live switch cannot hide, or all of a blocking one).

Predictions are corrected online: each executed step's measured time over its prediction feeds the factor of the
layout it ran in (a ratio of exponentially weighted sums, so a step counts by its predicted time), one factor per
regime — steps that carry prefill chunks and decode-only steps — since the model's error differs between them (a
long prompt's attention runs in many kernel chunks; decode rows in one or two) and a factor learnt on one must not
rescale the other. A layout not visited yet in a regime gets the mean correction of those that were (a machine
slower or busier than its profile is so for all of them), so it does not look cheaper than the visited ones merely
for lack of measurements; a regime nothing has run in yet borrows the other regime's factor — for decode, by the
overlap of the stage mix it was learnt at with a decode step's (below), the rest the layouts' mean. A borrowed factor
carries an uncertainty (`correction`): what it misses is the layout's own deviation from the visited layouts' mean,
which is independent from layout to layout, so a candidate is judged at its prediction inflated by its uncertainty
and the current layout's combined as independent errors (root of the sum of squares). It is entered only when its
lead survives that: two layouts on the same borrowed factor do not compare as measured, and a current layout not
measured yet is not left on its own borrowed factor (the steps it runs measure it). Before any step was measured
nothing tells the layouts apart, and the model's predictions are compared as they are. The switch-cost prediction
is corrected online too, per direction, from the measured added time of the switch steps (a conservative ratio
until a switch was observed), and after a switch the controller stays at least DWELL_RATIO x the round trip's
measured cost (in step seconds) before switching again, unless the current layout becomes infeasible. The last
HISTORY decisions that changed are kept for the API.

A measured factor is certain only for batches like those it was learnt on: the model's error sits in stages (one
layout's FFN slow, another's attention), so when the batch's shape moves — fewer rows, longer contexts — the stage
mix of its decode steps moves, and a layout's decode factor learnt elsewhere (in a layout auto left behind) may be
off by up to a bound that grows with the distance between the mixes (`correction`, `_decode_shape`); the layout in
use keeps being measured where the batch is. That bound widens what a *probe* (below) is judged by — the layout
could lead here, and a bounded round trip measures it — but not the normal rule: a worst-case bound is no evidence
against the layout's own measured factor, which stays its best estimate, so it does not hold auto back from a
switch that factor supports. A decode factor borrowed from the layout's own prefill factor (no layout
has run a decode step: every step carried a prompt chunk) is judged by the same mixes: it counts by their overlap
(`correction`), since a long chunk's time lies in the indexer, the attention and the exchange, a decode step's in
the FFN, and a stage's error need not be the step's.

*Probing* (optimism under uncertainty): the model's error differs by layout (each runs its own attention kernels
and collectives), so a layout ranked behind the current one may be the faster one; only running it tells. A layout
whose *optimistic* prediction — its point prediction divided by its uncertainty factor — leads by the margin, and
which is not measured yet in a regime, or measured there on batches of another shape only (its uncertainty there
at least PROBE_MIN_UNCERTAINTY beyond the current layout's, or at least PROBE_MIN_UNCERTAINTY where the current
layout's is below it), may be entered to measure it:
at most MAX_PROBES times per layout and regime, and only when twice the switch's corrected cost (there and back) is
within PROBE_BUDGET of the current layout's predicted time for the work left. The regime the next steps run in comes
first. A probe for the other one must first run the steps before that regime's first step in a layout that may be
slow at them, so it also pays, within the same budget, what those steps cost in the candidate at the pessimistic
end of its uncertainty beyond what they cost in the current layout (`Forecast.until_s`), and where that is more than
nothing it needs its point prediction to lead, not only its optimistic end; the forecast knows only the requests
that are here, so when arrivals keep that regime from coming, the probe ends unmeasured (below), is not counted, and
that layout is not probed ahead of that regime again. The LEARN_AFTER_SWITCH steps after any switch all train the
new layout's factor. A probe is a measurement, not a commitment: it sets no dwell (its round trip was paid for when
it was vetted), and once the probed layout is measured in the probe's regime — or, for a probe ahead of its regime,
once the steps since it ran PROBE_LEAD_SLACK x what it was priced for (PROBE_BUDGET of the work left, plus the steps
before its regime) without measuring it — and the layout it came from is faster on its point prediction, the
controller goes back without the margin (the payoff must still exceed the switch's cost); otherwise the normal rule
decides from there. A probe left for another probe before it measured its regime (prompts arrived during a decode
probe, and another layout's prefill probe qualified: the chain is how a layout leading in the new regime is found)
measured nothing, so it is not counted either. A layout measured in the next steps' regime (its uncertainty there
below PROBE_MIN_UNCERTAINTY, so no probe above takes it) that leads by the margin on its point prediction, and with
the current layout's uncertainty (staying shrinks that), but not once its own residual uncertainty is counted too,
would be held out for as long as auto stays: its own uncertainty shrinks only with its own steps. It is probed again
instead — the same probe, vetted by the same budget, at most MAX_PROBES times per layout and regime apart from the
probes above (they measured it; this measures it again where it is held out) — where the current layout is measured
there too (else staying measures the current one), and the trip ends once its steps there at least doubled (plus
one): the probe's measurements then weigh as much as the earlier ones, and the return judges it at the refreshed
point prediction. Its round trip must also fit in memory: a probe is taken only when the switch back passes the
controller's headroom check (`LayoutController.way_back`) for the running requests grown by what the probe may run —
each its pending prefill plus up to PROBE_LEN_STEPS more output tokens (the steps that measure the probed layout and
the re-evaluation that brings the return) — so a probe cannot strand the batch in a layout it measured slower until
the pool drains.

Re-evaluations may take at most OVERHEAD_BUDGET of the steps' measured time: a due one waits for that credit (not
at an idle boundary), so millisecond decode steps are not slowed by predictions that take about as long.
"""
from __future__ import annotations

import json
import logging
import sys
import math
import time
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from splash.costmodel import RowLoad
from splash.costmodel.policy import choose_layout
from splash.engine.layout_policy.forecast import BatchForecast, output_left
from splash.engine.layout_policy.budget import PredictionBudget
from splash.engine.layout_policy.correction import (LayoutStats, StepCorrection, SwitchCorrection, mix_distance,
                                                     stage_mix)
from splash.engine.layout_policy.decision import VERDICTS, CostModelLike, Decision, ReqView
from splash.engine.ledger import KVLedger
from splash.engine.scheduler import Scheduler

if TYPE_CHECKING:
    from splash.engine.messages import StepItem

__all__ = ["AutoLayout", "CostModelLike", "Decision", "ReqView", "VERDICTS"]

log = logging.getLogger("splash.layout_policy")

MIN_INTERVAL_STEPS = 4   # re-evaluate at most this often while requests run (a prediction costs ~1 ms per layout)
OBSERVE_EVERY = 8        # feed every this-many-th executed step to the online correction
DWELL_RATIO = 4.0        # after a switch, stay this many times the round trip's measured cost (2 x the switch's)
HISTORY = 64             # decisions kept for GET /v1/layout (those that changed verdict, target or layout)
MAX_PROBES = 1           # probes per layout and regime: entering it when only its optimistic prediction leads
PROBE_BUDGET = 0.05      # ... only when its round trip's corrected switch cost is within this of the work left
PROBE_MIN_UNCERTAINTY = 0.1   # ... and only when its uncertainty (log) is at least this: a layout not measured yet
PROBE_LEAD_SLACK = 2.0   # a probe ahead of its regime not measured within this many times the step seconds it was
                         # priced for (PROBE_BUDGET of the work left, plus the steps before its regime) ends unmeasured
LEARN_AFTER_SWITCH = 8   # steps after a switch that all train the new layout's factor (not every observe_every-th)
PROBE_LEN_STEPS = LEARN_AFTER_SWITCH + 16   # a probe's way back must fit after this many decode steps (the steps
                                            # that measure it, then up to a full re-evaluation interval)
OVERHEAD_BUDGET = 0.01   # re-evaluations: at most this share of the executed steps' measured time (half of the 2%
                         # auto may cost where it never switches: the rest is observations and noise)


def _probe_key(lay: str, regime: str, again: bool = False) -> str:
    """The key `AutoLayout.probes` counts a probe of `lay` in `regime` under: a probe of a measured layout again
    (`_probe_again`) apart from the probes that measure a layout."""
    return f"{lay}/{regime}" + ("/again" if again else "")


class AutoLayout:
    """Chooses the layout for `layout: auto`; see the module docstring. One instance on rank 0."""

    def __init__(self, model: CostModelLike, allowed: Sequence[str], margin: float, *, block_size: int,
                 world: int, capacity_blocks: Mapping[str, int], max_num_seqs: int,
                 max_num_batched_tokens: int, switch_mode: str = "live", reeval_steps: int = 16,
                 min_interval: int = MIN_INTERVAL_STEPS, observe_every: int = OBSERVE_EVERY, row=RowLoad,
                 clock=time.monotonic, timer=time.perf_counter, overhead_budget: float = OVERHEAD_BUDGET,
                 scheduler: Scheduler | None = None):
        """`scheduler`: the engine's, whose policy the forecast replays (default: one with `max_num_seqs` and
        `max_num_batched_tokens` and the default settings)."""
        self.model, self.allowed, self.margin = model, tuple(allowed), float(margin)
        self.capacity_blocks = dict(capacity_blocks)
        self.switch_mode, self.reeval_steps = switch_mode, reeval_steps
        self.min_interval, self.observe_every = min_interval, observe_every
        self._observed = 0
        self.row = row
        self.steps = StepCorrection(self.allowed)
        self.switch_cost = SwitchCorrection()
        self.last: Decision | None = None
        self._last_dict: dict | None = None     # `last` as a dict, once asked for
        self._model_view: dict | None = None    # the factors and errors as `summary` shows them, once asked for
        self.history: deque = deque(maxlen=HISTORY)
        self.verdicts: dict[str, int] = {}
        self.clock, self._t0 = clock, clock()
        self._since_switch_s = math.inf   # measured step seconds since the last switch
        self._dwell_s = 0.0               # ... that must pass before the next voluntary one
        self._learn_until = 0             # observed-step count up to which every step trains
        self.probes: dict[str, int] = {}    # "layout/regime" -> probes taken; "layout/regime/again": once measured
        # the regime of the probe proposed at this boundary, and the step seconds within which its steps should come
        # ... whether it is ahead of that regime, and for a probe of a measured layout its steps there before it
        self._probe_for: tuple[str, float, bool, int | None] = ("decode", math.inf, False, None)
        # (from, into, regime, deadline in executed step seconds, ahead of its regime, steps there before it) of the
        # probe not resolved yet
        self._probe_trip: tuple[str, str, str, float, bool, int | None] | None = None
        self._unmet: set[str] = set()   # "layout/regime" probed ahead of its regime, whose steps did not come
        self._shape: dict[str, dict[str, float]] = {}   # per layout, the stage mix of a decode step of the batch now
        self._regime_s: dict[str, dict[str, float]] = {}   # per layout, its forecast's corrected seconds per regime
        self._sig: tuple | None = None
        self._sig_step = -1 << 30
        self.overhead = PredictionBudget(overhead_budget, timer)
        if scheduler is None:
            scheduler = Scheduler(KVLedger(world, 0, block_size, self.allowed[0]), max_num_seqs,
                                  max_num_batched_tokens)
        self._pending: Decision | None = None   # advised at this boundary, waiting for vet_pending
        self._grow: dict[str, int] = {}          # per running request, the tokens it may add during a probe
        self.forecast = BatchForecast(model, row, world=world, block_size=block_size, scheduler=scheduler)

    # ---- online learning ---------------------------------------------------------------------------------
    @property
    def stats(self) -> dict[str, LayoutStats]:            # decode-only steps
        return self.steps.by_regime["decode"]

    @property
    def prefill_stats(self) -> dict[str, LayoutStats]:    # steps carrying prefill chunks
        return self.steps.by_regime["prefill"]

    @property
    def switches(self):
        return self.switch_cost.records

    def observe(self, layout: str, items: Sequence[StepItem], measured_s: float, switched: bool = False) -> None:
        """An executed step in `layout`: `items` are its pieces as the step message carried them (their rows are
        made only for the steps that train). A step that carried a switch does not train the step factor; its
        measured added time trains the switch-cost correction and sets the dwell."""
        if layout not in self.stats or not items or measured_s <= 0:
            return
        regime = "prefill" if any(len(s.tokens) > 1 for s in items) else "decode"
        self._observed += 1
        self._since_switch_s += measured_s
        self.overhead.ran_s += measured_s
        if self._observed == 1 and not switched:   # the engine's first step warms up (first touches, lazy setup):
            return                                  # 2x its twin in the shifting workload
        # prefill steps are few and long: each one trains its factor; decode steps every observe_every-th (one
        # prediction each, outside the overhead budget: the choices rest on them)
        if (not switched and regime == "decode" and self._observed % self.observe_every
                and self._observed > self._learn_until):
            return
        p = self.overhead.timed(self.model.step, layout, [self.row(len(s.tokens), s.start_pos, s.owner)
                                                          for s in items], budgeted=False)
        pred = p.seconds
        if pred <= 0:
            return
        if switched:
            last = self.last
            vetted = last is not None and last.target == layout and last.verdict == "switch"
            added = max(0.0, measured_s - pred * self.factor(layout, regime))
            self.switch_cost.learn(last.step if last else None, last.current if last else None, layout,
                                   last.switch_raw_s if vetted else None, added)
            # a probe sets no dwell: its round trip was paid for when it was vetted, and holding the way out back
            # would run the work left in a layout that may have measured slower
            probe = vetted and last.probe
            self._since_switch_s, self._dwell_s = 0.0, 0.0 if probe else DWELL_RATIO * 2 * added
            self._learn_until = self._observed + LEARN_AFTER_SWITCH
            return
        self.steps.learn(layout, regime, pred, measured_s, getattr(p, "stages", None))
        self._model_view = None

    def factor(self, layout: str, regime: str = "decode") -> float:
        """measured / predicted as learnt so far for `layout` in `regime` ("decode" or "prefill"); the visited
        layouts' mean when not visited yet; the other regime's factor when no layout has run in this one — for
        decode, counted by the overlap of its stage mix with a decode step of the batch at the last evaluation
        (`_decode_shape`, `StepCorrection.factor`)."""
        return self.steps.factor(layout, regime, self._shape.get(layout) if regime == "decode" else None)

    # ---- the choice ------------------------------------------------------------------------------------------
    def due(self, step: int, reqs: Sequence[ReqView]) -> bool:
        """Re-evaluate when the set of requests changed (at most every `min_interval` steps while requests run;
        at once at an idle boundary, where a switch moves no KV) or every `reeval_steps` steps (contexts grow) —
        while requests run, only within the overhead budget (a change not evaluated yet stays due)."""
        return self._due(step, [r.req_id for r in reqs if r.running], sum(1 for r in reqs if not r.running))

    def _due(self, step: int, running: Sequence[str], waiting: int) -> bool:
        """`due` from the running requests' ids and the number waiting: asked at every step boundary, so it
        compares the set of requests only where the answer can depend on it."""
        since = step - self._sig_step
        if running and (since < min(self.min_interval, self.reeval_steps) or not self.overhead.credit()):
            return False
        sig = self._sig
        same = (sig is not None and sig[1] == waiting and len(sig[0]) == len(running)
                and all(rid in sig[0] for rid in running))
        if since >= self.reeval_steps or not same:
            self._sig, self._sig_step = (frozenset(running), waiting), step
            return True
        return False

    def steps_to_due(self, step: int) -> int:
        """How many steps from boundary `step` (at least 1) until a re-evaluation falls due while the requests stay
        the same (`_due`: every `reeval_steps` steps): a simulator that charges steady decode steps together stops
        there, so auto is evaluated where the engine would evaluate it."""
        return max(1, self._sig_step + self.reeval_steps - step)

    def propose(self, step: int, current: str, reqs: Sequence[ReqView],
                usage: Mapping[str, Sequence[int]]) -> Decision:
        """The best layout for this boundary before its switch cost is known (`vet` adds that).

        `usage`: per allowed layout, the blocks per rank the running requests would use there."""
        return self.overhead.timed(self._propose, step, current, reqs, usage)

    def _propose(self, step: int, current: str, reqs: Sequence[ReqView],
                 usage: Mapping[str, Sequence[int]]) -> Decision:
        per_tok, total, admitted, infeasible, work_of, step_s, unc, until = {}, {}, {}, {}, {}, {}, {}, {}
        self._regime_s = {}
        self._shape = self._decode_shape(reqs, current)
        unc_probe = {}   # a probe's uncertainty: also how far the batch moved from where a factor was learnt
        for lay in self.allowed:
            used = usage.get(lay)
            cap = self.capacity_blocks.get(lay, 0)
            if used is None or any(u > cap for u in used):
                infeasible[lay] = f"live KV needs {max(used or [0])} blocks on a rank, holds {cap}"
                continue
            fc = self.forecast.waves(lay, reqs, cap)
            if fc is None:
                continue
            f, fp = self.factor(lay), self.factor(lay, "prefill")
            pre, dec, first, work = fc.prefill_s, fc.decode_s, fc.first_step_s, fc.work
            secs = pre * fp + dec * f
            total[lay], per_tok[lay], admitted[lay] = secs, secs / work, fc.admitted
            work_of[lay], step_s[lay] = work, first * f
            # pessimistic: each regime's factor at its uncertainty (borrowed factors are the uncertain ones), as
            # the normal rule and as a probe judge it
            for out, u in ((unc, self.steps.uncertainty), (unc_probe, self._uncertainty)):
                hi = pre * fp * math.exp(u(lay, "prefill")) + dec * f * math.exp(u(lay, "decode"))
                out[lay] = math.log(hi / secs) if secs > 0 and hi > 0 else 0.0
            until[lay] = self._until(lay, fc.until_s)
            self._regime_s[lay] = {"prefill": pre * fp, "decode": dec * f}
        u_cur = unc.get(current, 0.0)   # the current layout's own uncertainty: staying shrinks it
        unc, unc_probe = self._relative(current, unc), self._relative(current, unc_probe)
        base = dict(step=step, current=current, seconds_per_token=per_tok, batch_seconds=total, admitted=admitted,
                    infeasible=infeasible, margin=self.margin, work_tokens=max(work_of.values(), default=0),
                    step_s=step_s, uncertainty=unc, t_s=self.clock() - self._t0)
        if not per_tok:
            return Decision(verdict="idle", target=None, reason="no work to predict", **base)
        # the switching rule, with the switch cost not known yet (0): which layout would the margin let us take?
        lay, why = choose_layout(current, per_tok, set(per_tok), self.margin, base["work_tokens"],
                                 dict.fromkeys(per_tok, 0.0), unit="output tokens", uncertainty=unc)
        if lay == current:
            back = self._probe_return(current, per_tok)
            if back is not None:
                gain = per_tok[current] - per_tok[back[0]]
                return Decision(verdict="switch", target=back[0], reason=f"{why}; {back[1]}", probe_return=True,
                                payoff_s=gain * base["work_tokens"], **base)
            regime = "prefill" if any(r.pending > 1 for r in reqs) else "decode"
            probe = self._probe_target(current, per_tok, unc_probe, regime, until, total.get(current, 0.0))
            if probe is not None:
                self._probe_for = (probe[2], probe[4], probe[2] != regime, None)
                return Decision(verdict="switch", target=probe[0], probe=True, reason=f"{why}; {probe[1]}",
                                payoff_s=(per_tok[current] - per_tok[probe[0]]) * base["work_tokens"],
                                probe_lead_s=probe[3], **base)
            best = min(per_tok, key=per_tok.get)
            point = best != current and per_tok[best] <= (1 - self.margin) * per_tok[current]
            # held out by its own residual uncertainty, not by the current layout's
            own = point and per_tok[best] * math.exp(u_cur) <= (1 - self.margin) * per_tok[current]
            again = self._probe_again(current, best, regime) if own else None
            if again is not None:
                self._probe_for = (regime, math.inf, False, again)
                return Decision(verdict="switch", target=best, probe=True, reason=(
                    f"{why}; probe {best} again in {regime}: {1 - per_tok[best] / per_tok[current]:.1%} faster on "
                    f"its point prediction, its {regime} factor learnt on {again} steps"),
                    payoff_s=(per_tok[current] - per_tok[best]) * base["work_tokens"], **base)
            verdict = "stay" if best == current else "uncertain" if point else "below_margin"
            return Decision(verdict=verdict, target=None if best == current else best, reason=why, **base)
        if current in per_tok and self._since_switch_s < self._dwell_s:
            return Decision(verdict="dwell", target=lay, reason=(
                f"{why}; but dwell: {self._since_switch_s:.3g}s of steps since the last switch, "
                f"< {self._dwell_s:.3g}s ({DWELL_RATIO:g} x its measured round trip)"), **base)
        payoff = (math.inf if current not in per_tok
                  else (per_tok[current] - per_tok[lay] * math.exp(unc.get(lay, 0.0))) * base["work_tokens"])
        return Decision(verdict="switch", target=lay, reason=why, payoff_s=payoff, **base)

    def _decode_shape(self, reqs: Sequence[ReqView], current: str) -> dict[str, dict[str, float]]:
        """Per layout whose decode factor was learnt with a stage mix, the stage mix of one decode step of the running
        requests there (the batch as it is now): what that factor is judged against (`_uncertainty`). Not for
        `current`: its steps measure it on this batch, so its factor follows the batch's shape as it moves. While no
        layout has run a decode step, per layout whose prefill factor has a mix (the current one too: its steps
        measure prefill, not decode): what that factor, borrowed for decode, counts by (`factor`)."""
        rows = [self.row(1, r.cached, r.owner) for r in reqs if r.running and r.cached > 0]
        borrowed = not any(st.n for st in self.stats.values())
        out = {}
        for lay, st in self.stats.items():
            if rows and (borrowed and self.prefill_stats[lay].mix is not None
                         or lay != current and st.n and st.mix is not None):
                mix = stage_mix(getattr(self.model.step(lay, rows), "stages", None))
                if mix is not None:
                    out[lay] = mix
        return out

    def _uncertainty(self, lay: str, regime: str) -> float:
        """`StepCorrection.uncertainty` of `lay` in `regime` for the batch now, as a probe is judged by: a decode
        factor learnt at another stage mix than a decode step of this batch has (`_decode_shape`) is less certain for
        it. Prefill is judged without: its steps' mix moves within one prompt (a chunk at no context and at 100K), so
        its factor is an average over shapes already."""
        return self.steps.uncertainty(lay, regime, self._shape.get(lay) if regime == "decode" else None)

    def _relative(self, current: str, unc: Mapping[str, float]) -> dict[str, float]:
        """Each candidate's uncertainty relative to `current` (whose own entry is 0). A borrowed factor is the
        visited layouts' mean, and what it misses is the layout's own deviation from that mean — independent from
        layout to layout (each runs its own kernels) — so two layouts on the same borrowed factor are not known
        to compare as the model says: the uncertainties combine as independent errors (root of the sum of
        squares), and a current layout still on a borrowed factor is not left for a measured one on that factor
        alone (staying measures it). Before any step was measured there is nothing to borrow and nothing that
        could tell the layouts apart: the model's predictions are compared as they are."""
        if not any(st.n for by_lay in self.steps.by_regime.values() for st in by_lay.values()):
            return dict.fromkeys(unc, 0.0)
        u_cur = unc.get(current, 0.0)
        return {k: 0.0 if k == current else math.hypot(u, u_cur) for k, u in unc.items()}

    def _until(self, lay: str, until_s: Mapping[str, float]) -> dict[str, tuple[float, float]]:
        """Per regime, the corrected seconds `lay` runs before that regime's first step (the other regime's steps):
        at the point prediction and at the pessimistic end of its uncertainty."""
        out = {}
        for reg, secs in until_s.items():
            other = "prefill" if reg == "decode" else "decode"
            t = secs * self.factor(lay, other)
            out[reg] = (t, t * math.exp(self._uncertainty(lay, other)))
        return out

    def _probe_target(self, current: str, per_tok: Mapping[str, float], unc: Mapping[str, float],
                      regime: str, until: Mapping[str, Mapping[str, tuple[float, float]]] | None = None,
                      left: float = 0.0) -> tuple[str, str, str, float, float] | None:
        """The layout to probe at this boundary, why, the regime the probe measures, what it runs before that
        regime's first step beyond the current layout (seconds, pessimistic) and the step seconds within which it
        should have measured it (inf for the next steps' regime; else PROBE_LEAD_SLACK x the candidate's pessimistic
        lead and PROBE_BUDGET of `left`, the current layout's seconds for the work left) — or None (see the module
        docstring):
        the one whose optimistic prediction leads most, among those leading by the margin optimistically and not
        measured yet in the regime, with probes left there; not within the dwell. `regime` (the next steps') first;
        then the other one, whose probe must first run the steps before that regime's first step in a layout that
        may be slow at them: it is priced by them, at the candidate's pessimistic end against the current layout's
        point prediction, on top of its round trip (`vet`), and where that is more than nothing it needs a point
        lead."""
        if self._since_switch_s < self._dwell_s or current not in per_tok:
            return None
        cur = per_tok[current]
        other = "prefill" if regime == "decode" else "decode"
        for reg in (regime, other):
            best = None
            for k, t in per_tok.items():
                # not measured there (the trip's test), and less known there than the current layout: by
                # PROBE_MIN_UNCERTAINTY, or at all when the current layout is measured there
                u_k, u_cur = self._uncertainty(k, reg), self._uncertainty(current, reg)
                fresh = u_k - u_cur >= PROBE_MIN_UNCERTAINTY or u_cur < PROBE_MIN_UNCERTAINTY <= u_k
                if (k == current or not fresh or unc.get(k, 0.0) < PROBE_MIN_UNCERTAINTY
                        or self.probes.get(f"{k}/{reg}", 0) >= MAX_PROBES
                        or (reg != regime and f"{k}/{reg}" in self._unmet)):
                    continue
                lead, k_hi = 0.0, 0.0
                if reg != regime:
                    k_hi = (until or {}).get(k, {}).get(reg, (math.inf, math.inf))[1]
                    k_pt = (until or {}).get(k, {}).get(reg, (math.inf, math.inf))[0]
                    if not math.isfinite(k_hi):
                        continue   # its forecast never runs a step of that regime: nothing to measure
                    # what those steps' work costs in the current layout: at the ratio of the two layouts' seconds
                    # for the batch's steps of that (other) regime — not the current layout's own time before its
                    # first step of `reg`, which is shorter when it runs the same prompts later (its pool is full)
                    oth = "prefill" if reg == "decode" else "decode"
                    k_o, c_o = self._regime_s.get(k, {}).get(oth, 0.0), self._regime_s.get(current, {}).get(oth, 0.0)
                    lead = max(0.0, k_hi - (k_pt * c_o / k_o if k_o > 0 else 0.0))
                    if lead > 0 and t >= cur:
                        continue   # it pays more than its round trip and may not measure: it needs a point lead
                opt = t * math.exp(-unc[k])
                if opt <= (1 - self.margin) * cur and (best is None or opt < best[0]):
                    within = PROBE_LEAD_SLACK * (k_hi + PROBE_BUDGET * left) if reg != regime else math.inf
                    best = (opt, k, lead, within)
            if best is not None:
                opt, k, lead, within = best
                first = "" if reg == regime else f"; {lead:.4g}s more than {current} before its first {reg} step"
                return k, (f"probe {k} in {reg}: {1 - per_tok[k] / cur:.1%} faster on its point prediction, "
                           f"{1 - opt / cur:.1%} at the optimistic end of its uncertainty (x{math.exp(unc[k]):.3g}), "
                           f"{self._known(k, reg)}{first}"), reg, lead, within
        return None

    def _probe_again(self, current: str, k: str, regime: str) -> int | None:
        """A probe of `k`, measured in `regime`, that leads by the margin on its point prediction and with the current
        layout's uncertainty but not once its own residual uncertainty is counted too (see the module docstring):
        `k`'s steps in `regime` so far, or None when it is not taken — `k` or `current` not measured there (a
        probe's own case, or staying measures the current layout), its probes of this kind there spent, within the
        dwell, or while `current`'s own probe has not measured it (its return judges that)."""
        trip = self._probe_trip
        if (self._since_switch_s < self._dwell_s or self.probes.get(_probe_key(k, regime, True), 0) >= MAX_PROBES
                or (trip is not None and trip[1] == current)
                or max(self._uncertainty(k, regime), self._uncertainty(current, regime)) >= PROBE_MIN_UNCERTAINTY):
            return None
        return self.steps.by_regime[regime][k].n

    def _trip_measured(self, lay: str, regime: str, again: int | None) -> bool:
        """Whether the probe into `lay` measured it in `regime`: its uncertainty there below PROBE_MIN_UNCERTAINTY;
        for a probe of a layout measured there already (`again`: its steps before the probe), also its steps there
        at least doubled, plus one — the probe's own measurements weigh as much as the earlier ones, and its
        residual uncertainty has halved."""
        if self._uncertainty(lay, regime) >= PROBE_MIN_UNCERTAINTY:
            return False
        return again is None or self.steps.by_regime[regime][lay].n >= 2 * again + 1

    def _known(self, lay: str, regime: str) -> str:
        """What `lay`'s factor in `regime` rests on, for a probe's reason."""
        st = self.steps.by_regime[regime][lay]
        if not st.n:
            return f"not measured in {regime} yet"
        now = self._shape.get(lay) if regime == "decode" else None
        away = f" at a stage mix {mix_distance(st.mix, now):.3g} (L1) from this batch's" if now and st.mix else ""
        return f"its {regime} factor learnt on {st.n} steps{away}"

    def _probe_return(self, current: str, per_tok: Mapping[str, float]) -> tuple[str, str] | None:
        """After a probe into `current`: once it is measured in the regime the probe was for, the layout it came
        from and why when that one is predicted faster (the trip then ends either way); None otherwise. The origin
        is judged at its point prediction, without the margin: the probe was entered on an optimistic view of
        `current`, so `current` is kept only when its measurement bears that view out."""
        trip = self._probe_trip
        if trip is None or trip[1] != current:
            self._probe_trip = None
            return None
        origin, _, regime, deadline, ahead, again = trip
        measured = self._trip_measured(current, regime, again)
        if not measured and self.overhead.ran_s <= deadline:
            return None   # not measured yet: the normal rule decides meanwhile
        self._probe_trip = None
        if not measured and ahead:   # it measured nothing: not counted, but not tried again ahead of its regime
            key = f"{current}/{regime}"
            self.probes[key] -= 1
            self._unmet.add(key)
        if origin not in per_tok or per_tok[origin] >= per_tok[current]:
            return None
        what = (f"the probe measured {current} {per_tok[current] / per_tok[origin] - 1:.1%} slower in {regime}"
                if measured else f"its {regime} steps did not come within its deadline, and {current} is "
                f"{per_tok[current] / per_tok[origin] - 1:.1%} slower on its point prediction")
        return origin, f"back to {origin}: {what}"

    def vet(self, d: Decision, manifest: Any) -> Decision:
        """The same rule with the planned switch's predicted exposed cost: switch only when the payoff exceeds it
        (or when the current layout cannot run the batch at all)."""
        raw = self.overhead.timed(self.model.switch, manifest, self.switch_mode,
                                  d.step_s.get(d.target)).exposed_seconds
        cost = self.switch_cost.corrected(d.current, d.target, raw)
        per_tok = d.seconds_per_token
        if d.probe:
            left = d.batch_seconds.get(d.current, 0.0)
            ok = 2 * cost + d.probe_lead_s <= PROBE_BUDGET * left
            lead = f" + {d.probe_lead_s:.4g}s before its regime" if d.probe_lead_s else ""
            lay, why = (d.target if ok else d.current), (
                f"{d.reason}: round trip 2 x {cost:.4g}s{lead} {'<=' if ok else '>'} {PROBE_BUDGET:.0%} of the "
                f"{left:.4g}s left in {d.current}")
        else:   # going back from a probe that measured slower: no margin, at the point prediction; the payoff
            # must still pay the switch
            unc = {**d.uncertainty, d.target: 0.0} if d.probe_return else d.uncertainty
            lay, why = choose_layout(d.current, per_tok, set(per_tok), 0.0 if d.probe_return else self.margin,
                                     d.work_tokens, {d.target: cost}, unit="output tokens", uncertainty=unc)
        ratio, seen = self.switch_cost.ratio(d.current, d.target)
        why += f" (switch cost: model {raw:.4g}s x {ratio:.3g} {'learnt' if seen else 'borrowed/default'})"
        return replace(d, verdict="switch" if lay == d.target else "not_worth_it", switch_s=cost,
                       switch_raw_s=raw, reason=why)

    def record(self, d: Decision, deferred: str | None = None) -> Decision:
        """Remember (and log when it changed) the decision actually taken at this boundary."""
        if deferred:
            d = replace(d, verdict="defer", reason=f"{d.reason}; deferred: {deferred}")
        prev, self.last, self._last_dict = self.last, d, None
        self.verdicts[d.verdict] = self.verdicts.get(d.verdict, 0) + 1
        if d.verdict == "switch":
            self._refund_cut_probe(d)
            reg, within, ahead, again = self._probe_for   # its deadline counts the steps' measured seconds from here
            self._probe_trip = ((d.current, d.target, reg, self.overhead.ran_s + within, ahead, again) if d.probe
                                else None)
            if d.probe:
                key = _probe_key(d.target, self._probe_for[0], self._probe_for[3] is not None)
                self.probes[key] = self.probes.get(key, 0) + 1
        if prev is None or (prev.verdict, prev.target, prev.current) != (d.verdict, d.target, d.current):
            self.history.append(self._last_view())
            log.info("layout decision %s", json.dumps(self.history[-1], sort_keys=True))
        return d

    def _refund_cut_probe(self, d: Decision) -> None:
        """A probe chained from a probed layout before that one was measured in its probe's regime (prefill prompts
        arrived during a decode probe, and another layout's prefill probe qualified): the first probe measured
        nothing, so it is not counted against that layout's probes — it may be probed there again, as a probe ahead
        of its regime that measured nothing is (`_probe_return`). The chain itself is not refused: it is how a
        layout that leads in the new regime is found."""
        trip = self._probe_trip
        if trip is None or not d.probe or trip[1] != d.current:
            return
        if not self._trip_measured(d.current, trip[2], trip[5]):
            key = _probe_key(d.current, trip[2], trip[5] is not None)
            self.probes[key] = max(0, self.probes.get(key, 0) - 1)

    def _last_view(self) -> dict | None:
        """The last decision as a dict, made once per decision (the server's snapshot asks after every step)."""
        if self._last_dict is None and self.last is not None:
            self._last_dict = self.last.as_dict()
        return self._last_dict

    # ---- the engine's boundary -----------------------------------------------------------------------------------
    def advise(self, step: int, current: str, scheduler: Any, ledger: Any) -> str | None:
        """The layout auto wants at this boundary of the engine's `scheduler` and `ledger` (None: stay). A wanted
        switch waits for `vet_pending` once its manifest is planned; anything else is recorded now."""
        self._pending = None
        if not (scheduler.running or scheduler.waiting):
            return None
        if not self._due(step, [r.req_id for r in scheduler.running],
                         min(len(scheduler.waiting), scheduler.max_num_seqs)):
            return None
        d, views = self.overhead.timed(self._evaluate, step, current, scheduler, ledger)
        if d.verdict != "switch":
            self.record(d)
            return None
        self._pending = d
        self._grow = {v.req_id: v.pending + min(v.remaining, PROBE_LEN_STEPS) for v in views if v.running}
        return d.target

    def _evaluate(self, step: int, current: str, scheduler: Any, ledger: Any) -> tuple[Decision, list[ReqView]]:
        """`_propose` at this boundary, the request views and per-layout usage it needs made here, so that the
        overhead budget bounds all of an evaluation's time."""
        views = request_views(scheduler, ledger)
        return self._propose(step, current, views, {lay: ledger.usage_under(lay) for lay in self.allowed}), views

    def vet_pending(self, manifest: Any, deferral: str | None, way_back=None) -> str | None:
        """The last word on the switch `advise` wanted, now that its manifest is planned (and `deferral` says whether
        memory headroom holds it back): a reason to refuse it, or None. The decision is recorded either way.
        `way_back(grow)`: the headroom deferral of the switch back once each request grew by `grow[req]` tokens
        (None: it fits); a probe whose way back would not fit is refused."""
        d, self._pending = self._pending, None
        if d is None:
            return "no switch was advised at this boundary"
        if d.probe and way_back is not None:
            try:
                back = self.overhead.timed(way_back, self._grow)
            except Exception:  # noqa: BLE001 — a probe is optional: one whose way back cannot be planned is not taken
                log.exception("auto layout: planning a probe's way back failed; staying in %s", d.current)
                back = "its way back could not be planned"
            if back is not None:
                v = replace(d, verdict="not_worth_it", reason=(
                    f"{d.reason}: but the way back to {d.current} would not fit after the probe "
                    f"(each request +{PROBE_LEN_STEPS} output tokens): {back}"))
                self.record(v)
                return v.reason
        try:
            v = self.vet(d, manifest)
        except Exception:  # noqa: BLE001 — the scheduler only advises: no prediction, no switch
            log.exception("auto layout: switch-cost prediction failed; staying in %s", d.current)
            return "switch-cost prediction failed"
        self.record(v, deferral if v.verdict == "switch" else None)
        return None if v.verdict == "switch" else v.reason

    # ---- views for metrics / API ----------------------------------------------------------------------------
    def summary(self) -> dict:
        sw = self.switch_cost.summary()
        sw["dwell_s"], sw["since_switch_s"] = round(self._dwell_s, 4), round(min(self._since_switch_s, 1e9), 4)
        if self._model_view is None:   # it changes only when a step trains a factor
            self._model_view = {
                lay: {"factor": round(self.factor(lay), 4), "last_predicted_s": s.last_predicted,
                      "last_measured_s": s.last_measured, "median_error": s.median_error,
                      "uncertainty": round(self.steps.uncertainty(lay), 4),
                      "prefill_factor": round(self.factor(lay, "prefill"), 4),
                      "prefill_uncertainty": round(self.steps.uncertainty(lay, "prefill"), 4),
                      "prefill_median_error": self.prefill_stats[lay].median_error}
                for lay, s in self.stats.items()}
        return {"last_decision": self._last_view(),
                "decisions": dict(self.verdicts),
                "model": self._model_view,
                "switches": list(self.switches), "switch_cost": sw, "probes": dict(self.probes),
                "overhead": {**self.overhead.summary(), "forecasts_replayed": self.forecast.replayed,
                             "forecasts_followed": self.forecast.followed},
                "history": list(self.history)}


# ---- the engine's wiring ----------------------------------------------------------------------------------------
def request_views(scheduler: Any, ledger: Any) -> list[ReqView]:
    """The scheduler's running and waiting requests (the first `max_num_seqs` waiting) as ReqViews."""
    out = [ReqView(r.req_id, r.num_cached, r.pending, output_left(r), ledger.owner(r.req_id))
           for r in scheduler.running]
    for i, r in enumerate(scheduler.waiting):
        if i >= scheduler.max_num_seqs:
            break
        out.append(ReqView(r.req_id, 0, r.pending, output_left(r), None, running=False))
    return out


def make_auto_layout(runner: Any, world: int, control: Any, ledger: Any, hardware_profile: str, margin: float,
                     scheduler: Any) -> AutoLayout:
    """The scheduler for an engine: a cost model of its model, dtypes and world on `hardware_profile`."""
    from splash.costmodel import CostModel, load_profile

    decision_log = logging.getLogger("splash.layout_policy")
    if not decision_log.hasHandlers():
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(asctime)s %(name)s %(message)s"))
        decision_log.addHandler(handler)
    if decision_log.getEffectiveLevel() > logging.INFO:
        decision_log.setLevel(logging.INFO)

    weight_dtype = str(runner.dtype).removeprefix("torch.")
    model = CostModel(runner.cfg, world, load_profile(hardware_profile), weight_dtype, dict(control.kv_dtypes),
                      runner.block_size, rope_fp8=control.rope_fp8)
    return AutoLayout(model, control.allowed, margin, block_size=runner.block_size, world=world,
                      capacity_blocks={lay: ledger.cap(lay) for lay in control.allowed},
                      max_num_seqs=scheduler.max_num_seqs, max_num_batched_tokens=scheduler.budget,
                      switch_mode=control.mode, scheduler=scheduler)
