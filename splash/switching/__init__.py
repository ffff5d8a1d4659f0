"""Layout switching (handoff): the pure manifest planner (manifest, block_plan) and its executor on the ranks."""
