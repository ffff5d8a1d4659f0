"""What one stage alone would have to be to close each tokens/s miss of the paper table (``splash-sim gap``).
Pure, no torch.

A disaggregated batch's time (splash.sim.deploy) is prefill + exposed KV handoff + decode and the paper's tokens/s
fixes the total, so each stage can be solved for alone: the **prefill factor** (one factor at every position of one
hardware and 1 elsewhere is a per-kernel rate the model does not price, not a missing stage); the **decode step**
per output position (nearly flat in the input length: a need growing with it is not a decode cost, or a decode
instance that holds fewer requests at longer inputs and decodes in waves); the per-NIC **handoff rate**.

Two spec-sheet bounds beside them: the SM100 indexer's CUDA-core epilogue (DeepGEMM's ``fp8_mqa_logits`` is "bounded
by the cuda core", deepseek-ai/DeepGEMM#227: a ReLU and a head-weighted sum per (row, key, head) in FP32 at the
profile's ``extra.fp32_vector_flops_per_s``), which cannot slow the indexer while it is below the scoring
splash-sim prices; and the top-k's read of the FP32 logits the scoring kernel wrote (4 bytes a (row, key) at the
HBM rate, on the rank holding the rows). It also prints the link rate each hardware's published switch primitives
imply at the B200 shares and B200's blocking bound (splash.sim.fit).
"""
from __future__ import annotations

import math

EPILOGUE_FLOPS = 4.0   # per (row, key, head): FMNMX (ReLU) + FFMA (× head weight, summed) = 2 issue slots × 2 FLOPs
LOGIT_BYTES = 4.0      # an FP32 logit


# ---- the computation (tested on made-up values) -----------------------------------------------------------------

def paper_seconds(paper_tps: float, tokens: float) -> float:
    """End-to-end seconds the paper's tokens/s implies for ``tokens`` (all input and output tokens of the batch)."""
    if paper_tps <= 0:
        raise ValueError(f"paper tokens/s must be positive, got {paper_tps}")
    return tokens / paper_tps


def prefill_factor(paper_s: float, parts: dict[str, float]) -> float:
    """How many times the priced prefill would have to take for the total to be ``paper_s``."""
    return (paper_s - parts["handoff_s"] - parts["decode_s"]) / parts["prefill_s"]


def decode_step_needed(paper_s: float, parts: dict[str, float], output_len: int) -> float:
    """Seconds per output position the decode instance would need for the total to be ``paper_s``."""
    return (paper_s - parts["prefill_s"] - parts["handoff_s"]) / output_len


def handoff_rate_needed(paper_s: float, parts: dict[str, float], bytes_per_nic: float) -> float:
    """Per-NIC bytes/s at which the handoff, wholly exposed, makes the total ``paper_s`` (inf: no time is left
    for it, the other stages already exceed the paper's total)."""
    left = paper_s - parts["prefill_s"] - parts["decode_s"]
    return bytes_per_nic / left if left > 0 else math.inf


