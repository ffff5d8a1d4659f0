"""The vectorised batch sampler against the plain-Python reference (tests/sampling_ref.py): every vLLM/OpenAI
sampling parameter, alone and mixed in one batch, over several steps of history; the race samples from the
processed distribution; seeded rows do not depend on their neighbours; logprobs are of that distribution."""
from __future__ import annotations

import math
import random

import pytest
import torch
from sampling_ref import NEG, log_softmax, ref_processed, softmax

from splash.engine.sampler import Sampler, prompt_logprobs
from splash.engine.sampling import SamplingParams

V = 40
STOP = (3, 7)
CASES = {
    "plain_greedy": dict(temperature=0),
    "rep_greedy": dict(temperature=0, repetition_penalty=1.7),
    "rep_below_one": dict(temperature=0, repetition_penalty=0.6),
    "freq_pres": dict(temperature=0, frequency_penalty=0.9, presence_penalty=-0.4),
    "bias": dict(temperature=0, logit_bias={5: 30.0, 6: -100.0, 11: 2.5}),
    "min_tokens": dict(temperature=0, min_tokens=3, logit_bias={3: 50.0}),
    "temp": dict(temperature=0.7, seed=1),
    "top_k": dict(temperature=1.3, top_k=5, seed=2),
    "top_p": dict(temperature=0.9, top_p=0.6, seed=3),
    "min_p": dict(temperature=1.0, min_p=0.2, seed=4),
    "all": dict(temperature=0.8, top_k=9, top_p=0.9, min_p=0.05, repetition_penalty=1.3, frequency_penalty=0.5,
                presence_penalty=0.3, logit_bias={2: 4.0}, min_tokens=2, seed=5),
    "unseeded": dict(temperature=1.0, top_k=3),
}


def _batch(names, rng):
    s = Sampler(V)
    prompts = {n: [rng.randrange(V) for _ in range(rng.randint(1, 12))] for n in names}
    for n in names:
        s.add(n, prompts[n], SamplingParams(max_tokens=50, **CASES[n]), STOP)
    return s, prompts


def _check_rows(x: torch.Tensor, logits: torch.Tensor, names, prompts, outputs) -> None:
    for i, n in enumerate(names):
        ref = ref_processed(logits[i].tolist(), SamplingParams(max_tokens=50, **CASES[n]), prompts[n], outputs[n],
                            STOP)
        got = x[i].tolist()
        for v, (a, b) in enumerate(zip(got, ref)):
            assert (a == NEG) == (b == NEG) and (a == NEG or math.isclose(a, b, rel_tol=1e-5, abs_tol=1e-5)), \
                (n, v, a, b)


@pytest.mark.parametrize("name", sorted(CASES))
def test_each_parameter_matches_reference(name):
    rng = random.Random(hash(name) % 1000)
    s, prompts = _batch([name], rng)
    outputs = {name: []}
    for _ in range(5):  # history grows: counts, min_tokens and repetition state are tracked
        logits = torch.randn(1, V, generator=torch.Generator().manual_seed(rng.randrange(1 << 30))) * 3
        _check_rows(s.processed(logits, [name]), logits, [name], prompts, outputs)
        outputs[name] += s.sample(logits, [name])[0]


def test_mixed_batch_rows_match_reference_alone():
    """All parameters in one batch, in a shuffled order, over 6 steps: each row equals its own reference."""
    rng = random.Random(7)
    names = sorted(CASES)
    s, prompts = _batch(names, rng)
    outputs = {n: [] for n in names}
    for step in range(6):
        rng.shuffle(names)
        logits = torch.randn(len(names), V, generator=torch.Generator().manual_seed(step)) * 3
        _check_rows(s.processed(logits, names), logits, names, prompts, outputs)
        toks, _ = s.sample(logits, names)
        for n, t in zip(names, toks):
            outputs[n].append(t)
    for n in ("min_tokens",):
        assert not set(outputs[n][:3]) & set(STOP) and outputs[n][3] == 3   # bias +50 wins once allowed


def test_greedy_rows_take_processed_argmax():
    rng = random.Random(3)
    names = [n for n in CASES if CASES[n]["temperature"] == 0]
    s, prompts = _batch(names, rng)
    logits = torch.randn(len(names), V) * 3
    want = s.processed(logits, names).argmax(-1).tolist()
    assert s.sample(logits, names)[0] == want


