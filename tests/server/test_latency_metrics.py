"""The request latency histograms of GET /metrics (vLLM's TTFT, end-to-end latency and time per output token): one
observation per sequence, at its first token and at its end, in process on one rank."""
from __future__ import annotations

import re

import pytest

from server_util import in_process


def _value(text: str, name: str) -> float:
    m = re.search(rf"^{name} (\S+)$", text, re.M)
    assert m, name
    return float(m.group(1))


def test_each_sequence_is_observed_once_at_its_first_token_and_at_its_end(engine):
    async def checks(c, _):
        for body in ({"prompt": [1, 2, 3], "max_tokens": 5, "n": 2, "temperature": 0, "ignore_eos": True},
                     {"prompt": [4, 5], "max_tokens": 1, "temperature": 0, "ignore_eos": True},
                     {"prompt": [4, 5], "max_tokens": 0}):   # refused: no sequence reaches the engine
            await c.post("/v1/completions", json=body)
        return (await c.get("/metrics")).text

    text = in_process(engine, checks)
    count = {n: _value(text, f"splash_{n}_count") for n in
             ("time_to_first_token_seconds", "e2e_request_latency_seconds", "time_per_output_token_seconds")}
    # three sequences (n = 2, and one of one token); only the two of 5 tokens have gaps between tokens
    assert count == {"time_to_first_token_seconds": 3, "e2e_request_latency_seconds": 3,
                     "time_per_output_token_seconds": 2}, count
    ttft, e2e = (_value(text, f"splash_{n}_sum") for n in ("time_to_first_token_seconds",
                                                          "e2e_request_latency_seconds"))
    assert 0 < ttft <= e2e
    assert 'splash_e2e_request_latency_seconds_bucket{le="+Inf"} 3.0' in text
