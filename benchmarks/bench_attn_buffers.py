"""Fresh vs reused gather buffers of the `torch` MLA kernel's multi-chunk walk, inside real decode steps.

    OMP_NUM_THREADS=1 [MALLOC_MMAP_THRESHOLD_=131072] .venv/bin/mpiexec -n 2 -genvall .venv/bin/python \
        benchmarks/bench_attn_buffers.py tp:4:4096,tp:16:2048,dp_attn:32:2048

Points are layout:batch:context. `fresh`: each chunk gathers into a new tensor (the kernel before cost-model
round 4); `reused`: into the kernel's kept buffers. MALLOC_MMAP_THRESHOLD_ pins glibc's mmap threshold low, the
allocator state in which multi-MB temporaries are fresh pages on every call. Variants interleaved per repetition;
rank 0 prints min/median ms (CPU clock, max over ranks).
"""
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from splash.bench.decode_state import DecodeState  # noqa: E402
from splash.distributed import init_dist  # noqa: E402

comm = init_dist().comm
for lay, B, L in [(l, int(b), int(c)) for l, b, c in (x.split(":") for x in sys.argv[1].split(","))]:
    st = DecodeState(comm, "small-mla", lay, B, L)
    res = {"fresh": [], "reused": []}
    for r in range(3):
        for k in res:
            st.runner.attn._page_bufs = None if k == "fresh" else {}
            st.step(clock=time.thread_time)
            res[k] += [st.step(clock=time.thread_time) for _ in range(3)]
    if comm.rank == 0:
        print(os.environ.get("MALLOC_MMAP_THRESHOLD_", "default"), lay, B, L, " ".join(
            f"{k}={min(v)*1e3:.1f}/{statistics.median(v)*1e3:.1f}" for k, v in res.items()), flush=True)
