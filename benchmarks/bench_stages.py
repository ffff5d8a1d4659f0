"""Stage-level truth for the cost model: where a real multi-rank decode step spends its time, per layout.

    OMP_NUM_THREADS=1 .venv/bin/mpiexec -n 2 .venv/bin/python benchmarks/bench_stages.py \
        [--layouts dp_attn,dop] [--points 32x1024,16x1024,4x4096] [--reps 8] [--prefill C] [--json out.json]

Wraps, on every rank, the collectives of the communicator (all_reduce, all_gather(v), all_to_allv) and the MLA
stages of splash.attention.mla (the query/latent projections, attend, the output projection) with a CPU-clock
timer (time.thread_time: time descheduled by other jobs does not count; MPICH's busy wait for the peer does),
then runs bench_costmodel's decode steps (`splash-bench grid`'s DecodeState), layouts interleaved. Per
repetition the least-preempted of 3 steps is kept (as bench_costmodel --stat min --clock cpu); a stage's
figure is the median over repetitions of that step's stage time, on the rank where the step was slowest.
Printed next to the cost model's stage prediction (splash.costmodel.CostModel.step().stages), with the collectives
split as `splash-bench calibrate` splits them (splash/bench/calib_sync.py): own time (on the last rank to arrive)
vs the isolated α + bytes/β, and the wait for the peer; then those in-step terms (median over points and layouts).
`--write-profile FILE` writes --profile with them; `--from-json FILE` re-predicts a stored run. With `--prefill C`
every step also carries a C-token prefill chunk (DecodeState(prefill=C)), predicted as one more piece."""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from splash.bench.calib_sync import COLLECTIVES, isolated_collective_seconds, split_wait  # noqa: E402

MLA_STAGES = {"latent_query": "proj_in", "new_latent_kv": "proj_in", "query_and_latent": "proj_in",
              "attend": "attend", "out_projection": "proj_out"}
ACC: dict[str, float] = {}
CNT: dict[str, int] = {}
SEQ: list[float] = []   # every collective's time in call order (matched across ranks: same sequence)
DEPTH = [0]


def _timed(name: str, fn):
    def wrapper(*a, **k):
        if DEPTH[0]:
            return fn(*a, **k)
        DEPTH[0] += 1
        t0 = time.thread_time()
        try:
            return fn(*a, **k)
        finally:
            dt = time.thread_time() - t0
            ACC[name] = ACC.get(name, 0.0) + dt
            if name in COLLECTIVES:
                SEQ.append(dt)
            CNT[name] = CNT.get(name, 0) + 1
            DEPTH[0] -= 1
    return wrapper


def instrument(comm) -> None:
    from splash.attention import mla
    for fn, stage in MLA_STAGES.items():
        setattr(mla, fn, _timed(stage, getattr(mla, fn)))
    for c in COLLECTIVES:
        setattr(comm, c, _timed(c, getattr(comm, c)))


def timed_step(st) -> dict[str, float]:
    ACC.clear()
    CNT.clear()
    SEQ.clear()
    total = st.local_step(clock=time.thread_time)
    out = {"total": total, **ACC, **{f"n_{k}": float(v) for k, v in CNT.items() if k in COLLECTIVES},
           "seq": list(SEQ)}
    return out


def measure(comm, lay_states: dict, reps: int) -> dict[str, list[dict]]:
    """Per layout, per repetition: the least-preempted of 3 steps (by the slower rank's total), every rank's
    stage times of that step."""
    out = {lay: [] for lay in lay_states}
    lays = list(lay_states)
    for r in range(reps):
        for lay in lays[r % len(lays):] + lays[:r % len(lays)]:
            st = lay_states[lay]
            timed_step(st)
            steps = [comm.all_gather_obj(timed_step(st)) for _ in range(3)]
            out[lay].append(min(steps, key=lambda ranks: max(x["total"] for x in ranks)))
    return out


def summarise(rep_list: list[list[dict]]) -> dict[str, float]:
    """Median over repetitions of the slowest rank's stages (keys: stages, collectives, their counts, rest)."""
    rows = []
    for ranks in rep_list:
        slow = max(ranks, key=lambda x: x["total"])
        row = {k: v for k, v in slow.items() if k != "seq"}
        row["rest"] = slow["total"] - sum(v for k, v in row.items() if k != "total" and not k.startswith("n_"))
        # a collective's own cost: its time on the rank that arrived last (it did not wait); the rest of the
        # slowest rank's collective time is waiting for its peer (as calibrate splits it)
        split = split_wait(ranks)
        row["coll_own"], row["coll_wait"] = split["own"], split["wait"]
        rows.append(row)
    keys = sorted({k for r in rows for k in r})
    return {k: statistics.median(r.get(k, 0.0) for r in rows) for k in keys}


def predicted(preset: str, world: int, profile: str, b: int, ctx: int, lay: str,
              prefill: int = 0) -> dict[str, float]:
    """The cost model's stages for the point, and ``isolated``: its collectives at the isolated α + bytes/β
    alone (the step with them minus the step with free collectives, both without the in-step terms)."""
    from splash.costmodel import CostModel, RowLoad, load_profile
    from splash.models.presets import preset_config
    cm = CostModel(preset_config(preset), world, load_profile(profile), "float32", "float32", 16)
    rows = [RowLoad(1, ctx, i % world) for i in range(b)] + ([RowLoad(prefill, 0, 0)] if prefill else [])
    p = cm.step(lay, rows)
    iso = isolated_collective_seconds(cm, lay, rows)
    s = p.stages
    return {"total": p.seconds, "proj_in": s["qkv_a"] + s["q_b_absorb"], "attend": s["attention"],
            "proj_out": s["uv_o"], "exchange": s["exchange"], "ffn_all_reduce": s["ffn_all_reduce"],
            "collectives": sum(w["collectives"] for w in p.work.values()), "isolated": iso}


