"""Tables of every splash-bench command: one data form (`TableSpec`), rendered to a rich console or markdown.

`leader_table` is the paper's table shape (Tables 4–6): one row per point, one column per layout, the best
layout's cell in bold and its lead over the runner-up in the last column.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable, Iterable, Sequence

from splash.layouts.layout import LAYOUT_LABELS


def layout_label(name: str) -> str:
    return LAYOUT_LABELS.get(name, name)


@dataclass
class TableSpec:
    title: str
    columns: list[str]
    rows: list[list[str]] = field(default_factory=list)
    bold: set[tuple[int, int]] = field(default_factory=set)     # (row, column) cells shown in bold
    section_ends: set[int] = field(default_factory=set)         # rows after which a rule is drawn

    def add_row(self, cells: Sequence[str], bold_cols: Iterable[int] = (), end_section: bool = False) -> None:
        r = len(self.rows)
        self.rows.append(list(cells))
        self.bold |= {(r, c) for c in bold_cols}
        if end_section:
            self.section_ends.add(r)


def to_rich(spec: TableSpec):
    from rich.table import Table

    t = Table(title=spec.title)
    for c in spec.columns:
        t.add_column(c, justify="right")
    for r, row in enumerate(spec.rows):
        cells = [f"[bold]{v}[/bold]" if (r, c) in spec.bold else v for c, v in enumerate(row)]
        t.add_row(*cells, end_section=r in spec.section_ends)
    return t


def to_markdown(spec: TableSpec) -> str:
    lines = [f"**{spec.title}**", "", "| " + " | ".join(spec.columns) + " |",
             "|" + "|".join("---" for _ in spec.columns) + "|"]
    for r, row in enumerate(spec.rows):
        lines.append("| " + " | ".join(f"**{v}**" if (r, c) in spec.bold and v else v
                                         for c, v in enumerate(row)) + " |")
    return "\n".join(lines)


def print_tables(specs: Sequence[TableSpec], console=None, markdown_path: str | None = None) -> None:
    """Print `specs` to the console and, when `markdown_path` is given, write them there as markdown."""
    from rich.console import Console

    console = console or Console(width=160)
    for s in specs:
        console.print(to_rich(s))
    if markdown_path:
        with open(markdown_path, "w") as f:
            f.write("\n\n".join(to_markdown(s) for s in specs) + "\n")


def lead_text(best: float, second: float | None, higher_is_better: bool = True) -> str:
    """The leader's margin over the runner-up, e.g. '+12.3%' ('—' with no runner-up)."""
    if second is None or not second or math.isnan(second):
        return "—"
    ratio = best / second if higher_is_better else second / best
    return f"+{100 * (ratio - 1):.1f}%"


def leader_table(title: str, key_columns: Sequence[str], rows: Sequence[tuple[Sequence[str], dict]],
                 layouts: Sequence[str], fmt: Callable[[float], str] = lambda v: f"{v:.1f}",
                 higher_is_better: bool = True, section_every: int | None = None) -> TableSpec:
    """rows: (key cells, {layout: value or None}); a missing layout shows 'n/a'. The best cell is bold."""
    spec = TableSpec(title, [*key_columns, *map(layout_label, layouts), "best", "lead"])
    for i, (keys, values) in enumerate(rows):
        have = {k: v for k, v in values.items() if v is not None and k in layouts}
        order = sorted(have, key=have.get, reverse=higher_is_better)
        cells = [*keys, *(fmt(values[x]) if x in have else "n/a" for x in layouts)]
        bold = []
        if order:
            best = order[0]
            cells += [layout_label(best), lead_text(have[best], have[order[1]] if len(order) > 1 else None,
                                                    higher_is_better)]
            bold = [len(keys) + list(layouts).index(best), len(cells) - 2]
        else:
            cells += ["—", "—"]
        end = section_every is not None and (i + 1) % section_every == 0 and i + 1 < len(rows)
        spec.add_row(cells, bold, end)
    return spec
