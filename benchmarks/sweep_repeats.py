"""Before/after of repeated `splash-bench sweep` runs, with the noise measured from the runs themselves: runs of the
same tree against each other (A/A) give the spread a difference must leave to count.

    python benchmarks/sweep_repeats.py OLD-1.json OLD-2.json ... --new NEW-1.json NEW-2.json ...

Run the two trees alternately (old, new, old, new, ...) so that a drift of the host hits both. Prints the geometric
mean over the points of new/old per alternation, the A/A range (every pair of runs of one tree: geometric mean and
per point), and new/old of the per-point medians.
"""
from __future__ import annotations

import argparse
import itertools
import math
import statistics

from splash.bench.compare import figures, key_text
from splash.bench.results import read_json


def points(path: str) -> dict[tuple, float]:
    return figures(read_json(path), "output_tokens_per_s")


def gmean(xs) -> float:
    xs = list(xs)
    return math.exp(sum(map(math.log, xs)) / len(xs))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("old", nargs="+")
    ap.add_argument("--new", nargs="+", required=True)
    a = ap.parse_args()
    old, new = [points(p) for p in a.old], [points(p) for p in a.new]
    keys = sorted(set.intersection(*(set(r) for r in old + new)))
    print(f"{len(keys)} points, {len(old)} old and {len(new)} new runs")
    print("new/old per alternation (geomean):", " ".join(f"{gmean(n[k] / o[k] for k in keys):.3f}"
                                                         for o, n in zip(old, new)))
    aa = [(runs[j], runs[i]) for runs in (old, new) for i, j in itertools.combinations(range(len(runs)), 2)]
    g = [gmean(b[k] / a_[k] for k in keys) for b, a_ in aa]
    p = [b[k] / a_[k] for b, a_ in aa for k in keys]
    print(f"A/A: geomean {min(g):.3f}-{max(g):.3f}, per point {min(p):.3f}-{max(p):.3f}")
    med = {k: statistics.median(n[k] for n in new) / statistics.median(o[k] for o in old) for k in keys}
    print(f"new/old of the medians: geomean {gmean(med.values()):.3f}, per point {min(med.values()):.3f}-"
          f"{max(med.values()):.3f}")
    for k, v in med.items():
        print(f"  {key_text(k)}: {v:.3f}")


if __name__ == "__main__":
    main()
