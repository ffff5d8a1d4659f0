"""Seeded workloads for `splash-sim --trace` (names usable in place of a workload file). Pure, no torch.

- ``rl-rollout``: an RL rollout as the paper describes it (§1): a group of generations launched together, most of
  them short, a few long traces holding the group until they finish — 128 requests of 1,000 prompt tokens at
  t = 0; 90% generate 500-4,000 tokens, 10% generate 16,000-32,000.
- ``agentic``: 16 sessions of 4 turns each; turn k of a session arrives at 20·k s (+ up to 5 s) with a prompt of
  16,000 + 24,000·k tokens (the growing conversation, ±2,000) and generates 300-1,500 tokens.
"""
from __future__ import annotations

import random

from splash.sim.trace import Req

def rl_rollout(seed: int, n: int = 128) -> list[Req]:
    rng = random.Random(seed)
    out = []
    for i in range(n):
        long = rng.random() < 0.10
        out.append(Req(f"r{i}", 0.0, 1000, rng.randint(16_000, 32_000) if long else rng.randint(500, 4000)))
    return out


def agentic(seed: int, sessions: int = 16, turns: int = 4) -> list[Req]:
    rng = random.Random(seed)
    out = []
    for s in range(sessions):
        for k in range(turns):
            out.append(Req(f"s{s}t{k}", 20.0 * k + rng.uniform(0, 5), 16_000 + 24_000 * k + rng.randint(-2000, 2000),
                           rng.randint(300, 1500)))
    out.sort(key=lambda r: (r.arrive, r.rid))
    return out


def builtin(name: str, seed: int) -> list[Req]:
    if name not in BUILTIN:
        raise ValueError(f"unknown workload {name!r} (built in: {', '.join(BUILTIN)}; or a workload file)")
    return BUILTIN[name](seed)


BUILTIN = {"rl-rollout": rl_rollout, "agentic": agentic}
