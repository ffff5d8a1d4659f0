"""Candidate mechanisms for DOP's measured lead at long inputs, each computed from the model's and the hardware's
bytes and FLOPs, never fitted; ``splash-sim mechanisms`` prints them at the paper's positions. Pure, no torch.

1. **Transient memory per prefill chunk**: the DSA indexer's fp32 logits [rows × keys] (DeepGEMM
   ``fp8_mqa_logits`` writes them whole before the top-k), the BF16 copy of the latent history the sparse prefill
   reads (SGLang's ``dequantize_k_cache_paged``) and the int32 top-k indices; the room left for them bounds the
   chunk, and a smaller chunk re-reads the history more often.
2. **Indexer work per rank**: scoring is rows × keys on whoever holds the keys; DOP runs its projections on every row.
3. **Waves that wait for the handoff**: a unit holding one request at a time cannot admit the next until the
   previous one's KV has left over the inter-node link.
4. **Exchange bytes per query row**, per layer, by layout (splash.costmodel.work).
5. **The prefill/decode pipeline**: the decode instance's room gates the prefill (SGLang's disaggregation
   pre-allocates a request's KV on the decode side before its prefill may start), or decode overlaps the prefill
   of later requests; either way the order in which a layout finishes its requests matters (``pd_makespan``).
6. **Decode in the swept layout**: the decode instance (its ranks and nodes as the setup has them) runs the layout
   the prefill instance sweeps, not a fixed one.
7. **Per-step dominance**: at balanced owners DOP's step is DP-attn's work plus its own, stage by stage, so no
   rate the two layouts share can make DOP's step the shorter (``step_excess``).
"""
from __future__ import annotations

import dataclasses
import math

from splash.layouts.layout import KV_ALL, KV_OWNER, kv_ownership_of, parse_layout
from splash.layouts.memory import kv_bytes_per_token_layer
from splash.sim.deploy import kv_bytes_per_request_token

LOGIT_BYTES = 4.0    # fp32 indexer logits
INDEX_BYTES = 4.0    # int32 top-k indices
BF16 = 2.0


def prefill_transient_bytes(cfg, rows: int, keys: int) -> dict[str, float]:
    """Per-rank transient buffers of one layer's prefill of ``rows`` query rows over ``keys`` visible keys."""
    out = {"dequant_kv": keys * (cfg.kv_lora_rank + cfg.qk_rope_head_dim) * BF16}
    if cfg.index_topk:
        out["indexer_logits"] = rows * keys * LOGIT_BYTES
        out["topk_indices"] = rows * cfg.index_topk * INDEX_BYTES
    return out


