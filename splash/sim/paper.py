"""`splash-sim paper`: every published figure of the paper (splash/sim/paper_data.py) beside splash-sim's value for
it, the error, whether the figure was fitted (B200) or held out (H200, DCU), and whether it is within the issue's
tolerance. No torch.

    splash-sim paper [--only b200,h200,bw1000] [--json FILE]

The table's computation (``judge``, ``table``) is separate from the simulation (``Evaluator``) so that it can be
unit-tested on made-up values.
"""
from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

from splash.layouts.layout import LAYOUT_LABELS
from splash.sim.paper_data import (CAPACITY_TOL, FIGURES, LEADER_SHARE, RATE_TOL, SETUPS, SWITCH_FACTOR, Figure,
                                   Setup)

HW_NAMES = {"b200": "B200", "h200": "H200", "bw1000": "DCU"}


def _rel(sim: float, paper: float) -> float:
    return sim / paper - 1.0 if paper else math.inf


def judge(kind: str, paper, sim) -> tuple[float | None, bool]:
    """(error, within) of one figure. ``sim`` None: the sim cannot express it (never within).

    capacity: relative error within 2%; tokens_per_s / primitive_ms / latency_s: within 25%; ratio (a tokens/s
    ratio such as "DOP +10.6% over CP"): on the same side of 1 as the paper's and within 25%; switch_ms: within a
    factor of 2;
    count: equal (error = sim − paper); leader: the same layout (error None); leader_share: at least 80% of the
    paper's named positions (paper = their number, sim = how many match); bound_max: at most the paper's bound."""
    if sim is None:
        return None, False
    if kind == "leader":
        return None, sim == paper
    if kind == "count":
        return float(sim - paper), sim == paper
    if kind == "leader_share":
        return _rel(sim, paper), sim >= LEADER_SHARE * paper
    err = _rel(float(sim), float(paper))
    if kind == "capacity":
        return err, abs(err) <= CAPACITY_TOL
    if kind in ("tokens_per_s", "primitive_ms", "latency_s"):
        return err, abs(err) <= RATE_TOL
    if kind == "ratio":
        return err, (sim > 1.0) == (paper > 1.0) and abs(err) <= RATE_TOL
    if kind == "switch_ms":
        return err, sim > 0 and 1.0 / SWITCH_FACTOR <= sim / paper <= SWITCH_FACTOR
    if kind == "bound_max":
        return err, sim <= paper
    raise ValueError(f"unknown figure kind {kind!r}")


def label(fig: Figure) -> str:
    return f"{HW_NAMES.get(fig.hardware, fig.hardware)} {fig.source}: {fig.what}"


def table(figures: list[Figure], values: dict[str, object]) -> list[dict]:
    """Rows {figure, paper, sim, error, split, within} in ``figures`` order; ``values``: figure key -> sim value
    (missing or None = not expressible). A ``leader_share`` figure's sim value is counted here from the leader
    rows it names."""
    rows, within = [], {}
    for f in figures:
        sim = values.get(f.key)
        if f.kind == "leader_share":
            sim = sum(1 for k in f.probe[1] if within.get(k))
        err, ok = judge(f.kind, f.paper, sim)
        within[f.key] = ok
        split = SETUPS[f.setup or f.hardware].split
        rows.append({"figure": label(f), "paper": f.paper, "sim": sim, "error": err, "split": split, "within": ok})
    return rows


def summary(rows: list[dict]) -> dict[str, tuple[int, int]]:
    """split -> (rows within, rows)."""
    out: dict[str, tuple[int, int]] = {}
    for r in rows:
        n, m = out.get(r["split"], (0, 0))
        out[r["split"]] = (n + bool(r["within"]), m + 1)
    return out


# ---- the simulation side ---------------------------------------------------------------------------------------

