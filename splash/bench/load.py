"""Bounded loopback load test of splash-serve: many concurrent streaming clients, optional forced switches.

  # start 4 ranks itself, 64 streaming clients x 4 requests, pin the next layout every 8 engine steps:
  splash-bench load --launch --np 4 --clients 64 --requests-per-client 4 --switch-every 8

  # against a server that is already running (loopback only):
  splash-bench load --url http://127.0.0.1:8000 --admin-token TOKEN --clients 64

Every request streams (SSE) greedy tokens with ``ignore_eos`` and ``return_token_ids``; it counts as *failed*
if the HTTP call errors or the stream has no ``[DONE]``, as *lost* if it delivered fewer tokens than
``max_tokens``, and as a *mismatch* if its tokens differ from the same prompt's tokens in an unswitched
reference pass run first. Exit status 0 only when all three counts are 0. ``--update-doc`` writes the result
into docs/benchmarks.md under "## Server load test (issue 5)"; ``--json FILE`` writes it as a splash-bench
result (kind "load", one run), which ``splash-bench compare`` can compare with another.

Abuse (`splash.bench.load_abuse`), next to the well-behaved clients:

  # 16 clients that abandon long non-streaming requests after 0.5 s, 4 that send 9 MiB bodies, and a probe
  splash-bench load --launch --np 2 --clients 16 --abandon 16 --oversized 4 --probe-every 0.25

With any of ``--abandon`` / ``--oversized`` / ``--probe-every``, the KV in use must also return to 0 (from
/metrics) within ``--drain-wait`` s, every abuser must get the expected answer and every probe must succeed
for exit status 0; ``--update-doc`` then writes under "## Server load test under abuse (issue 14)".
"""
from __future__ import annotations

import argparse
import asyncio
import ipaddress
import os
import random
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlparse

import httpx

from splash.bench import load_abuse
from splash.bench import results as R
from splash.bench.results import pct
from splash.bench.serve_proc import Outcome, launch, stop, stream_completion, stream_turn
SECTION = "## Server load test (issue 5)"


@dataclass
class Stats:
    ok: int = 0
    failed: int = 0
    lost: int = 0
    mismatched: int = 0
    tokens: int = 0
    latencies: list[float] = field(default_factory=list)
    ttfts: list[float] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)


async def client_task(client, prompts, ref, max_tokens, n_requests, rng, stats: Stats) -> None:
    for _ in range(n_requests):
        i = rng.randrange(len(prompts))
        out, t0 = Outcome(), time.perf_counter()
        ids = await stream_turn(client, t0, prompts[i], max_tokens, out)
        if out.error:   # counted and reported
            stats.failed += 1
            stats.errors.append(out.error)
            continue
        stats.latencies.append(time.perf_counter() - t0)
        stats.ttfts.append(out.ttft)
        stats.tokens += len(ids)
        if not out.ok:   # no [DONE]
            stats.failed += 1
        elif len(ids) != max_tokens:
            stats.lost += 1
        elif ref is not None and ids != ref[i]:
            stats.mismatched += 1
        else:
            stats.ok += 1


async def switcher(client, every_steps: int, layouts: list[str], token: str | None, stop: asyncio.Event,
                   log: dict) -> None:
    """Pin the next layout of ``layouts`` every ``every_steps`` engine steps (reads steps from /v1/layout)."""
    headers = bearer(token) if token else {}   # else the client's own (its API key, if any)
    state = (await client.get("/v1/layout")).json()
    last, k = state["steps"], 0
    while not stop.is_set():
        await asyncio.sleep(0.01)
        state = (await client.get("/v1/layout")).json()
        if state["steps"] - last < every_steps:
            continue
        target = layouts[k % len(layouts)]
        if target == state["layout"]:
            k += 1
            target = layouts[k % len(layouts)]
        r = await client.post("/v1/layout", json={"layout": target}, headers=headers)
        if r.status_code != 200:
            log["switch_errors"] = log.get("switch_errors", 0) + 1
            log["last_error"] = r.text[:200]
        else:
            log["requested"] = log.get("requested", 0) + 1
        last, k = state["steps"], k + 1


def bearer(key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"} if key else {}


def make_prompts(n: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(rng.randrange(8, 129))] for _ in range(n)]


