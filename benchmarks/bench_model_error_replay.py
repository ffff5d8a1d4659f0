"""One replay of the scheduler-under-model-error experiment with auto's decisions: what `splash-sim --trace WORKLOAD
--truth-error results/sim-paper.json --truth-kernels KERNELS --seeds SEED` runs for one (workload, truth kernels,
seed, mode), plus every decision auto took and the CPU time of its evaluations, so a case can be read decision by
decision and two trees compared byte for byte. Pure Python, no torch.

    PYTHONHASHSEED=0 .venv/bin/python benchmarks/bench_model_error_replay.py agentic per_layout 8 \
        [--mode auto|oracle|tp|dp_attn|cp|dop] [--table results/sim-paper.json] [--json FILE]

Prints tokens/s, switches, the evaluations and their CPU seconds (`AutoLayout._evaluate`, what the engine's overhead
budget charges; `observe`), then the switch timeline; --json writes those with `decisions` (every decision recorded,
`dataclasses.asdict` of each `Decision`, floats in full) and `truth_factors`. (PYTHONHASHSEED=0 was needed before
session 22's fix of `forecast._Clone.block_hash`, which hashed with Python's salted `hash`; it is harmless now.)
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from splash.costmodel.profile import load_profile  # noqa: E402
from splash.costmodel.step_cost import CostModel  # noqa: E402
from splash.engine.layout_policy.auto import AutoLayout  # noqa: E402
from splash.sim import trace  # noqa: E402
from splash.sim.cli import build_parser  # noqa: E402
from splash.sim.model_error import TRUTH_KERNELS, draw_truth, held_out_residuals  # noqa: E402
from splash.sim.presets import load_sim_model  # noqa: E402
from splash.sim.serving import SimSetup, capacities  # noqa: E402
from splash.sim.storage import RUNTIME_RESERVE_BYTES  # noqa: E402
from splash.sim.workloads import BUILTIN, builtin  # noqa: E402


class _Recorded(AutoLayout):
    """The replay's AutoLayout, keeping every decision it records and the CPU time of its evaluations."""

    def record(self, d, deferred=None):
        d = super().record(d, deferred)
        self.kept.append(dataclasses.asdict(d))
        return d

    def _evaluate(self, *a):
        t = time.process_time()
        try:
            return super()._evaluate(*a)
        finally:
            self.cpu["evaluate_s"] += time.process_time() - t
            self.cpu["evaluations"] += 1

    def observe(self, *a, **kw):
        t = time.process_time()
        try:
            return super().observe(*a, **kw)
        finally:
            self.cpu["observe_s"] += time.process_time() - t


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("workload", choices=BUILTIN)
    ap.add_argument("kernels", choices=TRUTH_KERNELS)
    ap.add_argument("seed", type=int)
    ap.add_argument("--mode", default="auto", help="auto, oracle (auto planning with the truth) or a fixed layout")
    ap.add_argument("--table", default="results/sim-paper.json", help="`splash-sim paper --json` output")
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    # the CLI's setup for `--model glm-5.3 --hardware b200 --ranks 8` and its defaults
    c = build_parser().parse_args(["--model", "glm-5.3", "--hardware", "b200", "--ranks", "8"])
    model = load_sim_model(c.model, c.weight_dtype, c.kv_dtype)
    prof = load_profile(c.hardware)
    cm = CostModel(model.cfg, c.ranks, prof, model.weight_dtype, model.kv_dtype, c.block_size, cp_prefill=c.cp_prefill)
    setup = SimSetup(model, prof, c.ranks, c.mem_fraction, c.block_size, c.chunk,
                     RUNTIME_RESERVE_BYTES if c.reserve is None else float(c.reserve),
                     c.prefill_split == "owner", c.storage, c.deployment, c.decode_layout,
                     c.decode_ranks, c.decode_nodes)
    caps = capacities(setup)
    truth = draw_truth(cm, held_out_residuals(json.loads(Path(a.table).read_text())["rows"]), a.seed, a.kernels)
    made = []
    build = trace._scheduler

    def keep(*args, **kw):   # the replay builds its AutoLayout inside: keep it to read its decisions
        auto = build(*args, **kw)
        auto.__class__ = _Recorded
        auto.kept, auto.cpu = [], {"evaluations": 0, "evaluate_s": 0.0, "observe_s": 0.0}
        made.append(auto)
        return auto

    trace._scheduler = keep
    t0 = time.process_time()
    res = trace.replay(cm, setup, caps, builtin(a.workload, a.seed), "auto" if a.mode == "oracle" else a.mode,
                       c.margin, truth=truth, plan=truth if a.mode == "oracle" else None)
    auto = made[0] if made else None
    cpu = {k: round(v, 3) for k, v in auto.cpu.items()} if auto else {}
    out = {"workload": a.workload, "kernels": a.kernels, "seed": a.seed, "mode": a.mode,
           "tokens_per_s": res.output_tokens_per_s, "switches": res.switches,
           "cpu_s": round(time.process_time() - t0, 1), **cpu,
           "timeline": res.timeline, "decisions": auto.kept if auto else [],
           "truth_factors": {f"{lay}/{st}": f for (lay, st), f in truth.step_factor.items()}}
    if a.json:
        # without the CPU seconds: two runs of the same tree write the same bytes
        cpu = ("cpu_s", "evaluate_s", "observe_s")
        Path(a.json).write_text(json.dumps({k: v for k, v in out.items() if k not in cpu}, indent=1))
    print(json.dumps({k: v for k, v in out.items() if k not in ("timeline", "decisions", "truth_factors")}))
    for t, move, why in res.timeline:
        print(f"  {t:8.2f} s  {move}  {why}")


if __name__ == "__main__":
    main()