def in_step_terms(results: list[dict]) -> dict[str, float]:
    """The profile's in-step collective terms as these steps show them (median over points and layouts):
    ``collective_sync_s`` = a collective's own time beyond its isolated α + bytes/β; ``collective_wait_fraction``
    = the slowest rank's wait for its peer / its time outside collectives."""
    own, frac = [], []
    for r in results:
        m, q = r["measured"], r["predicted"]
        n = sum(m.get(f"n_{c}", 0.0) for c in COLLECTIVES)
        if n:
            own.append((m["coll_own"] - q["isolated"]) / n)
            frac.append(m["coll_wait"] / (m["total"] - sum(m.get(c, 0.0) for c in COLLECTIVES)))
    return {"collective_sync_s": max(0.0, statistics.median(own)), "collective_wait_fraction": statistics.median(frac)}


def print_row(r: dict) -> None:
    m, q, b, ctx, lay = r["measured"], r["predicted"], r["batch"], r["context"], r["layout"]
    coll = sum(m.get(c, 0.0) for c in COLLECTIVES)
    pre = f"+{r['prefill']} " if r.get("prefill") else ""
    print(f"B={b} L={ctx} {pre}{lay:8s} total {m['total'] * 1e3:7.2f}/{q['total'] * 1e3:7.2f}ms  proj_in "
          f"{m.get('proj_in', 0) * 1e3:5.2f}/{q['proj_in'] * 1e3:5.2f}  attend {m.get('attend', 0) * 1e3:7.2f}/"
          f"{q['attend'] * 1e3:7.2f}  proj_out {m.get('proj_out', 0) * 1e3:5.2f}/{q['proj_out'] * 1e3:5.2f}  "
          f"collectives {coll * 1e3:5.2f}/{(q['exchange'] + q['ffn_all_reduce']) * 1e3:5.2f} "
          f"(own {m['coll_own'] * 1e3:5.2f} vs isolated {q['isolated'] * 1e3:5.2f}, wait {m['coll_wait'] * 1e3:5.2f}; "
          + " ".join(f"{c} {m.get(c, 0) * 1e3:.2f}ms/{m.get('n_' + c, 0):.0f}" for c in COLLECTIVES if m.get(c))
          + f")  rest {m['rest'] * 1e3:6.2f}", flush=True)


def measure_all(a) -> tuple[list[dict], str]:
    from splash.bench.decode_state import DecodeState
    from splash.distributed import init_dist
    comm = init_dist().comm
    instrument(comm)
    load0 = os.getloadavg()[0]
    results = []
    for pt in a.points.split(","):
        b, ctx = map(int, pt.split("x"))
        states = {lay: DecodeState(comm, a.preset, lay, b, ctx, prefill=a.prefill) for lay in a.layouts.split(",")}
        got = measure(comm, states, a.reps)
        del states
        for lay, reps in got.items():
            results.append({"batch": b, "context": ctx, "mean_context": ctx + 2 + a.reps * 2, "layout": lay,
                            "prefill": a.prefill, "measured": summarise(reps)})
    meta = (f"{a.preset}, {comm.size} ranks, cpu clock, {a.reps} repetitions, load average {load0:.2f} before / "
            f"{os.getloadavg()[0]:.2f} after")
    return (results if comm.rank == 0 else []), meta


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="small-mla")
    ap.add_argument("--profile", default="cpu", help="hardware profile (name or YAML) predicted against")
    ap.add_argument("--layouts", default="dp_attn,dop")
    ap.add_argument("--points", default="32x1024,16x1024,4x4096", help="BxCONTEXT,...")
    ap.add_argument("--reps", type=int, default=8)
    ap.add_argument("--prefill", type=int, default=0, metavar="C",
                    help="each step also carries a C-token prefill chunk from position 0 (0: decode steps only)")
    ap.add_argument("--json", default=None, help="write the measured and predicted stages here")
    ap.add_argument("--from-json", default=None, help="skip measuring: re-predict this file's stages")
    ap.add_argument("--write-profile", default=None,
                    help="write --profile with its in-step collective terms replaced by the measured ones here")
    a = ap.parse_args()
    if a.from_json:
        d = json.loads(Path(a.from_json).read_text())
        results, meta, world = d["results"], d["meta"] + f" (re-predicted, {a.profile})", d.get("world", 2)
    else:
        results, meta = measure_all(a)
        world = 2 if not results else int(meta.split(", ")[1].split()[0])
    if not results:
        return
    for r in results:
        r["predicted"] = predicted(a.preset, world, a.profile, r["batch"], r["mean_context"], r["layout"],
                                   r.get("prefill", 0))
        print_row(r)
    terms = in_step_terms(results)
    print(meta)
    print(f"in-step collective terms (median over points and layouts): collective_sync_s "
          f"{terms['collective_sync_s'] * 1e6:.1f} us per collective, collective_wait_fraction "
          f"{terms['collective_wait_fraction']:.4f} of the time outside collectives")
    if a.json:
        Path(a.json).write_text(json.dumps({"meta": meta, "world": world, "in_step_terms": terms,
                                            "results": results}, indent=1))
    if a.write_profile:
        from splash.costmodel.profile import load_profile, save_profile
        base = load_profile(a.profile)
        prof = dataclasses.replace(base, **{k: float(f"{v:.4g}") for k, v in terms.items()},
                                   source=f"{base.source}; in-step collective terms by bench_stages.py ({meta})")
        save_profile(prof, a.write_profile, f"# {a.profile} with collective_sync_s and collective_wait_fraction "
                     f"measured by benchmarks/bench_stages.py (real {a.layouts} decode steps)")


if __name__ == "__main__":
    main()
