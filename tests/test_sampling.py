"""Sampling through the engine: seeded reproducibility independent of batch composition, top-p, stop tokens,
finish reasons, and SamplingParams validation."""
from __future__ import annotations

import math

import pytest
import torch
from hf_models import random_prompts

from splash.engine.llm import LLM
from splash.engine.sampler import Sampler
from splash.engine.sampling import SamplingParams


@pytest.fixture(scope="module")
def llm():
    from splash.distributed.communicator import SingleRankCommunicator

    return LLM(preset="tiny-mla", block_size=4, max_num_batched_tokens=32, comm=SingleRankCommunicator())


PROMPTS = random_prompts([5, 23, 11, 40], seed=11)


def _toks(outs):
    return [o.token_ids for o in outs]


def test_seeded_sampling_is_reproducible_regardless_of_batch(llm):
    sp = SamplingParams(max_tokens=24, temperature=1.0, seed=1234, ignore_eos=True)
    alone = llm.generate([PROMPTS[1]], sp)[0].token_ids
    assert len(alone) == 24
    assert llm.generate([PROMPTS[1]], sp)[0].token_ids == alone
    # same request at another position, next to greedy and differently seeded requests, in a busier batch
    mixed = [SamplingParams(max_tokens=30, temperature=0, ignore_eos=True),
             SamplingParams(max_tokens=10, temperature=0.7, seed=5, ignore_eos=True), sp,
             SamplingParams(max_tokens=24, temperature=1.0, seed=99, top_p=0.9, ignore_eos=True)]
    outs = llm.generate([PROMPTS[0], PROMPTS[2], PROMPTS[1], PROMPTS[3]], mixed)
    assert outs[2].token_ids == alone
    # and through a tiny step budget (chunked prefill, different step mix)
    from splash.distributed.communicator import SingleRankCommunicator
    small = LLM(preset="tiny-mla", block_size=4, max_num_batched_tokens=5, max_num_seqs=2,
                comm=SingleRankCommunicator())
    assert small.generate([PROMPTS[3], PROMPTS[1]], [mixed[3], sp])[1].token_ids == alone
    # a different seed gives a different continuation (24 tokens at temperature 1: collision is ~impossible)
    other = llm.generate([PROMPTS[1]], SamplingParams(max_tokens=24, temperature=1.0, seed=4321, ignore_eos=True))
    assert other[0].token_ids != alone


def test_sampling_is_actually_random(llm):
    """Temperature 1 samples differ from greedy (a sampler that always took the argmax would fail here)."""
    greedy = _toks(llm.generate(PROMPTS, SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)))
    sampled = _toks(llm.generate(PROMPTS, SamplingParams(max_tokens=16, temperature=1.0, seed=3, ignore_eos=True)))
    assert sampled != greedy


def test_tiny_top_p_equals_greedy(llm):
    greedy = _toks(llm.generate(PROMPTS, SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)))
    for seed in (0, 1):
        nucleus = llm.generate(PROMPTS, SamplingParams(max_tokens=16, temperature=1.0, top_p=1e-6, seed=seed,
                                                       ignore_eos=True))
        assert _toks(nucleus) == greedy


def test_top_p_restricts_to_nucleus():
    logits = torch.tensor([2.0, 1.5, 0.0, -1.0, -3.0])
    probs = torch.softmax(logits, -1)  # 0.53, 0.32, 0.07, 0.03, 0.004
    sp = SamplingParams(temperature=1.0, top_p=0.8, seed=0)
    s = Sampler(len(logits))
    s.add("r", [], sp, ())   # seeded: one generator of its own across the 400 draws
    seen = {s.sample(logits[None], ["r"])[0][0] for _ in range(400)}
    assert seen == {0, 1}  # smallest set with mass >= 0.8 is the top two
    assert probs[:2].sum() >= 0.8 > probs[0]


def test_stop_token_and_length_finish_reasons(llm):
    prompt = PROMPTS[2]
    greedy = llm.generate([prompt], SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))[0]
    assert len(greedy.token_ids) == 12 and greedy.finish_reason == "length"
    stop = greedy.token_ids[4]
    first = greedy.token_ids.index(stop)
    outs = llm.generate([prompt, prompt, prompt], [
        SamplingParams(max_tokens=12, temperature=0, stop_token_ids=(stop,), ignore_eos=True),
        SamplingParams(max_tokens=12, temperature=0, stop_token_ids=[9999, stop], ignore_eos=True),
        SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)])
    for o in outs[:2]:
        assert o.token_ids == greedy.token_ids[:first + 1]  # the stop token is included, then the request ends
        assert o.finish_reason == "stop"
    assert outs[2].token_ids == greedy.token_ids[:3] and outs[2].finish_reason == "length"


def test_max_tokens_one(llm):
    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=1, temperature=0, ignore_eos=True))
    assert all(len(o.token_ids) == 1 and o.finish_reason == "length" for o in outs)


@pytest.mark.parametrize("kwargs,field", [
    (dict(max_tokens=0), "max_tokens"), (dict(max_tokens=-3), "max_tokens"), (dict(max_tokens=2.5), "max_tokens"),
    (dict(temperature=-0.1), "temperature"), (dict(temperature=math.nan), "temperature"),
    (dict(top_p=0.0), "top_p"), (dict(top_p=1.01), "top_p"), (dict(top_p=math.nan), "top_p"),
    (dict(n=0), "n"),
])
def test_invalid_sampling_params(kwargs, field):
    with pytest.raises(ValueError, match=rf"^{field}\b"):
        SamplingParams(**kwargs)


def test_valid_sampling_params_defaults():
    sp = SamplingParams(stop_token_ids=[3, 4])
    assert sp.stop_token_ids == (3, 4) and sp.max_tokens == 16 and not sp.greedy
    s = Sampler(8)
    s.add("g", [1], SamplingParams(temperature=0, seed=3), ())
    assert SamplingParams(temperature=0).greedy and s.states["g"].gen is None   # greedy draws no noise
