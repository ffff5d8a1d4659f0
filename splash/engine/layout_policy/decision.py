"""What the `layout: auto` scheduler (`auto`) sees and says — pure Python, no torch: the request
views it predicts from, the decisions it records, and the cost model's interface it needs."""
from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

# stay: current predicted fastest; below_margin: another leads by less than the margin; not_worth_it: the switch
# costs more than its payoff; switch: taken; defer: wanted but no memory headroom yet; idle: nothing to predict;
# uncertain: leads by the margin only on a borrowed correction factor; dwell: too soon after the last switch
VERDICTS = ("stay", "below_margin", "not_worth_it", "switch", "defer", "idle", "uncertain", "dwell")


class CostModelLike(Protocol):
    """What the controller needs of `splash.costmodel.CostModel` (kept as a protocol so this module is pure)."""

    def step(self, layout: str, rows: Sequence[Any]) -> Any: ...       # -> object with .seconds

    def switch(self, manifest: Any, mode: str, step_seconds: float | None = None) -> Any: ...  # .exposed_seconds


@dataclass(frozen=True)
class ReqView:
    """One request as the scheduler sees it at a boundary."""
    req_id: str
    cached: int           # tokens whose KV is resident
    pending: int          # tokens still to prefill before the next sample (1 in decode)
    remaining: int        # output tokens still to generate (max_tokens / max_model_len bound)
    owner: int | None     # ledger owner (DP-attn/DOP owner, CP anchor); None for waiting requests
    running: bool = True


@dataclass(frozen=True)
class Decision:
    """One evaluated boundary: what each layout was predicted to cost and what the controller did."""
    step: int
    current: str
    verdict: str                      # one of VERDICTS
    target: str | None
    reason: str
    seconds_per_token: dict[str, float] = field(default_factory=dict)   # corrected prediction per layout
    batch_seconds: dict[str, float] = field(default_factory=dict)       # time to finish its batch
    admitted: dict[str, int] = field(default_factory=dict)              # requests in each layout's batch
    infeasible: dict[str, str] = field(default_factory=dict)            # layout -> why not
    margin: float = 0.0
    payoff_s: float = 0.0
    switch_s: float = 0.0
    work_tokens: int = 0                                                # output tokens the payoff is over
    step_s: dict[str, float] = field(default_factory=dict)              # one decode step of the batch now
    uncertainty: dict[str, float] = field(default_factory=dict)         # log-space, combined with the current's
    switch_raw_s: float = 0.0                                           # the model's switch cost before correction
    t_s: float = 0.0                                                    # seconds since the scheduler started
    probe: bool = False                      # entering `target` to measure it (its lead is within its uncertainty)
    probe_return: bool = False               # leaving a probed layout that measured slower for where it came from
    probe_lead_s: float = 0.0                # a probe's steps before its regime's first one, beyond the current's

    def as_dict(self) -> dict:
        r6 = lambda d: {k: round(v, 6) for k, v in d.items()}  # noqa: E731
        return {"step": self.step, "current": self.current, "verdict": self.verdict, "target": self.target,
                "reason": self.reason, "seconds_per_token": r6(self.seconds_per_token),
                "batch_seconds": r6(self.batch_seconds), "admitted": dict(self.admitted),
                "infeasible": dict(self.infeasible), "margin": self.margin,
                "payoff_s": round(self.payoff_s, 6) if math.isfinite(self.payoff_s) else None,
                "switch_s": round(self.switch_s, 6), "work_tokens": self.work_tokens,
                "step_s": r6(self.step_s), "uncertainty": r6(self.uncertainty),
                "switch_raw_s": round(self.switch_raw_s, 6), "t_s": round(self.t_s, 3),
                "probe": self.probe, "probe_return": self.probe_return,
                "probe_lead_s": round(self.probe_lead_s, 6)}
