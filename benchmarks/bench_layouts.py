"""Moved to `splash-bench grid` (splash/bench/grid.py); this wrapper keeps the old command working:

    mpiexec -n 2 .venv/bin/python benchmarks/bench_layouts.py [options of splash-bench grid]
"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from splash.bench.cli import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main(["grid", *sys.argv[1:]]))