class Evaluator:
    """splash-sim's value of each probe of one Setup, with the throughput points cached."""

    def __init__(self, setup: Setup, scale: dict[str, float] | None = None):
        import dataclasses

        from splash.costmodel.profile import load_profile
        from splash.costmodel.step_cost import CostModel
        from splash.sim.presets import load_sim_model
        from splash.sim.serving import SimSetup, capacities
        self.setup = setup
        self.model = load_sim_model(setup.model)
        self.profile = load_profile(setup.hardware)
        if scale:   # a sensitivity experiment: profile fields times a factor, on every hardware alike
            self.profile = dataclasses.replace(self.profile, **{k: getattr(self.profile, k) * f
                                                                for k, f in scale.items()})
        m = self.model
        self.sim = SimSetup(m, self.profile, 8, deployment=setup.deployment, decode_layout=setup.decode_layout,
                            decode_world=setup.decode_world, decode_nodes=setup.decode_nodes)
        self.cm = CostModel(m.cfg, 8, self.profile, m.weight_dtype, m.kv_dtype, self.sim.block_size,
                            cp_prefill="split")
        self.caps = capacities(self.sim)
        self._cache: dict[tuple, object] = {}   # a sweep asks for the same points and switch tables many times

    def _memo(self, key: tuple, compute):
        if key not in self._cache:
            self._cache[key] = compute()
        return self._cache[key]

    def point(self, layout: str, batch: int, input_len: int) -> dict:
        from splash.sim.deploy import throughput
        return self._memo(("tps", layout, batch, input_len), lambda: throughput(
            self.cm, self.sim, self.caps, layout, batch, input_len, self.setup.output_len))

    def tps(self, layout: str, batch: int, input_len: int) -> float | None:
        p = self.point(layout, batch, input_len)
        return p["tokens_per_s"] if p["feasible"] else None

    def leader(self, batch: int, input_len: int) -> str | None:
        feas = {k: self.tps(k, batch, input_len) for k in LAYOUT_LABELS}
        feas = {k: v for k, v in feas.items() if v}
        return max(feas, key=feas.get) if feas else None

    def ratio(self, a: str, b: str, batch: int, input_len: int) -> float | None:
        x, y = self.tps(a, batch, input_len), self.tps(b, batch, input_len)
        return x / y if x and y else None

    def switches(self, batch: int, tokens: int) -> list[dict]:
        from splash.sim.switch_table import switch_costs
        return self._memo(("switch", batch, tokens), lambda: switch_costs(self.cm, self.sim, batch, tokens))

    def evaluate(self, probe: tuple):
        kind, *a = probe
        if kind == "tps":
            return self.tps(*a)
        if kind == "tps_range":
            lay, points, end = a
            return _extreme([self.tps(lay, b, n) for b, n in points], end)
        if kind == "ratio":
            return self.ratio(*a)
        if kind == "ratio_range":
            x, y, points, end = a
            return _extreme([self.ratio(x, y, b, n) for b, n in points], end)
        if kind == "leader":
            return self.leader(*a)
        if kind == "capacity":
            lay, what = a
            c = self.caps[lay]
            return c.distinct_tokens if what == "distinct" else c.tokens_per_rank
        if kind == "capacity_ratio":
            return self.caps[a[0]].distinct_tokens / self.caps[a[1]].distinct_tokens
        if kind == "freed_gib":
            return (self.caps[a[0]].room_bytes_per_rank - self.caps[a[1]].room_bytes_per_rank) / (1 << 30)
        if kind == "resident":
            from splash.sim.residency import pooled_resident
            from splash.sim.serving import concurrency
            lay, batch, n, out, *how = a
            if how == ["pooled"]:   # the layout's distinct pool over one request (splash.sim.residency)
                return pooled_resident(self.caps[lay].distinct_tokens, n + out, batch)
            k = min(batch, concurrency(self.sim, self.caps, lay, n + out))
            return k / self.sim.world if how == ["per_owner"] else k
        if kind in ("primitive", "primitive_dir", "switch", "switch_range", "switch_saving", "switch_step_share"):
            return self._switch_probe(kind, a)
        if kind == "burst":
            from splash.sim.serving import burst
            *run, what = a     # (layout, batch, input, output), what
            b = self._memo(("burst", *run), lambda: burst(self.cm, self.sim, self.caps, *run))
            return b[what] if b["feasible"] else None
        if kind == "scenario_limit":
            from splash.sim.scenario import scenario_limit
            return scenario_limit(self.model, a[0])
        if kind == "leaders":
            return None  # counted by table()
        raise ValueError(f"unknown probe {kind!r}")

    def _switch_probe(self, kind: str, a: tuple) -> float | None:
        if kind in ("primitive_dir", "switch"):     # one direction's: (src, dst, what, batch, ctx)
            src, dst, what, batch, ctx = a
            rows = [r for r in self.switches(batch, ctx) if (r["src"], r["dst"]) == (src, dst)]
            if kind == "switch":
                return rows[0][f"{what}_s"] * 1e3 if rows else None
            return _extreme([r[f"{what}_layer_s"] * 1e3 for r in rows if r[f"{what}_layer_s"] > 0], "max")
        if kind == "switch_step_share":
            rows = self.switches(*a)
            return max(r["live_s"] / r["dst_step_s"] for r in rows) if rows else None
        *what, batch, ctx, end = a
        rows = self.switches(batch, ctx)
        if kind == "primitive":
            vals = [r[f"{what[0]}_layer_s"] * 1e3 for r in rows if r[f"{what[0]}_layer_s"] > 0]
        elif kind == "switch_range":
            vals = [r[f"{what[0]}_s"] * 1e3 for r in rows]
        else:   # switch_saving
            vals = [r["live_s"] / r["blocking_s"] for r in rows if r["recv_bytes"] > 0]
        return _extreme(vals, end)


