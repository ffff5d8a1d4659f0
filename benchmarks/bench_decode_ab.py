"""Paired A/B of SPLASH's CPU kernels on bench_decode_vs_hf's decode step: two engines in one process, one with
some kernels off (A), one with all on (B), run alternately.

    .venv/bin/python benchmarks/bench_decode_ab.py --off mla_project [--off moe_experts,moe_route] [--pairs 24]

`--off` names routes of splash.native.ops (each then returns None, so the torch function it stands for runs),
`pack_attention` / `pack_linear` / `pack_experts` (A's attention projections / dense MLPs, shared experts and LM
head / MoE experts load plain, not packed, and run on torch's GEMMs), `checks` (A's routes run each op's checks
before its C call, as `torch.ops.splash.<name>` does: A/B > 1 is what the checks would cost the routes, which test
their arguments in one expression instead) or `dispatcher` (A's routes go through `torch.ops.splash`: the checks and
torch's dispatcher). Each pair times one engine then the other (the order alternating), each as max_tokens=1 then
max_tokens=`--new` back to back, decode step = their CPU-time difference over the new tokens. Prints both engines'
min and median step and the median of the per-pair ratios A/B (> 1: B, the kernels on, is faster): on a host whose
speed drifts by tens of percent within minutes, the pairing is what makes a few-percent difference visible (an A/A
run of one build gives 0.97-1.03 here).
"""
from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from bench_decode_vs_hf import BENCH_MODEL, splash_runner

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from hf_models import make_tiny_deepseek, random_prompts  # noqa: E402

from splash.models import build as model_build  # noqa: E402
from splash.models import weights as model_weights  # noqa: E402
from splash.native import ops  # noqa: E402


LOAD = {"pack_attention": (model_weights,), "pack_linear": (model_weights, model_build),
        "pack_experts": (model_weights,)}   # packing at load: off leaves those weights plain
ENTRY = {"checks": lambda: ops.checked, "dispatcher": lambda: torch.ops.splash}


@contextlib.contextmanager
def kernels_off(names: list[str]):
    """Within the block: the named routes return None (their torch functions run); a LOAD name leaves its weights
    plain (torch's GEMMs then)."""
    saved = [(ops, n, getattr(ops, n)) for n in names if n not in LOAD and n not in ENTRY]
    saved += [(m, n, getattr(m, n)) for n in names if n in LOAD for m in LOAD[n]]
    for m, n, _ in saved:
        setattr(m, n, (lambda w: w) if n in LOAD else (lambda *a, **k: None))
    for entry in set(names) & set(ENTRY):   # the routes call the C through the checks (and the dispatcher)
        saved += [(ops.kernels, n, f) for n, f in vars(ops.kernels).items()]
        for n in list(vars(ops.kernels)):
            setattr(ops.kernels, n, getattr(ENTRY[entry](), n))
    try:
        yield
    finally:
        for m, n, f in saved:
            setattr(m, n, f)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--off", action="append", required=True,
                    help="kernels off in engine A: splash.native.ops function names or pack_attention (comma-separated"
                         " or repeated)")
    ap.add_argument("--pairs", type=int, default=24)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--new", type=int, default=33, help="new tokens per timed run")
    args = ap.parse_args()
    off = [n for arg in args.off for n in arg.split(",") if n]
    bad = [n for n in off if n not in LOAD and n not in ENTRY and not callable(getattr(ops, n, None))]
    if bad:
        ap.error(f"--off: {', '.join(bad)} is not a route of splash.native.ops (nor one of "
                 f"{', '.join([*ENTRY, *LOAD])})")
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        path = make_tiny_deepseek(Path(tmp) / "bench", tokenizer=False, **BENCH_MODEL)
        prompts = random_prompts([args.prompt_len] * args.batch, seed=0, vocab=BENCH_MODEL["vocab_size"])
        with kernels_off(off):
            a = splash_runner(path, prompts, 16)
        b = splash_runner(path, prompts, 16)
        engines = {"A": (a, lambda: kernels_off(off)), "B": (b, contextlib.nullcontext)}
        toks = {}
        for k, (run, ctx) in engines.items():
            with ctx():
                toks[k] = run(8)
        steps: dict[str, list[float]] = {"A": [], "B": []}
        for i in range(args.pairs):
            for k in ("A", "B") if i % 2 == 0 else ("B", "A"):
                run, ctx = engines[k]
                with ctx():
                    t0 = time.process_time()
                    run(1)
                    t1 = time.process_time()
                    run(args.new)
                    t2 = time.process_time()
                steps[k].append(((t2 - t1) - (t1 - t0)) / (args.new - 1) * 1e3)
    ratios = [x / y for x, y in zip(steps["A"], steps["B"])]
    print(f"off in A: {', '.join(off)}; same greedy tokens: {toks['A'] == toks['B']}; {args.pairs} pairs, "
          f"batch {args.batch} x prompt {args.prompt_len}")
    for k in ("A", "B"):
        print(f"  {k}: decode step min {min(steps[k]):.2f} ms, median {statistics.median(steps[k]):.2f} ms")
    print(f"  paired median A/B = {statistics.median(ratios):.3f} (> 1: the kernels help); "
          f"min A / min B = {min(steps['A']) / min(steps['B']):.3f}")


if __name__ == "__main__":
    main()
