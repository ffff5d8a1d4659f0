#!/usr/bin/env python
"""Bounded loopback load test of splash-serve: many concurrent streaming clients, optional forced switches.

  # start 4 ranks itself, 64 streaming clients x 4 requests, pin the next layout every 8 engine steps:
  python scripts/load_test.py --launch --np 4 --clients 64 --requests-per-client 4 --switch-every 8

  # against a server that is already running (loopback only):
  python scripts/load_test.py --url http://127.0.0.1:8000 --admin-token TOKEN --clients 64

Every request streams (SSE) greedy tokens with ``ignore_eos`` and ``return_token_ids``; it counts as *failed*
if the HTTP call errors or the stream has no ``[DONE]``, as *lost* if it delivered fewer tokens than
``max_tokens``, and as a *mismatch* if its tokens differ from the same prompt's tokens in an unswitched
reference pass run first. Exit status 0 only when all three counts are 0. ``--update-doc`` writes the result
into docs/benchmarks.md under "## Server load test (issue 5)".

Abuse (issue 14), next to the well-behaved clients:

  # 16 clients that abandon long non-streaming requests after 0.5 s, 4 that send 9 MiB bodies, and a probe
  python scripts/load_test.py --launch --np 2 --clients 16 --abandon 16 --oversized 4 --probe-every 0.25

``--abandon N``: N clients loop sending non-streaming requests of ``--abandon-tokens`` tokens and hang up after
``--abandon-after`` s (the server must cancel them). ``--oversized N``: N clients loop sending bodies of
``--oversized-bytes`` (the server must answer 413 without reading them). ``--probe-every S``: a short request
(4 tokens, non-streaming) every S seconds; its latency p50/p99 is the cost of the abuse. After the load, the
KV in use must return to 0 (read from /metrics) within ``--drain-wait`` s; that is checked and reported, and
the result goes under "## Server load test under abuse (issue 14)".
"""
from __future__ import annotations

import argparse
import asyncio
import ipaddress
import json
import os
import random
import re
import shlex
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlparse

import httpx

REPO = Path(__file__).resolve().parents[1]
SECTION = "## Server load test (issue 5)"
SECTION_ABUSE = "## Server load test under abuse (issue 14)"
LAYOUTS = ("tp", "dp_attn", "cp", "dop")


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


async def stream_one(client: httpx.AsyncClient, prompt: list[int], max_tokens: int) -> tuple[list[int], float, bool]:
    """(token ids, time to first token, saw [DONE]) of one streaming completion."""
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True, "ignore_eos": True,
            "return_token_ids": True}
    ids: list[int] = []
    t0, ttft, done = time.perf_counter(), 0.0, False
    async with client.stream("POST", "/v1/completions", json=body) as r:
        if r.status_code != 200:
            raise RuntimeError(f"HTTP {r.status_code}: {(await r.aread())[:200]!r}")
        async for line in r.aiter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                done = True
                break
            msg = json.loads(line[6:])
            if "error" in msg:
                raise RuntimeError(msg["error"]["message"])
            for ch in msg["choices"]:
                if ch.get("token_ids") and not ids:
                    ttft = time.perf_counter() - t0
                ids += ch.get("token_ids") or []
    return ids, ttft, done


async def client_task(client, prompts, ref, max_tokens, n_requests, rng, stats: Stats) -> None:
    for _ in range(n_requests):
        i = rng.randrange(len(prompts))
        t0 = time.perf_counter()
        try:
            ids, ttft, done = await stream_one(client, prompts[i], max_tokens)
        except Exception as e:  # noqa: BLE001 — counted and reported
            stats.failed += 1
            stats.errors.append(f"{type(e).__name__}: {e}")
            continue
        stats.latencies.append(time.perf_counter() - t0)
        stats.ttfts.append(ttft)
        stats.tokens += len(ids)
        if not done:
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
    headers = {"Authorization": f"Bearer {token}"} if token else {}
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
        if r.status_code == 501:
            log["note"] = "switching not implemented by this engine build: ran without switches"
            return
        if r.status_code != 200:
            log["switch_errors"] = log.get("switch_errors", 0) + 1
            log["last_error"] = r.text[:200]
        else:
            log["requested"] = log.get("requested", 0) + 1
        last, k = state["steps"], k + 1


@dataclass
class Abuse:
    abandoned: int = 0
    oversized: int = 0
    oversized_status: dict = field(default_factory=dict)
    unexpected: list[str] = field(default_factory=list)
    probe: list[float] = field(default_factory=list)
    probe_failed: int = 0
    drained_s: float | None = None


async def abandoner(url: str, args, stop: asyncio.Event, ab: Abuse) -> None:
    body = {"prompt": [7, 8, 9], "max_tokens": args.abandon_tokens, "ignore_eos": True}
    while not stop.is_set():
        async with httpx.AsyncClient(base_url=url, timeout=args.abandon_after) as c:   # closing it hangs up
            try:
                r = await c.post("/v1/completions", json=body)
                ab.unexpected.append(f"abandoned request answered {r.status_code}")
            except httpx.TimeoutException:
                ab.abandoned += 1
            except httpx.HTTPError as e:
                ab.unexpected.append(f"abandoner: {type(e).__name__}: {e}")


