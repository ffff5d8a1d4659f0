"""Compare two results point by point (same kind: sweep points by layout, input length, batch size, output
length; `grid` points by layout, batch and context, as decode steps/s; serving runs by mode) and flag
regressions — for CI between versions and across machines:

    splash-bench compare OLD.json NEW.json [--tolerance 0.05] [--metric output_tokens_per_s]

Prints new/old per matched point; a point regresses when new < old x (1 - tolerance). Points present in only
one file are listed (they fail the comparison only with --require-all). Environment fields that differ
(hardware, backend, ranks, versions, git revision, model, dtypes) are named. Exit status: 1 when any point
regresses, 0 otherwise, 2 on bad input (unreadable file, not a splash-bench result, different kinds, or no
point in common).
"""
from __future__ import annotations

import argparse
import sys

from splash.bench import results as R
from splash.bench.tables import TableSpec, layout_label, print_tables


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("old", metavar="OLD.json")
    p.add_argument("new", metavar="NEW.json")
    p.add_argument("--tolerance", type=float, default=0.05, help="allowed relative drop [0.05 = 5%%]")
    p.add_argument("--metric", choices=R.METRICS, default="output_tokens_per_s",
                   help="figure compared (serving runs always use output_tokens_per_s)")
    p.add_argument("--require-all", action="store_true", help="a point missing from either file also fails")


def figures(doc: dict, metric: str) -> dict[tuple, float]:
    """point key -> figure (higher is better): sweep points by SWEEP_KEY, grid points by ('grid', layout,
    batch, context) as decode steps/s, serving runs by ('run', mode)."""
    out: dict[tuple, float] = {}
    for pt in doc.get("points") or []:
        if all(k in pt for k in R.SWEEP_KEY) and isinstance(pt.get(metric), (int, float)):
            out[R.sweep_key(pt)] = float(pt[metric])
        elif doc["kind"] == "grid" and isinstance(pt.get("step_ms"), (int, float)) and pt["step_ms"] > 0:
            out[("grid", pt["layout"], pt["batch_size"], pt["context"])] = 1e3 / pt["step_ms"]
    for run in doc.get("runs") or []:
        out[("run", run["mode"])] = float(run["output_tokens_per_s"])
    return out


def key_text(key: tuple) -> str:
    if key[0] == "run":
        return f"run {key[1]}"
    if key[0] == "grid":
        return f"{layout_label(key[1])} B={key[2]} L={key[3]} (decode steps/s)"
    lay, n, b, o = key
    return f"{layout_label(lay)} in={n} B={b} out={o}"


def compare(old: dict, new: dict, metric: str, tolerance: float):
    """(rows, regressions, only_old, only_new); rows: (key, old, new, ratio, status)."""
    a, b = figures(old, metric), figures(new, metric)
    rows, bad = [], []
    for key in sorted(set(a) & set(b), key=str):
        ratio = b[key] / a[key] if a[key] else float("inf")
        status = "regression" if ratio < 1 - tolerance else "faster" if ratio > 1 + tolerance else "ok"
        rows.append((key, a[key], b[key], ratio, status))
        if status == "regression":
            bad.append(key)
    return rows, bad, sorted(set(a) - set(b), key=str), sorted(set(b) - set(a), key=str)


def _table(rows, args) -> TableSpec:
    spec = TableSpec(f"{args.metric.replace('_', ' ')}: {args.new} vs {args.old} (tolerance {args.tolerance:.0%})",
                     ["point", "old", "new", "new/old", "status"])
    for i, (key, o, n, ratio, status) in enumerate(rows):
        spec.add_row([key_text(key), f"{o:.1f}", f"{n:.1f}", f"{ratio:.3f}",
                      "[red]REGRESSION[/red]" if status == "regression" else status],
                     bold_cols=(3, 4) if status == "regression" else ())
    return spec


def run(args) -> int:
    old, new = R.read_json(args.old), R.read_json(args.new)
    if not 0 <= args.tolerance < 1:
        print("error: --tolerance must be in [0, 1)", file=sys.stderr)
        return 2
    if old["kind"] != new["kind"]:
        print(f"error: cannot compare a {old['kind']!r} result with a {new['kind']!r} result", file=sys.stderr)
        return 2
    rows, bad, only_old, only_new = compare(old, new, args.metric, args.tolerance)
    for field, x, y in R.env_differences(old["environment"], new["environment"]):
        print(f"environments differ: {field}: {x!r} -> {y!r}")
    if not rows:
        print(f"error: no point of {args.old} matches a point of {args.new}", file=sys.stderr)
        return 2
    print_tables([_table(rows, args)])
    for name, keys in ((args.old, only_old), (args.new, only_new)):
        if keys:
            print(f"only in {name}: " + ", ".join(map(key_text, keys)))
    print(f"{len(rows)} points compared: {len(bad)} regressed beyond {args.tolerance:.0%}"
          + (f", {len(only_old) + len(only_new)} unmatched" if only_old or only_new else ""))
    if bad or (args.require_all and (only_old or only_new)):
        return 1
    return 0
