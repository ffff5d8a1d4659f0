"""The torch MLA kernel's decode over a bf16 pool on this CPU: separate ckv / kpe tensors (the CPU's layout) vs the
GPU's fused [blocks, page, d_c + d_r] layout (ckv / kpe strided views of it; splash.kv.paged_cache).

    .venv/bin/python benchmarks/bench_fused_pool.py [--repeats 9]

One thread; each figure is the best of `--repeats` runs of one layer's `TorchMLAKernel.run`, in process CPU time
(robust when other jobs share the cores). DeepSeek dims (512 + 64), 16 heads, pages of 16 tokens.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from test_attention_kernels import make_state  # noqa: E402

from splash.attention.kernels.torch_mla import TorchMLAKernel  # noqa: E402

CASES = [("16 x 2000 tokens", [(2000, 1)] * 16), ("64 x 300 tokens", [(300, 1)] * 64)]


def best_ms(kernel, state, repeats: int) -> float:
    cache, _, _, _, meta, q = state
    kernel.plan(meta)
    best = float("inf")
    for _ in range(repeats):
        t = time.process_time()
        kernel.run(0, q[..., :512], q[..., 512:], cache)
        best = min(best, time.process_time() - t)
    return best * 1e3


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=9)
    args = ap.parse_args()
    torch.set_num_threads(1)
    print("| requests | compute | separate (ms) | fused (ms) | fused / separate |\n|---|---|---|---|---|")
    for name, specs in CASES:
        for compute in ("bfloat16", "float32"):
            ms = [best_ms(TorchMLAKernel(0.1, compute_dtype=compute),
                          make_state("bfloat16", 16, specs, dc=512, dr=64, heads=16, fused=fused), args.repeats)
                  for fused in (False, True)]
            print(f"| {name} | {compute} | {ms[0]:.1f} | {ms[1]:.1f} | {ms[1] / ms[0]:.2f}x |")


if __name__ == "__main__":
    main()
