"""`splash-bench workload`: the shifting-workload experiment — the same requests served once with `auto` and once
per fixed layout, each by a real splash-serve under mpiexec, driven by concurrent streaming HTTP clients.

    splash-bench workload --np 2 [--workload FILE] [--modes auto,tp,dp_attn,cp,dop] [--json FILE]

The workload file (request groups, below) is read and expanded into requests by `splash.workload`, as
`splash-sim --trace` reads and expands it. ``--prefix-caching on,off`` serves every mode with the prefix cache
and without it; the table then adds the cache's hit rate and the TTFT of later turns (their prompts' prefix was
cached). The default workload has phases with different leaders, shaped like an RL rollout group: a few short
interactive requests, then a burst of many requests that ends as a few long ones. Every mode serves identical
prompts; the table reports output tokens/s, total time, latency p50/p99, TTFT p50, switches, completed and lost
requests, and whether each mode's tokens equal the first mode's. With --json each run keeps the scheduler's
structured decision lines from its server log (``decision_log``) and its bounded decision history from GET
/v1/layout (``scheduler.history``); the server logs are copied to FILE's stem + "-logs/".
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import shutil
import statistics
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

from splash import workload as workload_format
from splash.bench import results as R
from splash.bench.results import pct
from splash.bench.serve_proc import REPO, Outcome, launch, read_metrics, stop, stream_turn
from splash.layouts.layout import LAYOUT_NAMES
from splash.workload import SEED, VOCAB, load_workload, make_requests

MODES = ("auto", *LAYOUT_NAMES)
TIMELINE_BIN_S = 0.5
DECISION_LINE = re.compile(r"layout decision (\{.*\})\s*$")


async def _one(client, t_start: float, at: float, parts: list[list[int]], max_tokens: int) -> Outcome:
    """One request — or, with several parts, one conversation: each turn's prompt is the conversation so far (the
    prompts and answers before) plus its part, sent when the turn before has answered."""
    await asyncio.sleep(max(0.0, t_start + at - time.perf_counter()))
    out, t0 = Outcome(), time.perf_counter()
    history: list[int] = []
    for part in parts:
        history += part
        got = await stream_turn(client, t_start, history, max_tokens, out)
        history += got
        if not got or out.error:
            break
    out.latency = time.perf_counter() - t0
    out.end_s = time.perf_counter() - t_start
    out.ok = out.ok and out.error is None and len(out.ids) == max_tokens * len(parts)
    return out


async def _poll_layout(client, t_start: float, stop_ev: asyncio.Event, samples: list) -> None:
    while not stop_ev.is_set():
        try:
            s = (await client.get("/v1/layout")).json()
            samples.append((time.perf_counter() - t_start, s["steps"], s["layout"], s["switch_count"]))
        except Exception:  # noqa: BLE001 — a missed sample only thins the timeline
            pass
        await asyncio.sleep(0.05)


async def drive(url: str, requests: list, timeout_s: float) -> tuple[list[Outcome], float, list, dict]:
    import httpx
    limits = httpx.Limits(max_connections=len(requests) + 8, max_keepalive_connections=len(requests) + 8)
    async with httpx.AsyncClient(base_url=url, limits=limits, timeout=httpx.Timeout(timeout_s, connect=30)) as c:
        samples: list = []
        stop_ev = asyncio.Event()
        t_start = time.perf_counter()
        poller = asyncio.create_task(_poll_layout(c, t_start, stop_ev, samples))
        outs = await asyncio.gather(*(_one(c, t_start, at, p, n) for at, p, n in requests))
        total = time.perf_counter() - t_start
        stop_ev.set()
        await poller
        final = (await c.get("/v1/layout")).json()
        m = await read_metrics(c)   # prompt tokens the prefix cache looked up / found cached
        final["prefix_cache"] = {k: m[f"splash_prefix_cache_{k}_total"] for k in ("queries", "hits")
                                 if f"splash_prefix_cache_{k}_total" in m}
    return list(outs), total, samples, final


def summarise(mode: str, outs: list[Outcome], total: float, samples: list, final: dict) -> dict:
    lat = sorted(o.latency for o in outs if o.ok)
    tokens = sum(len(o.ids) for o in outs)
    bins = Counter(int(t / TIMELINE_BIN_S) for o in outs for t in o.arrivals)
    timeline, events, prev = [], [], None
    for t, step, lay, _ in samples:
        timeline.append({"t_s": round(t, 3), "step": step, "layout": lay,
                         "tokens_per_s": bins.get(int(t / TIMELINE_BIN_S), 0) / TIMELINE_BIN_S})
        if prev is not None and lay != prev:
            events.append({"t_s": round(t, 3), "src": prev, "dst": lay})
        prev = lay
    ttft = [o.ttft for o in outs if o.ok]
    later = [t for o in outs if o.ok for t in o.turn_ttfts[1:]]
    pc = final.get("prefix_cache") or {}
    return {"mode": mode, "output_tokens_per_s": tokens / total if total else 0.0, "total_s": total,
            "completed": sum(o.ok for o in outs), "lost": sum(not o.ok for o in outs),
            "switches": final.get("switch_count", 0), "latency_p50_s": pct(lat, 50), "latency_p99_s": pct(lat, 99),
            "ttft_p50_s": statistics.median(ttft) if ttft else 0.0, "final_layout": final.get("layout"),
            "ttft_p50_later_turns_s": statistics.median(later) if later else None,
            "prefix_cache_hit_rate": pc["hits"] / pc["queries"] if pc.get("queries") else 0.0,
            "switch_counts": final.get("switches", {}), "scheduler": final.get("scheduler"),
            "timeline": timeline, "switch_events": events,
            "errors": [o.error for o in outs if o.error][:3]}


def decision_log(text: str) -> list[dict]:
    """The scheduler's structured decision lines ("layout decision {json}") of a server log, in order."""
    out = []
    for line in text.splitlines():
        m = DECISION_LINE.search(line)
        if m:
            try:
                out.append(json.loads(m.group(1)))
            except ValueError:
                pass   # a line cut by the log's end
    return out


