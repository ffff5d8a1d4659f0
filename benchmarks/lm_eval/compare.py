"""Compare lm-evaluation-harness per-sample results of two runs (e.g. `local-completions` against splash-serve
and the `hf` backend on the same checkpoint): log-likelihood of every (doc, choice) and generated text.

    python benchmarks/lm_eval/compare.py OUT_A OUT_B [--tol 1e-3]

OUT_A / OUT_B are lm_eval --output_path directories (run with --log_samples). Exits 1 when a log-likelihood
differs by more than --tol or an is_greedy flag differs; prints the largest difference and generation agreement.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def samples(out: Path, task: str) -> dict[int, dict]:
    files = sorted(out.rglob(f"samples_{task}_*.jsonl"))
    if not files:
        raise SystemExit(f"{out}: no samples_{task}_*.jsonl (run lm_eval with --log_samples)")
    return {d["doc_id"]: d for d in map(json.loads, files[-1].read_text().splitlines())}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("a", type=Path)
    ap.add_argument("b", type=Path)
    ap.add_argument("--tol", type=float, default=1e-3)
    ap.add_argument("--loglik-task", default="splash_tiny_loglik")
    ap.add_argument("--gen-task", default="splash_tiny_gen")
    args = ap.parse_args()
    a, b = samples(args.a, args.loglik_task), samples(args.b, args.loglik_task)
    assert a.keys() == b.keys(), "different documents"
    worst, n, greedy_diff = 0.0, 0, 0
    for k in a:
        for (la, ga), (lb, gb) in zip(a[k]["filtered_resps"], b[k]["filtered_resps"]):
            worst = max(worst, abs(float(la) - float(lb)))
            greedy_diff += ga != gb
            n += 1
    ga, gb = samples(args.a, args.gen_task), samples(args.b, args.gen_task)
    same = sum(ga[k]["filtered_resps"] == gb[k]["filtered_resps"] for k in ga)
    print(f"{args.loglik_task}: {n} log-likelihoods, max |a - b| = {worst:.3g} (tol {args.tol}), "
          f"is_greedy differs in {greedy_diff}")
    print(f"{args.gen_task}: {same}/{len(ga)} generations identical")
    return 0 if worst <= args.tol and greedy_diff == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
