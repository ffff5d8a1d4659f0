"""``splash-bench``: one command for SPLASH's benchmarks.

Subcommands are modules named in ``SUBCOMMANDS``, imported only when needed; each exposes
``add_arguments(parser)`` and ``run(args) -> int``. A module that cannot be imported (not installed in this
build, or a missing optional dependency) is left out of ``--help``; naming it explicitly says why.
"""
from __future__ import annotations

import argparse
import importlib
import sys
from typing import Sequence

# name -> (module, one-line help). Commands under mpirun say so in their help.
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "sweep": ("splash.bench.sweep", "fixed-layout throughput sweep through the engine (run under mpirun)"),
    "compare": ("splash.bench.compare", "compare two result JSONs point by point; exit 1 on a regression"),
    "plot": ("splash.bench.plot", "PNG figures of a sweep or serving-run result"),
    "show": ("splash.bench.show", "print a result's tables again (rich or markdown)"),
    "grid": ("splash.bench.grid", "decode step time per layout over batch x context, KV resident (mpirun)"),
    "switch": ("splash.bench.switch", "added time of live and blocking switches per direction (mpirun)"),
    "load": ("splash.bench.load", "bounded loopback load test of splash-serve (streaming clients)"),
    "calibrate": ("splash.bench.calibrate", "measure this machine and write a cost-model hardware profile"),
    "workload": ("splash.bench.workload", "serving workload through the engine, auto vs fixed layouts"),
    "grammar": ("splash.bench.grammar", "per-token cost of the structured-output grammar mask in the sampler"),
}


def _load(name: str):
    """The subcommand's module, or the ImportError that kept it out."""
    try:
        return importlib.import_module(SUBCOMMANDS[name][0])
    except ImportError as e:
        return e


def build_parser(names: Sequence[str] | None = None) -> tuple[argparse.ArgumentParser, dict]:
    """The parser with every importable subcommand (or only `names`); also returns name -> module."""
    parser = argparse.ArgumentParser(
        prog="splash-bench", description="SPLASH benchmarks: layout sweeps, regression compare, plots.",
        epilog="Run 'splash-bench COMMAND --help' for a command's options.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    mods = {}
    for name in names if names is not None else SUBCOMMANDS:
        mod = _load(name)
        if isinstance(mod, ImportError):
            continue
        mods[name] = mod
        doc = (mod.__doc__ or "").strip()
        p = sub.add_parser(name, help=SUBCOMMANDS[name][1], description=doc or SUBCOMMANDS[name][1],
                           formatter_class=argparse.RawDescriptionHelpFormatter)
        mod.add_arguments(p)
    return parser, mods


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    first = next((a for a in argv if not a.startswith("-")), None)
    if first in SUBCOMMANDS:
        mod = _load(first)
        if isinstance(mod, ImportError):
            print(f"error: splash-bench {first} is not available in this build: {mod}", file=sys.stderr)
            return 2
        parser, mods = build_parser([first])  # import only the command that runs
    else:
        parser, mods = build_parser()
    args = parser.parse_args(argv)
    args.argv = argv  # the command line, as results record it
    if args.command is None:
        parser.print_help()
        return 2
    from splash.bench.results import ResultError

    try:
        return int(mods[args.command].run(args) or 0)
    except ResultError as e:  # a result file that cannot be read or has the wrong shape
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
