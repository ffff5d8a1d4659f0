"""PNG figures of a result (matplotlib, no display needed):

    splash-bench plot RESULT.json --out DIR [--metric total_tokens_per_s]

A sweep gives `throughput_vs_input_len.png` (one panel per batch size, a line per layout, log x) and
`throughput_vs_batch.png` (one panel per input length). A serving run (a result with "runs", as `workload`
writes) gives `timeline_<i>_<mode>.png` per run: the layout at each step with the switches marked, and the
tokens/s over time.
"""
from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

from splash.bench import results as R
from splash.bench.show import METRIC_LABEL, subtitle
from splash.bench.tables import LAYOUT_LABELS, layout_label

ORDER = list(LAYOUT_LABELS)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("result", metavar="RESULT.json")
    p.add_argument("--out", metavar="DIR", required=True, help="directory for the PNG files")
    p.add_argument("--metric", choices=R.METRICS, default="total_tokens_per_s", help="sweep figures' y axis")
    p.add_argument("--dpi", type=int, default=120)


def _pyplot():
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def _panels(plt, n: int):
    cols = min(n, 3)
    rows = math.ceil(n / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(5 * cols, 3.8 * rows), squeeze=False)
    for ax in axes.flat[n:]:
        ax.set_visible(False)
    return fig, list(axes.flat[:n])


def _sweep_figure(plt, doc: dict, metric: str, x_axis: str, panel_axis: str, path: Path, dpi: int) -> Path:
    pts = doc["points"]
    layouts = sorted({p["layout"] for p in pts}, key=lambda x: ORDER.index(x) if x in ORDER else 99)
    panels = sorted({p[panel_axis] for p in pts})
    fig, axes = _panels(plt, len(panels))
    names = {"input_len": "input length (tokens)", "batch_size": "batch size"}
    for ax, pv in zip(axes, panels):
        for lay in layouts:
            sel = sorted((p[x_axis], p[metric]) for p in pts if p["layout"] == lay and p[panel_axis] == pv)
            if sel:
                ax.plot([x for x, _ in sel], [y for _, y in sel], marker="o", label=layout_label(lay))
        xs = sorted({p[x_axis] for p in pts})
        if len(xs) > 1 and xs[-1] / xs[0] >= 4:
            ax.set_xscale("log", base=2)
        ax.set_xticks(xs, [str(x) for x in xs])
        ax.set_xlabel(names[x_axis])
        ax.set_ylabel(METRIC_LABEL.get(metric, metric))
        ax.set_title(f"{'batch' if panel_axis == 'batch_size' else 'input'} = {pv}")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(subtitle(doc), fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=dpi)
    plt.close(fig)
    return path


def plot_sweep(doc: dict, out: Path, metric: str = "total_tokens_per_s", dpi: int = 120) -> list[Path]:
    plt = _pyplot()
    out.mkdir(parents=True, exist_ok=True)
    if not doc["points"]:
        return []
    return [_sweep_figure(plt, doc, metric, "input_len", "batch_size", out / "throughput_vs_input_len.png", dpi),
            _sweep_figure(plt, doc, metric, "batch_size", "input_len", out / "throughput_vs_batch.png", dpi)]


def _timeline_figure(plt, run: dict, title: str, path: Path, dpi: int) -> Path:
    tl = run.get("timeline") or []
    fig, (top, bot) = plt.subplots(2, 1, sharex=True, figsize=(10, 5.5), gridspec_kw={"height_ratios": [1, 1.4]})
    seen = sorted({r["layout"] for r in tl}, key=lambda x: ORDER.index(x) if x in ORDER else 99)
    levels = {lay: i for i, lay in enumerate(seen)}
    t = [r["t_s"] for r in tl]
    top.step(t, [levels[r["layout"]] for r in tl], where="post", color="tab:blue")
    top.scatter(t, [levels[r["layout"]] for r in tl], s=6, color="tab:blue")
    top.set_yticks(range(len(seen)), [layout_label(x) for x in seen])
    top.set_ylim(-0.5, max(len(seen) - 0.5, 0.5))
    top.set_ylabel("layout")
    bot.plot(t, [r["tokens_per_s"] for r in tl], color="tab:green", lw=1)
    bot.set_ylabel("tokens/s")
    bot.set_xlabel("time (s)")
    for i, ev in enumerate(run.get("switch_events") or []):
        for ax in (top, bot):
            ax.axvline(ev["t_s"], color="tab:red", ls="--", lw=0.8, label="switch" if i == 0 and ax is bot else None)
        top.annotate(f"{layout_label(ev['src'])}→{layout_label(ev['dst'])}", (ev["t_s"], len(seen) - 0.5),
                     fontsize=7, rotation=90, va="top", ha="right", color="tab:red")
    if run.get("switch_events"):
        bot.legend(fontsize=8)
    for ax in (top, bot):
        ax.grid(True, alpha=0.3)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=dpi)
    plt.close(fig)
    return path


def plot_runs(doc: dict, out: Path, dpi: int = 120) -> list[Path]:
    plt = _pyplot()
    out.mkdir(parents=True, exist_ok=True)
    paths = []
    for i, run in enumerate(doc.get("runs") or []):
        mode = str(run["mode"])
        title = (f"{mode}: {run['output_tokens_per_s']:.1f} output tok/s, completed {run.get('completed', '?')}, "
                 f"lost {run.get('lost', '?')}, switches {run.get('switches', '?')}, {run.get('total_s', 0):.1f} s"
                 f" — {subtitle(doc)}")
        safe = "".join(c if c.isalnum() or c in "-_" else "_" for c in mode)
        paths.append(_timeline_figure(plt, run, title, out / f"timeline_{i}_{safe}.png", dpi))
    return paths


def run(args) -> int:
    doc = R.read_json(args.result)
    try:
        _pyplot()
    except ImportError:
        print("error: splash-bench plot needs matplotlib (pip install matplotlib)", file=sys.stderr)
        return 2
    out = Path(args.out)
    paths = plot_sweep(doc, out, args.metric, args.dpi) if doc.get("points") else []
    paths += plot_runs(doc, out, args.dpi)
    if not paths:
        print(f"error: {args.result}: nothing to plot (no points, no runs)", file=sys.stderr)
        return 2
    for p in paths:
        print(p)
    return 0
