"""Rank 0's ledger counts blocks per rank in closed form (no per-step work proportional to context): equal to
walking every block through the ownership model, for every layout, world size, anchor and block range; and the
scheduler slices a request's tokens without rebuilding its whole history."""
from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from splash.engine.ledger import KVLedger
from splash.engine.scheduler import Request


@settings(max_examples=300, deadline=None)
@given(st.sampled_from(["tp", "dp_attn", "cp", "dop"]), st.integers(1, 8), st.data())
def test_need_closed_form_matches_walk(layout, world, data):
    led = KVLedger(world, 10, 4, layout)
    owner = data.draw(st.integers(0, world - 1))
    b0 = data.draw(st.integers(0, 50))
    b1 = data.draw(st.integers(b0 - 3, b0 + 60))
    walk = [0] * world
    for b in range(b0, b1):
        for r in led.holders(b, owner):
            walk[r] += 1
    assert led._need(owner, b0, b1) == walk


def test_token_slice():
    req = Request("a", [1, 2, 3], 10, output=[4, 5])
    for a in range(6):
        for b in range(a, 6):
            assert req.token_slice(a, b) == tuple(req.tokens[a:b])
    assert req.num_tokens == 5