async def oversizer(url: str, args, stop: asyncio.Event, ab: Abuse) -> None:
    blob = b'{"prompt": "' + b"x" * args.oversized_bytes + b'"}'
    async with httpx.AsyncClient(base_url=url, timeout=30) as c:
        while not stop.is_set():
            try:
                r = await c.post("/v1/completions", content=blob, headers={"content-type": "application/json"})
                key = str(r.status_code)
            except httpx.HTTPError as e:   # the server may close while the client still writes the body
                key = type(e).__name__
            ab.oversized += 1
            ab.oversized_status[key] = ab.oversized_status.get(key, 0) + 1
            if key not in ("413", "WriteError", "RemoteProtocolError", "ReadError"):
                ab.unexpected.append(f"oversized body answered {key}")
            await asyncio.sleep(0.05)


async def prober(client, every: float, stop: asyncio.Event, ab: Abuse) -> None:
    body = {"prompt": [1, 2, 3, 4], "max_tokens": 4, "temperature": 0}
    while not stop.is_set():
        t0 = time.perf_counter()
        try:
            r = await client.post("/v1/completions", json=body)
            if r.status_code == 200:
                ab.probe.append(time.perf_counter() - t0)
            else:
                ab.probe_failed += 1
        except httpx.HTTPError:
            ab.probe_failed += 1
        await asyncio.sleep(every)


async def metric(client, name: str) -> float:
    for line in (await client.get("/metrics")).text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[-1])
    raise KeyError(name)


async def wait_drained(client, limit_s: float) -> float | None:
    """Seconds until no request runs or waits and no KV is in use (None if not within limit_s)."""
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < limit_s:
        busy = sum([await metric(client, n) for n in ("splash_requests_running", "splash_requests_waiting",
                                                     "splash_kv_used_tokens")])
        if busy == 0:
            return time.perf_counter() - t0
        await asyncio.sleep(0.2)
    return None


def make_prompts(n: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(rng.randrange(8, 129))] for _ in range(n)]


async def reference_pass(client, prompts, max_tokens) -> list[list[int]]:
    out = await asyncio.gather(*(stream_one(client, p, max_tokens) for p in prompts))
    return [ids for ids, _, _ in out]


async def run_load(args, url: str) -> dict:
    limits = httpx.Limits(max_connections=args.clients + 16, max_keepalive_connections=args.clients + 16)
    timeout = httpx.Timeout(args.request_timeout, connect=30)
    async with httpx.AsyncClient(base_url=url, limits=limits, timeout=timeout) as client:
        models = (await client.get("/v1/models")).json()["data"][0]
        prompts = make_prompts(args.prompts, args.vocab, args.seed)
        ref = await reference_pass(client, prompts, args.max_tokens) if args.prompts else None
        before = (await client.get("/v1/layout")).json()
        stats, log, stop = Stats(), {}, asyncio.Event()
        sw = None
        if args.switch_every:
            sw = asyncio.create_task(switcher(client, args.switch_every, args.layouts.split(","), args.admin_token,
                                              stop, log))
        ab, abuse_stop = Abuse(), asyncio.Event()
        abusers = [asyncio.create_task(abandoner(url, args, abuse_stop, ab)) for _ in range(args.abandon)]
        abusers += [asyncio.create_task(oversizer(url, args, abuse_stop, ab)) for _ in range(args.oversized)]
        if args.probe_every:
            abusers.append(asyncio.create_task(prober(client, args.probe_every, abuse_stop, ab)))
        t0 = time.perf_counter()
        tasks = [client_task(client, prompts, ref, args.max_tokens, args.requests_per_client,
                             random.Random(args.seed + c), stats) for c in range(args.clients)]
        await asyncio.wait_for(asyncio.gather(*tasks), args.max_duration)
        wall = time.perf_counter() - t0
        stop.set()
        abuse_stop.set()
        await asyncio.gather(*abusers)
        if sw is not None:
            await sw
        ab.drained_s = await wait_drained(client, args.drain_wait)
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


def launch(args) -> tuple[subprocess.Popen, str, Path]:
    work = Path(tempfile.mkdtemp(prefix="splash-load-"))
    err = work / "server.err"
    mpiexec = os.path.join(os.path.dirname(sys.executable), "mpiexec")
    cmd = [mpiexec, "-n", str(args.np), sys.executable, "-m", "splash.cli.serve", "--config", args.config,
           "--port", "0", "--quiet", "--host", "127.0.0.1", *shlex.split(args.server_args)]
    if args.admin_token:
        cmd += ["--admin-token", args.admin_token]
    env = {**os.environ}
    env["PYTHONPATH"] = os.pathsep.join(x for x in (str(REPO), env.get("PYTHONPATH", "")) if x)
    env.setdefault("OMP_NUM_THREADS", "1")
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=open(err, "w"),
                            start_new_session=True)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            sys.exit(f"error: the server exited with {proc.returncode}:\n{err.read_text()}")
        m = re.search(r"serving \S+ on (http://\S+) ", err.read_text())
        if m:
            try:
                if httpx.get(f"{m.group(1)}/health", timeout=2).status_code == 200:
                    return proc, m.group(1), err
            except httpx.HTTPError:
                pass
        time.sleep(0.2)
    os.killpg(proc.pid, signal.SIGKILL)
    sys.exit("error: the server did not become ready in 120 s")


