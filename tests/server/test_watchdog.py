"""The heartbeat watchdog over loopback, in one process: it fires on a dead or silent peer, never on a slow one."""
from __future__ import annotations

import time

from splash.server.watchdog import Watchdog


def _group(n_followers: int, timeout: float = 0.4):
    fired: list[str] = []
    hub = Watchdog(0, timeout, abort=fired.append, interval_s=0.05)
    addr = hub.serve(tuple(range(1, n_followers + 1)))
    followers = []
    for r in range(1, n_followers + 1):
        f = Watchdog(r, timeout, abort=fired.append, interval_s=0.05)
        f.connect(addr)
        followers.append(f)
    assert _wait(lambda: len(hub._peers) == n_followers, 5.0)   # every link identified
    return hub, followers, fired


def _wait(pred, timeout: float) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if pred():
            return True
        time.sleep(0.02)
    return pred()


def test_live_peers_never_fire_and_goodbye_is_clean():
    hub, followers, fired = _group(2)
    time.sleep(1.2)          # three timeouts of healthy beating (a slow step changes nothing here)
    assert fired == []
    hub.stop()               # rank 0 says goodbye first, as at shutdown
    for f in followers:
        f.stop()
    time.sleep(0.6)
    assert fired == []


def test_silent_follower_is_named_within_the_timeout():
    hub, (f1, f2), fired = _group(2)
    time.sleep(0.2)
    f2._stop.set()           # its thread stops beating, the link stays open: what SIGSTOP looks like
    t0 = time.monotonic()
    assert _wait(lambda: fired, 3.0)
    assert time.monotonic() - t0 < 0.4 + 1.0
    assert "rank 0: rank 2 has not sent a heartbeat" in fired[0] and "collective_timeout_s" in fired[0]
    for w in (hub, f1):
        w.stop()


def test_dead_follower_is_named_at_once():
    hub, (f1,), fired = _group(1, timeout=5.0)
    f1._stop.set()
    f1._thread.join(2)
    f1._peers[0].close()     # the process died: the link closes without a goodbye
    assert _wait(lambda: fired, 2.0)
    assert "rank 1 died" in fired[0]
    hub.stop()


def test_follower_notices_a_silent_rank_0():
    hub, (f1,), fired = _group(1)
    hub._stop.set()          # rank 0's heartbeat thread stops (rank 0 stopped or hung)
    assert _wait(lambda: fired, 3.0)
    assert fired[0].startswith("splash-serve: rank 1: rank 0 has not sent a heartbeat")
    f1.stop()


def test_follower_that_never_connects_is_named():
    fired: list[str] = []
    hub = Watchdog(0, 0.3, abort=fired.append, interval_s=0.05)
    hub.serve((1,))
    assert _wait(lambda: fired, 3.0) and "rank 1 has not connected" in fired[0]
    hub.stop()
