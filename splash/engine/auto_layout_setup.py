"""The engine's wiring of the live scheduler (splash.engine.auto_layout): the request views it predicts from, and
an AutoLayout built from the runner's model, dtypes and world on a hardware profile. Its decision lines
("layout decision {json}", logger ``splash.scheduler``, INFO) go to stderr unless logging is configured already."""
from __future__ import annotations

import logging
import sys
from typing import Any

from splash.engine.auto_layout import AutoLayout, ReqView


def request_views(scheduler: Any, ledger: Any) -> list[ReqView]:
    """The scheduler's running and waiting requests (the first `max_num_seqs` waiting) as ReqViews."""
    def left(r) -> int:
        return max(0, min(r.max_tokens - len(r.output), r.max_len - len(r.prompt) - len(r.output)))
    out = [ReqView(r.req_id, r.num_cached, r.pending, left(r), ledger.reqs.get(r.req_id, (0, None))[1])
           for r in scheduler.running]
    for i, r in enumerate(scheduler.waiting):
        if i >= scheduler.max_num_seqs:
            break
        out.append(ReqView(r.req_id, 0, r.pending, left(r), None, running=False))
    return out


def make_auto_layout(runner: Any, world: int, control: Any, ledger: Any, hardware_profile: str, margin: float,
                     scheduler: Any) -> AutoLayout:
    """The scheduler for an engine: a cost model of its model, dtypes and world on `hardware_profile`."""
    from splash.costmodel import CostModel, load_profile

    decision_log = logging.getLogger("splash.scheduler")
    if not decision_log.hasHandlers():
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(asctime)s %(name)s %(message)s"))
        decision_log.addHandler(handler)
    if decision_log.getEffectiveLevel() > logging.INFO:
        decision_log.setLevel(logging.INFO)

    weight_dtype = str(runner.dtype).removeprefix("torch.")
    model = CostModel(runner.cfg, world, load_profile(hardware_profile), weight_dtype, dict(control.kv_dtypes),
                      runner.block_size)
    return AutoLayout(model, control.allowed, margin, block_size=runner.block_size, world=world,
                      capacity_blocks={lay: ledger.cap(lay) for lay in control.allowed},
                      max_num_seqs=scheduler.max_num_seqs, max_num_batched_tokens=scheduler.budget,
                      switch_mode=control.mode, scheduler=scheduler)
