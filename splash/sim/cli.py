"""splash-sim: predicted throughput per attention layout at paper scale, from the cost model. No torch, no MPI.

    splash-sim --model glm-5.3 --hardware b200 --ranks 8 --batch-sizes 16 --input-lens 1K,4K,16K,64K,128K,256K,512K
    splash-sim --model glm-5.3-flash --hardware bw1000 --ranks 8 --trace benchmarks/workloads/rl-rollout-samples.yaml
    splash-sim paper [--json FILE]      # the paper's figures beside splash-sim's (splash/sim/paper.py)
    splash-sim mechanisms [--only b200]  # what candidate mechanisms for DOP's lead predict (prefill_mechanisms.py)
    splash-sim gap [--only b200]        # what one stage alone would need to close a tokens/s miss (tps_gap.py)

Models: the presets glm-5.3, glm-5.3-flash, deepseek-v3.2, deepseek-v3 (public configs) or a model directory /
config.json. Hardware: a profile name (configs/hardware: b200, h200, bw1000, cpu) or a profile YAML.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from splash.costmodel.step_cost import LAYOUTS
from splash.layouts.layout import LAYOUT_LABELS
from splash.sim.storage import RUNTIME_RESERVE_BYTES, STORAGES



def parse_len(text: str) -> int:
    """'1K' → 1000, '512K' → 512000, '2M' → 2000000 (decimal, as the paper counts: its 512K requests fit two
    per owner in DOP's 1,033,920 tokens per rank, "16 resident"); '1Ki' → 1024, '512Ki' → 524288; '3000' → 3000."""
    t = text.strip().upper()
    units = {"KI": 1 << 10, "MI": 1 << 20, "GI": 1 << 30, "K": 10 ** 3, "M": 10 ** 6, "G": 10 ** 9}
    suffix = next((u for u in units if t.endswith(u)), "")
    num = t[:len(t) - len(suffix)] if suffix else t
    try:
        v = int(num) * units.get(suffix, 1)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a length: {text!r} (examples: 1024, 1K, 512K, 512Ki)") from None
    if v < 0:
        raise argparse.ArgumentTypeError(f"length must be non-negative: {text!r}")
    return v


def _lens(text: str) -> list[int]:
    return [parse_len(x) for x in text.split(",") if x.strip()]


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="splash-sim", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="glm-5.3", help="preset name or model directory / config.json")
    ap.add_argument("--hardware", default="b200", help="hardware profile name or YAML path")
    ap.add_argument("--ranks", type=int, default=8, help="T, ranks in the group")
    ap.add_argument("--batch-sizes", type=_lens, default=[16], help="comma list, e.g. 1,16,128")
    ap.add_argument("--input-lens", type=_lens, default=_lens("1K,4K,16K,64K,128K,256K,512K"),
                    help="comma list; K/M suffixes are decimal (1K = 1000, as the paper counts), Ki/Mi binary")
    ap.add_argument("--output-len", type=parse_len, default=1024, help="output tokens per request (default 1024)")
    ap.add_argument("--kv-dtype", default=None, help="KV dtype (default: the preset's)")
    ap.add_argument("--weight-dtype", default=None, help="weight dtype (default: the preset's)")
    ap.add_argument("--mem-fraction", type=float, default=0.85, help="share of device memory for weights + KV")
    ap.add_argument("--block-size", type=int, default=64, help="KV page size in tokens")
    ap.add_argument("--chunk", type=parse_len, default=16384, help="prefill tokens per step")
    ap.add_argument("--prefill-split", choices=("owner", "admission"), default="owner",
                    help="how DP-attn/DOP spend a step's --chunk prefill budget: owner (default): each owner "
                         "with prompt tokens left takes chunk // ranks a step, as SGLang's DP-attention gives each "
                         "DP rank chunked_prefill_size // dp_size (an idle owner's share is not handed on); "
                         "admission takes it in admission order, as this engine's scheduler does (--trace always runs "
                         "the engine's scheduler, so it ignores this flag)")
    ap.add_argument("--cp-prefill", choices=("split", "partials"), default="split",
                    help="CP prefill: split (default) splits each chunk's rows over the ranks and all-gathers the "
                         "history's latent KV + indexer keys per layer (SGLang's NSA context-parallel prefill); "
                         "partials attends every row on every rank over its position shard and all-gathers the "
                         "partial outputs + LSE, as this engine's CP does (decode rows always use partials)")
    ap.add_argument("--reserve", type=parse_len, default=None,
                    help="bytes per rank the runtime holds besides weights and KV (default 3.2 GiB, derived from "
                         "the paper's B200 DOP pool: splash/sim/storage.py)")
    ap.add_argument("--storage", choices=STORAGES, default="sglang",
                    help="how the deployment stores weights and state: sglang (the stack of the paper's figures: "
                         "vocabulary-parallel embedding/LM head, replicated embedding under DP-attn, BF16 W_UK/W_UV "
                         "copies, hybrid state pool) or engine (what this engine stores)")
    ap.add_argument("--deployment", choices=("colocated", "disaggregated"), default="colocated",
                    help="colocated (default): prefill and decode in the swept layout on --ranks; disaggregated: "
                         "the swept layout prefills, the KV is handed off over the inter-node link, and a decode "
                         "instance of --decode-ranks over --decode-nodes runs --decode-layout (splash/sim/deploy.py)")
    ap.add_argument("--decode-ranks", type=int, default=8, help="ranks of the decode instance (disaggregated)")
    ap.add_argument("--decode-nodes", type=int, default=1, help="nodes the decode instance spans (disaggregated)")
    ap.add_argument("--decode-layout", choices=LAYOUTS, default="dp_attn",
                    help="layout of the decode instance (disaggregated)")
    ap.add_argument("--json", default=None, metavar="FILE", help="write the points and capacities as JSON")
    ap.add_argument("--trace", default=None, metavar="FILE",
                    help="replay a workload file (the requests splash-bench workload sends: splash/workload.py) or a "
                         "built-in seeded one (rl-rollout, agentic) through the engine's layout: auto scheduler, "
                         "and compare with each fixed layout")
    ap.add_argument("--no-enable-prefix-caching", dest="enable_prefix_caching", action="store_false", default=None,
                    help="--trace: replay a workload file without the prefix cache (on by default, as splash-serve "
                         "runs; the built-in workloads share no prompt tokens and replay without it)")
    ap.add_argument("--truth-error", default=None, metavar="PAPER_JSON",
                    help="with --trace: charge every step and switch with a truth model whose per-kernel times "
                         "differ from the nominal by errors drawn from the held-out residuals of this "
                         "`splash-sim paper --json` table, while auto plans with the nominal model; reports auto, "
                         "every fixed layout and the per-phase oracle per seed (splash/sim/model_error.py)")
    ap.add_argument("--seeds", default="1,2,3", help="comma list of seeds for --truth-error (default 1,2,3)")
    ap.add_argument("--truth-kernels", choices=("shared", "per_layout"), default="shared",
                    help="with --truth-error: stages that compute the same in every layout (FFN/MoE, LM head, norms) "
                         "share one error (shared), or every layout's stage draws its own (per_layout)")
    ap.add_argument("--margin", type=float, default=0.10, help="switch margin of the --trace scheduler (layout.switch_margin)")
    return ap