def largest_chunk_rows(cfg, keys: int, room: float) -> float:
    """The most query rows whose transients (``prefill_transient_bytes``) fit in ``room`` bytes at ``keys``
    (inf for a model without an indexer: no buffer grows with the rows)."""
    fixed = sum(prefill_transient_bytes(cfg, 0, keys).values())
    per_row = sum(prefill_transient_bytes(cfg, 1, keys).values()) - fixed
    if room < fixed:
        return 0
    return math.inf if per_row == 0 else int((room - fixed) // per_row)


def activation_room(s) -> float:
    """Bytes a rank has for prefill transients: (1 − memory fraction) × memory, the same in every layout (the KV
    pool is sized at the fraction, SGLang's ``mem_fraction_static``; replicated projections shrink the pool)."""
    return (1.0 - s.mem_fraction) * s.profile.memory_bytes


def history_reread_seconds(cfg, kv_dtype: str, keys: int, bytes_per_s: float) -> float:
    """One chunk's re-read of a ``keys``-token history, one layer: its latent KV + indexer keys, read once."""
    return keys * kv_bytes_per_token_layer(cfg, kv_dtype) / bytes_per_s


def indexer_scoring_seconds(cfg, rows: int, keys: int, flops_per_s: float) -> float:
    """The indexer's q·k scoring of ``rows`` over ``keys``, one layer (2 × heads × head_dim FLOPs a pair)."""
    return 2.0 * rows * keys * cfg.index_n_heads * cfg.index_head_dim / flops_per_s


def request_handoff_seconds(s, layout: str, input_len: int) -> float:
    """One request's KV leaving the prefill instance: from its owner's NIC alone in DP-attn/DOP, from every
    rank's NIC in TP/CP (a share each)."""
    nics = 1 if kv_ownership_of(layout) == KV_OWNER else s.world
    return input_len * kv_bytes_per_request_token(s) / (nics * s.profile.inter_node_bytes_per_s)


def exposed_wave_handoff_seconds(s, layout: str, batch: int, resident: int, input_len: int) -> float:
    """Handoff time beyond the last request's (which splash.sim.deploy charges): a unit (owner in DP-attn/DOP,
    group in TP/CP) holding one request at a time waits out (requests per unit − 1) handoffs; two or more resident
    prefill the next while it runs."""
    units = s.world if kv_ownership_of(layout) == KV_OWNER else 1
    per_unit_resident = resident // units
    per_unit_requests = -(-batch // units)
    if per_unit_resident != 1 or per_unit_requests <= 1:
        return 0.0
    return (per_unit_requests - 1) * request_handoff_seconds(s, layout, input_len)


def exchange_bytes_per_row(cfg, layout: str, act_bytes: float = BF16) -> float:
    """Bytes one query row puts through a layer's exchanges (the attention's, not the FFN all-reduce every layout
    shares): DP-attn all-gathers its hidden state; DOP all-to-alls its absorbed query (all heads' d_c + d_r) to
    the owner and the latent output (d_c) back, then all-reduces the hidden state; CP (split) all-gathers the
    hidden state (its history gather is per chunk, ``history_reread_seconds``); TP all-reduces it."""
    hid, H = cfg.hidden_size, cfg.num_attention_heads
    lay = parse_layout(layout)
    if lay.shards_projections and lay.owner_based:      # DOP
        return H * (cfg.kv_lora_rank + cfg.qk_rope_head_dim) * act_bytes + H * cfg.kv_lora_rank * act_bytes \
            + hid * act_bytes
    return hid * act_bytes


PD_MODES = ("serial", "gated", "overlap")


def pd_makespan(batch: int, units: int, prefill_s: float, decode_s: float, slots: int, mode: str,
                handoff_s: float = 0.0) -> float:
    """End-to-end seconds of ``batch`` identical requests through a prefill instance of ``units`` independent
    prefill units (the owners in DP-attn/DOP, the group in TP/CP), each prefilling its requests (request i on unit
    i % units) one after another in ``prefill_s`` each, then ``handoff_s`` to move one, and a decode instance that
    decodes ``slots`` requests at once in ``decode_s`` each (a long-context decode step's time barely depends on
    its batch, so a slot's pace does not either). ``mode``:
    - "serial": every prefill first, then every decode in waves of ``slots`` (splash.sim.deploy's model);
    - "gated": SGLang's prefill/decode disaggregation: the decode side pre-allocates a request's KV before the
      prefill side may start it, so a slot is held from prefill start to decode end;
    - "overlap": a request decodes as soon as it is handed off and a slot is free; the prefill runs ahead."""
    if mode not in PD_MODES:
        raise ValueError(f"mode must be one of {', '.join(PD_MODES)}, got {mode!r}")
    if batch <= 0:
        return 0.0
    if units < 1 or slots < 1:
        raise ValueError(f"units and slots must be >= 1, got {units}, {slots}")
    if mode == "serial":
        return -(-batch // units) * prefill_s + handoff_s + -(-batch // slots) * decode_s
    import heapq
    unit_free = [0.0] * units
    slot_free = [0.0] * slots          # a heap of the times the slots free up
    end = 0.0
    for i in range(batch):
        u = i % units
        slot = heapq.heappop(slot_free)
        if mode == "gated":
            done = max(unit_free[u], slot) + prefill_s
            finish = done + handoff_s + decode_s
        else:
            done = unit_free[u] + prefill_s
            finish = max(done + handoff_s, slot) + decode_s
        unit_free[u] = done
        heapq.heappush(slot_free, finish)
        end = max(end, finish)
    return end


def pd_tokens_per_s(ev, layout: str, batch: int, input_len: int, mode: str) -> float:
    """Tokens/s of the paper's disaggregated setup ``ev`` (a splash.sim.paper.Evaluator) under ``pd_makespan``'s
    ``mode``: a unit's prefill of one request is the sim's prefill of one request per unit with every unit busy,
    a slot's decode is the decode instance's wave of as many requests as it holds, the handoff is one request's
    over its unit's NICs."""
    from splash.sim.deploy import decode_instance, decode_seconds
    from splash.sim.serving import concurrency, prefill_seconds
    s, out = ev.sim, ev.setup.output_len
    d, _, dcaps = decode_instance(s)
    slots = min(batch, concurrency(d, dcaps, s.decode_layout, input_len + out))
    if slots == 0:
        raise ValueError(f"the decode instance holds no request of {input_len + out} tokens")
    units = s.world if kv_ownership_of(layout) == KV_OWNER else 1
    prefill = prefill_seconds(ev.cm, s, layout, min(batch, units), input_len)
    t = pd_makespan(batch, units, prefill, decode_seconds(s, slots, input_len, out), slots, mode,
                    request_handoff_seconds(s, layout, input_len))
    return batch * (input_len + out) / t


def swept_decode_tokens_per_s(ev, layout: str, batch: int, input_len: int) -> float:
    """Tokens/s of ``ev``'s disaggregated setup with its decode instance in ``layout`` too (0 when infeasible)."""
    from splash.sim.deploy import throughput
    s = dataclasses.replace(ev.sim, decode_layout=layout)
    return throughput(ev.cm, s, ev.caps, layout, batch, input_len, ev.setup.output_len)["tokens_per_s"]


def step_excess(cm, a: str, b: str, rows) -> dict[str, float]:
    """Stage by stage, how many seconds layout ``a``'s step exceeds ``b``'s on the busiest rank (negative: saves),
    ``rows`` a list of splash.costmodel.step_cost.RowLoad."""
    sa, sb = cm.step(a, rows).stages, cm.step(b, rows).stages
    return {k: sa.get(k, 0.0) - sb.get(k, 0.0) for k in sorted(set(sa) | set(sb))}


# ---- what each predicts at the paper's positions (`splash-sim mechanisms`) ----------------------------------

POINTS = {"b200": ((16, 64_000), (16, 128_000), (16, 256_000), (16, 512_000), (128, 64_000), (128, 128_000),
                   (256, 128_000)),
          "h200": ((16, 64_000), (16, 128_000), (16, 256_000)),
          "bw1000": ((16, 256_000), (16, 512_000))}
LAYOUTS = ("tp", "dp_attn", "cp", "dop")


def _last_step(layout: str, batch: int, input_len: int, chunk: int, world: int):
    """The last full prefill step of a request at ``input_len`` (history input_len − the step's rows), as the
    layout's prefill schedules it (every owner busy in DP-attn/DOP; one request's chunk in TP/CP)."""
    from splash.costmodel.step_cost import RowLoad
    if kv_ownership_of(layout) == KV_OWNER:
        per = chunk // world
        return [RowLoad(per, input_len - per, o) for o in range(min(batch, world))]
    return [RowLoad(chunk, input_len - chunk, 0)]


def mechanism_rows(hardware: str, points=None) -> list[dict]:
    """One row per (position, layout): what each mechanism predicts there (see the module docstring)."""
    from splash.sim.paper import Evaluator
    from splash.sim.paper_data import SETUPS
    from splash.sim.serving import capacities, concurrency
    ev = Evaluator(SETUPS[hardware])
    s, cm, cfg, prof = ev.sim, ev.cm, ev.model.cfg, ev.profile
    rows = []
    for batch, n in points or POINTS[hardware]:
        for lay in LAYOUTS:
            base = ev.point(lay, batch, n)
            if not base["feasible"]:
                continue
            k = base["concurrency"]
            total = batch * (n + ev.setup.output_len) / base["tokens_per_s"]
            # query rows a rank runs in one full prefill step: an owner's share (DP-attn/DOP, SGLang's
            # chunked_prefill_size // dp_size), 1/T of the chunk (CP split), the whole chunk (TP)
            r_chunk = s.chunk if kv_ownership_of(lay) == KV_ALL else s.chunk // s.world
            transient = sum(prefill_transient_bytes(cfg, r_chunk, n).values())
            room = activation_room(s)
            # transients out of the pool's budget instead: admission shrinks so one chunk's buffers fit
            shared = dataclasses.replace(s, reserve_bytes=s.reserve_bytes + transient)
            k_shared = min(batch, concurrency(shared, capacities(shared), lay, n))
            step = cm.step(lay, _last_step(lay, batch, n, s.chunk, s.world))
            handoff = exposed_wave_handoff_seconds(s, lay, batch, k, n)
            rows.append({
                "hardware": hardware, "batch": batch, "input_len": n, "layout": lay, "resident": k,
                "tokens_per_s": base["tokens_per_s"],
                "rank_chunk_rows": r_chunk, "transient_gib": transient / (1 << 30),
                "room_gib": room / (1 << 30), "fit_rows": largest_chunk_rows(cfg, n, room),
                "resident_if_shared": k_shared,
                "reread_over_scoring": (history_reread_seconds(cfg, s.model.kv_dtype, n, prof.kv_read_bytes_per_s)
                                        / indexer_scoring_seconds(cfg, r_chunk, n, prof.attention_flops_per_s)
                                        if cfg.index_topk else 0.0),
                "step_ms": step.seconds * 1e3, "indexer_ms": step.stages.get("indexer", 0.0) * 1e3,
                "exchange_ms": step.stages.get("exchange", 0.0) * 1e3,
                "exchange_bytes_per_row": exchange_bytes_per_row(cfg, lay),
                "exposed_handoff_s": handoff,
                "tokens_per_s_serial_waves": batch * (n + ev.setup.output_len) / (total + handoff),
                "tokens_per_s_pd_gated": pd_tokens_per_s(ev, lay, batch, n, "gated"),
                "tokens_per_s_pd_overlap": pd_tokens_per_s(ev, lay, batch, n, "overlap"),
                "tokens_per_s_swept_decode": swept_decode_tokens_per_s(ev, lay, batch, n),
            })
    return rows


def leaders(rows: list[dict], field: str) -> dict[tuple, str]:
    """(hardware, batch, input_len) -> the layout with the highest ``field``."""
    best: dict[tuple, tuple[float, str]] = {}
    for r in rows:
        key = (r["hardware"], r["batch"], r["input_len"])
        if key not in best or r[field] > best[key][0]:
            best[key] = (r[field], r["layout"])
    return {k: v[1] for k, v in best.items()}


def main(argv: list[str] | None = None) -> int:
    import argparse
    import json
    from pathlib import Path

    from rich.console import Console
    from rich.table import Table
    ap = argparse.ArgumentParser(prog="splash-sim mechanisms", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", default="b200", help="comma list of hardware (b200, h200, bw1000)")
    ap.add_argument("--json", default=None, metavar="FILE", help="write {'rows': [...]} as JSON")
    a = ap.parse_args(argv)
    want = [x.strip() for x in a.only.split(",") if x.strip()]
    bad = [w for w in want if w not in POINTS]
    if bad:
        print(f"splash-sim mechanisms: --only: unknown hardware {', '.join(bad)} (allowed: {', '.join(POINTS)})")
        return 2
    rows = [r for hw in want for r in mechanism_rows(hw)]
    cols = (("batch", "B"), ("input_len", "input"), ("layout", "layout"), ("resident", "resident"),
            ("tokens_per_s", "tok/s"), ("rank_chunk_rows", "rows/rank"), ("transient_gib", "transient GiB"),
            ("room_gib", "room GiB"), ("fit_rows", "rows fit"), ("resident_if_shared", "resident if shared"),
            ("reread_over_scoring", "re-read/scoring"), ("step_ms", "last step ms"), ("indexer_ms", "indexer ms"),
            ("exchange_ms", "exchange ms"), ("exchange_bytes_per_row", "exch B/row"),
            ("exposed_handoff_s", "wave handoff s"), ("tokens_per_s_serial_waves", "tok/s serial waves"),
            ("tokens_per_s_pd_gated", "tok/s PD gated"), ("tokens_per_s_pd_overlap", "tok/s PD overlap"),
            ("tokens_per_s_swept_decode", "tok/s swept decode"))
    t = Table(title="splash-sim: candidate mechanisms for DOP's lead (splash/sim/prefill_mechanisms.py)")
    for _, name in cols:
        t.add_column(name, justify="right")
    for r in rows:
        t.add_row(*(_fmt(r[k]) for k, _ in cols))
    con = Console(width=230)
    con.print(t)
    for field in ("tokens_per_s", "tokens_per_s_serial_waves", "tokens_per_s_pd_gated", "tokens_per_s_pd_overlap",
                  "tokens_per_s_swept_decode"):
        lead = leaders(rows, field)
        con.print(f"leaders by {field}: " + ", ".join(f"{hw} {b}x{n // 1000}K {v}" for (hw, b, n), v in lead.items()))
    if a.json:
        Path(a.json).write_text(json.dumps({"rows": rows}, indent=1, default=str))
    return 0


def _fmt(v) -> str:
    if isinstance(v, str):
        return v
    if isinstance(v, int) or (isinstance(v, float) and math.isinf(v)):
        return f"{v:,}" if not isinstance(v, float) else "inf"
    return f"{v:,.0f}" if abs(v) >= 100 else f"{v:.3g}"