def run_mode(args, mode: str, requests: list, workdir: Path,
             cache: bool = True) -> tuple[dict, list[list[int]], dict]:
    """Serve `requests` with a fresh server in `mode` (with or without the prefix cache): (result, token ids per
    request, phase rates)."""
    tag = mode if cache else f"{mode}-nocache"
    log_path = workdir / f"server-{tag}.log"
    extra = args.server_args + ("" if cache else " --no-enable-prefix-caching")
    try:
        proc, url = launch(args.np, args.config, ["--log-decisions", "--layout", mode], extra, log_path)
    except RuntimeError as e:
        raise RuntimeError(f"{mode}: {e}") from None
    try:
        outs, total, samples, final = asyncio.run(drive(url, requests, args.request_timeout))
    finally:
        rc = stop(proc)
    res = summarise(mode, outs, total, samples, final)
    res["prefix_caching"] = cache
    res["server_exit"] = rc
    text = log_path.read_text()
    res["server_log_tail"] = text[-1500:] if rc not in (0, None) else ""
    res["decision_log"] = decision_log(text)
    return res, [o.ids for o in outs], phase_rates(requests, outs)


# ---- the per-phase oracle ---------------------------------------------------------------------------------------
def phase_rates(requests: list, outs: list[Outcome]) -> dict[tuple[int, ...], tuple[int, float]]:
    """Per phase (the set of request groups active: started and not all finished), (tokens, seconds) of one run."""
    starts = sorted({at for at, _, _ in requests})
    group_of = [starts.index(at) for at, _, _ in requests]
    ends = {g: max(o.end_s for o, gg in zip(outs, group_of) if gg == g) for g in set(group_of)}
    cuts = sorted(set(starts) | set(ends.values()))
    out: dict[tuple[int, ...], list] = {}
    arrivals = sorted(t for o in outs for t in o.arrivals)
    for a, b in zip(cuts, cuts[1:]):
        active = tuple(sorted(g for g in ends if starts[g] <= a and ends[g] >= b))
        if not active or b <= a:
            continue
        n = sum(1 for t in arrivals if a <= t < b)
        acc = out.setdefault(active, [0, 0.0])
        acc[0] += n
        acc[1] += b - a
    return {k: (v[0], v[1]) for k, v in out.items()}


