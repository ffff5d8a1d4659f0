"""A plain-Python reference of vLLM's sampling semantics, one row at a time, looping over the vocabulary — what
the vectorised `splash.engine.sampler.Sampler` is checked against (tests/test_sampler.py, test_logprobs.py)."""
from __future__ import annotations

import math
from collections import Counter

NEG = float("-inf")


def softmax(x: list[float]) -> list[float]:
    m = max(x)
    e = [math.exp(v - m) if v != NEG else 0.0 for v in x]
    s = sum(e)
    return [v / s for v in e]


def log_softmax(x: list[float]) -> list[float]:
    m = max(x)
    lse = m + math.log(sum(math.exp(v - m) for v in x if v != NEG))
    return [v - lse if v != NEG else NEG for v in x]


def ref_processed(logits, p, prompt: list[int], output: list[int], stop_ids=()) -> list[float]:
    """The logits a row samples from, as vLLM documents the parameters (see splash.engine.sampler)."""
    x = [float(v) for v in logits]
    V = len(x)
    for t, b in p.logit_bias:
        x[t] += b
    if len(output) < p.min_tokens:
        for t in stop_ids:
            x[t] = NEG
    cnt, in_prompt = Counter(output), set(prompt)
    for v in range(V):
        if p.repetition_penalty != 1 and (v in in_prompt or cnt[v] > 0):
            x[v] = x[v] / p.repetition_penalty if x[v] > 0 else x[v] * p.repetition_penalty
        x[v] -= p.frequency_penalty * cnt[v] + p.presence_penalty * (cnt[v] > 0)
    if p.temperature == 0:
        return x
    x = [v / p.temperature for v in x]
    if p.min_p > 0:
        probs = softmax(x)
        top = max(probs)
        x = [v if pr >= p.min_p * top else NEG for v, pr in zip(x, probs)]
    order = sorted(range(V), key=lambda v: -x[v])
    if p.top_k > 0:
        for v in order[p.top_k:]:
            x[v] = NEG
    if p.top_p < 1:
        probs, mass = softmax(x), 0.0
        for v in order:
            if mass >= p.top_p:
                x[v] = NEG
            mass += probs[v]
    return x
