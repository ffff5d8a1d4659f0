"""The code's layering, checked: import-linter's contracts (.importlinter: no import circles between sibling packages
or modules; the ownership model, cost model, simulator, scheduler, ledger and manifest planner import no torch; the
models know nothing of layouts, switching, the engine or the server), and no layout re-interpreted from its name
outside the ownership model (splash.layouts): code asks a `Layout` what it is instead of comparing names."""
from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LAYOUT_NAMES = {"tp", "dp_attn", "cp", "dop"}


def test_import_contracts():
    lint = Path(sys.executable).with_name("lint-imports")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    res = subprocess.run([str(lint), "--config", str(ROOT / ".importlinter"), "--no-cache"], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stdout[-4000:] + res.stderr[-2000:]
    assert "broken" not in res.stdout.split("Contracts:")[-1].replace("0 broken", "")


def layout_name_comparisons(tree: ast.AST) -> list[int]:
    """Lines comparing a value with a layout's name (`x == "tp"`, `x in ("tp", "dop")`)."""
    out = []
    for n in ast.walk(tree):
        if isinstance(n, ast.Compare):
            for c in (n.left, *n.comparators):
                consts = [c] if isinstance(c, ast.Constant) else list(getattr(c, "elts", []))
                if any(isinstance(k, ast.Constant) and k.value in LAYOUT_NAMES for k in consts):
                    out.append(n.lineno)
                    break
    return out


def test_the_check_finds_name_comparisons():
    src = 'a = lay == "tp"\nb = lay in ("cp", "dop")\nc = "dp_attn" != lay\nd = lay.kv_ownership == "owner"\n'
    assert layout_name_comparisons(ast.parse(src)) == [1, 2, 3]


def test_no_layout_name_comparisons_outside_the_ownership_model():
    found = []
    for sub in ("splash", "backends"):
        for p in sorted((ROOT / sub).rglob("*.py")):
            if p.parent.name == "layouts":
                continue
            found += [f"{p.relative_to(ROOT)}:{ln}" for ln in layout_name_comparisons(ast.parse(p.read_text()))]
    assert not found, "compare Layout properties (splash.layouts), not names: " + ", ".join(found)


def private_imports(tree: ast.AST, exists=lambda mod: False) -> list[str]:
    """Private names (`_x`) one module takes from another: `from splash.a import _x`, or `m._x` where `m` is a
    project module it imported (`exists(dotted)` says whether a dotted name is a module). A name shared across
    modules is public; one used in one module stays private there."""
    out, mods = [], {}
    project = ("splash", "backends")
    for n in ast.walk(tree):
        if isinstance(n, ast.ImportFrom) and (n.module or "").startswith(project):
            for a in n.names:
                if a.name.startswith("_") and not a.name.startswith("__"):
                    out.append(f"{n.lineno}: from {n.module} import {a.name}")
                elif exists(f"{n.module}.{a.name}"):
                    mods[a.asname or a.name] = f"{n.module}.{a.name}"
        elif isinstance(n, ast.Import):
            for a in n.names:
                if a.name.startswith(project):
                    mods[a.asname or a.name.split(".")[0]] = a.name
    for n in ast.walk(tree):
        if (isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name) and n.value.id in mods
                and n.attr.startswith("_") and not n.attr.startswith("__")):
            out.append(f"{n.lineno}: {n.value.id}.{n.attr}")
    return out


def _is_module(dotted: str) -> bool:
    p = ROOT.joinpath(*dotted.split("."))
    return p.with_suffix(".py").exists() or (p / "__init__.py").exists()


def test_the_check_finds_private_imports():
    src = ("from splash.a import _x, y\nfrom splash import m\nimport splash.b as b\n"
           "def f():\n    return m._z, b._w, m.ok, y._not_a_module\n")
    assert private_imports(ast.parse(src), lambda d: d == "splash.m") == [
        "1: from splash.a import _x", "5: m._z", "5: b._w"]


def test_no_private_names_imported_across_modules():
    found = []
    for sub in ("splash", "backends"):
        for p in sorted((ROOT / sub).rglob("*.py")):
            found += [f"{p.relative_to(ROOT)}:{x}" for x in private_imports(ast.parse(p.read_text()), _is_module)]
    assert not found, "make a name public where modules share it: " + ", ".join(found)
