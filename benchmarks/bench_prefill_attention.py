"""Prefill attention on one rank: the `torch` kernel's chunked GEMM path against SPLASH's C kernel (every query row
an entry that sees the keys up to its own position), same cache, same rows, side by side.

    .venv/bin/python benchmarks/bench_prefill_attention.py [--preset small-mla] [--reps 5]

Each point is B requests whose q new rows end at context s (history s - q), over two layers, plan included; the
best of `reps` on the thread's CPU clock. With no AVX2/FMA or no C compiler the C kernel is absent and only the
torch column is printed.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from splash import native  # noqa: E402
from splash.bench.calib_attention import attention_call  # noqa: E402
from splash.bench.calib_timing import timeit  # noqa: E402
from splash.bench.tables import TableSpec, print_tables  # noqa: E402
from splash.models.presets import preset_config  # noqa: E402

POINTS = [(32, 32, 32), (1, 512, 512), (1, 2048, 2048), (1, 2048, 512), (1, 4608, 512), (1, 2176, 128),
          (4, 1024, 512)]   # (B, context s, new rows q)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="small-mla")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args()
    torch.set_num_threads(1)
    cfg = preset_config(args.preset)
    h = cfg.num_attention_heads
    from rich.console import Console
    t = TableSpec(f"prefill attention, {args.preset} ({h} heads, latent {cfg.kv_lora_rank} + rope "
                  f"{cfg.qk_rope_head_dim}), 2 layers, 1 thread, best of {args.reps} (ms, CPU clock)",
                  ["B", "context", "new rows", "torch chunked", "C kernel", "torch / C"])
    have = native.lib() is not None
    orig = native.enabled
    best = lambda run: timeit(run, args.reps, warm=1, clock=time.thread_time, stat=min)  # noqa: E731
    for b, s, q in POINTS:
        run = attention_call(cfg, args.block_size, b, s, h, q)
        native.enabled = lambda: False
        try:
            slow = best(run)
        finally:
            native.enabled = orig
        fast = best(run) if have and native.enabled() else float("nan")
        t.add_row([str(b), str(s), str(q), f"{slow * 1e3:.2f}", f"{fast * 1e3:.2f}", f"{slow / fast:.2f}x"])
    print_tables([t], Console(width=120))


if __name__ == "__main__":
    main()
