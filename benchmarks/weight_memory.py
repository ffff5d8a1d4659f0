"""Resident weight bytes per rank, measured from the tensors, per layout and through a chain of switches.

    mpiexec -n 2 .venv/bin/python benchmarks/weight_memory.py [--preset small-mla] [--quantization fp8|int8]

A generation runs while the layout walks all 12 switch directions (one switch per step); after every step each
rank's resident weight bytes (every distinct storage once, so a view that keeps a larger tensor alive counts
that tensor) are measured and printed next to the memory model's figure for the current layout
(`splash.layouts.memory.rank_weight_bytes`, when this checkout has it)."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from splash.engine.llm import LLM  # noqa: E402
from splash.engine.sampling import SamplingParams  # noqa: E402

CIRCUIT = ["dp_attn", "tp", "cp", "tp", "dop", "dp_attn", "cp", "dp_attn", "dop", "cp", "dop", "tp"]


def leaves(obj):
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, (list, tuple)):
        for x in obj:
            yield from leaves(x)
    elif hasattr(obj, "__dict__"):
        for v in vars(obj).values():
            yield from leaves(v)


def resident(weights) -> int:
    return sum({t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in leaves(weights)}.values())


def model_bytes(llm: LLM) -> float | None:
    try:
        from splash.layouts.memory import rank_weight_bytes
    except ImportError:
        return None
    r = llm.runner
    return rank_weight_bytes(r.cfg, r.layout, r.comm.size, r.comm.rank, r.dtype.itemsize,
                             getattr(r, "weight_quant", None))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="small-mla")
    ap.add_argument("--quantization", default=None)
    a = ap.parse_args()
    kw = {"quantization": a.quantization} if a.quantization else {}
    llm = LLM(preset=a.preset, layout="tp", block_size=16, num_kv_blocks=64, **kw)
    r, eng, comm = llm.runner, llm.engine, llm.comm
    rows = []
    step = r.step

    def measured(batch, switch=None):
        out = step(batch, switch)
        rows.append((r.layout, resident(r.weights), model_bytes(llm)))
        return out
    r.step = measured
    rows.append((r.layout, resident(r.weights), model_bytes(llm)))
    if comm.rank == 0:
        for _ in range(2):
            eng.add_request(list(range(1, 9)), SamplingParams(max_tokens=16, ignore_eos=True))
        k = 0
        while eng.has_work():
            if k < len(CIRCUIT):
                eng.request_layout(CIRCUIT[k])
            eng.step()
            k += 1
        eng.stop()
    else:
        eng.follow()
    allrows = comm.all_gather_obj(rows)
    if comm.rank:
        return
    mib = 1 << 20
    print(f"preset {a.preset}, weights {a.quantization or 'plain ' + str(r.dtype)}, {comm.size} ranks")
    print("| step | layout | " + " | ".join(f"rank {i} MiB (model)" for i in range(comm.size)) + " |")
    print("|---|---|" + "---|" * comm.size)
    last = None
    for k, per in enumerate(zip(*allrows)):
        key = tuple((lay, b) for lay, b, _ in per)
        if key == last and k != len(rows) - 1:
            continue
        last = key
        cells = [f"{b / mib:.3f} ({'—' if m is None else f'{m / mib:.3f}'})" for _, b, m in per]
        print(f"| {k} | {per[0][0]} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
