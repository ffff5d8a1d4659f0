"""Worker for test_auto_switch: `layout: auto` switches live mid-generation on real ranks when the scheduler's
cost model says so, and the tokens stay transformers' tokens.

argv: model_dir ref.pt. The cost model is a stand-in with a scripted regime (the real model's accuracy is
benchmarks/bench_costmodel.py's business): TP is fastest for one or two rows, DOP for a wide batch, CP for a
single long row. The batch starts wide, shrinks as requests finish, and the last request runs long, so the
scheduler must go tp -> dop -> ... -> cp by itself, live, while requests run. (The forecast charges the whole
remaining batch, wide phase and long tail, so the wide phase's lead is made large enough — 3x — to outweigh the
tail at the start; once the wide phase is over, the tail alone decides.) The online correction is off
and the overhead budget unbounded, so the decisions do not depend on this machine's timings. Steps are scripted
at 0.1 s per row, so each regime's payoff exceeds the scheduler's prior switch cost (10 x a 5 ms floor before
any switch is measured).
"""
from __future__ import annotations

import math
import sys
from pathlib import Path
from types import SimpleNamespace

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from mpi_util import run_worker  # noqa: E402

from splash.engine.layout_policy.auto import AutoLayout  # noqa: E402
from splash.engine.llm import LLM  # noqa: E402
from splash.engine.sampling import SamplingParams  # noqa: E402


class Regimes:
    def step(self, layout, rows):
        n, ctx = len(rows), max(c for _, c, _ in rows)
        if n >= 3:
            best = "dop"
        elif n == 1 and ctx >= 40:
            best = "cp"
        else:
            best = "tp"
        return SimpleNamespace(seconds=0.1 * n * (1.0 if layout == best else 3.0 if n >= 3 else 2.0))

    def switch(self, manifest, mode, step_seconds=None):
        return SimpleNamespace(exposed_seconds=1e-6)


def main() -> None:
    model_dir, ref_path = sys.argv[1:3]
    ref = torch.load(ref_path)
    llm = LLM(model_dir, layout="auto", block_size=4, max_num_batched_tokens=16, num_kv_blocks=256,
              hardware_profile=None)   # the stand-in below replaces the cost model
    eng = llm.engine
    rank = llm.comm.rank
    if rank == 0:
        assert eng.layout == "tp" and eng.layout_mode == "auto"
        eng.auto = AutoLayout(Regimes(), eng.control.allowed, 0.10, block_size=4, world=llm.comm.size,
                              capacity_blocks={a: eng.ledger.cap(a) for a in eng.control.allowed},
                              max_num_seqs=256, max_num_batched_tokens=16, reeval_steps=1,
                              row=lambda n, c, o: (n, c, o), overhead_budget=math.inf)
        eng.auto.observe = lambda *a, **k: None   # no online correction and no overhead bound (it would weigh this
        # machine's prediction time against its step time): deterministic decisions
    params = [SamplingParams(max_tokens=m, temperature=0, ignore_eos=True) for m in ref["max_tokens"]]
    outs = llm.generate(ref["prompts"], params)
    for o, want, m in zip(outs, ref["tokens"], ref["max_tokens"]):
        assert o.token_ids == want[:m], f"rank {rank}: {o.token_ids} != {want[:m]}"
    bm = llm.runner.bm
    assert bm.num_free + bm.num_evictable == bm.num_blocks, f"rank {rank} leaked {bm.num_used} blocks"
    if rank == 0:
        path = sorted(eng.switch_counts)
        assert ("tp", "dop") in path, path
        assert any(dst == "cp" for _, dst in path), path
        assert eng.auto.verdicts.get("switch", 0) >= 2, eng.auto.verdicts
        print(f"rank 0: auto OK switches {path} verdicts {eng.auto.verdicts}", flush=True)


if __name__ == "__main__":
    run_worker(main)
