"""The switching rule of the transition-aware scheduler (paper §4.2), as one pure function (the engine's and
``splash-sim --trace``'s). No torch."""
from __future__ import annotations

import math
from collections.abc import Mapping


def choose_layout(current: str, predicted: Mapping[str, float], feasible: set[str], margin: float,
                  remaining_steps: float, switch_seconds: Mapping[str, float],
                  unit: str = "steps", uncertainty: Mapping[str, float] | None = None) -> tuple[str, str]:
    """(layout to run next, reason).

    ``predicted``: step seconds per layout (or, with ``unit="tokens"``, seconds per output token, and then
    ``remaining_steps`` counts output tokens); ``feasible``: layouts whose memory and switch headroom allow them;
    ``switch_seconds``: exposed cost of switching to each layout (missing: not taken); ``uncertainty``: per layout,
    a log-space uncertainty of its prediction (missing: 0).

    An infeasible layout is never chosen; an infeasible or unpredicted ``current`` gives way to the fastest feasible
    one whatever the margin and cost. Otherwise a candidate, judged at its pessimistic prediction
    ``predicted[c] * exp(uncertainty[c])``, must be at least ``margin`` faster than ``current`` (hysteresis: at a
    crossover neither beats the other by the margin, so the rule never flaps) and pay
    ``(predicted[current] - predicted[c]) * remaining_steps`` more than its switch cost; the largest net payoff wins
    (ties: faster, then name).
    """
    if not 0.0 <= margin < 1.0:
        raise ValueError(f"margin must be in [0, 1), got {margin}")
    cands = {k: v for k, v in predicted.items() if k in feasible and math.isfinite(v)}
    if not cands:
        return current, "stay: no feasible layout with a prediction"
    if current not in cands:
        best = min(cands, key=lambda k: (cands[k], k))
        why = "infeasible" if current not in feasible else "unpredicted"
        return best, f"switch: current {current} is {why}; {best} is the fastest feasible ({cands[best]:.4g}s)"
    cur = cands[current]
    unc = uncertainty or {}
    hi = {k: t * math.exp(max(0.0, unc.get(k, 0.0))) if k != current else t for k, t in cands.items()}
    scored = []
    for k, t in hi.items():
        if k == current:
            continue
        if t > (1.0 - margin) * cur:
            continue
        cost = switch_seconds.get(k)
        if cost is None or not math.isfinite(cost):
            continue
        payoff = (cur - t) * max(0.0, remaining_steps)
        if payoff > cost:
            scored.append((payoff - cost, -t, k, payoff, cost))
    if not scored:
        best = min(cands, key=lambda k: (cands[k], k))
        if best == current:
            return current, f"stay: {current} is the fastest feasible ({cur:.4g}s)"
        gain, gain_hi = 1.0 - cands[best] / cur, 1.0 - hi[best] / cur
        if gain_hi < margin <= gain:
            return current, (f"stay: {best} is {gain:.1%} faster, {gain_hi:.1%} with its uncertainty "
                             f"(x{hi[best] / cands[best]:.3g}), below the {margin:.0%} margin")
        if gain < margin:
            return current, f"stay: {best} is {gain:.1%} faster, below the {margin:.0%} margin"
        cost = switch_seconds.get(best)
        payoff = (cur - hi[best]) * max(0.0, remaining_steps)
        return current, (f"stay: {best} pays {payoff:.4g}s over {remaining_steps:.4g} {unit}, not more than "
                         f"its switch cost {cost if cost is not None else 'unknown'}s")
    net, _, k, payoff, cost = max(scored)
    lead = f" ({1.0 - hi[k] / cur:.1%} with its uncertainty)" if hi[k] != cands[k] else ""
    return k, (f"switch: {k} {1.0 - cands[k] / cur:.1%} faster than {current}{lead}; payoff {payoff:.4g}s over "
               f"{remaining_steps:.4g} {unit} > switch cost {cost:.4g}s")
