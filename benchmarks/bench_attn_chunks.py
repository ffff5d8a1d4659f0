"""Split-KV chunking of the `torch` MLA kernel inside real decode steps: CPU time per step under each variant.

    OMP_NUM_THREADS=1 .venv/bin/mpiexec -n 2 .venv/bin/python benchmarks/bench_attn_chunks.py \
        tp:16:2048,dp_attn:32:2048 [reps]

Points are layout:batch:context. Variants: `old32` (full chunks + a remainder, 32 MiB scratch budget: the kernel
before cost-model round 4) and balanced chunks (torch_mla.chunk_spans) at 32, 24, 16, 12 and 8 MiB. On one
DecodeState per point the variants are interleaved per repetition (1 warm-up step after each change, 2 timed);
rank 0 prints min/median ms per variant (CPU clock, max over ranks).
"""
from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from splash.attention.kernels import torch_mla  # noqa: E402

BALANCED = torch_mla.chunk_spans


def full_plus_remainder(pages: int, C: int) -> list[tuple[int, int]]:
    return [(j, min(C, pages - j)) for j in range(0, pages, C)]


VARIANTS = {"old32": (full_plus_remainder, 32), **{f"bal{m}": (BALANCED, m) for m in (32, 24, 16, 12, 8)}}


def main() -> None:
    from splash.bench.decode_state import DecodeState
    from splash.distributed import init_dist
    points = [(lay, int(b), int(c)) for lay, b, c in (x.split(":") for x in sys.argv[1].split(","))]
    reps = int(sys.argv[2]) if len(sys.argv) > 2 else 3
    comm = init_dist().comm
    for lay, b, c in points:
        st = DecodeState(comm, "small-mla", lay, b, c)
        res = {k: [] for k in VARIANTS}
        for _ in range(reps):
            for k, (spans, mib) in VARIANTS.items():
                torch_mla.chunk_spans = spans
                st.runner.attn.scratch_budget = mib << 20
                st.step(clock=time.thread_time)
                res[k] += [st.step(clock=time.thread_time) for _ in range(2)]
        torch_mla.chunk_spans = BALANCED
        if comm.rank == 0:
            print(f"{lay} B={b} L={c} " + " ".join(f"{k}={min(v) * 1e3:.1f}/{statistics.median(v) * 1e3:.1f}"
                                                    for k, v in res.items()), flush=True)


if __name__ == "__main__":
    main()
