"""Abusive clients for `splash-bench load`, next to the well-behaved streaming clients: abandoners hang
up on long non-streaming requests (the server must cancel them), oversizers send bodies over its limit (it must
answer 413 without reading them), a prober's short-request latency is what the abuse costs; afterwards the KV in
use must return to 0 (flags: `splash-bench load --help`)."""
from __future__ import annotations

import argparse
import asyncio
import time
from dataclasses import dataclass, field

import httpx

from splash.bench.results import pct
from splash.bench.serve_proc import read_metrics

SECTION_ABUSE = "## Server load test under abuse (issue 14)"


@dataclass
class Abuse:
    abandoned: int = 0
    oversized: int = 0
    oversized_status: dict = field(default_factory=dict)
    unexpected: list[str] = field(default_factory=list)
    probe: list[float] = field(default_factory=list)
    probe_failed: int = 0
    drained_s: float | None = None


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--abandon", type=int, default=0, help="clients abandoning non-streaming requests")
    p.add_argument("--abandon-tokens", type=int, default=3000)
    p.add_argument("--abandon-after", type=float, default=0.5, help="seconds before an abandoner hangs up")
    p.add_argument("--oversized", type=int, default=0, help="clients sending bodies over the server's limit")
    p.add_argument("--oversized-bytes", type=int, default=9 << 20)
    p.add_argument("--probe-every", type=float, default=0.0, help="seconds between short probe requests")
    p.add_argument("--drain-wait", type=float, default=60.0, help="seconds the KV may take to return to 0 "
                                                                   "(checked when any abuse runs)")


def enabled(args) -> bool:
    return bool(args.abandon or args.oversized or args.probe_every)


async def abandoner(url: str, args, stop: asyncio.Event, ab: Abuse, auth: dict) -> None:
    body = {"prompt": [7, 8, 9], "max_tokens": args.abandon_tokens, "ignore_eos": True}
    while not stop.is_set():
        async with httpx.AsyncClient(base_url=url, timeout=args.abandon_after, headers=auth) as c:   # closing: hang up
            try:
                r = await c.post("/v1/completions", json=body)
                ab.unexpected.append(f"abandoned request answered {r.status_code}")
            except httpx.TimeoutException:
                ab.abandoned += 1
            except httpx.HTTPError as e:
                ab.unexpected.append(f"abandoner: {type(e).__name__}: {e}")


async def oversizer(url: str, args, stop: asyncio.Event, ab: Abuse, auth: dict) -> None:
    blob = b'{"prompt": "' + b"x" * args.oversized_bytes + b'"}'
    async with httpx.AsyncClient(base_url=url, timeout=30, headers=auth) as c:
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


def start(url: str, client, args, stop: asyncio.Event, ab: Abuse) -> list[asyncio.Task]:
    """The abusers' tasks (none when no abuse is asked for); they run until `stop` is set. They send the API key
    `client` sends, if any: an abuser is to be refused for what it does, not for a missing key."""
    auth = {k: v for k, v in client.headers.items() if k == "authorization"}
    tasks = [asyncio.create_task(abandoner(url, args, stop, ab, auth)) for _ in range(args.abandon)]
    tasks += [asyncio.create_task(oversizer(url, args, stop, ab, auth)) for _ in range(args.oversized)]
    if args.probe_every:
        tasks.append(asyncio.create_task(prober(client, args.probe_every, stop, ab)))
    return tasks


async def wait_drained(client, limit_s: float) -> float | None:
    """Seconds until no request runs or waits and no KV is in use (None if not within limit_s)."""
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < limit_s:
        m = await read_metrics(client)
        busy = sum(m[n] for n in ("splash_requests_running", "splash_requests_waiting", "splash_kv_used_tokens"))
        if busy == 0:
            return time.perf_counter() - t0
        await asyncio.sleep(0.2)
    return None


def report_lines(args, ab: Abuse) -> list[str]:
    return [
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


def clean(args, ab: Abuse) -> bool:
    """No abuse asked for, or the server drained, answered every abuser as expected and every probe."""
    return not enabled(args) or (ab.drained_s is not None and not ab.unexpected and ab.probe_failed == 0)