def pct(xs: list[float], q: float) -> float:
    return statistics.quantiles(xs, n=100)[q - 1] if len(xs) > 1 else (xs[0] if xs else 0.0)


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
        f"{sw_after - sw_before} (layout {res['before']['layout']} -> {res['after']['layout']})"
        + (f"; {res['log']['note']}" if "note" in res["log"] else ""),
        f"- result: {s.ok} ok, **{s.failed} failed, {s.lost} lost**, {s.mismatched} token mismatches vs the "
        f"unswitched reference pass",
        f"- throughput: {s.tokens} tokens in {res['wall']:.1f} s = **{s.tokens / res['wall']:.1f} tokens/s**; "
        f"request latency p50 {pct(s.latencies, 50):.2f} s / p99 {pct(s.latencies, 99):.2f} s; "
        f"TTFT p50 {pct(s.ttfts, 50):.2f} s",
    ]
    ab: Abuse = res["abuse"]
    if args.abandon or args.oversized or args.probe_every:
        lines += [
            f"- abuse alongside: {args.abandon} clients abandoning non-streaming {args.abandon_tokens}-token "
            f"requests after {args.abandon_after} s ({ab.abandoned} abandoned), {args.oversized} clients sending "
            f"{args.oversized_bytes / 2**20:.1f} MiB bodies ({ab.oversized} sent, outcomes {ab.oversized_status}); "
            f"unexpected answers: {len(ab.unexpected)}" + (f" {ab.unexpected[:3]}" if ab.unexpected else ""),
            f"- short probe (4 tokens, non-streaming, every {args.probe_every} s) during the load: "
            f"{len(ab.probe)} ok, {ab.probe_failed} failed, latency p50 {pct(ab.probe, 50):.2f} s / "
            f"**p99 {pct(ab.probe, 99):.2f} s**",
            "- after the load: " + (f"no request running or waiting and **KV in use 0** after {ab.drained_s:.1f} s"
                                    if ab.drained_s is not None else
                                    f"**KV or requests still in use after {args.drain_wait} s**"),
        ]
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


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", help="a running server (loopback only)")
    p.add_argument("--launch", action="store_true", help="start the server itself under mpiexec")
    p.add_argument("--np", type=int, default=4, help="ranks to launch (with --launch)")
    p.add_argument("--config", default="configs/cpu.yaml", help="server config (with --launch)")
    p.add_argument("--server-args", default="", help="extra splash-serve flags (with --launch)")
    p.add_argument("--admin-token", default="load-test-token", help="bearer token for POST /v1/layout")
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
    p.add_argument("--abandon", type=int, default=0, help="clients abandoning non-streaming requests")
    p.add_argument("--abandon-tokens", type=int, default=3000)
    p.add_argument("--abandon-after", type=float, default=0.5, help="seconds before an abandoner hangs up")
    p.add_argument("--oversized", type=int, default=0, help="clients sending bodies over the server's limit")
    p.add_argument("--oversized-bytes", type=int, default=9 << 20)
    p.add_argument("--probe-every", type=float, default=0.0, help="seconds between short probe requests")
    p.add_argument("--drain-wait", type=float, default=60.0, help="seconds the KV may take to return to 0")
    args = p.parse_args(argv)
    if bool(args.url) == bool(args.launch):
        p.error("give exactly one of --url or --launch")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    command = "python scripts/load_test.py " + " ".join(shlex.quote(a) for a in (argv or sys.argv[1:]))
    proc, err = None, None
    args.load_before = os.getloadavg()[0]
    if args.launch:
        proc, url, err = launch(args)
    else:
        url = args.url.rstrip("/")
    check_loopback(url)
    server_rc = None
    try:
        res = asyncio.run(run_load(args, url))
    finally:
        if proc is not None:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                server_rc = proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
    body = report(args, res, command, server_rc)
    print(body)
    abused = bool(args.abandon or args.oversized or args.probe_every)
    if args.update_doc:
        update_doc(Path(args.update_doc), body, SECTION_ABUSE if abused else SECTION)
    s, ab = res["stats"], res["abuse"]
    clean = not abused or (ab.drained_s is not None and not ab.unexpected and ab.probe_failed == 0)
    return 0 if s.failed == s.lost == s.mismatched == 0 and server_rc in (None, 0) and clean else 1


if __name__ == "__main__":
    sys.exit(main())
