"""Per-step attention metadata cost and the attention's scratch memory, at serving scale (one rank, no model).

    .venv/bin/python benchmarks/bench_plan.py [--points 64x1024,256x4096,256x32768,16x262144] [--json FILE]

Each point is B requests holding `context` tokens each, in a decode step (one new token per request): the rank
allocates the blocks for the new tokens and builds the step's attention metadata, as a layout executor's
`prepare` does (TP placement: every block is local). metadata_ms is the median wall time of that over
`--repeats` steps. scratch_bytes is the memory the attention allocates per layer for these metadata, beyond its
inputs and outputs, at the latent width given (default GLM-5.3 / DeepSeek-V3: d_c 512 + d_r 64, 16 local heads,
fp32 KV): the dense gathered copies of the histories (c_kv, k_rope), slot indices, masks and scores.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from splash.attention.batch import StepRequest, build_attn_plan  # noqa: E402
from splash.kv.block_manager import BlockManager  # noqa: E402

DEFAULT_POINTS = "64x1024,256x4096,256x32768,16x262144"


def setup(batch: int, context: int, bs: int) -> tuple[BlockManager, list[StepRequest]]:
    per = -(-(context + 1) // bs) + 1
    bm = BlockManager(batch * per, bs)
    for i in range(batch):
        bm.ensure(f"r{i}", list(range(-(-context // bs))))
    return bm, [StepRequest(f"r{i}", context, 1) for i in range(batch)]


def scratch_bytes(plan, heads: int, d_c: int, d_r: int) -> int:
    """What `attend_plan` allocates for this plan (fp32 KV): the gathered c_kv / k_rope copies, the int64 slots,
    the bool mask and the fp32 scores (softmax in place), for the decode batch and every prefill request."""
    s = plan.decode_slots.numel()
    total = s * (8 + 1 + 4 * (d_c + d_r) + 4 * heads)
    for rows, slots, _ in plan.prefill:
        n, k = rows.numel(), slots.numel()
        total += k * (8 + 8 + 4 * (d_c + d_r)) + n * k + n * heads * k * (1 + 4)
    return total


def measure(batch: int, context: int, bs: int, repeats: int, heads: int, d_c: int, d_r: int) -> dict:
    bm, reqs = setup(batch, context, bs)
    times, plan = [], None
    for _ in range(repeats):
        t0 = time.perf_counter()
        for q in reqs:  # the executor's prepare: blocks for the new token, then the plan
            bm.ensure(q.req_id, [q.start_pos // bs])
        plan = build_attn_plan(reqs, bm.table, bs, lambda q, b: True)
        times.append(time.perf_counter() - t0)
    return {"batch": batch, "context": context, "metadata_ms": statistics.median(times) * 1e3,
            "scratch_bytes": scratch_bytes(plan, heads, d_c, d_r)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--points", default=DEFAULT_POINTS, help="comma-separated BATCHxCONTEXT")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--heads", type=int, default=16, help="local heads (for the scratch figure)")
    ap.add_argument("--kv-lora-rank", type=int, default=512)
    ap.add_argument("--rope-dim", type=int, default=64)
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads (the engine's decode runs use 1)")
    ap.add_argument("--json", help="write [{batch, context, metadata_ms, scratch_bytes}] here")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    rows = []
    for p in a.points.split(","):
        b, c = map(int, p.lower().split("x"))
        r = measure(b, c, a.block_size, a.repeats, a.heads, a.kv_lora_rank, a.rope_dim)
        rows.append(r)
        print(f"B={b:4d} context={c:7d}: metadata {r['metadata_ms']:9.3f} ms/step, attention scratch "
              f"{r['scratch_bytes'] / 2**20:11.1f} MiB/layer", flush=True)
    if a.json:
        Path(a.json).write_text(json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    main()