def oracle(fixed: dict[str, dict]) -> dict | None:
    """Each phase served at its best fixed layout's measured rate (switch costs ignored): output tok/s, and the
    leader per phase. Phase token counts: the median over the fixed runs."""
    if not fixed:
        return None
    phases = set().union(*(set(p) for p in fixed.values()))
    total_tok, total_s, leaders = 0.0, 0.0, {}
    for ph in sorted(phases):
        rates = {m: n / s for m, p in fixed.items() if ph in p for n, s in [p[ph]] if s > 0}
        if not rates:
            continue
        tok = statistics.median(p[ph][0] for p in fixed.values() if ph in p)
        best = max(rates, key=rates.get)
        leaders["+".join(map(str, ph))] = best
        if rates[best] > 0:
            total_tok += tok
            total_s += tok / rates[best]
    return {"output_tokens_per_s": total_tok / total_s if total_s else 0.0, "phase_leaders": leaders}


# ---- CLI ------------------------------------------------------------------------------------------------------
def add_arguments(p: argparse.ArgumentParser) -> None:
    p.description = __doc__ + "\n" + workload_format.__doc__
    p.add_argument("--np", type=int, default=2, help="ranks per server (mpiexec -n)")
    p.add_argument("--config", default=str(REPO / "configs" / "cpu.yaml"), help="splash-serve config")
    p.add_argument("--server-args", default="--preset small-mla",
                   help="extra splash-serve flags for every mode (default: %(default)s)")
    p.add_argument("--modes", default=",".join(MODES), help="auto and/or fixed layouts, comma-separated")
    p.add_argument("--workload", metavar="FILE", help="request groups (JSON or YAML); default: built in. "
                   "benchmarks/workloads/rollout-at-capacity.yaml: an RL rollout whose long tail fills the KV pool")
    p.add_argument("--vocab", type=int, default=VOCAB, help="prompt token ids are drawn below this")
    p.add_argument("--seed", type=int, default=SEED)
    p.add_argument("--request-timeout", type=float, default=600.0, help="seconds per request")
    p.add_argument("--json", metavar="FILE", help="write every run's result here")
    p.add_argument("--prefix-caching", default="on", metavar="on,off",
                   help="serve every mode with the prefix cache (on), without it (off), or both (on,off)")


def print_table(runs: list[dict], orc: dict | None, title: str) -> None:
    from rich.console import Console

    from splash.bench.tables import TableSpec, print_tables

    both = len({r.get("prefix_caching", True) for r in runs}) > 1
    turns = any(r.get("ttft_p50_later_turns_s") is not None for r in runs)
    cols = ["mode", "output tok/s", "total s", "p50 lat s", "p99 lat s", "TTFT p50 s"]
    cols += ["TTFT later turns s"] if turns else []
    cols += ["cache hits"] if both or any(r.get("prefix_cache_hit_rate") for r in runs) else []
    t = TableSpec(title, [*cols, "switches", "completed", "lost", "tokens = first mode"])
    best = max((r["output_tokens_per_s"] for r in runs), default=0)
    for r in runs:
        bold = [1] if r["output_tokens_per_s"] == best else []
        row = [r["mode"] + ("" if r.get("prefix_caching", True) else " (no cache)"),
               f"{r['output_tokens_per_s']:.1f}", f"{r['total_s']:.2f}", f"{r['latency_p50_s']:.2f}",
               f"{r['latency_p99_s']:.2f}", f"{r['ttft_p50_s']:.2f}"]
        if "TTFT later turns s" in cols:
            later = r.get("ttft_p50_later_turns_s")
            row.append("—" if later is None else f"{later:.2f}")
        if "cache hits" in cols:
            row.append(f"{r.get('prefix_cache_hit_rate', 0.0):.0%}")
        t.add_row([*row, str(r["switches"]), str(r["completed"]), str(r["lost"]),
                   "yes" if r.get("same_tokens", True) else "NO"], bold)
    con = Console(width=150)
    print_tables([t], con)
    fixed = [r for r in runs if r["mode"] != "auto" and r.get("prefix_caching", True)]
    auto = next((r for r in runs if r["mode"] == "auto" and r.get("prefix_caching", True)), None)
    if auto and fixed:
        tps = sorted(r["output_tokens_per_s"] for r in fixed)
        con.print(f"auto vs best fixed: {auto['output_tokens_per_s'] / tps[-1]:.3f}x; vs median fixed: "
                  f"{auto['output_tokens_per_s'] / statistics.median(tps):.3f}x"
                  + (f"; vs per-phase oracle ({orc['output_tokens_per_s']:.1f} tok/s, leaders "
                     f"{orc['phase_leaders']}): {auto['output_tokens_per_s'] / orc['output_tokens_per_s']:.3f}x"
                     if orc and orc["output_tokens_per_s"] else ""))


