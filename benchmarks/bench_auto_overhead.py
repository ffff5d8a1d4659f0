"""What `layout: auto` costs while it never switches: two engines in one process pair, auto and pinned TP, on the
same model and requests, run alternately (paired A/B: on a host whose speed drifts, the pairing is what makes a
few-percent difference visible), with auto's re-evaluations, forecasts and online corrections all running.

    .venv/bin/mpiexec -n 2 .venv/bin/python benchmarks/bench_auto_overhead.py [--pairs 12] [--requests 16]

Auto is kept in TP by allowing only TP besides itself (`allowed_layouts: [tp]`), so every difference is its own work;
or, forecasting all four layouts as it serves, by a margin no layout can lead by (`--allowed tp,dp_attn,cp,dop
--margin 0.95`).
Prints, on rank 0, each engine's median wall seconds per generate and the median of the per-pair ratios auto / TP
(1.00 = free), and rank 0's split of auto's time (forecasts, corrections) from the scheduler's own accounting.
"""
from __future__ import annotations

import argparse
import statistics
import time

from splash.distributed import init_dist
from splash.engine.llm import LLM
from splash.engine.sampling import SamplingParams


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--pairs", type=int, default=12)
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--prompt", type=int, default=64)
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--preset", default="tiny-mla")
    ap.add_argument("--allowed", default="tp", help="layouts auto may choose (default tp: it never switches)")
    ap.add_argument("--margin", type=float, default=0.10, help="auto's switch margin")
    a = ap.parse_args()
    comm = init_dist().comm
    allowed = tuple(a.allowed.split(","))
    engines = {"auto": LLM(preset=a.preset, layout="auto", allowed_layouts=allowed, switch_margin=a.margin, comm=comm),
               "tp": LLM(preset=a.preset, layout="tp", allowed_layouts=allowed, hardware_profile=None, comm=comm)}
    prompts = [[(7 * i + j) % 250 + 1 for j in range(a.prompt)] for i in range(a.requests)]
    params = SamplingParams(max_tokens=a.new, temperature=0.0, ignore_eos=True)
    for llm in engines.values():   # warm-up
        llm.generate(prompts[:2], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
    times: dict[str, list[float]] = {k: [] for k in engines}
    ratios = []
    for p in range(a.pairs):
        order = ["auto", "tp"] if p % 2 == 0 else ["tp", "auto"]
        t = {}
        for name in order:
            comm.barrier()
            t0 = time.perf_counter()
            engines[name].generate(prompts, params)
            t[name] = time.perf_counter() - t0
            times[name].append(t[name])
        ratios.append(t["auto"] / t["tp"])
    if comm.rank == 0:
        auto = engines["auto"].engine.auto
        med = {k: statistics.median(v) for k, v in times.items()}
        print(f"{a.requests} requests x ({a.prompt} prompt + {a.new} new), {a.pairs} pairs, world {comm.size}")
        print(f"median s per generate: auto {med['auto']:.4f}  tp {med['tp']:.4f}")
        print(f"median per-pair ratio auto/tp: {statistics.median(ratios):.4f}  "
              f"(min {min(ratios):.4f}, max {max(ratios):.4f})")
        print(f"auto layout: {engines['auto'].engine.layout}; verdicts {auto.verdicts}; "
              f"overhead {auto.overhead.summary()}")


if __name__ == "__main__":
    main()
