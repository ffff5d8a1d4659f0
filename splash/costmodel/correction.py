"""Online correction of the cost model from measured step times (issue 8 item 4). Pure, no torch.

One multiplicative factor per layout, an exponential moving average of measured / predicted over the steps
run in that layout; layouts not run yet keep the mean factor of those that were (the machine-wide error,
e.g. load), or 1.0. The prediction error before correction is kept for /metrics and logs.
"""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class LayoutCorrection:
    alpha: float = 0.2                 # EMA weight of the newest step
    lo: float = 0.2                    # factor clamp: one odd step cannot swing the choice arbitrarily
    hi: float = 5.0
    factors: dict[str, float] = field(default_factory=dict)
    samples: dict[str, int] = field(default_factory=dict)
    abs_rel_error: dict[str, float] = field(default_factory=dict)  # EMA of |pred·factor - meas| / meas
    last: dict[str, tuple[float, float]] = field(default_factory=dict)  # layout -> (predicted, measured)

    def update(self, layout: str, predicted: float, measured: float) -> None:
        """Record one step run in ``layout``: the raw prediction and the measured seconds."""
        if predicted <= 0 or measured <= 0:
            return
        f_old = self.factor(layout)
        err = abs(predicted * f_old - measured) / measured
        ratio = min(self.hi, max(self.lo, measured / predicted))
        n = self.samples.get(layout, 0)
        a = 1.0 if n == 0 else self.alpha
        self.factors[layout] = (1 - a) * self.factors.get(layout, ratio) + a * ratio
        self.abs_rel_error[layout] = err if n == 0 else (1 - self.alpha) * self.abs_rel_error[layout] + self.alpha * err
        self.samples[layout] = n + 1
        self.last[layout] = (predicted, measured)

    def factor(self, layout: str) -> float:
        if layout in self.factors:
            return self.factors[layout]
        if self.factors:
            return sum(self.factors.values()) / len(self.factors)
        return 1.0

    def corrected(self, predicted: dict[str, float]) -> dict[str, float]:
        """Predicted seconds per layout × its factor."""
        return {k: v * self.factor(k) for k, v in predicted.items()}
