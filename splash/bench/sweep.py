"""Fixed-layout throughput sweep through the engine, under mpirun:

    mpiexec -n 2 splash-bench sweep --config configs/cpu.yaml --layouts tp,dp_attn,cp,dop \\
        --input-lens 128,512,2048 --batch-sizes 1,8 --output-len 16 --repeats 3 --json results/sweep.json

Every rank builds the same engine from the serving config. At each point (input length x batch size) the
layouts run side by side, their order rotated from point to point: the engine is pinned to the layout (the
idle engine switches, untimed), warm-up runs, then each repeat adds `batch` random prompts of `input_len`
tokens at once and steps the engine until all `output_len` greedy tokens (EOS ignored) are out — queueing,
chunked prefill and decode included — timed on rank 0. Figures: output tokens/s = batch x output_len / wall,
total tokens/s = batch x (input_len + output_len) / wall; the JSON keeps every repeat and their medians. The KV
pool is sized so the largest point fits in every layout (unless the config sets cache.num_kv_blocks). The JSON
is rewritten after every point, so an interrupted sweep keeps what it measured; --resume skips the points
already in the file.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import zlib

from splash.bench import results as R
from splash.cli.args import layout_list
# config fields a resumed sweep must share with the file (the axes may grow)
SAME_ON_RESUME = ("output_len", "warmup", "repeats", "seed", "engine", "ranks")


def int_list(text: str) -> list[int]:
    try:
        vals = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected comma-separated integers") from None
    if not vals or min(vals) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: expected positive integers")
    return vals


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", metavar="YAML", help="serving config (model, dtypes, KV, scheduler); "
                   "default: the built-in defaults")
    p.add_argument("--preset", help="override model.preset")
    p.add_argument("--model", metavar="DIR", help="override model.model (an HF checkpoint directory)")
    p.add_argument("--kv-cache-dtype", help="override cache.kv_cache_dtype")
    p.add_argument("--max-num-batched-tokens", type=int, help="override scheduler.max_num_batched_tokens "
                   "(the prefill chunk budget of a step)")
    p.add_argument("--layouts", type=layout_list, help="comma-separated subset of tp,dp_attn,cp,dop "
                   "[the config's layout.allowed_layouts]")
    p.add_argument("--input-lens", type=int_list, default=[128, 512], metavar="N,N", help="[128,512]")
    p.add_argument("--batch-sizes", type=int_list, default=[1, 8], metavar="N,N", help="[1,8]")
    p.add_argument("--output-len", type=int, default=16, metavar="N", help="generated tokens per request [16]")
    p.add_argument("--warmup", type=int, default=1, metavar="N", help="untimed runs per point [1]")
    p.add_argument("--repeats", type=int, default=3, metavar="N", help="timed runs per point [3]")
    p.add_argument("--seed", type=int, default=0, help="prompt seed [0]")
    p.add_argument("--metric", choices=R.METRICS, default="total_tokens_per_s", help="what the tables show")
    p.add_argument("--json", metavar="FILE", help="write the result here (after every point)")
    p.add_argument("--resume", action="store_true", help="continue the sweep in --json FILE")
    p.add_argument("--force", action="store_true", help="overwrite an existing --json FILE")
    p.add_argument("--markdown", metavar="FILE", help="also write the tables as markdown")


def serve_config(args):
    from splash.config.serve_config import ServeConfig, apply_overrides, load_serve_config

    cfg = load_serve_config(args.config) if args.config else ServeConfig()
    over = {k: v for k, v in (("preset", args.preset), ("model", args.model),
                              ("kv_cache_dtype", args.kv_cache_dtype),
                              ("max_num_batched_tokens", args.max_num_batched_tokens)) if v is not None}
    return apply_overrides(cfg, over, "splash-bench sweep flags") if over else cfg


def sweep_config(args, engine_args, ranks: int, threads: int) -> dict:
    import dataclasses
    engine = {**dataclasses.asdict(engine_args), "allowed_layouts": list(engine_args.allowed_layouts)}   # as JSON
    return {"layouts": list(args.layouts), "input_lens": list(args.input_lens),
            "batch_sizes": list(args.batch_sizes), "output_len": args.output_len, "warmup": args.warmup,
            "repeats": args.repeats, "seed": args.seed, "ranks": ranks, "threads_per_rank": threads,
            "engine": engine}


def _check_args(args) -> None:
    if args.output_len < 1 or args.repeats < 1 or args.warmup < 0:
        raise ValueError("--output-len and --repeats must be >= 1, --warmup >= 0")
    if args.resume and not args.json:
        raise ValueError("--resume needs --json FILE")
    if args.json and os.path.exists(args.json) and not (args.resume or args.force):
        raise ValueError(f"{args.json} exists: pass --resume to continue that sweep or --force to overwrite it")


def prior_doc(args, config: dict) -> dict | None:
    """With --resume and an existing file: that sweep, checked against this one (the axes may grow)."""
    if not (args.resume and os.path.exists(args.json)):
        return None
    doc = R.read_json(args.json)
    if doc["kind"] != "sweep":
        raise R.ResultError(f"{args.json}: a {doc['kind']!r} result, not a sweep")
    old = doc.get("config", {})
    diff = [k for k in SAME_ON_RESUME if old.get(k) != config.get(k)]
    if diff:
        raise R.ResultError(f"{args.json}: cannot resume, this sweep differs in {', '.join(diff)}")
    for axis in ("layouts", "input_lens", "batch_sizes"):
        old[axis] = list(dict.fromkeys([*old.get(axis, []), *config[axis]]))
    doc["complete"] = False
    doc.setdefault("resumed", []).append({"command": R.command_line(getattr(args, "argv", None)),
                                          "load_average": R.load_average()})
    return doc


def _error(comm, msg) -> int:
    """Every rank stops with the same error; rank 0 says it."""
    if comm.rank == 0:
        print(f"error: {msg}", file=sys.stderr)
    return 2


def plan(args, done: set) -> list[tuple[int, int, str]]:
    """(input_len, batch, layout) in measuring order: layouts side by side at each point, the order rotated
    from point to point so that no layout always runs first (a drifting machine load biases none)."""
    k = len(args.layouts)
    points = [(n, b) for b in args.batch_sizes for n in args.input_lens]
    return [(n, b, lay) for i, (n, b) in enumerate(points) for lay in args.layouts[i % k:] + args.layouts[:i % k]
            if (lay, n, b, args.output_len) not in done]


def measure(llm, comm, args, layout: str, n: int, b: int) -> dict:
    from splash.bench.driver import make_prompts, run_point, switch_to

    if llm.engine.layout != layout:
        switch_to(llm, comm, layout)
    vocab = llm.cfg.vocab_size
    seed = zlib.crc32(f"{args.seed}/{n}/{b}".encode())  # same prompts for every layout at this point
    for w in range(args.warmup):
        run_point(llm, comm, make_prompts(b, n, vocab, seed + 1000 + w), args.output_len)
    reps = [run_point(llm, comm, make_prompts(b, n, vocab, seed + r), args.output_len)
            for r in range(args.repeats)]
    pt = {"layout": layout, "input_len": n, "batch_size": b, "output_len": args.output_len, "repeats": reps}
    for k in (*R.METRICS, "wall_s", "ttft_median_s"):
        vals = [r[k] for r in reps if r.get(k) is not None]
        pt[k] = statistics.median(vals) if vals else None
    pt["load_average"] = R.load_average()
    return pt


def run(args) -> int:
    from splash.distributed import init_dist
    from splash.models.config import ConfigError

    ctx = init_dist()
    comm = ctx.comm
    try:
        _check_args(args)
        cfg = serve_config(args)
        args.layouts = args.layouts or list(cfg.layout.allowed_layouts)
    except (ValueError, ConfigError) as e:  # every rank sees the same error
        return _error(comm, e)
    return _sweep(args, cfg, ctx)


def _sweep(args, cfg, ctx) -> int:
    from splash.bench.driver import describe_model, pool_blocks
    from splash.distributed.launch import set_threads
    from splash.server.startup import engine_args

    comm, threads = ctx.comm, set_threads(ctx)
    st = engine_args(cfg)   # the engine splash-serve builds from this config
    config = sweep_config(args, st, comm.size, threads)
    doc, err = None, None   # a bad --resume file fails before the model loads
    if comm.rank == 0:
        try:
            doc = prior_doc(args, config)
        except R.ResultError as e:
            err = str(e)
    if comm.broadcast_obj(err):
        return _error(comm, err)
    blocks = pool_blocks(max(args.batch_sizes), max(args.input_lens) + args.output_len + 1, st.block_size)
    try:
        llm = _build(st, comm, args.layouts[0], blocks)
    except ValueError as e:  # the same on every rank (model and world size do not fit)
        return _error(comm, e)
    if comm.rank == 0 and doc is None:
        env = R.environment(backend=cfg.parallel.backend, ranks=comm.size, model=describe_model(st, llm.cfg))
        env["threads_per_rank"] = threads
        doc = R.new_result("sweep", env, config, getattr(args, "argv", None))
    from splash.bench.show import sweep_tables

    try:
        return R.measure_points(args, comm, doc, _todo(llm, comm, args, doc),
                                lambda comm, n, b, lay: measure(llm, comm, args, lay, n, b),
                                lambda d: sweep_tables(d, args.metric), _line)
    except KeyboardInterrupt:
        if comm.rank == 0:
            print(f"\ninterrupted: {len(doc['points'])} points kept in {args.json or '(no --json)'}; "
                  "rerun with --resume to continue", file=sys.stderr)
        return 130


def _line(pt: dict) -> str:
    return (f"{pt['layout']:>7} in={pt['input_len']:<6} B={pt['batch_size']:<4} {pt['output_tokens_per_s']:9.1f} "
            f"out tok/s {pt['total_tokens_per_s']:10.1f} total tok/s  ({pt['wall_s']:.2f} s)")


def _todo(llm, comm, args, doc) -> list[tuple[int, int, str]]:
    """The points still to measure; layouts this engine cannot run and points longer than max_model_len are
    left out and named in the result's "skipped"."""
    from splash.bench.driver import layout_unavailable

    done = comm.broadcast_obj({R.sweep_key(p) for p in doc["points"]} if doc else None)
    skipped = {lay: why for lay in args.layouts if (why := layout_unavailable(llm, lay))}
    limit = llm.engine.max_model_len
    if comm.rank == 0:
        doc.setdefault("skipped", {}).update(skipped)
        if max(args.input_lens) + args.output_len > limit:
            doc["skipped"]["long_points"] = f"input_len + output_len > max_model_len {limit}"
    return [p for p in plan(args, done) if p[2] not in skipped and p[0] + args.output_len <= limit]


def _build(st, comm, first: str, blocks: int):
    from splash.bench.driver import build_llm
    from splash.models.config import ConfigError

    try:
        return build_llm(st, comm, first, blocks)
    except ConfigError:
        raise
    except ValueError:  # e.g. the heads do not divide over the ranks: start replicated, skip that layout later
        return build_llm(st, comm, "dp_attn", blocks)
