"""Startup errors and faults of the real server under ``mpiexec -n 2``: nothing may hang.

* a bad YAML / a missing checkpoint / a busy port: every rank exits 2 quickly, the message printed once;
* a follower that stops answering mid-step (SIGSTOP): the watchdog aborts the whole job, naming the rank.
"""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import time

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


def test_stalled_rank_trips_the_watchdog(tmp_path):
    cfg = write_config(tmp_path / "serve.yaml", "server: {port: 0, quiet: true, collective_timeout_s: 2.0}\n")
    srv = ServerProc(2, "--config", str(cfg), workdir=tmp_path)
    try:
        url = srv.wait_ready(60)
        pids = srv.rank_pids()
        assert set(pids) == {0, 1}, pids
        os.kill(pids[1], signal.SIGSTOP)          # rank 1 hangs: it will never join the next step
        with pytest.raises(httpx.HTTPError):
            httpx.post(f"{url}/v1/completions", json={"prompt": "hello", "max_tokens": 4}, timeout=20)
        rc = srv.proc.wait(30)
        out = srv.output()
        assert rc != 0, out
        assert "rank 0" in out and "collective_timeout_s" in out, out
    finally:
        pids = srv.rank_pids()
        if 1 in pids:
            try:
                os.kill(pids[1], signal.SIGCONT)
            except ProcessLookupError:
                pass
        srv.kill()
