"""Layout switching (handoff): the pure manifest planner. No torch."""
from splash.switching.manifest import BlockMove, Manifest, ReqState, kv_action, plan_switch, weight_action

__all__ = ["BlockMove", "Manifest", "ReqState", "kv_action", "plan_switch", "weight_action"]
