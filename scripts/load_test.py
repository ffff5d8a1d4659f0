#!/usr/bin/env python
"""Moved to `splash-bench load` (splash/bench/load.py); this wrapper keeps the old command working:

    python scripts/load_test.py --launch --np 4 --clients 64 --requests-per-client 4 --switch-every 8
"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from splash.bench.cli import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main(["load", *sys.argv[1:]]))
