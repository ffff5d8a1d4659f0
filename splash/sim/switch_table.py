"""Per-direction switch cost for splash-sim: the manifest planner's bytes, priced by the cost model. No torch."""
from __future__ import annotations

from splash.costmodel.step_cost import EXCHANGE_STAGES, LAYOUTS, RowLoad
from splash.layouts.layout import parse_layout
from splash.switching.manifest import ReqState, plan_switch


def switch_step_rows(layout: str, batch: int, tokens: int, chunk: int, world: int) -> list[RowLoad]:
    """The step a switch at ``batch`` x ``tokens`` runs in: one prefill step of ``chunk`` tokens at that context
    (the paper's switch study holds B = 16 requests of 256K tokens, where steps are long-context prefill chunks),
    split over the owners in DP-attn/DOP as splash-sim's prefill is (serving._prefill_steps), one request's chunk
    in TP/CP."""
    if parse_layout(layout).owner_based:
        return [RowLoad(chunk // world, tokens, o) for o in range(min(batch, world))]
    return [RowLoad(chunk, tokens, 0)]


def step_link_share(pred) -> float:
    """Share of a predicted step spent in its collectives (the link the switch's transfers share)."""
    coll = sum(pred.stages.get(k, 0.0) for k in EXCHANGE_STAGES)
    return coll / pred.seconds if pred.seconds > 0 else 0.0


def plan_directions(setup, batch: int, tokens: int) -> dict[tuple[str, str], object]:
    """The manifest of every src→dst direction for ``batch`` live requests of ``tokens`` KV tokens (owners
    round-robin); directions the model's heads cannot take are left out."""
    m, T = setup.model, setup.world
    reqs = {f"r{i}": ReqState(tokens, i % T) for i in range(batch)}
    out = {}
    for src in LAYOUTS:
        for dst in LAYOUTS:
            if src == dst:
                continue
            try:
                out[src, dst] = plan_switch(src, dst, m.cfg, T, reqs, setup.block_size, {"float32": 4,
                                            "bfloat16": 2}.get(m.weight_dtype, 1), m.kv_dtype)
            except ValueError:
                continue
    return out


def price_directions(cm, setup, manifests: dict, batch: int, tokens: int) -> list[dict]:
    """Each planned direction priced by ``cm``: live (hidden behind the destination layout's step,
    ``switch_step_rows``) and blocking."""
    out = []
    for (src, dst), man in manifests.items():
        try:
            pred = cm.step(dst, switch_step_rows(dst, batch, tokens, setup.chunk, setup.world))
        except ValueError:
            continue
        step = pred.seconds
        live = cm.switch(man, "live", step, step_link_share(pred))
        blocking = cm.switch(man, "blocking", step)
        out.append({"src": src, "dst": dst, "recv_bytes": live.recv_bytes, "live_s": live.exposed_seconds,
                    "blocking_s": blocking.exposed_seconds, "transfer_s": blocking.seconds, "dst_step_s": step,
                    "kv_layer_s": live.kv_layer_seconds, "weight_layer_s": live.weight_layer_seconds})
    return out


def switch_costs(cm, setup, batch: int, tokens: int) -> list[dict]:
    """Every src→dst direction for ``batch`` live requests of ``tokens`` KV tokens (owners round-robin), the live
    cost hidden behind the destination layout's step (``switch_step_rows``)."""
    return price_directions(cm, setup, plan_directions(setup, batch, tokens), batch, tokens)


def print_switch_costs(console, cm, setup, batch: int, tokens: int) -> None:
    from rich.table import Table
    t = Table(title=f"predicted switch cost per direction — B={batch} live requests × {tokens:,} tokens")
    for col in ("direction", "MiB in (busiest rank)", "live exposed ms", "blocking ms", "dst step ms"):
        t.add_column(col, justify="right")
    for r in switch_costs(cm, setup, batch, tokens):
        t.add_row(f"{r['src']}→{r['dst']}", f"{r['recv_bytes'] / (1 << 20):,.1f}", f"{r['live_s'] * 1e3:.2f}",
                  f"{r['blocking_s'] * 1e3:.2f}", f"{r['dst_step_s'] * 1e3:.2f}")
    console.print(t)
