"""A splash-serve job under mpiexec for a benchmark: start it on a free loopback port, wait until it answers
/health, stream greedy completions from it, read its /metrics, stop it (the whole process group: every rank)."""
from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def launch(np_: int, config: str | None, flags: list[str], server_args: str, log_path: Path,
           timeout_s: float = 180, api_key: str | None = None) -> tuple[subprocess.Popen, str]:
    """(process, base url) of `splash-serve [--config config] *flags *server_args` on `np_` ranks (the mpiexec next
    to this Python, else on PATH); its stderr goes to `log_path`; with `api_key` it requires that key. RuntimeError
    (with the log's tail) when it exits or is not ready within `timeout_s`."""
    import httpx
    mpiexec = shutil.which("mpiexec", path=os.path.dirname(sys.executable)) or shutil.which("mpiexec") or "mpiexec"
    cmd = [mpiexec, "-n", str(np_), sys.executable, "-m", "splash.cli.serve", *(["--config", config] if config else []),
           "--port", "0", "--host", "127.0.0.1", "--quiet", *flags, *shlex.split(server_args)]
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    env.pop("SPLASH_API_KEY", None)   # the caller's key, not one this shell happens to export
    if api_key:
        env["SPLASH_API_KEY"] = api_key
    env["PYTHONPATH"] = os.pathsep.join(x for x in (str(REPO), env.get("PYTHONPATH", "")) if x)
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=open(log_path, "w"),
                            start_new_session=True)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with {proc.returncode}:\n{log_path.read_text()[-2000:]}")
        m = re.search(r"serving \S+ on (http://\S+) ", log_path.read_text())
        if m:
            try:
                if httpx.get(f"{m.group(1)}/health", timeout=2).status_code == 200:
                    return proc, m.group(1)
            except httpx.HTTPError:
                pass
        time.sleep(0.2)
    os.killpg(proc.pid, signal.SIGKILL)
    raise RuntimeError(f"the server did not become ready in {timeout_s:g} s")


def stop(proc: subprocess.Popen) -> int | None:
    """SIGTERM every rank; their exit status (None: killed after 60 s)."""
    os.killpg(proc.pid, signal.SIGTERM)
    try:
        return proc.wait(60)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        return None


async def stream_completion(client, prompt: list[int], max_tokens: int, on_tokens: Callable[[list[int]], None]) -> bool:
    """POST a greedy streaming /v1/completions (ignore_eos, token ids returned) on an httpx.AsyncClient; each event's
    new token ids go to `on_tokens` as they arrive. -> whether the stream ended with [DONE]. RuntimeError on an HTTP
    error or an error event."""
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True, "ignore_eos": True,
            "return_token_ids": True}
    async with client.stream("POST", "/v1/completions", json=body) as r:
        if r.status_code != 200:
            raise RuntimeError(f"HTTP {r.status_code}: {(await r.aread())[:200]!r}")
        async for line in r.aiter_lines():
            if line == "data: [DONE]":
                return True
            if not line.startswith("data: "):
                continue
            msg = json.loads(line[6:])
            if "error" in msg:
                raise RuntimeError(msg["error"]["message"])
            for ch in msg["choices"]:
                on_tokens(ch.get("token_ids") or [])
    return False


@dataclass
class Outcome:
    """One streamed request or conversation, as `load` and `workload` count it."""
    ids: list[int] = field(default_factory=list)
    ok: bool = False
    latency: float = 0.0
    ttft: float = 0.0
    arrivals: list[float] = field(default_factory=list)   # seconds since the run's start, one per token
    end_s: float = 0.0                                      # completion, seconds since the run's start
    error: str | None = None
    turn_ttfts: list[float] = field(default_factory=list)  # one per turn of a conversation


async def stream_turn(client, t_start: float, prompt: list[int], max_tokens: int, out: Outcome) -> list[int]:
    """Stream one completion into `out` (its tokens, their arrival since `t_start`, TTFT; `ok`: it ended with
    [DONE]; `error`: what went wrong); -> its token ids."""
    t0, ids = time.perf_counter(), []

    def got(new: list[int]) -> None:
        now = time.perf_counter()
        if new and not ids:
            out.turn_ttfts.append(now - t0)
            out.ttft = out.ttft or now - t0
        ids.extend(new)
        out.arrivals += [now - t_start] * len(new)

    out.ok = False
    try:
        out.ok = await stream_completion(client, prompt, max_tokens, got)
    except Exception as e:  # noqa: BLE001 — the caller counts and reports it
        out.error = f"{type(e).__name__}: {e}"
    out.ids += ids
    return ids


async def read_metrics(client) -> dict[str, float]:
    """The server's unlabelled /metrics samples by name, on an httpx.AsyncClient."""
    from prometheus_client.parser import text_string_to_metric_families
    text = (await client.get("/metrics")).text
    return {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples if not s.labels}
