"""Decode step time per layout over a grid of batch size x context length, KV resident (run under mpirun):

    mpiexec -n 2 splash-bench grid [--preset small-mla] [--batches 1,4,16] [--contexts 256,1024,4096]
        [--steps 8] [--json FILE]

Every layout runs the same decode batch on the same weights with the KV already resident (written straight into
each rank's pool where the layout places it); rank 0 prints the median step time (max over ranks) per layout,
the fastest in bold with its lead over the runner-up. Unlike `sweep` this isolates one decode step (no
prefill, no scheduling).
"""
from __future__ import annotations

import argparse
import statistics

from splash.bench import results as R
from splash.bench.sweep import int_list
from splash.cli.args import layout_list
from splash.layouts.layout import LAYOUT_NAMES


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--preset", default="small-mla")
    p.add_argument("--layouts", type=layout_list, default=LAYOUT_NAMES)
    p.add_argument("--batches", type=int_list, default=[1, 4, 16])
    p.add_argument("--contexts", type=int_list, default=[256, 1024, 4096])
    p.add_argument("--steps", type=int, default=8, help="timed decode steps per point (after 2 warm-ups)")
    p.add_argument("--json", metavar="FILE", help="write the result (kind 'grid') here")
    p.add_argument("--markdown", metavar="FILE", help="also write the table as markdown")


def measure(comm, preset: str, layout: str, batch: int, ctx: int, steps: int) -> dict:
    from splash.bench.decode_state import DecodeState

    st = DecodeState(comm, preset, layout, batch, ctx)
    for _ in range(2):
        st.step()
    times = [st.step() for _ in range(steps)]
    return {"layout": layout, "batch_size": batch, "context": ctx, "step_ms": 1e3 * statistics.median(times),
            "steps_ms": [1e3 * t for t in times], "load_average": R.load_average()}


def grid_table(doc: dict):
    from splash.bench.show import subtitle
    from splash.bench.tables import leader_table

    pts = doc["points"]
    layouts = doc["config"]["layouts"]
    keys = sorted({(p["batch_size"], p["context"]) for p in pts})
    ms = {(p["layout"], p["batch_size"], p["context"]): p["step_ms"] for p in pts}
    rows = [([str(b), str(c)], {lay: ms.get((lay, b, c)) for lay in layouts}) for b, c in keys]
    ncols = len({c for _, c in keys})
    return leader_table(f"decode step ms (median, max over ranks) — {subtitle(doc)}", ["batch", "context"], rows,
                        layouts, fmt=lambda v: f"{v:.2f}", higher_is_better=False, section_every=ncols)


def run(args) -> int:
    from splash.models.presets import preset_config

    model = {"name": args.preset, "dtype": "float32", "kv_cache_dtype": "float32",
             "num_hidden_layers": preset_config(args.preset).num_hidden_layers}
    config = {"layouts": args.layouts, "batches": args.batches, "contexts": args.contexts, "steps": args.steps}
    points = [(args.preset, lay, b, c, args.steps) for b in args.batches for c in args.contexts for lay in args.layouts]
    comm, doc = R.mpi_result(args, "grid", model, config)
    return R.measure_points(args, comm, doc, points, measure, lambda d: [grid_table(d)],
                            lambda p: f"{p['layout']:>7} B={p['batch_size']} L={p['context']} {p['step_ms']:.2f} ms")
