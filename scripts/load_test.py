#!/usr/bin/env python
"""Bounded loopback load test of splash-serve — a thin wrapper of `splash-bench load` (splash/bench/load.py,
abuse clients in splash/bench/load_abuse.py), kept for its command line:

  python scripts/load_test.py --launch --np 4 --clients 64 --requests-per-client 4 --switch-every 8
  python scripts/load_test.py --url http://127.0.0.1:8000 --admin-token TOKEN --clients 64
  python scripts/load_test.py --launch --np 2 --clients 16 --abandon 16 --oversized 4 --probe-every 0.25

Same flags, checks, report and exit status as `splash-bench load` (see its --help).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from splash.bench import load  # noqa: E402


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    p = argparse.ArgumentParser(description=load.__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    load.add_arguments(p)
    args = p.parse_args(argv)
    if bool(args.url) == bool(args.launch):
        p.error("give exactly one of --url or --launch")
    args.argv, args.prog = argv, "python scripts/load_test.py"
    return load.run(args)


if __name__ == "__main__":
    sys.exit(main())
