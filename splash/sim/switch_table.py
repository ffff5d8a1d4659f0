"""Per-direction switch cost for splash-sim: the manifest planner's bytes, priced by the cost model. No torch."""
from __future__ import annotations

from splash.costmodel.step_cost import LAYOUTS, RowLoad
from splash.switching.manifest import ReqState, plan_switch


def switch_costs(cm, setup, batch: int, tokens: int) -> list[dict]:
    """Every src→dst direction for ``batch`` live requests of ``tokens`` KV tokens (owners round-robin)."""
    m, T = setup.model, setup.world
    reqs = {f"r{i}": ReqState(tokens, i % T) for i in range(batch)}
    rows = [RowLoad(1, tokens, i % T) for i in range(batch)]
    out = []
    for src in LAYOUTS:
        for dst in LAYOUTS:
            if src == dst:
                continue
            try:
                man = plan_switch(src, dst, m.cfg, T, reqs, setup.block_size, {"float32": 4, "bfloat16": 2}.get(
                    m.weight_dtype, 1), m.kv_dtype)
                step = cm.step(dst, rows).seconds
            except ValueError:
                continue
            live, blocking = cm.switch(man, "live", step), cm.switch(man, "blocking", step)
            out.append({"src": src, "dst": dst, "recv_bytes": live.recv_bytes, "live_s": live.exposed_seconds,
                        "blocking_s": blocking.exposed_seconds, "dst_step_s": step,
                        "kv_layer_s": live.kv_layer_seconds, "weight_layer_s": live.weight_layer_seconds})
    return out


def print_switch_costs(console, cm, setup, batch: int, tokens: int) -> None:
    from rich.table import Table
    t = Table(title=f"predicted switch cost per direction — B={batch} live requests × {tokens:,} tokens")
    for col in ("direction", "MiB in (busiest rank)", "live exposed ms", "blocking ms", "dst decode step ms"):
        t.add_column(col, justify="right")
    for r in switch_costs(cm, setup, batch, tokens):
        t.add_row(f"{r['src']}→{r['dst']}", f"{r['recv_bytes'] / (1 << 20):,.1f}", f"{r['live_s'] * 1e3:.2f}",
                  f"{r['blocking_s'] * 1e3:.2f}", f"{r['dst_step_s'] * 1e3:.2f}")
    console.print(t)
