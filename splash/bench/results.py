"""The result JSON of every splash-bench command: one schema, the environment it ran in, safe writes, checks.

A result file is one JSON object::

    {"schema": "splash-bench/1", "kind": "sweep" | "workload" | "grid" | ...,
     "created": ISO-8601 UTC, "command": the command line, "complete": bool,
     "environment": environment(...),          # hardware, backend, ranks, versions, git revision, model, dtypes
     "config": {...},                          # the command's own parameters
     "points": [...] (sweep-like kinds) and/or "runs": [...] (serving runs, as `workload` writes)}

Sweep points: {"layout", "input_len", "batch_size", "output_len", "repeats": [{...per repeat...}],
"output_tokens_per_s", "total_tokens_per_s", "wall_s"} — the three figures are medians over the repeats.
No torch import here: the environment asks torch only if it is already imported or importable.
"""
from __future__ import annotations

import datetime as _dt
import json
import os
import platform
import shlex
import statistics
import subprocess
import sys
from importlib import metadata
from pathlib import Path
from typing import Any, Iterable

SCHEMA = "splash-bench/1"
SWEEP_KEY = ("layout", "input_len", "batch_size", "output_len")
METRICS = ("output_tokens_per_s", "total_tokens_per_s")
REPO = Path(__file__).resolve().parents[2]


class ResultError(ValueError):
    """A result file that is missing, not JSON, or not in this schema (message names the file)."""


