"""The code's layering, checked: import-linter's contracts (.importlinter: no import circles between sibling packages
or modules; the ownership model, cost model, simulator, scheduler, ledger and manifest planner import no torch; the
models know nothing of layouts, switching, the engine or the server; the attention and switch executors import no
runner), no layout re-interpreted from its name outside the ownership model (splash.layouts): code asks a `Layout`
what it is instead of comparing names, no model family tested outside the hybrid model's own files (code asks the
family description, splash.models.family), and the runner's layout state changes only through `ModelRunner.adopt`."""
from __future__ import annotations

import ast
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LAYOUT_NAMES = {"tp", "dp_attn", "cp", "dop"}


def lint_imports(root: Path) -> subprocess.CompletedProcess:
    lint = Path(sys.executable).with_name("lint-imports")
    env = {**os.environ, "PYTHONPATH": str(root)}
    return subprocess.run([str(lint), "--config", str(root / ".importlinter"), "--no-cache"], cwd=root, env=env,
                          capture_output=True, text=True, timeout=120)


def test_import_contracts():
    res = lint_imports(ROOT)
    assert res.returncode == 0, res.stdout[-4000:] + res.stderr[-2000:]
    assert "broken" not in res.stdout.split("Contracts:")[-1].replace("0 broken", "")


def test_the_contracts_catch_an_executor_reaching_for_the_runner(tmp_path):
    for sub in ("splash", "backends"):
        shutil.copytree(ROOT / sub, tmp_path / sub, ignore=shutil.ignore_patterns("__pycache__", "*.so"))
    shutil.copy(ROOT / ".importlinter", tmp_path)
    tp = tmp_path / "splash" / "attention" / "tp.py"
    tp.write_text(tp.read_text() + "\nfrom splash.engine.runner import ModelRunner  # noqa: E402,F401\n")
    res = lint_imports(tmp_path)
    assert res.returncode != 0 and "splash.attention.tp -> splash.engine.runner" in res.stdout, res.stdout[-3000:]


def test_runner_layout_state_changes_only_through_adopt():
    from splash.attention.context import layout_state
    from splash.engine.llm import LLM

    r = LLM(preset="tiny-mla", layout="tp", num_kv_blocks=16, block_size=4).runner
    for name in ("layout", "layout_state", "kv_dtype", "executor",   # layout state: through adopt only
                 "cfg", "comm", "family", "weights", "cache", "bm", "tables", "attn", "states"):  # the rank's ctx
        with pytest.raises(AttributeError):
            setattr(r, name, getattr(r, name))
    before = r.executor
    dop = layout_state("dop", r.family, 1, 0, "bfloat16")
    r.adopt(dop)
    assert (r.layout, r.kv_dtype, r.layout_state) == ("dop", "bfloat16", dop)
    assert r.executor is not before and r.executor.r is r.ctx  # the new executor works on the same rank state


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


def layout_name_lookups(tree: ast.AST) -> list[int]:
    """Lines that key something by a layout's literal name, or test a name's prefix: a dict literal with a name as
    a key (`{"tp": ...}`), a subscript by a name (`caps["dop"]`), `.get("dop")` / `.pop` / `.setdefault`,
    `.startswith("dp")` / `.endswith`."""
    def is_name(a: ast.AST) -> bool:
        return isinstance(a, ast.Constant) and a.value in LAYOUT_NAMES

    def is_prefix(a: ast.AST) -> bool:
        return (isinstance(a, ast.Constant) and isinstance(a.value, str) and len(a.value) >= 2
                and any(n.startswith(a.value) or n.endswith(a.value) for n in LAYOUT_NAMES))
    out = []
    for n in ast.walk(tree):
        if isinstance(n, ast.Dict) and any(k is not None and is_name(k) for k in n.keys):
            out.append(n.lineno)
        elif isinstance(n, ast.Subscript) and is_name(n.slice):
            out.append(n.lineno)
        elif isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.args:
            if n.func.attr in ("get", "pop", "setdefault") and is_name(n.args[0]):
                out.append(n.lineno)
            elif n.func.attr in ("startswith", "endswith") and is_prefix(n.args[0]):
                out.append(n.lineno)
    return sorted(set(out))


def test_the_check_finds_name_comparisons():
    src = 'a = lay == "tp"\nb = lay in ("cp", "dop")\nc = "dp_attn" != lay\nd = lay.kv_ownership == "owner"\n'
    assert layout_name_comparisons(ast.parse(src)) == [1, 2, 3]
    src = ('a = {"tp": 1}\nb = d.get("dop")\nc = lay.startswith("dp")\nd = {"x": 1}.get("y")\n'
           'e = lay.endswith("attn")\nf = s.startswith("d")\ng = caps["cp"].tokens\nh = x["dtype"]\n')
    assert layout_name_lookups(ast.parse(src)) == [1, 2, 3, 5, 7]


def test_no_layout_name_comparisons_outside_the_ownership_model():
    found = []
    for sub in ("splash", "backends"):
        for p in sorted((ROOT / sub).rglob("*.py")):
            if p.parent.name == "layouts":
                continue
            rel = p.relative_to(ROOT).as_posix()
            tree = ast.parse(p.read_text())
            lines = layout_name_comparisons(tree) + layout_name_lookups(tree)
            found += [f"{rel}:{ln}" for ln in sorted(set(lines))]
    assert not found, "ask Layout properties (splash.layouts), not names: " + ", ".join(found)


# the hybrid (glm5_next) model's own files: its config, model, KDA / KPool, attention, builder, recurrent store,
# state transfer and the family description every other module asks (splash.models.family)
HYBRID_FILES = {f"splash/{f}.py" for f in (
    "models/config", "models/hybrid_config", "models/glm5_next", "models/kda", "models/kpool", "models/family",
    "attention/hybrid", "attention/kpool", "engine/hybrid_setup", "kv/recurrent", "switching/state_transfer")}


def family_tests(tree: ast.AST) -> list[int]:
    """Lines that ask which family a config is instead of asking its description: reading `.hybrid`, calling
    `.is_linear_layer(...)`."""
    out = []
    for n in ast.walk(tree):
        if isinstance(n, ast.Attribute) and n.attr == "hybrid" and isinstance(n.ctx, ast.Load):
            out.append(n.lineno)
        elif isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr == "is_linear_layer":
            out.append(n.lineno)
    return sorted(set(out))


def test_the_check_finds_family_tests():
    src = ("if cfg.hybrid is not None:\n    n = cfg.hybrid.hc_mult\nk = r.cfg.is_linear_layer(3)\n"
           "fam = describe(cfg)\nx = fam.linear is None\nimport splash.attention.hybrid\n")
    assert family_tests(ast.parse(src)) == [1, 2, 3]


def test_no_hybrid_reads_outside_the_hybrid_model():
    found = []
    for sub in ("splash", "backends"):
        for p in sorted((ROOT / sub).rglob("*.py")):
            rel = p.relative_to(ROOT).as_posix()
            if rel not in HYBRID_FILES:
                found += [f"{rel}:{ln}" for ln in family_tests(ast.parse(p.read_text()))]
    assert not found, "ask the model's description (splash.models.family.describe), not cfg.hybrid: " + ", ".join(found)


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