async def reference_pass(client, prompts, max_tokens) -> list[list[int]]:
    refs: list[list[int]] = [[] for _ in prompts]
    await asyncio.gather(*(stream_completion(client, p, max_tokens, ids.extend) for p, ids in zip(prompts, refs)))
    return refs


async def run_load(args, url: str) -> dict:
    limits = httpx.Limits(max_connections=args.clients + 16, max_keepalive_connections=args.clients + 16)
    timeout = httpx.Timeout(args.request_timeout, connect=30)
    async with httpx.AsyncClient(base_url=url, limits=limits, timeout=timeout, headers=bearer(args.api_key)) as client:
        models = (await client.get("/v1/models")).json()["data"][0]
        prompts = make_prompts(args.prompts, args.vocab, args.seed)
        ref = await reference_pass(client, prompts, args.max_tokens) if args.prompts else None
        before = (await client.get("/v1/layout")).json()
        stats, log, ab, done = Stats(), {}, load_abuse.Abuse(), asyncio.Event()
        background = load_abuse.start(url, client, args, done, ab)   # the switcher and abusers run until done
        if args.switch_every:
            background.append(asyncio.create_task(switcher(client, args.switch_every, args.layouts.split(","),
                                                           args.admin_token, done, log)))
        t0 = time.perf_counter()
        tasks = [client_task(client, prompts, ref, args.max_tokens, args.requests_per_client,
                             random.Random(args.seed + c), stats) for c in range(args.clients)]
        await asyncio.wait_for(asyncio.gather(*tasks), args.max_duration)
        wall = time.perf_counter() - t0
        done.set()
        await asyncio.gather(*background)
        if load_abuse.enabled(args):
            ab.drained_s = await load_abuse.wait_drained(client, args.drain_wait)
        after = (await client.get("/v1/layout")).json()
    return {"model": models["id"], "load": args.load_before, "stats": stats, "wall": wall, "before": before,
            "after": after, "log": log, "abuse": ab}


def check_loopback(url: str) -> None:
    host = urlparse(url).hostname or ""
    ok = host == "localhost"
    try:
        ok = ok or ipaddress.ip_address(host).is_loopback
    except ValueError:
        pass
    if not ok:
        sys.exit(f"error: {url}: this load test only targets loopback addresses")


def report(args, res: dict, command: str, server_rc: int | None) -> str:
    s: Stats = res["stats"]
    total = args.clients * args.requests_per_client
    sw_before, sw_after = res["before"]["switch_count"], res["after"]["switch_count"]
    lines = [
        f"- command: `{command}`",
        f"- server: {args.np if args.launch else '?'} ranks, model `{res['model']}`, config `{args.config}`; "
        f"host: {os.cpu_count()} CPU cores, load average {res['load']:.1f} before the run "
        f"(ranks > cores means oversubscribed timings)",
        f"- load: {args.clients} concurrent streaming clients x {args.requests_per_client} requests = {total} "
        f"requests, prompts 8-128 tokens, max_tokens {args.max_tokens} (greedy, ignore_eos)",
        f"- forced switches: every {args.switch_every or '-'} engine steps over {args.layouts}; executed "
        f"{sw_after - sw_before} (layout {res['before']['layout']} -> {res['after']['layout']})",
        f"- result: {s.ok} ok, **{s.failed} failed, {s.lost} lost**, {s.mismatched} token mismatches vs the "
        f"unswitched reference pass",
        f"- throughput: {s.tokens} tokens in {res['wall']:.1f} s = **{s.tokens / res['wall']:.1f} tokens/s**; "
        f"request latency p50 {pct(s.latencies, 50):.2f} s / p99 {pct(s.latencies, 99):.2f} s; "
        f"TTFT p50 {pct(s.ttfts, 50):.2f} s",
    ]
    if load_abuse.enabled(args):
        lines += load_abuse.report_lines(args, res["abuse"])
    if server_rc is not None:
        lines.append(f"- shutdown: SIGTERM -> every rank exited, mpiexec status {server_rc}")
    if s.errors:
        lines.append(f"- first errors: {s.errors[:3]}")
    return "\n".join(lines)