# ---- environment ----------------------------------------------------------------------------------------
def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _accelerators(backend: str) -> list[str]:
    if backend == "cpu":
        return []
    try:
        import torch
        return [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    except Exception:  # noqa: BLE001 — the description is best effort
        return []


def hardware(backend: str = "cpu") -> dict[str, Any]:
    """What the numbers ran on; `description` is the one-line label tables and compare print."""
    cores, cpu, acc = os.cpu_count(), _cpu_model(), _accelerators(backend)
    try:
        memory = round(os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") / 2**30, 1)
    except (OSError, ValueError):   # no such sysconf name here
        memory = None
    desc = f"{len(acc)}x {acc[0]}" if acc else f"CPU: {cpu}, {cores} cores"
    return {"description": desc, "device": backend if acc else "cpu", "cpu": cpu, "cpu_cores": cores,
            "memory_gib": memory, "accelerators": acc, "hostname": platform.node()}


def versions() -> dict[str, str | None]:
    out: dict[str, str | None] = {"python": platform.python_version()}
    for dist in ("splash", "torch", "mpi4py", "transformers"):
        try:
            out[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            out[dist] = None
    try:
        from mpi4py import MPI
        out["mpi"] = MPI.Get_library_version().splitlines()[0].strip()
    except Exception:  # noqa: BLE001
        out["mpi"] = None
    return out


def git_revision() -> dict[str, Any]:
    """{"revision": sha or None, "dirty": bool or None} of the source tree this code runs from."""
    def git(*args: str) -> str | None:
        try:
            r = subprocess.run(["git", "-C", str(REPO), *args], capture_output=True, text=True, timeout=10)
        except (OSError, subprocess.TimeoutExpired):
            return None
        return r.stdout.strip() if r.returncode == 0 else None

    rev = git("rev-parse", "HEAD")
    status = git("status", "--porcelain", "--untracked-files=no") if rev else None
    return {"revision": rev, "dirty": None if status is None else bool(status)}


def load_average() -> list[float] | None:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


def environment(*, backend: str, ranks: int, model: dict[str, Any]) -> dict[str, Any]:
    """The environment block of a result. `model`: name, source (preset/path), dtype, kv_cache_dtype, ..."""
    return {"hardware": hardware(backend), "backend": backend, "ranks": ranks, "versions": versions(),
            "git": git_revision(), "model": dict(model), "load_average_start": load_average()}


# fields compare names when they differ (dotted paths into the environment)
ENV_FIELDS = ("hardware.description", "backend", "ranks", "versions.torch", "versions.splash", "versions.mpi",
              "git.revision", "model.name", "model.dtype", "model.kv_cache_dtype")


def _get(d: dict, dotted: str) -> Any:
    for part in dotted.split("."):
        d = d.get(part) if isinstance(d, dict) else None
    return d


def env_differences(a: dict, b: dict) -> list[tuple[str, Any, Any]]:
    """(field, old, new) for every ENV_FIELDS entry that differs between two environments."""
    return [(f, _get(a, f), _get(b, f)) for f in ENV_FIELDS if _get(a, f) != _get(b, f)]


# ---- documents ----------------------------------------------------------------------------------------
def command_line(argv: Iterable[str] | None = None, prog: str = "splash-bench") -> str:
    """The command as results and reports record it: `prog` and the arguments (default: this process's)."""
    return f"{prog} {shlex.join(sys.argv[1:] if argv is None else argv)}"


def new_result(kind: str, environment: dict, config: dict, argv: Iterable[str] | None = None) -> dict:
    """A result with no points yet; `argv`: the splash-bench arguments (default: this process's)."""
    return {"schema": SCHEMA, "kind": kind,
            "created": _dt.datetime.now(_dt.timezone.utc).replace(microsecond=0).isoformat(),
            "command": command_line(argv), "complete": False,
            "environment": environment, "config": config, "points": []}


def finish(doc: dict, path: str | os.PathLike | None) -> None:
    """Mark a result complete, with the load average at its end; write it to `path` when given."""
    doc["complete"], doc["load_average_end"] = True, load_average()
    if path:
        write_json(path, doc)


def write_runs(path: str | os.PathLike, kind: str, env: dict, config: dict, argv, runs: list, **extra) -> None:
    """A complete serving result (`runs` instead of `points`, as `workload` and `load` write) to `path`."""
    doc = new_result(kind, env, config, argv)
    doc.pop("points")
    doc.update(runs=runs, **extra, complete=True)
    write_json(path, doc)


def pct(xs: list[float], q: int) -> float:
    """The q-th percentile (statistics.quantiles' default method) of a serving run's latencies; 0 for none."""
    return statistics.quantiles(xs, n=100)[q - 1] if len(xs) > 1 else (xs[0] if xs else 0.0)


def mpi_result(args, kind: str, model: dict, config: dict):
    """(communicator, a new `kind` result on rank 0 and None elsewhere) of an mpirun command on CPU ranks."""
    from splash.distributed import init_dist

    comm = init_dist().comm
    if comm.rank != 0:
        return comm, None
    env = environment(backend="cpu", ranks=comm.size, model=model)
    return comm, new_result(kind, env, config, getattr(args, "argv", None))


def measure_points(args, comm, doc: dict | None, points, measure, tables, line=None) -> int:
    """An mpirun command's loop: every rank runs ``measure(comm, *point)`` for each point; rank 0 keeps what it
    returns in `doc` (rewritten to --json after every point) under a progress bar, printing ``line(result)``, then
    prints ``tables(doc)`` (and writes them to --markdown)."""
    from contextlib import nullcontext

    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from splash.bench.tables import print_tables

    bar = (Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
           if comm.rank == 0 else nullcontext())
    with bar as progress:
        task = progress.add_task(doc["kind"], total=len(points)) if progress else None
        for point in points:
            res = measure(comm, *point)
            if progress:
                doc["points"].append(res)
                if args.json:
                    write_json(args.json, doc)
                if line:
                    progress.console.print(line(res))
                progress.advance(task)
    if comm.rank == 0:
        finish(doc, args.json)
        print_tables(tables(doc), markdown_path=args.markdown)
    return 0


def write_json(path: str | os.PathLike, doc: dict) -> None:
    """Write atomically (temp file + rename): an interrupted run never leaves a half-written file."""
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    tmp = p.with_name(f".{p.name}.tmp{os.getpid()}")
    tmp.write_text(json.dumps(doc, indent=1) + "\n")
    os.replace(tmp, p)


def _fail(path, msg: str):
    raise ResultError(f"{path}: {msg}")


def _number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _check_sweep_point(path, i: int, pt: Any) -> None:
    if not isinstance(pt, dict):
        _fail(path, f"points[{i}] is not an object")
    for k in SWEEP_KEY:
        if k not in pt:
            _fail(path, f"points[{i}] has no {k!r}")
    for m in METRICS:
        if not _number(pt.get(m)):
            _fail(path, f"points[{i}].{m} must be a number")
    if not isinstance(pt.get("repeats"), list) or not pt["repeats"]:
        _fail(path, f"points[{i}].repeats must be a non-empty list")


def _check_run(path, i: int, run: Any) -> None:
    if not isinstance(run, dict) or "mode" not in run:
        _fail(path, f"runs[{i}] must be an object with a 'mode'")
    if not _number(run.get("output_tokens_per_s")):
        _fail(path, f"runs[{i}].output_tokens_per_s must be a number")
    for j, row in enumerate(run.get("timeline") or []):
        if not isinstance(row, dict) or not {"t_s", "step", "layout", "tokens_per_s"} <= set(row):
            _fail(path, f"runs[{i}].timeline[{j}] needs t_s, step, layout, tokens_per_s")


def validate(doc: Any, path: str = "<result>") -> dict:
    """Check a result's shape; returns it, or raises ResultError naming what is wrong."""
    if not isinstance(doc, dict):
        _fail(path, "not a JSON object")
    if doc.get("schema") != SCHEMA:
        _fail(path, f"schema is {doc.get('schema')!r}, expected {SCHEMA!r}")
    if not isinstance(doc.get("kind"), str):
        _fail(path, "no 'kind'")
    if not isinstance(doc.get("environment"), dict):
        _fail(path, "no 'environment' object")
    points, runs = doc.get("points"), doc.get("runs")
    if points is None and runs is None:
        _fail(path, "has neither 'points' nor 'runs'")
    for name, items in (("points", points), ("runs", runs)):
        if items is not None and not isinstance(items, list):
            _fail(path, f"{name!r} is not a list")
    if doc["kind"] == "sweep":
        for i, pt in enumerate(points or []):
            _check_sweep_point(path, i, pt)
    for i, run in enumerate(runs or []):
        _check_run(path, i, run)
    return doc


def read_json(path: str | os.PathLike) -> dict:
    """Load and validate a result file; ResultError on a missing file, bad JSON or a wrong shape."""
    try:
        text = Path(path).read_text()
    except OSError as e:
        raise ResultError(f"{path}: cannot read: {e.strerror or e}") from None
    try:
        doc = json.loads(text)
    except json.JSONDecodeError as e:
        raise ResultError(f"{path}: not valid JSON: {e}") from None
    return validate(doc, str(path))


def sweep_key(pt: dict) -> tuple:
    return tuple(pt[k] for k in SWEEP_KEY)
