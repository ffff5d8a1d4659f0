"""Print the tables of a result file again (rich, or markdown for docs), without rerunning it:

    splash-bench show results/sweep.json [--metric output_tokens_per_s] [--markdown]
"""
from __future__ import annotations

import argparse
import sys

from splash.bench import results as R
from splash.bench.tables import TableSpec, leader_table, print_tables, to_markdown

METRIC_LABEL = {"output_tokens_per_s": "output tokens/s", "total_tokens_per_s": "total tokens/s"}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("result", metavar="RESULT.json")
    p.add_argument("--metric", choices=R.METRICS, default="total_tokens_per_s")
    p.add_argument("--markdown", action="store_true", help="markdown tables (for docs) instead of rich")


def subtitle(doc: dict) -> str:
    """One line naming the model, dtypes, ranks and hardware (and the sweep's output length and repeats)."""
    env, cfg = doc["environment"], doc.get("config", {})
    model = env.get("model", {})
    hw = env.get("hardware", {}).get("description", "?")
    text = (f"{model.get('name', '?')} {model.get('dtype', '?')}/KV {model.get('kv_cache_dtype', '?')}, "
            f"{env.get('ranks', '?')} ranks, {hw}")
    if "output_len" in cfg:
        text += f"; output {cfg['output_len']} tokens, median of {cfg.get('repeats', '?')}"
    return text


def sweep_tables(doc: dict, metric: str = "total_tokens_per_s") -> list[TableSpec]:
    """One leader table per sweep axis with more than one value (at least one table)."""
    pts = doc["points"]
    layouts = [x for x in doc.get("config", {}).get("layouts", []) if any(p["layout"] == x for p in pts)]
    layouts += sorted({p["layout"] for p in pts} - set(layouts))
    ins = sorted({p["input_len"] for p in pts})
    bss = sorted({p["batch_size"] for p in pts})
    val = {(p["layout"], p["input_len"], p["batch_size"]): p[metric] for p in pts}
    label, sub = METRIC_LABEL.get(metric, metric), subtitle(doc)
    specs = []
    if len(ins) > 1 or len(bss) == 1:
        rows = [([str(b), str(n)], {lay: val.get((lay, n, b)) for lay in layouts}) for b in bss for n in ins]
        specs.append(leader_table(f"{label} vs input length — {sub}", ["batch", "input len"], rows, layouts,
                                  section_every=len(ins)))
    if len(bss) > 1:
        rows = [([str(n), str(b)], {lay: val.get((lay, n, b)) for lay in layouts}) for n in ins for b in bss]
        specs.append(leader_table(f"{label} vs batch size — {sub}", ["input len", "batch"], rows, layouts,
                                  section_every=len(bss)))
    return specs


def run(args) -> int:
    doc = R.read_json(args.result)
    if doc["kind"] != "sweep":
        print(f"error: {args.result}: showing a {doc['kind']!r} result is not supported", file=sys.stderr)
        return 2
    specs = sweep_tables(doc, args.metric)
    if args.markdown:
        print("\n\n".join(to_markdown(s) for s in specs))
    else:
        print_tables(specs)
    return 0