def update_doc(path: Path, body: str, section: str = SECTION) -> None:
    text = path.read_text() if path.exists() else "# Benchmarks\n"
    block = f"{section}\n\n{body}\n"
    if section in text:
        start = text.index(section)
        nxt = text.find("\n## ", start + len(section))
        text = text[:start] + block + (text[nxt + 1:] if nxt >= 0 else "")
    else:
        text = text.rstrip("\n") + "\n\n" + block
    path.write_text(text)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--url", help="a running server (loopback only)")
    p.add_argument("--launch", action="store_true", help="start the server itself under mpiexec")
    p.add_argument("--np", type=int, default=4, help="ranks to launch (with --launch)")
    p.add_argument("--config", default="configs/cpu.yaml", help="server config (with --launch)")
    p.add_argument("--server-args", default="", help="extra splash-serve flags (with --launch)")
    p.add_argument("--admin-token", default="load-test-token", help="bearer token for POST /v1/layout")
    p.add_argument("--api-key", help="bearer key every request sends (a server with server.api_key); with "
                                     "--launch the server requires it (given through SPLASH_API_KEY)")
    p.add_argument("--clients", type=int, default=64)
    p.add_argument("--requests-per-client", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--prompts", type=int, default=32, help="distinct prompts (0: skip the reference pass)")
    p.add_argument("--vocab", type=int, default=256, help="prompt token ids are drawn below this")
    p.add_argument("--switch-every", type=int, default=0, help="pin the next layout every K engine steps")
    p.add_argument("--layouts", default="dp_attn,cp,dop,tp")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--request-timeout", type=float, default=300.0)
    p.add_argument("--max-duration", type=float, default=600.0, help="bound on the whole load phase (s)")
    p.add_argument("--update-doc", metavar="MD", help="write the result into this markdown file's section")
    p.add_argument("--json", metavar="FILE", help="write the result as a splash-bench JSON (kind 'load')")
    load_abuse.add_arguments(p)


def run(args) -> int:
    if bool(args.url) == bool(args.launch):
        print("error: give exactly one of --url or --launch", file=sys.stderr)
        return 2
    command = R.command_line(getattr(args, "argv", None), getattr(args, "prog", "splash-bench"))
    proc, err = None, None
    args.load_before = os.getloadavg()[0]
    if args.launch:
        err = Path(tempfile.mkdtemp(prefix="splash-load-")) / "server.err"
        flags = ["--admin-token", args.admin_token] if args.admin_token else []
        try:
            proc, url = launch(args.np, args.config, flags, args.server_args, err, timeout_s=120,
                               api_key=args.api_key)
        except RuntimeError as e:
            sys.exit(f"error: {e}")
    else:
        url = args.url.rstrip("/")
    check_loopback(url)
    server_rc = None
    try:
        res = asyncio.run(run_load(args, url))
    finally:
        if proc is not None:
            server_rc = stop(proc)
    body = report(args, res, command, server_rc)
    print(body)
    if args.update_doc:
        update_doc(Path(args.update_doc), body,
                   load_abuse.SECTION_ABUSE if load_abuse.enabled(args) else SECTION)
    if args.json:
        write_result(args, res)
    s = res["stats"]
    ok = s.failed == s.lost == s.mismatched == 0 and server_rc in (None, 0)
    return 0 if ok and load_abuse.clean(args, res["abuse"]) else 1


def write_result(args, res: dict) -> None:
    """The run as a splash-bench result: one entry of "runs", in the shape the workload command writes."""
    s: Stats = res["stats"]
    mode = f"switch-every-{args.switch_every}" if args.switch_every else res["before"]["layout"]
    env = R.environment(backend="cpu", ranks=args.np if args.launch else None,
                        model={"name": res["model"], "config": args.config})
    config = {k: getattr(args, k) for k in (
        "clients", "requests_per_client", "max_tokens", "prompts", "switch_every", "layouts", "seed")}
    run = {"mode": mode, "output_tokens_per_s": s.tokens / res["wall"], "total_s": res["wall"],
           "completed": s.ok, "failed": s.failed, "lost": s.lost, "mismatched": s.mismatched,
           "switches": res["after"]["switch_count"] - res["before"]["switch_count"],
           "latency_p50_s": pct(s.latencies, 50), "latency_p99_s": pct(s.latencies, 99),
           "ttft_p50_s": pct(s.ttfts, 50), "load_average_before": res["load"]}
    R.write_runs(args.json, "load", env, config, getattr(args, "argv", None), [run])