def run_points(cm, setup, caps, batches, input_lens, output_len) -> list[dict]:
    from splash.sim.deploy import throughput
    points = []
    for b in batches:
        for n in input_lens:
            lay = {k: throughput(cm, setup, caps, k, b, n, output_len) for k in LAYOUTS}
            feas = {k: v for k, v in lay.items() if v["feasible"]}
            leader = max(feas, key=lambda k: feas[k]["tokens_per_s"]) if feas else None
            points.append({"batch_size": b, "input_len": n, "output_len": output_len,
                           "layouts": {k: {"tokens_per_s": v["tokens_per_s"], "feasible": v["feasible"]}
                                       for k, v in lay.items()},
                           "leader": leader, "_concurrency": {k: v["concurrency"] for k, v in lay.items()}})
    return points


def _fmt_len(n: int) -> str:
    """The inverse of parse_len where it is exact (512000 → 512K, 524288 → 512Ki)."""
    for div, suf in ((10 ** 6, "M"), (1 << 20, "Mi"), (10 ** 3, "K"), (1 << 10, "Ki")):
        if n >= div and n % div == 0:
            return f"{n // div}{suf}"
    return str(n)


def print_points(console, points, title: str) -> None:
    from rich.table import Table
    for b in sorted({p["batch_size"] for p in points}):
        t = Table(title=f"{title} — B={b}: predicted tokens/s (input + output)")
        t.add_column("input", justify="right")
        for k in LAYOUTS:
            t.add_column(LAYOUT_LABELS[k], justify="right")
        t.add_column("leader (lead over runner-up)", justify="left")
        for p in (p for p in points if p["batch_size"] == b):
            lay, lead = p["layouts"], p["leader"]
            cells = []
            for k in LAYOUTS:
                v = lay[k]
                txt = f"{v['tokens_per_s']:,.0f}" if v["feasible"] else "—"
                conc = p["_concurrency"][k]
                if v["feasible"] and conc < b:
                    txt += f" ({conc} at once)"
                cells.append(f"[bold]{txt}[/]" if k == lead else txt)
            rest = sorted((v["tokens_per_s"] for k, v in lay.items() if k != lead and v["feasible"]), reverse=True)
            gain = f"+{lay[lead]['tokens_per_s'] / rest[0] - 1:.1%}" if lead and rest and rest[0] > 0 else ""
            t.add_row(_fmt_len(p["input_len"]), *cells, f"{LAYOUT_LABELS.get(lead, 'none')} {gain}")
        console.print(t)


