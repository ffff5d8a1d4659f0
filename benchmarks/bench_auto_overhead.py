"""What `layout: auto` costs while it never switches: two engines in one process pair, auto and pinned TP, on the
same model and requests, run alternately (paired A/B: on a host whose speed drifts, the pairing is what makes a
few-percent difference visible), with auto's re-evaluations, forecasts and online corrections all running.

    .venv/bin/mpiexec -n 2 .venv/bin/python benchmarks/bench_auto_overhead.py [--pairs 12] [--requests 16]
    .venv/bin/mpiexec -n 2 .venv/bin/python benchmarks/bench_auto_overhead.py --workload builtin --preset small-mla \
        --allowed tp,dp_attn,cp,dop --pairs 6

Auto is kept in TP by allowing only TP besides itself (`allowed_layouts: [tp]`), so every difference is its own work;
or, forecasting all four layouts as it serves, by a margin no layout can lead by (`--allowed tp,dp_attn,cp,dop
--margin 0.95`). The pinned engine has the cost model too and observes its steps, as a pinned splash-serve does.

Without `--workload` each run is one `generate` of the same requests. With it each run serves a workload file's
requests (`splash-bench workload`'s format; `builtin`: its built-in shifting workload) at their arrival times, the
engine stepped as the server's engine thread steps it (requests added when due, idle until the next arrival), and a
run's time is its first arrival to its last token. Prints, on rank 0, per pair the two runs' seconds and auto / TP
(1.00 = free), their median and spread, and per engine rank 0's thread CPU seconds, steps, the full garbage
collections in its runs, auto's time in forecasts and both engines' time in observations (the scheduler's own
accounting).
"""
from __future__ import annotations

import argparse
import gc
import statistics
import time

from splash.distributed import init_dist
from splash.engine.llm import LLM
from splash.engine.sampling import SamplingParams


class GCTimer:
    """Full (generation 2) collections on this process and their seconds, while `on`."""

    def __init__(self):
        self.on, self.n, self.s, self._t = False, 0, 0.0, 0.0
        gc.callbacks.append(self._cb)

    def _cb(self, phase, info):
        if not self.on or info.get("generation") != 2:
            return
        if phase == "start":
            self._t = time.perf_counter()
        else:
            self.n, self.s = self.n + 1, self.s + time.perf_counter() - self._t


def serve(llm: LLM, requests: list, rank: int) -> tuple[float, int]:
    """Serve `requests` ((arrival s, prompt, max_tokens) each) at their arrival times: (seconds, output tokens)."""
    eng = llm.engine
    if rank != 0:
        eng.follow()
        return 0.0, 0
    todo = sorted(requests, key=lambda r: r[0])
    i, tokens, t0 = 0, 0, time.perf_counter()
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for _, _, n in todo]
    try:
        while i < len(todo) or eng.has_work():
            now = time.perf_counter() - t0
            while i < len(todo) and todo[i][0] <= now:
                eng.add_request(list(todo[i][1]), params[i])
                i += 1
            if eng.has_work():
                tokens += len(eng.step())
            elif i < len(todo):
                time.sleep(max(0.0, todo[i][0] - now))
    finally:
        eng.stop()
    return time.perf_counter() - t0, tokens


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--pairs", type=int, default=12)
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--prompt", type=int, default=64)
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--preset", default="tiny-mla")
    ap.add_argument("--allowed", default="tp", help="layouts auto may choose (default tp: it never switches)")
    ap.add_argument("--margin", type=float, default=0.10, help="auto's switch margin")
    ap.add_argument("--workload", metavar="FILE", help="serve a workload file's requests at their arrival times "
                    "(`builtin`: splash-bench workload's built-in one) instead of one generate per run")
    ap.add_argument("--max-num-seqs", type=int, default=64, help="as configs/cpu.yaml")
    a = ap.parse_args()
    comm = init_dist().comm
    allowed = tuple(a.allowed.split(","))
    kw = dict(preset=a.preset, allowed_layouts=allowed, switch_margin=a.margin, comm=comm,
              max_num_seqs=a.max_num_seqs)
    engines = {"auto": LLM(layout="auto", **kw), "tp": LLM(layout="auto", **kw)}
    engines["tp"].engine.request_layout("tp")   # pinned, with the cost model observing, as a pinned server runs
    if a.workload:
        from splash.workload import load_workload, make_requests
        reqs = [(at, parts[0], n) for at, parts, n in
                make_requests(load_workload(None if a.workload == "builtin" else a.workload))]
    else:
        prompts = [[(7 * i + j) % 250 + 1 for j in range(a.prompt)] for i in range(a.requests)]
        params = SamplingParams(max_tokens=a.new, temperature=0.0, ignore_eos=True)
    for llm in engines.values():   # warm-up
        llm.generate([[1, 2, 3, 4]] * 2, SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
    gc.collect()
    gc.freeze()   # the start-up heap, as splash-serve's engine thread freezes it
    gct = GCTimer()
    times: dict[str, list[float]] = {k: [] for k in engines}
    cpu, steps, gcs = dict.fromkeys(engines, 0.0), dict.fromkeys(engines, 0), {k: [0, 0.0] for k in engines}
    ratios, lines = [], []
    for p in range(a.pairs):
        order = ["auto", "tp"] if p % 2 == 0 else ["tp", "auto"]
        t = {}
        for name in order:
            comm.barrier()
            llm = engines[name]
            n0, c0, g0 = llm.engine.num_steps, time.thread_time(), (gct.n, gct.s)
            gct.on = True
            if a.workload:
                t[name] = serve(llm, reqs, comm.rank)[0]
            else:
                t0 = time.perf_counter()
                llm.generate(prompts, params)
                t[name] = time.perf_counter() - t0
            gct.on = False
            t[name] = comm.broadcast_obj(t[name])
            cpu[name] += time.thread_time() - c0
            steps[name] += llm.engine.num_steps - n0
            gcs[name][0] += gct.n - g0[0]
            gcs[name][1] += gct.s - g0[1]
            times[name].append(t[name])
        ratios.append(t["auto"] / t["tp"])
        lines.append(f"pair {p}: auto {t['auto']:.3f} s  tp {t['tp']:.3f} s  auto/tp {ratios[-1]:.4f}")
    if comm.rank == 0:
        med = {k: statistics.median(v) for k, v in times.items()}
        what = f"workload {a.workload}" if a.workload else f"{a.requests} requests x ({a.prompt} prompt + {a.new} new)"
        print(f"{what}, preset {a.preset}, allowed {a.allowed}, margin {a.margin}, {a.pairs} pairs, world {comm.size}")
        print("\n".join(lines))
        print(f"median s per run: auto {med['auto']:.4f}  tp {med['tp']:.4f}")
        print(f"median per-pair ratio auto/tp: {statistics.median(ratios):.4f}  "
              f"(min {min(ratios):.4f}, max {max(ratios):.4f})")
        for k, llm in engines.items():
            ov = llm.engine.auto.overhead
            print(f"{k}: rank-0 thread CPU {cpu[k]:.3f} s over {steps[k]} steps; full GCs {gcs[k][0]} "
                  f"({gcs[k][1]:.3f} s); forecasts {ov.spent_s:.3f} s, observations {ov.observe_s:.3f} s")
        auto = engines["auto"].engine.auto
        print(f"auto layout: {engines['auto'].engine.layout}; verdicts {auto.verdicts}; "
              f"overhead {auto.overhead.summary()}; forecasts replayed {auto.forecast.replayed}, "
              f"followed {auto.forecast.followed}")


if __name__ == "__main__":
    main()
