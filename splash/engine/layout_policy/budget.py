"""The live scheduler's own time (splash.engine.layout_policy.auto): its re-evaluations may take at most a share of the
executed steps' measured time; its observations are timed and reported but not bounded. Pure Python."""
from __future__ import annotations

import math
import time


class PredictionBudget:
    def __init__(self, share: float, timer=time.perf_counter):
        self.share, self.timer = share, timer
        self.spent_s = 0.0      # re-evaluations' prediction time (what the budget bounds)
        self.observe_s = 0.0    # observations' prediction time (reported only)
        self.ran_s = 0.0        # the executed steps' measured time

    def credit(self) -> bool:
        """Whether the re-evaluations' time so far is within the budget of the steps' time (always, for a share
        of math.inf: no bound)."""
        return self.share == math.inf or self.spent_s <= self.share * self.ran_s

    def timed(self, fn, *args, budgeted: bool = True):
        """fn(*args), its time counted as a re-evaluation's (budgeted) or an observation's."""
        t = self.timer()
        try:
            return fn(*args)
        finally:
            dt = max(0.0, self.timer() - t)
            if budgeted:
                self.spent_s += dt
            else:
                self.observe_s += dt

    def summary(self) -> dict:
        return {"predict_s": round(self.spent_s, 4), "observe_s": round(self.observe_s, 4),
                "steps_s": round(self.ran_s, 4),
                "share": round(self.spent_s / self.ran_s, 4) if self.ran_s else None, "budget": self.share}