def print_capacity(console, caps) -> None:
    from rich.table import Table
    t = Table(title="KV capacity (MLA layers' KV, whole blocks)")
    most = max(LAYOUTS, key=lambda k: caps[k].distinct_tokens)   # the layout that holds the most (DOP in the paper)
    top = caps[most].distinct_tokens
    for col in ("layout", "distinct tokens", "tokens per rank", f"vs {LAYOUT_LABELS[most]}"):
        t.add_column(col, justify="right")
    for k in LAYOUTS:
        c = caps[k]
        t.add_row(LAYOUT_LABELS[k], f"{c.distinct_tokens:,}", f"{c.tokens_per_rank:,}",
                  f"{c.distinct_tokens / top - 1:+.1%}" if top else "—")
    console.print(t)
    if top:
        vs = (f"{top / max(1, caps[k].distinct_tokens) - 1:+.1%} vs {LAYOUT_LABELS[k]}" for k in LAYOUTS if k != most)
        console.print(f"{LAYOUT_LABELS[most]} holds {', '.join(vs)}.")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["paper"]:
        from splash.sim.paper import main as paper_main
        return paper_main(argv[1:])
    if argv[:1] == ["mechanisms"]:
        from splash.sim.prefill_mechanisms import main as mechanisms_main
        return mechanisms_main(argv[1:])
    if argv[:1] == ["gap"]:
        from splash.sim.tps_gap import main as gap_main
        return gap_main(argv[1:])
    a = build_parser().parse_args(argv)
    from rich.console import Console

    from splash.costmodel.profile import load_profile
    from splash.costmodel.step_cost import CostModel
    from splash.models.config import ConfigError
    from splash.sim.presets import load_sim_model
    from splash.sim.serving import SimSetup, capacities
    from splash.sim.switch_table import print_switch_costs

    console = Console(width=150)
    try:
        model = load_sim_model(a.model, a.weight_dtype, a.kv_dtype)
        prof = load_profile(a.hardware)
        cm = CostModel(model.cfg, a.ranks, prof, model.weight_dtype, model.kv_dtype, a.block_size,
                       cp_prefill=a.cp_prefill)
        reserve = RUNTIME_RESERVE_BYTES if a.reserve is None else float(a.reserve)
        setup = SimSetup(model, prof, a.ranks, a.mem_fraction, a.block_size, a.chunk, reserve,
                         a.prefill_split == "owner", a.storage, a.deployment, a.decode_layout,
                         a.decode_ranks, a.decode_nodes)
        caps = capacities(setup)
    except (ConfigError, ValueError) as e:
        print(f"splash-sim: {e}", file=sys.stderr)
        return 2
    title = (f"{model.name} on {a.ranks}× {prof.name} ({model.weight_dtype} weights, {model.kv_dtype} KV, "
             f"memory fraction {a.mem_fraction}, {a.storage} storage)")
    if a.trace and a.truth_error:
        from splash.sim.model_error import experiment_cli
        try:
            seeds = [int(x) for x in a.seeds.split(",") if x.strip()]
        except ValueError:
            print(f"splash-sim: --seeds: not a comma list of integers: {a.seeds!r}", file=sys.stderr)
            return 2
        return experiment_cli(console, cm, setup, caps, a.trace, a.truth_error, seeds, a.margin, a.json,
                              a.truth_kernels)
    if a.trace:
        return replay_cli(console, cm, setup, caps, a.trace, a.margin, a.enable_prefix_caching)
    points = run_points(cm, setup, caps, a.batch_sizes, a.input_lens, a.output_len)
    print_points(console, points, title)
    print_capacity(console, caps)
    print_switch_costs(console, cm, setup, max(a.batch_sizes), a.input_lens[len(a.input_lens) // 2])
    if a.json:
        out = {"points": [{k: v for k, v in p.items() if not k.startswith("_")} for p in points],
               "kv_capacity_tokens": {k: caps[k].distinct_tokens for k in LAYOUTS}}
        Path(a.json).write_text(json.dumps(out, indent=1))
    return 0


def replay_cli(console, cm, setup, caps, path: str, margin: float, prefix_caching: bool | None = None) -> int:
    from rich.table import Table

    from splash.sim.trace import load_workload, replay
    from splash.sim.workloads import BUILTIN, builtin
    try:
        work = builtin(path, 1) if path in BUILTIN else load_workload(path)
    except (OSError, ValueError) as e:
        print(f"splash-sim: {e}")
        return 2
    results = [replay(cm, setup, caps, work, "auto", margin, prefix_caching=prefix_caching)]
    for lay in LAYOUTS:
        try:
            results.append(replay(cm, setup, caps, work, lay, margin, prefix_caching=prefix_caching))
        except ValueError as e:
            console.print(f"{lay}: cannot serve this workload ({e})")
    auto = results[0]
    tl = Table(title=f"auto: layout timeline ({auto.switches} switches, margin {margin:.0%})")
    for col in ("t (s)", "switch", "why"):
        tl.add_column(col)
    for when, what, why in auto.timeline:
        tl.add_row(f"{when:.2f}", what, why)
    console.print(tl)
    turns = sum(len(r.parts) or 1 for r in work)
    t = Table(title=f"{path}: {turns} requests" + (f" ({len(work)} conversations)" if turns > len(work) else "")
              + f", prefix cache {'on' if auto.prompt_tokens else 'off'}, predicted")
    for col in ("mode", "output tok/s", "total s", "switches", "cache hits", "auto vs this"):
        t.add_column(col, justify="right")
    for r in results:
        t.add_row(r.mode, f"{r.output_tokens_per_s:,.1f}", f"{r.total_s:.2f}", str(r.switches),
                  f"{r.cached_prompt_tokens / r.prompt_tokens:.0%}" if r.prompt_tokens else "—",
                  f"{auto.output_tokens_per_s / r.output_tokens_per_s:.2f}x" if r.output_tokens_per_s else "—")
    console.print(t)
    return 0


if __name__ == "__main__":
    sys.exit(main())
