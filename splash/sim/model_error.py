"""The scheduler under model error: a *truth* cost model whose per-kernel (per layout and stage) times differ from
the nominal one by 1 + s·|r|, r drawn from splash-sim's held-out residuals against the paper and s a random sign
(``random.Random(seed)``); one factor per switch direction likewise. ``splash-sim --trace --truth-error`` charges
the truth while ``auto`` plans with the nominal model and learns from what it is charged. A stage that computes the
same in every layout (COMMON_STAGES) is one kernel with one error shared by the layouts, unless
``kernels="per_layout"``. Pure, no torch.
"""
from __future__ import annotations

import random
from dataclasses import dataclass, field
from types import SimpleNamespace

from splash.costmodel.step_cost import LAYOUTS
from splash.costmodel.work import STAGES

RESIDUAL_KINDS = ("tokens_per_s", "primitive_ms")   # per-kernel-like figures: rates and per-layer times
EXTRA_STAGES = ("sync", "overlap")                    # stages a StepPrediction carries beyond work.STAGES
COMMON_STAGES = ("plan", "ffn", "ffn_all_reduce", "lm_head", "other")   # the same computation in every layout
TRUTH_KERNELS = ("shared", "per_layout")            # COMMON_STAGES share one error / every (layout, stage) its own


def held_out_residuals(rows: list[dict]) -> list[float]:
    """Relative errors of the held-out tokens/s and per-layer primitive rows of a `splash-sim paper` table (the
    rows are matched to splash.sim.paper_data.FIGURES by their label, so a table from --json works)."""
    from splash.sim.paper import label
    from splash.sim.paper_data import FIGURES
    kinds = {label(f): f.kind for f in FIGURES}
    out = []
    for r in rows:
        kind = kinds.get(r.get("figure"))
        if kind in RESIDUAL_KINDS and r.get("split") == "held_out" and isinstance(r.get("error"), (int, float)):
            out.append(float(r["error"]))
    if not out:
        raise ValueError("no held-out tokens/s or primitive rows with an error in the table")
    return out


@dataclass
class TruthModel:
    """The nominal cost model with each stage of each layout scaled by its factor (and each switch direction)."""
    nominal: object
    step_factor: dict = field(default_factory=dict)     # (layout, stage) -> factor
    switch_factor: dict = field(default_factory=dict)   # (src, dst) -> factor

    def step(self, layout, rows):
        p = self.nominal.step(layout, rows)
        secs = sum(v * self.step_factor.get((p.layout, k), 1.0) for k, v in p.stages.items())
        return SimpleNamespace(layout=p.layout, seconds=secs, stages=p.stages)

    def switch(self, manifest, mode, step_seconds=None, step_link_share=0.0):
        p = self.nominal.switch(manifest, mode, step_seconds, step_link_share)
        f = self.switch_factor.get((p.src, p.dst), 1.0)
        return SimpleNamespace(src=p.src, dst=p.dst, exposed_seconds=p.exposed_seconds * f,
                               seconds=p.seconds * f)

    def __getattr__(self, name):   # world, block_size, stage_seconds ... of the nominal model
        return getattr(self.nominal, name)


def draw_truth(nominal, residuals: list[float], seed: int, kernels: str = "shared") -> TruthModel:
    if kernels not in TRUTH_KERNELS:
        raise ValueError(f"kernels must be one of {', '.join(TRUTH_KERNELS)}, got {kernels!r}")
    rng = random.Random(seed)

    def factor() -> float:
        return max(0.05, 1.0 + rng.choice((-1.0, 1.0)) * abs(rng.choice(residuals)))

    steps = {(lay, st): factor() for lay in LAYOUTS for st in (*STAGES, *EXTRA_STAGES)}
    if kernels == "shared":
        common = {st: factor() for st in COMMON_STAGES}
        steps.update({(lay, st): f for lay in LAYOUTS for st, f in common.items()})
    switches = {(a, b): factor() for a in LAYOUTS for b in LAYOUTS if a != b}
    return TruthModel(nominal, steps, switches)


def experiment(cm, setup, caps, workload_for_seed, residuals: list[float], seeds: list[int],
               margin: float = 0.1, kernels: str = "shared") -> list[dict]:
    """Per seed: auto (plans with ``cm``, charged and learning from the truth), every fixed layout and the
    per-phase oracle (auto planning with the truth itself), all charged with the seed's truth. Output tokens/s."""
    from splash.sim.trace import replay
    out = []
    for seed in seeds:
        work = workload_for_seed(seed)
        truth = draw_truth(cm, residuals, seed, kernels)
        row = {"seed": seed, "auto": replay(cm, setup, caps, work, "auto", margin, truth=truth)}
        for lay in LAYOUTS:
            try:
                row[lay] = replay(cm, setup, caps, work, lay, margin, truth=truth)
            except ValueError:
                row[lay] = None
        row["oracle"] = replay(cm, setup, caps, work, "auto", margin, truth=truth, plan=truth)
        fixed = {k: row[k].output_tokens_per_s for k in LAYOUTS if row[k] is not None}
        best = max(fixed, key=fixed.get)
        out.append({"seed": seed, "tokens_per_s": {k: (None if row[k] is None else row[k].output_tokens_per_s)
                                                   for k in ("auto", *LAYOUTS, "oracle")},
                    "auto_switches": row["auto"].switches, "oracle_switches": row["oracle"].switches,
                    "best_fixed": best, "auto_vs_best": row["auto"].output_tokens_per_s / fixed[best],
                    "oracle_vs_best": row["oracle"].output_tokens_per_s / fixed[best]})
    return out


def experiment_cli(console, cm, setup, caps, trace: str, table_json: str, seeds: list[int], margin: float,
                   json_out: str | None = None, kernels: str = "shared") -> int:
    import json
    from pathlib import Path

    from rich.table import Table

    from splash.sim.trace import load_workload
    from splash.sim.workloads import BUILTIN, builtin
    try:
        residuals = held_out_residuals(json.loads(Path(table_json).read_text())["rows"])
        fixed = None if trace in BUILTIN else load_workload(trace)
    except (OSError, ValueError, KeyError, TypeError) as e:
        print(f"splash-sim: {e}")
        return 2
    rows = experiment(cm, setup, caps, lambda seed: builtin(trace, seed) if fixed is None else fixed, residuals,
                      seeds, margin, kernels)
    t = Table(title=f"{trace} under model error ({len(residuals)} held-out residuals from {table_json}, {kernels} "
                    f"kernel errors): output tokens/s, all charged with the seed's truth")
    for col in ("seed", "auto", "TP", "DP-attn", "CP", "DOP", "oracle", "best fixed", "auto / best",
                "oracle / best", "switches (auto, oracle)"):
        t.add_column(col, justify="right")
    for r in rows:
        v = r["tokens_per_s"]
        t.add_row(str(r["seed"]), *(f"{v[k]:,.1f}" if v[k] is not None else "—"
                                    for k in ("auto", *LAYOUTS, "oracle")),
                  r["best_fixed"], f"{r['auto_vs_best']:.3f}", f"{r['oracle_vs_best']:.3f}",
                  f"{r['auto_switches']}, {r['oracle_switches']}")
    console.print(t)
    worst = min(r["auto_vs_best"] for r in rows)
    console.print(f"auto vs the best fixed layout: worst {worst:.3f}, mean "
                  f"{sum(r['auto_vs_best'] for r in rows) / len(rows):.3f} over seeds {seeds}")
    if json_out:
        Path(json_out).write_text(json.dumps({"trace": trace, "kernels": kernels, "residuals": residuals,
                                              "seeds": rows}, indent=1))
    return 0
