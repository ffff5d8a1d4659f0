"""Projection payload of a layout switch per direction, BF16 vs FP8 vs INT8 weights: measured bytes and time.

    mpiexec -n 2 .venv/bin/python benchmarks/bench_weight_switch.py [--preset small-mla] [--trials 7]

A runner holds the preset's weights (compute dtype bf16; fp8/int8 quantised at load, kept in stored form) and no
requests, so a switch moves only attention projections. For each of the 12 directions and each format, a
blocking switch is timed (all layers: pack, all-gather, reassemble — or slice for a discard) and switched back;
the bytes each rank received are measured from the all-gather results (minus its own shard) and compared with
the manifest's figure. Rank 0 prints a markdown table: max received MiB per rank (all layers), the manifest's,
resident weight MiB per rank before/after, and p50 time in ms."""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from splash.distributed import init_dist  # noqa: E402
from splash.engine.runner import ModelRunner  # noqa: E402
from splash.models.loader import quantizing_getter  # noqa: E402
from splash.models.presets import preset_config, preset_getter  # noqa: E402
from splash.models.weights import resident_bytes  # noqa: E402
from splash.switching.executor import SwitchExecutor  # noqa: E402
from splash.switching.manifest import plan_switch  # noqa: E402

LAYOUTS = ("tp", "dp_attn", "cp", "dop")
FORMATS = ("bf16", "fp8", "int8")


def count_gathers(r: ModelRunner, box: list) -> None:
    gather = r.comm.iall_gatherv

    def wrapped(t, counts=None):
        h = gather(t, counts)
        wait = h.wait

        def waited():
            out = wait()
            box[0] += (out.numel() - t.numel()) * out.element_size()
            return out
        h.wait = waited
        return h
    r.comm.iall_gatherv = wrapped


def switch(r: ModelRunner, dst: str) -> tuple[float, float]:
    """Blocking switch of an empty runner to `dst`: (seconds, manifest bytes this rank receives)."""
    m = plan_switch(r.layout, dst, r.cfg, r.comm.size, {}, r.block_size, r.dtype.itemsize, r.kv_dtype,
                    weight_quant=r.weight_quant)
    r.comm.barrier()
    t0 = time.perf_counter()
    r.step(None, SwitchExecutor(r.ctx, m, "blocking", r.streams))
    r.comm.barrier()
    return time.perf_counter() - t0, m.weight_recv_total[r.comm.rank]


def measure(comm, preset: str, fmt: str, trials: int) -> list[tuple]:
    get = preset_getter(preset, 0, torch.bfloat16)
    if fmt != "bf16":
        get = quantizing_getter(get, fmt, torch.bfloat16)
    rows = []
    for src in LAYOUTS:
        r = ModelRunner(preset_config(preset), get, comm, src, "bfloat16", 16, 4, torch.bfloat16)
        box = [0]
        count_gathers(r, box)
        for dst in LAYOUTS:
            if dst == src:
                continue
            times, before = [], resident_bytes(r.weights)
            for _ in range(trials):
                box[0] = 0
                dt, want = switch(r, dst)
                got, after = box[0], resident_bytes(r.weights)
                switch(r, src)
                times.append(dt)
            rows.append((src, dst, fmt, got, want, before, after, statistics.median(times)))
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="small-mla")
    ap.add_argument("--trials", type=int, default=7)
    a = ap.parse_args()
    comm = init_dist().comm
    torch.set_num_threads(1)
    rows = [row for fmt in FORMATS for row in measure(comm, a.preset, fmt, a.trials)]
    gathered = comm.all_gather_obj(rows)
    if comm.rank:
        return
    mib = 1 << 20
    print(f"preset {a.preset}, {comm.size} ranks, CPU, compute bf16, blocking switch of projections only, "
          f"p50 of {a.trials}")
    print("| direction | format | received MiB/rank (max, measured) | manifest MiB | resident weight MiB/rank "
          "before → after | p50 ms |")
    print("|---|---|---|---|---|---|")
    for i, (src, dst, fmt, _, _, _, _, _) in enumerate(rows):
        per = [g[i] for g in gathered]
        got, want = max(p[3] for p in per), max(p[4] for p in per)
        assert all(p[3] == p[4] for p in per), f"{src}->{dst} {fmt}: measured {[p[3] for p in per]} != manifest"
        t = max(p[7] for p in per)
        print(f"| {src}→{dst} | {fmt} | {got / mib:.3f} | {want / mib:.3f} | "
              f"{max(p[5] for p in per) / mib:.2f} → {max(p[6] for p in per) / mib:.2f} | {t * 1e3:.2f} |")


if __name__ == "__main__":
    main()