def test_race_samples_the_processed_distribution():
    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0, -3.0]])
    sp = SamplingParams(temperature=0.8, top_k=4, top_p=0.95, seed=0)
    probs = softmax(ref_processed(logits[0].tolist(), sp, [], []))
    s = Sampler(6)
    s.add("r", [], sp, ())
    n = 4000
    seen = [0] * 6
    for _ in range(n):
        seen[s.sample(logits, ["r"])[0][0]] += 1
    for v in range(6):
        tol = 4 * math.sqrt(probs[v] * (1 - probs[v]) / n) + 1e-9
        assert abs(seen[v] / n - probs[v]) <= tol, (v, seen, probs)
    assert seen[4] == seen[5] == 0    # cut by top_k


def test_seeded_rows_do_not_depend_on_the_batch():
    logits = torch.randn(3, V) * 2

    def run(names):
        s = Sampler(V)
        for n in names:
            s.add(n, [1, 2], SamplingParams(temperature=1.0, seed=42 if n == "a" else None, top_p=0.95), ())
        out = []
        for _ in range(20):
            rows = torch.stack([logits[0] if n == "a" else logits[1 + i % 2] for i, n in enumerate(names)])
            out.append(s.sample(rows, names)[0][names.index("a")])
        return out

    assert run(["a"]) == run(["x", "a", "y"])


def test_logprobs_are_of_the_sampled_distribution():
    logits = torch.randn(3, V) * 2
    s = Sampler(V)
    s.add("g", [], SamplingParams(temperature=0, logprobs=5), ())
    s.add("t", [], SamplingParams(temperature=0.5, logprobs=3, seed=1), ())
    s.add("k", [], SamplingParams(temperature=1.0, top_k=2, logprobs=4, seed=2), ())
    s.add("none", [], SamplingParams(temperature=0), ())
    toks, lps = s.sample(torch.cat([logits, logits[:1]]), ["g", "t", "k", "none"])
    assert lps[3] is None
    for i, (name, T) in enumerate([("g", 1.0), ("t", 0.5), ("k", 1.0)]):
        ref = log_softmax(ref_processed(logits[i].tolist(), s.states[name].params, [], []))
        lp = lps[i]
        assert lp.token == toks[i] and math.isclose(lp.logprob, ref[toks[i]], abs_tol=1e-5)
        order = sorted(range(V), key=lambda v: -ref[v])
        finite = [t for t, v in lp.top if v > -9999.0]   # the order among -inf entries is arbitrary
        assert finite == order[:len(finite)]
        assert lp.rank == 1 + sum(r > ref[toks[i]] for r in ref)
    assert len(lps[0].top) == 5 and lps[0].rank == 1
    assert [v for _, v in lps[2].top][2:] == [-9999.0, -9999.0]   # top_k=2: the rest are -inf, shown as -9999


def test_prompt_logprobs_function():
    logits = torch.randn(4, V)
    targets = [3, 9, 0, 39]
    got = prompt_logprobs(logits, targets, 2)
    for i, t in enumerate(targets):
        ref = log_softmax(logits[i].tolist())
        assert math.isclose(got[i].logprob, ref[t], abs_tol=1e-5) and got[i].token == t
        assert [x for x, _ in got[i].top] == sorted(range(V), key=lambda v: -ref[v])[:2]


@pytest.mark.parametrize("kwargs,field", [
    (dict(top_k=-2), "top_k"), (dict(min_p=1.5), "min_p"), (dict(repetition_penalty=0), "repetition_penalty"),
    (dict(presence_penalty=2.5), "presence_penalty"), (dict(frequency_penalty=-3), "frequency_penalty"),
    (dict(min_tokens=20, max_tokens=10), "min_tokens"), (dict(logprobs=21), "logprobs"),
    (dict(prompt_logprobs=-1), "prompt_logprobs"), (dict(logit_bias={1: 101}), "logit_bias"),
])
def test_invalid_new_params(kwargs, field):
    with pytest.raises(ValueError, match=rf"^{field}\b"):
        SamplingParams(**kwargs)


def test_logit_bias_outside_vocab_is_rejected():
    with pytest.raises(ValueError, match="outside the vocabulary"):
        Sampler(V).add("r", [], SamplingParams(logit_bias={V: 1.0}), ())
