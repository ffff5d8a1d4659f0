"""Per-step attention metadata cost and the attention's scratch memory, at serving scale (one rank, no model).

    .venv/bin/python benchmarks/bench_plan.py [--points 64x1024,256x4096,256x32768,16x262144] [--json FILE]

Each point is B requests holding `context` tokens each, decoding `--steps` consecutive steps (one new token per
request per step; every `block_size`-th step appends a page to every request): per step the rank allocates the
new pages, appends them to its tensor page table, builds the step's attention metadata and plans the attention
kernel, as a layout executor's `prepare` does (TP placement: every block is local). metadata_ms is the median
wall time per step, metadata_max_ms the slowest step, metadata_cross_ms the median of the page-crossing steps
(those in which every request appends a page; 4 of the default 64), and the metadata_cpu_* figures the same
in process CPU time (what the process got; robust when other jobs share the cores);
the first step (which also grows the page table) is a warm-up and not timed. scratch_bytes is what the torch
kernel may allocate per layer beyond its inputs and outputs for that plan (`TorchMLAKernel.scratch_bound`: one
chunk's buffers, plus the page ids and masks it keeps across layers, `index_cache_bytes`), at the latent width given (default GLM-5.3 /
DeepSeek-V3: d_c 512 + d_r 64, 16 local heads); tests/test_attention_kernels.py checks the bytes of the
tensors a chunk really allocates against that bound.

Before issue 9 (build_attn_plan + dense gathers; the figures in docs/benchmarks.md) the same points cost
15-2331 ms of metadata per step and 0.15-19 GB of scratch per layer.
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

from splash.attention.batch import StepRequest  # noqa: E402
from splash.attention.kernels.torch_mla import TorchMLAKernel  # noqa: E402
from splash.attention.metadata import build_metadata  # noqa: E402
from splash.kv.block_manager import BlockManager  # noqa: E402
from splash.kv.page_table import PageTable, ensure_step_pages  # noqa: E402

DEFAULT_POINTS = "64x1024,256x4096,256x32768,16x262144"


def setup(batch: int, context: int, bs: int) -> tuple[BlockManager, PageTable, list[StepRequest]]:
    per = -(-context // bs) + 8  # room for the steps timed
    bm, tables = BlockManager(batch * per, bs), PageTable(bs)
    for i in range(batch):
        tables.append(f"r{i}", bm.ensure(f"r{i}", list(range(-(-context // bs)))))
    tables.flush()
    return bm, tables, [StepRequest(f"r{i}", context, 1) for i in range(batch)]


def prepare(bm: BlockManager, tables: PageTable, reqs: list[StepRequest], kernel: TorchMLAKernel) -> None:
    """What a layout executor's `prepare` does for a decode step (`RankContext.plan_step`: `ensure_step_pages`,
    `build_metadata` and the kernel's plan): pages for the new tokens, metadata, plan."""
    ensure_step_pages(bm, tables, reqs)
    kernel.plan(build_metadata(reqs, tables))


def measure(batch: int, context: int, bs: int, steps: int, heads: int, d_c: int, d_r: int) -> dict:
    bm, tables, reqs = setup(batch, context, bs)
    kernel = TorchMLAKernel(1.0)
    times, cpu, cross, cross_cpu = [], [], [], []
    for k in range(steps + 1):  # step 0 (the first token of a new page for every request) warms up, untimed
        step = [StepRequest(q.req_id, context + k, 1) for q in reqs]
        t0, c0 = time.perf_counter(), time.process_time()
        with torch.inference_mode():   # as in ModelRunner.step
            prepare(bm, tables, step, kernel)
        t, c = time.perf_counter() - t0, time.process_time() - c0
        if k:
            times.append(t)
            cpu.append(c)
            if (context + k) % bs == 0:  # every request appends a page this step
                cross.append(t)
                cross_cpu.append(c)
    scratch = kernel.scratch_bound(heads, d_c, d_r) + kernel.index_budget
    ms = lambda xs, f=statistics.median: f(xs) * 1e3 if xs else None  # noqa: E731
    return {"batch": batch, "context": context, "metadata_ms": ms(times), "metadata_max_ms": ms(times, max),
            "metadata_cpu_ms": ms(cpu), "metadata_cpu_max_ms": ms(cpu, max),
            "metadata_cross_ms": ms(cross), "metadata_cross_cpu_ms": ms(cross_cpu), "scratch_bytes": scratch}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--points", default=DEFAULT_POINTS, help="comma-separated BATCHxCONTEXT")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--heads", type=int, default=16, help="local heads (for the scratch figure)")
    ap.add_argument("--kv-lora-rank", type=int, default=512)
    ap.add_argument("--rope-dim", type=int, default=64)
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads (the engine's decode runs use 1)")
    ap.add_argument("--json", help="write [{batch, context, metadata_ms, scratch_bytes, metadata_max_ms, "
                                   "metadata_cpu_ms, metadata_cpu_max_ms, metadata_cross_ms, "
                                   "metadata_cross_cpu_ms}] here")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    rows = []
    for p in a.points.split(","):
        b, c = map(int, p.lower().split("x"))
        r = measure(b, c, a.block_size, a.steps, a.heads, a.kv_lora_rank, a.rope_dim)
        rows.append(r)
        cross = ("" if r["metadata_cross_ms"] is None else f"; page-crossing steps {r['metadata_cross_ms']:.3f}"
                 f" (CPU {r['metadata_cross_cpu_ms']:.3f})")
        print(f"B={b:4d} context={c:7d}: metadata {r['metadata_ms']:7.3f} ms/step (max {r['metadata_max_ms']:.3f}; "
              f"CPU time {r['metadata_cpu_ms']:.3f}, max {r['metadata_cpu_max_ms']:.3f}{cross}), "
              f"attention scratch "
              f"{r['scratch_bytes'] / 2**20:11.1f} MiB/layer", flush=True)
    if a.json:
        Path(a.json).write_text(json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    main()
