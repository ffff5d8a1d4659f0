"""Layout switching (handoff): the pure manifest planner. No torch."""
from splash.switching.block_plan import BlockMove, CachedBlock
from splash.switching.manifest import Manifest, ReqState, kv_action, plan_switch, weight_action

__all__ = ["BlockMove", "CachedBlock", "Manifest", "ReqState", "kv_action", "plan_switch", "weight_action"]
