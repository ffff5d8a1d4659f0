"""What the scheduler prefills of a workload's first turns with the prefix cache on and off, per layout — the engine's
own `Scheduler` and `KVLedger` (pure Python, no model, no ranks), with configs/cpu.yaml's scheduler settings — and
what the `auto` forecast (`BatchForecast.replay`, forked from that scheduler before its first step) charges as
prefill and costs in time.

    .venv/bin/python benchmarks/bench_prefix_sched.py [--workload benchmarks/workloads/rl-rollout-samples.yaml]

Every request of the workload is queued at once (its at_s and stagger ignored; a multi-turn group's first turn
only), each request sampling tokens of its own. Prints per layout and cache setting: prompt tokens computed (of all
requests' prompt tokens), the hit rate (prompt tokens found cached / looked up), scheduler steps, and the forecast's
prefill-step tokens and its median time over 5 calls.
"""
from __future__ import annotations

import argparse
import random
import statistics
import time

from splash.workload import load_workload, make_requests
from splash.engine.layout_policy.auto import request_views
from splash.engine.layout_policy.forecast import BatchForecast
from splash.engine.ledger import KVLedger
from splash.engine.scheduler import Request, Scheduler


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workload", default="benchmarks/workloads/rl-rollout-samples.yaml")
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--blocks", type=int, default=20_000, help="KV blocks per rank (default: room for all)")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--max-num-seqs", type=int, default=64)
    ap.add_argument("--max-num-batched-tokens", type=int, default=2048)
    a = ap.parse_args()
    reqs = make_requests(load_workload(a.workload), 32_000, 0)
    prompts = [(parts[0], m) for _, parts, m in reqs]
    total = sum(len(p) for p, _ in prompts)
    for lay in ("tp", "dp_attn", "cp", "dop"):
        for on in (True, False):
            led = KVLedger(a.ranks, a.blocks, a.block_size, lay, prefix=on)
            s = Scheduler(led, a.max_num_seqs, a.max_num_batched_tokens)
            lens = {}
            for i, (p, m) in enumerate(prompts):
                s.add(Request(f"r{i}", list(p), m))
                lens[f"r{i}"] = len(p)
            # the replay alone (no cost model: its tokens, not its seconds, are measured here)
            fc = BatchForecast(None, None, world=a.ranks, block_size=a.block_size, scheduler=s)
            views = request_views(s, led)
            times, rp = [], None
            for _ in range(5):
                t0 = time.perf_counter()
                rp = fc.replay(lay, views, a.blocks)
                times.append(time.perf_counter() - t0)
            charged = sum(n for seg in rp.segments if seg.prefill for n, _, _ in seg.rows)
            rng, computed, steps = random.Random(1), 0, 0
            while s.has_work():
                plan = s.schedule()
                steps += 1
                computed += sum(max(0, min(it.start_pos + len(it.tokens), lens[it.req_id]) - it.start_pos)
                                for it in plan.items)
                s.update(plan, {it.req_id: rng.randrange(32_000) for it in plan.items if it.sample})
            print(f"{lay:8s} cache {'on ' if on else 'off'}: prompt tokens computed {computed:6d} of {total}, hit rate "
                  f"{s.prefix_hits / max(1, s.prefix_queries):4.0%}, {steps:3d} steps; forecast: prefill-step tokens "
                  f"{charged:6d}, {statistics.median(times) * 1e3:5.0f} ms")


if __name__ == "__main__":
    main()
