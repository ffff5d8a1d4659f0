"""What an SM90 FlashInfer fp8 pool's e4m3 rope key changes in the switch planner and the cost model (pure, no GPU).

    .venv/bin/python benchmarks/rope_fp8_bytes.py [--config configs/h200.yaml] [--requests 32] [--tokens 8192]

For the config's model on its hardware profile and world size, with its pool's KV dtype, prints each figure counted
with a bf16 rope key and with the e4m3 one the pool really stores there (splash.layouts.memory.rope_fp8_pool):
bytes per token per layer, the busiest rank's KV received by a switch and the cost model's blocking switch time,
the headroom check's block and one-layer buffers of a DOP -> CP switch, and a DOP decode step's KV read."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from splash.cli import check  # noqa: E402
from splash.cli.args import build_config  # noqa: E402
from splash.costmodel import CostModel, load_profile  # noqa: E402
from splash.costmodel.step_cost import RowLoad  # noqa: E402
from splash.engine.layout_policy.control import LayoutController  # noqa: E402
from splash.engine.llm import pool_kv_dtype  # noqa: E402
from splash.engine.runner import resolve_layout_kv_dtypes  # noqa: E402
from splash.switching.manifest import ReqState  # noqa: E402

MIB, GIB = 2 ** 20, 2 ** 30


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", default="configs/h200.yaml")
    p.add_argument("--requests", type=int, default=32)
    p.add_argument("--tokens", type=int, default=8192, help="KV tokens of each request")
    a = p.parse_args(argv)
    cfg = build_config(["--config", a.config])
    prof = load_profile(cfg.hardware_profile)
    world = check._world(cfg, prof)[0]
    m = check._model(cfg)[0]
    kv = pool_kv_dtype(m, resolve_layout_kv_dtypes(cfg.kv_dtype, cfg.cache.layout_kv_dtypes).values())
    bs, wbytes = cfg.block_size, 1 if m.quantization else 2
    reqs = {f"r{i}": ReqState(a.tokens, i % world) for i in range(a.requests)}
    print(f"{a.config}: {m.model_type}, {kv} KV, {world} ranks, {bs}-token pages, {prof.name} profile; "
          f"{a.requests} requests x {a.tokens} tokens")
    rows = {}
    for rope_fp8 in (False, True):
        ctl = LayoutController(m, world, bs, wbytes, kv, rope_fp8=rope_fp8)
        ctl.weight_quant = m.quantization
        cm = CostModel(m, world, prof, cfg.compute_dtype, kv, bs, rope_fp8=rope_fp8)
        out = rows.setdefault(rope_fp8, {})
        for src, dst in (("dop", "tp"), ("dop", "cp")):
            man = ctl.plan(src, dst, reqs)
            out[f"{src}->{dst} KV recv, busiest rank (GiB)"] = max(man.kv_recv_total) / GIB
            out[f"{src}->{dst} blocking switch (ms)"] = cm.switch(man, "blocking").seconds * 1e3
        man = ctl.plan("dop", "cp", reqs)
        unit = ctl.pool_block_bytes_layer * man.num_layers
        buf = max(man.kv_recv_bytes[r] + man.weight_recv_bytes[r] for r in range(world))
        out["bytes / token / layer"] = man.kv_block_bytes_layer / bs
        out["headroom block, all layers (MiB)"] = unit / MIB
        out["dop->cp one-layer buffers (blocks)"] = -(-int(buf) // unit)
        step = cm.step("dop", [RowLoad(1, a.tokens, i % world) for i in range(a.requests)])
        out["DOP decode attention KV read, busiest rank (GiB)"] = step.work["attention"]["kv_bytes"] / GIB
    print(f"{'':52} {'bf16 rope':>10} {'e4m3 rope':>10}")
    for key in rows[False]:
        print(f"{key:52} {rows[False][key]:10.4g} {rows[True][key]:10.4g}")


if __name__ == "__main__":
    main()
