"""Which attention layout the engine runs in — the one place that decides, pure Python, no torch.

At each step boundary the engine asks `control.LayoutController.decide`: in pinned mode the target is the pinned
layout (POST /v1/layout or the config); in auto mode it is what `auto.AutoLayout.advise` wants, from forecasts of
every allowed layout (`forecast`: the engine's own scheduler replayed under each layout's KV pool, priced by the cost
model and corrected online by `correction`, within the time `budget` allows). The controller plans the switch's
manifest and checks its memory headroom; auto then vets it against the switch's predicted cost
(`AutoLayout.vet_pending`), and records a structured `decision.Decision` — candidates, predictions, margin, payoff,
verdict and why — which GET /v1/layout shows as is. Decision lines are logged on ``splash.layout_policy``.
"""
