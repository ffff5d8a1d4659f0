"""CPU time of `auto`'s evaluations over the built-in workload's request mix, offline (no model, no ranks): the
engine's own `Scheduler` with the prefix cache on, stepped as the engine steps it (each request makes its max_tokens,
sampling tokens of its own), `AutoLayout.advise` at every boundary with no overhead budget (every due evaluation
runs), the cost model of small-mla on the cpu profile, four layouts.

    .venv/bin/python benchmarks/bench_auto_forecasts.py

Prints, per phase (the two interactive requests; the burst of 32 until only 2 are left; the long tail), the
evaluations, the forecasts replayed (the rest were answered from a forecast the engine followed) and the CPU
milliseconds spent in `advise`, then the verdicts.
"""
from __future__ import annotations

import math
import time

import splash.engine.layout_policy.forecast as forecast
from splash.costmodel import CostModel, RowLoad, load_profile
from splash.engine.layout_policy.auto import AutoLayout
from splash.engine.ledger import KVLedger
from splash.engine.scheduler import Request, Scheduler
from splash.models.preset_configs import preset_config

LAYOUTS = ("tp", "dp_attn", "cp", "dop")
BURST_STEP = 60


def main() -> None:
    model = CostModel(preset_config("small-mla"), 2, load_profile("cpu"), "float32", dict.fromkeys(LAYOUTS, "float32"),
                      16)
    led = KVLedger(2, 2000, 16, "tp", prefix=True)
    s = Scheduler(led, 64, 2048)
    a = AutoLayout(model, LAYOUTS, 0.1, block_size=16, world=2, capacity_blocks=dict.fromkeys(LAYOUTS, 2000),
                   max_num_seqs=64, max_num_batched_tokens=2048, row=RowLoad, scheduler=s, overhead_budget=math.inf)
    replays, real = [0], forecast.replay

    def counted(*args, **kw):
        replays[0] += 1
        return real(*args, **kw)
    forecast.replay = counted
    for i in range(2):
        s.add(Request(f"i{i}", list(range(1000 * i, 1000 * i + 64)), 256))
    phases = ("interactive", "burst", "tail")
    cpu, evals, rep = dict.fromkeys(phases, 0.0), dict.fromkeys(phases, 0), dict.fromkeys(phases, 0)
    step, tok = 0, 1 << 20
    while s.running or s.waiting:
        if step == BURST_STEP:
            for i in range(30):
                s.add(Request(f"b{i}", list(range(5000 + 600 * i, 5512 + 600 * i)), 64))
            for i in range(2):
                s.add(Request(f"l{i}", list(range(50000 + 3000 * i, 52048 + 3000 * i)), 768))
        phase = "interactive" if step < BURST_STEP else "burst" if len(s.running) + len(s.waiting) > 2 else "tail"
        n0, r0, t0 = sum(a.verdicts.values()), replays[0], time.process_time()
        a.advise(step, "tp", s, led)
        cpu[phase] += time.process_time() - t0
        evals[phase] += sum(a.verdicts.values()) - n0
        rep[phase] += replays[0] - r0
        plan = s.schedule()
        sampled = {}
        for it in plan.items:
            if it.sample:
                tok += 1
                sampled[it.req_id] = tok
        s.update(plan, sampled)
        step += 1
    print(f"{step} steps")
    for ph in (*phases, "total"):
        e, r, c = ((sum(evals.values()), sum(rep.values()), sum(cpu.values())) if ph == "total"
                   else (evals[ph], rep[ph], cpu[ph]))
        print(f"{ph:12s} evaluations {e:3d}  forecasts replayed {r:3d}  CPU in advise {c * 1e3:7.1f} ms")
    print("verdicts", dict(a.verdicts))


if __name__ == "__main__":
    main()