def write_result(args, workload: dict, runs: list[dict], orc: dict | None, load: float) -> None:
    """The splash-bench result JSON (kind 'workload': `runs`, no `points`), with the environment block."""
    model = {"name": args.server_args or "config default", "source": args.config}
    R.write_runs(args.json, "workload", R.environment(backend="cpu", ranks=args.np, model=model),
                 {"workload": workload, "modes": args.modes, "server_args": args.server_args,
                  "config": args.config, "seed": args.seed}, getattr(args, "argv", None),
                 json.loads(json.dumps(runs, default=str)), oracle=orc, load_average_before=load,
                 load_average_after=os.getloadavg()[0])


def run(args) -> int:
    try:
        workload = load_workload(args.workload)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    bad = [m for m in modes if m not in MODES]
    if bad or not modes:
        print(f"error: --modes: unknown {bad} (choose from {', '.join(MODES)})", file=sys.stderr)
        return 2
    caching = [c.strip() for c in args.prefix_caching.split(",") if c.strip()]
    if not caching or any(c not in ("on", "off") for c in caching):
        print(f"error: --prefix-caching: {args.prefix_caching!r} is not on, off or on,off", file=sys.stderr)
        return 2
    requests = make_requests(workload, args.vocab, args.seed)
    workdir = Path(tempfile.mkdtemp(prefix="splash-workload-"))
    load = os.getloadavg()[0]
    runs, first_ids, phases = [], None, {}
    for mode in modes:
        for c in caching:
            print(f"[workload] {mode}{'' if c == 'on' else ' (no prefix cache)'}: {len(requests)} requests on "
                  f"{args.np} ranks ...", file=sys.stderr, flush=True)
            res, ids, ph = run_mode(args, mode, requests, workdir, cache=c == "on")
            first_ids = ids if first_ids is None else first_ids
            res["same_tokens"] = ids == first_ids
            res["phases"] = {"+".join(map(str, k)): {"tokens": n, "seconds": s} for k, (n, s) in ph.items()}
            runs.append(res)
            if mode != "auto" and c == "on":
                phases[mode] = ph
    orc = oracle({m: p for m, p in phases.items() if p})
    title = (f"shifting workload — {args.np} ranks, {args.server_args or 'config defaults'}, "
             f"{len(requests)} requests; load average {load:.1f} before")
    print_table(runs, orc, title)
    if args.json:
        write_result(args, workload, runs, orc, load)
        logs = Path(args.json).with_name(Path(args.json).stem + "-logs")
        logs.mkdir(parents=True, exist_ok=True)
        for f in workdir.glob("server-*.log"):
            shutil.copy(f, logs / f.name)
    lost = sum(r["lost"] for r in runs)
    return 0 if lost == 0 and all(r.get("same_tokens", True) for r in runs) else 1


if __name__ == "__main__":
    from splash.bench.cli import main
    sys.exit(main(["workload", *sys.argv[1:]]))
