"""One replay of the scheduler-under-model-error experiment, with auto's decisions: what `splash-sim --truth-error`
runs for one (workload, truth kernels, seed, mode), plus the AutoLayout's decision history and the seed's truth
factors, so a seed where auto loses can be read decision by decision. Pure Python, no torch.

    .venv/bin/python benchmarks/bench_model_error_replay.py agentic shared 7 [--mode auto|oracle|tp|dp_attn|cp|dop]
        [--table results/sim-paper.json] [--json FILE]

Prints tokens/s, switches and the switch timeline; --json writes those with `history` (AutoLayout.history: the
decisions that changed, each with every layout's corrected prediction and uncertainty) and `truth_factors`.
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from splash.costmodel.profile import load_profile
from splash.costmodel.step_cost import CostModel
from splash.sim import trace
from splash.sim.cli import build_parser
from splash.sim.model_error import TRUTH_KERNELS, draw_truth, held_out_residuals
from splash.sim.presets import load_sim_model
from splash.sim.serving import SimSetup, capacities
from splash.sim.storage import RUNTIME_RESERVE_BYTES
from splash.sim.workloads import BUILTIN, builtin


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

    def keep(*args, **kw):   # the replay builds its AutoLayout inside: keep it to read its history
        auto = build(*args, **kw)
        made.append(auto)
        return auto

    trace._scheduler = keep
    t0 = time.time()
    res = trace.replay(cm, setup, caps, builtin(a.workload, a.seed), "auto" if a.mode == "oracle" else a.mode,
                       c.margin, truth=truth, plan=truth if a.mode == "oracle" else None)
    out = {"workload": a.workload, "kernels": a.kernels, "seed": a.seed, "mode": a.mode,
           "tokens_per_s": res.output_tokens_per_s, "switches": res.switches, "wall_s": round(time.time() - t0, 1),
           "timeline": res.timeline, "history": list(made[0].history) if made else [],
           "truth_factors": {f"{lay}/{st}": f for (lay, st), f in truth.step_factor.items()}}
    print(json.dumps({k: out[k] for k in ("workload", "kernels", "seed", "mode", "tokens_per_s", "switches",
                                          "wall_s")}))
    for t, move, why in res.timeline:
        print(f"  {t:8.2f} s  {move}  {why}")
    if a.json:
        Path(a.json).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