def _extreme(vals: list, end: str):
    """min or max of ``vals`` (``end``); None when there are none or one is not expressible."""
    return None if not vals or None in vals else (min if end == "min" else max)(vals)


def simulate(figures: list[Figure], progress=None, scale: dict[str, float] | None = None) -> dict[str, object]:
    """figure key -> splash-sim's value, one Evaluator per setup (``scale``: profile field -> factor)."""
    evals: dict[str, Evaluator] = {}
    values: dict[str, object] = {}
    for f in figures:
        key = f.setup or f.hardware
        if key not in evals:
            evals[key] = Evaluator(SETUPS[key], scale)
        values[f.key] = evals[key].evaluate(f.probe)
        if progress:
            progress(f)
    return values


def _fmt(v) -> str:
    if v is None:
        return "—"
    if isinstance(v, str):
        return LAYOUT_LABELS.get(v, v)
    if isinstance(v, bool):
        return str(v).lower()
    return f"{v:,.0f}" if isinstance(v, int) or abs(v) >= 100 else f"{v:.4g}"


def print_table(console, rows: list[dict]) -> None:
    from rich.table import Table
    t = Table(title="splash-sim against the paper's figures")
    for col, just in (("figure", "left"), ("paper", "right"), ("sim", "right"), ("error", "right"),
                      ("split", "left"), ("within", "left")):
        t.add_column(col, justify=just)
    for r in rows:
        err = r["error"]
        err_s = "—" if err is None else (f"{err:+.0f}" if isinstance(err, float) and r["figure"].count("requests")
                                         else f"{err:+.1%}")
        t.add_row(r["figure"], _fmt(r["paper"]), _fmt(r["sim"]), err_s, r["split"],
                  "[green]true[/]" if r["within"] else "[red]false[/]")
    console.print(t)
    for split, (n, m) in summary(rows).items():
        console.print(f"{split}: {n} of {m} rows within tolerance")


def parse_scale(items: list[str]) -> dict[str, float]:
    """['field=factor', ...] -> {field: factor}; the field must be a numeric HardwareProfile field."""
    import dataclasses

    from splash.costmodel.profile import HardwareProfile
    numeric = {f.name for f in dataclasses.fields(HardwareProfile) if f.type in ("float", float)}
    out = {}
    for item in items:
        field, sep, factor = item.partition("=")
        if not sep or field not in numeric:
            raise ValueError(f"{item!r}: expected FIELD=FACTOR with FIELD one of {', '.join(sorted(numeric))}")
        try:
            out[field] = float(factor)
        except ValueError:
            raise ValueError(f"{item!r}: factor {factor!r} is not a number") from None
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="splash-sim paper", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", default=None, help="comma list of hardware to evaluate (b200, h200, bw1000)")
    ap.add_argument("--json", default=None, metavar="FILE", help="write {'rows': [...]} as JSON")
    ap.add_argument("--scale", action="append", default=[], metavar="FIELD=FACTOR",
                    help="sensitivity experiment: multiply a numeric hardware-profile field by FACTOR on every "
                         "hardware (repeatable), e.g. attention_flops_per_s=0.35")
    a = ap.parse_args(argv)
    try:
        scale = parse_scale(a.scale)
    except ValueError as e:
        print(f"splash-sim paper: --scale: {e}")
        return 2
    from rich.console import Console
    figs = FIGURES
    if a.only:
        want = {x.strip() for x in a.only.split(",") if x.strip()}
        bad = want - set(HW_NAMES)
        if bad:
            print(f"splash-sim paper: --only: unknown hardware {', '.join(sorted(bad))} "
                  f"(allowed: {', '.join(HW_NAMES)})")
            return 2
        figs = [f for f in FIGURES if f.hardware in want]
    rows = table(figs, simulate(figs, scale=scale))
    print_table(Console(width=170), rows)
    if a.json:
        Path(a.json).write_text(json.dumps({"rows": rows}, indent=1))
    return 0