def topk_read_seconds(cfg, batch: int, input_len: int, world: int, owner_based: bool,
                      memory_bytes_per_s: float) -> float:
    """The top-k's read of the FP32 logits over a whole prompt of ``input_len`` on the busiest rank, every layer:
    each causal row scores its context, input_len² / 2 (row, key) pairs a request and layer; an owner holds
    ⌈batch / world⌉ requests' rows, a CP rank 1/world of every request's."""
    if not cfg.index_topk:
        return 0.0
    pairs = input_len * input_len / 2.0
    per_rank = -(-batch // world) * pairs if owner_based else batch * pairs / world
    return per_rank * cfg.num_hidden_layers * LOGIT_BYTES / memory_bytes_per_s


def indexer_bound_ratio(cfg, attention_flops_per_s: float, fp32_flops_per_s: float) -> float:
    """The indexer's CUDA-core epilogue time per (row, key) over the time splash-sim charges for its scoring
    (2 × heads × head_dim FLOPs at ``attention_flops_per_s``): below 1, the epilogue cannot make it slower."""
    epilogue = cfg.index_n_heads * EPILOGUE_FLOPS / fp32_flops_per_s
    scoring = 2.0 * cfg.index_n_heads * cfg.index_head_dim / attention_flops_per_s
    return epilogue / scoring


# ---- the published tokens/s figures, per point ------------------------------------------------------------------

def tps_targets(hardware: str) -> list[dict]:
    """The disaggregated tokens/s figures of ``hardware`` as {"figure", "layout", "points", "paper": (lo, hi)}:
    an exact figure has lo == hi at its one point; a published range ("DOP 21,059-23,470 tok/s at the long inputs")
    cannot be placed point by point, so every point of it gets the whole range."""
    from splash.sim.paper_data import FIGURES, SETUPS
    out, ranges = [], {}
    for f in FIGURES if SETUPS[hardware].deployment == "disaggregated" else ():
        if f.hardware != hardware or f.kind != "tokens_per_s" or f.setup:
            continue
        kind, lay, *rest = f.probe
        if kind == "tps":
            b, n = rest
            out.append({"figure": f.key, "layout": lay, "points": ((b, n),), "paper": (f.paper, f.paper)})
        elif kind == "tps_range":
            base = f.key.rsplit(".", 1)[0]
            r = ranges.setdefault(base, {"figure": base, "layout": lay, "points": rest[0], "paper": [math.inf, 0]})
            r["paper"] = [min(r["paper"][0], f.paper), max(r["paper"][1], f.paper)]
    out += [{**r, "paper": tuple(r["paper"])} for r in ranges.values()]
    return out


def gap_rows(hardware: str) -> list[dict]:
    """One row per (tokens/s figure, point): splash-sim's stages there and what each would need alone."""
    from splash.layouts.layout import parse_layout
    from splash.sim.deploy import disaggregated_parts, kv_bytes_per_request_token
    from splash.sim.paper import Evaluator
    from splash.sim.paper_data import SETUPS
    from splash.sim.serving import concurrency
    ev = Evaluator(SETUPS[hardware])
    s, out_len = ev.sim, ev.setup.output_len
    fp32 = ev.profile.extra.get("fp32_vector_flops_per_s")
    bound = (indexer_bound_ratio(ev.model.cfg, ev.profile.attention_flops_per_s, float(fp32))
             if fp32 and ev.model.cfg.index_topk else None)
    rows = []
    for t in tps_targets(hardware):
        for b, n in t["points"]:
            k = min(b, concurrency(s, ev.caps, t["layout"], n))
            parts = disaggregated_parts(ev.cm, s, t["layout"], b, n, out_len, k)
            tokens = b * (n + out_len)
            nic_bytes = b * n * kv_bytes_per_request_token(s) / s.world
            row = {"hardware": hardware, "figure": t["figure"], "layout": t["layout"], "batch": b, "input_len": n,
                   "paper_tps": t["paper"], "sim_tps": tokens / sum(parts.values()), **parts,
                   "sim_decode_step_s": parts["decode_s"] / out_len,
                   "nic_spec_bytes_per_s": s.profile.inter_node_bytes_per_s, "indexer_bound_ratio": bound,
                   "topk_read_s": topk_read_seconds(ev.model.cfg, b, n, s.world,
                                                    parse_layout(t["layout"]).owner_based,
                                                    ev.profile.memory_bytes_per_s)}
            # the paper's high tokens/s is the smaller gap: (lo, hi) of each need, from the range's two ends
            secs = [paper_seconds(p, tokens) for p in t["paper"]]
            row["prefill_factor"] = tuple(sorted(prefill_factor(x, parts) for x in secs))
            row["decode_step_needed_s"] = tuple(sorted(decode_step_needed(x, parts, out_len) for x in secs))
            row["handoff_rate_needed"] = tuple(sorted(handoff_rate_needed(x, parts, nic_bytes) for x in secs))
            rows.append(row)
    return rows


def main(argv: list[str] | None = None) -> int:
    import argparse
    import json
    from pathlib import Path

    from rich.console import Console
    from rich.table import Table
    ap = argparse.ArgumentParser(prog="splash-sim gap", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", default="b200,h200,bw1000", help="comma list of hardware (b200, h200, bw1000)")
    ap.add_argument("--json", default=None, metavar="FILE", help="write {'rows': [...]} as JSON")
    a = ap.parse_args(argv)
    want = [x.strip() for x in a.only.split(",") if x.strip()]
    bad = [w for w in want if w not in ("b200", "h200", "bw1000")]
    if bad:
        print(f"splash-sim gap: --only: unknown hardware {', '.join(bad)} (allowed: b200, h200, bw1000)")
        return 2
    rows = [r for hw in want for r in gap_rows(hw)]
    t = Table(title="splash-sim: what one stage alone would need to close a tokens/s gap (splash/sim/tps_gap.py)")
    for col in ("hardware", "figure", "layout", "B", "input", "paper tok/s", "sim tok/s", "prefill s", "handoff s",
                "decode s", "prefill ×", "decode ms/pos (sim)", "NIC GB/s (spec)", "indexer bound/priced",
                "top-k read s"):
        t.add_column(col, justify="right")
    for r in rows:
        lo, hi = r["paper_tps"]
        t.add_row(r["hardware"], r["figure"].split(".", 1)[1], r["layout"], str(r["batch"]), f"{r['input_len']:,}",
                  f"{lo:,.0f}" if lo == hi else f"{lo:,.0f}–{hi:,.0f}", f"{r['sim_tps']:,.0f}",
                  f"{r['prefill_s']:.1f}", f"{r['handoff_s']:.2f}", f"{r['decode_s']:.1f}",
                  _span(r["prefill_factor"], "{:.2f}"),
                  f"{_span(tuple(x * 1e3 for x in r['decode_step_needed_s']), '{:.0f}')} "
                  f"({r['sim_decode_step_s'] * 1e3:.1f})",
                  f"{_span(tuple(x / 1e9 for x in r['handoff_rate_needed']), '{:.2f}')} "
                  f"({r['nic_spec_bytes_per_s'] / 1e9:.0f})",
                  "—" if r["indexer_bound_ratio"] is None else f"{r['indexer_bound_ratio']:.2f}",
                  f"{r['topk_read_s']:.2f}")
    con = Console(width=230)
    con.print(t)
    # the per-layer primitives' side of the same question: the link rate their published ranges imply
    from splash.costmodel.profile import load_profile
    from splash.sim.fit import implied_link_rates
    links = {}
    for hw in want:
        links[hw] = implied_link_rates(hw)
        spec = load_profile(hw).link_bytes_per_s
        con.print(f"{hw}: link rate the published per-layer primitives imply at the B200 shares, GB/s each way: "
                  + ", ".join(f"{k} {lo / 1e9:.0f}–{hi / 1e9:.0f}" for k, (lo, hi) in links[hw].items())
                  + f" (profile: {spec / 1e9:.0f}, {load_profile(hw).provenance.get('link_bytes_per_s', '')})")
    blocking = None
    if "b200" in want:
        from splash.sim.fit import paper_blocking_bound
        blocking = paper_blocking_bound()
        con.print(f"b200 DOP->CP, the paper's primitives back to back (78 layers at their high ends): blocking "
                  f"{blocking['blocking_s'] * 1e3:.1f} ms (paper {blocking['paper_blocking_s'] * 1e3:.1f}); "
                  f"with the paper's live p50, live / blocking ≥ {blocking['live_over_blocking']:.4f} (paper's "
                  f"high end {blocking['paper_live_over_blocking_max']:.4f})")
    if a.json:
        Path(a.json).write_text(json.dumps({"rows": rows, "implied_link_rates": links, "b200_blocking": blocking},
                                           indent=1, default=str))
    return 0


def _span(v: tuple[float, float], fmt: str) -> str:
    lo, hi = v
    return fmt.format(lo) if math.isclose(lo, hi) else f"{fmt.format(lo)}–{fmt.format(hi)}"
