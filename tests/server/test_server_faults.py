"""Startup errors and faults of the real server under ``mpiexec -n 2``: nothing may hang.

* a bad YAML / a missing checkpoint / a busy port: every rank exits 2 quickly, the message printed once;
* SIGTERM to a follower alone: ignored (said once), the job keeps serving; a step slower than
  collective_timeout_s is not a fault (the watchdog measures heartbeats, not steps);
* a follower that stops answering (SIGSTOP): the watchdog aborts the whole job within collective_timeout_s
  and a few seconds, naming the rank;
* a follower killed (SIGKILL): every process is gone within 10 s.
(SIGTERM to mpiexec with streams running is the last check of test_server_abuse.py.)
"""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from server_util import REPO_ROOT, ServerProc, mpiexec_path, serve_cmd, server_env, write_config

pytestmark = pytest.mark.skipif(mpiexec_path() is None, reason="mpiexec not found")


def _run(*args: str, timeout: float = 60.0) -> subprocess.CompletedProcess:
    t0 = time.monotonic()
    proc = subprocess.run(serve_cmd(2, *args), cwd=REPO_ROOT, env=server_env(), capture_output=True, text=True,
                          timeout=timeout, start_new_session=True)
    proc.elapsed = time.monotonic() - t0
    return proc


def test_bad_yaml_exits_2_on_every_rank(tmp_path):
    cfg = write_config(tmp_path / "bad.yaml", "server:\n  port: 0\n  bogus_key: 1\n")
    p = _run("--config", str(cfg))
    assert p.returncode == 2, p.stderr
    assert p.stderr.count("error: ") == 1 and "bogus_key" in p.stderr and str(cfg) in p.stderr
    assert p.elapsed < 30


def test_missing_checkpoint_exits_2(tmp_path):
    p = _run("--model", str(tmp_path / "no-such-model"), "--port", "0")
    assert p.returncode == 2 and "error: " in p.stderr and "config.json" in p.stderr, p.stderr


def test_busy_port_exits_2(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(1)
        port = s.getsockname()[1]
        p = _run("--port", str(port), "--quiet")
    assert p.returncode == 2 and "cannot listen" in p.stderr, p.stderr


def _metrics(url: str) -> dict[str, float]:
    out = {}
    for line in httpx.get(f"{url}/metrics", timeout=10).text.splitlines():
        if line.startswith("splash_step_duration_seconds_") or line.startswith("splash_requests_running"):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


def test_follower_sigterm_is_ignored_and_a_slow_step_is_not_a_fault(tmp_path):
    cfg = write_config(tmp_path / "serve.yaml", "scheduler: {max_num_batched_tokens: 4096}\n"
                                                "server: {port: 0, quiet: true, collective_timeout_s: 1.0}\n")
    srv = ServerProc(2, "--config", str(cfg), workdir=tmp_path)
    try:
        url = srv.wait_ready(60)
        pids = srv.rank_pids()
        os.kill(pids[1], signal.SIGTERM)
        body = {"prompt": [5, 6, 7], "max_tokens": 8, "temperature": 0, "return_token_ids": True}
        want = httpx.post(f"{url}/v1/completions", json=body, timeout=30).json()["choices"][0]["token_ids"]
        # one step prefilling 2 x 1500 tokens: seconds on this CPU, several times collective_timeout_s
        long = [{"prompt": [(7 * i + j) % 250 for j in range(1500)], "max_tokens": 2} for i in range(2)]
        with ThreadPoolExecutor(2) as pool:
            rs = list(pool.map(lambda b: httpx.post(f"{url}/v1/completions", json=b, timeout=120), long))
        assert all(r.status_code == 200 for r in rs), [r.text for r in rs]
        m = _metrics(url)
        slow = m["splash_step_duration_seconds_count"] - m['splash_step_duration_seconds_bucket{le="1.0"}']
        if slow == 0:
            pytest.skip("no step took longer than collective_timeout_s on this machine")
        time.sleep(2.0)
        again = httpx.post(f"{url}/v1/completions", json=body, timeout=30)
        assert again.json()["choices"][0]["token_ids"] == want
        assert srv.proc.poll() is None and set(srv.rank_pids()) == {0, 1}
        assert "rank 1: ignoring SIGTERM" in srv.output() and "aborting" not in srv.output(), srv.output()
    finally:
        srv.kill()


def test_stopped_follower_trips_the_watchdog_naming_it(tmp_path):
    cfg = write_config(tmp_path / "serve.yaml", "server: {port: 0, quiet: true, collective_timeout_s: 2.0}\n")
    srv = ServerProc(2, "--config", str(cfg), workdir=tmp_path)
    try:
        url = srv.wait_ready(60)
        pids = srv.rank_pids()
        assert set(pids) == {0, 1}, pids
        t0 = time.monotonic()
        os.kill(pids[1], signal.SIGSTOP)          # rank 1 hangs: it will never join the next step
        with pytest.raises(httpx.HTTPError):
            httpx.post(f"{url}/v1/completions", json={"prompt": "hello", "max_tokens": 4}, timeout=20)
        rc = srv.proc.wait(30)
        elapsed = time.monotonic() - t0
        out = srv.output()
        assert rc != 0, out
        assert "rank 0: rank 1 has not sent a heartbeat" in out and "collective_timeout_s" in out, out
        assert elapsed < 2.0 + 8.0, elapsed
    finally:
        pids = srv.rank_pids()
        if 1 in pids:
            try:
                os.kill(pids[1], signal.SIGCONT)
            except ProcessLookupError:
                pass
        srv.kill()


def test_killed_follower_ends_every_process(tmp_path):
    cfg = write_config(tmp_path / "serve.yaml", "server: {port: 0, quiet: true, collective_timeout_s: 30.0}\n")
    srv = ServerProc(2, "--config", str(cfg), workdir=tmp_path)
    try:
        url = srv.wait_ready(60)
        stream = threading.Thread(target=lambda: _drain_stream(url), daemon=True)
        stream.start()
        time.sleep(1.0)
        pids = srv.rank_pids()
        t0 = time.monotonic()
        os.kill(pids[1], signal.SIGKILL)
        srv.proc.wait(10)
        while srv.descendants() and time.monotonic() - t0 < 10:
            time.sleep(0.1)
        assert not srv.descendants() and time.monotonic() - t0 < 10, srv.output()
        assert all(not os.path.exists(f"/proc/{p}") or _zombie(p) for p in pids.values())
    finally:
        srv.kill()


def _zombie(pid: int) -> bool:
    try:
        return open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


def _drain_stream(url: str) -> None:
    try:
        with httpx.stream("POST", f"{url}/v1/completions", timeout=30,
                          json={"prompt": [1, 2], "max_tokens": 3000, "ignore_eos": True, "stream": True}) as r:
            for _ in r.iter_lines():
                pass
    except httpx.HTTPError:
        pass
