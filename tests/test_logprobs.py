"""Sampling parameters, logprobs and prompt logprobs through the engine, against transformers on the same weights:
every generated token is the one the reference sampler picks from HF's logits at that position; logprobs equal HF's
log-softmax (of the processed distribution) within 1e-4; prompt logprobs equal HF's on the prompt — under chunked
prefill, mixed batches and requests that do not ask for them."""
from __future__ import annotations

import math

import pytest
import torch
from hf_models import hf_logits, random_prompts
from sampling_ref import NEG, log_softmax, ref_processed

from splash.engine.llm import LLM
from splash.engine.sampling import SamplingParams

TOL = 1e-4
PROMPTS = random_prompts([9, 21, 4, 33], seed=5)
EOS = 257
MIXED = [
    SamplingParams(max_tokens=10, temperature=0, repetition_penalty=1.5, logprobs=3, prompt_logprobs=2),
    SamplingParams(max_tokens=12, temperature=0, frequency_penalty=1.2, presence_penalty=0.6, min_tokens=5,
                   logit_bias={EOS: 8.0, 65: 1.5}, logprobs=0),
    SamplingParams(max_tokens=8, temperature=0.9, top_k=6, top_p=0.9, min_p=0.02, seed=11, logprobs=2,
                   ignore_eos=True),
    SamplingParams(max_tokens=9, temperature=0, ignore_eos=True, prompt_logprobs=0),
]


@pytest.fixture(scope="module")
def ckpt(tiny_ckpt):
    return tiny_ckpt("dense")


@pytest.fixture(scope="module")
def hf(hf_ref):
    return hf_ref("dense")


def _llm(ckpt, budget: int) -> LLM:
    from splash.distributed.communicator import SingleRankCommunicator
    return LLM(str(ckpt), block_size=4, max_num_batched_tokens=budget, comm=SingleRankCommunicator())


def check_against_hf(hf, prompts, params, outs) -> None:
    """Replay each output on HF's full-sequence logits with the reference sampler (shared with the 2-rank test)."""
    for prompt, sp, out in zip(prompts, params, outs):
        toks = out.token_ids
        logits = hf_logits(hf, prompt + toks)
        stops = () if sp.ignore_eos else (EOS,)
        for t, tok in enumerate(toks):
            x = ref_processed(logits[len(prompt) - 1 + t].tolist(), sp, prompt, toks[:t], stops)
            if sp.temperature == 0:
                assert tok == max(range(len(x)), key=x.__getitem__), (sp, t)
            else:
                assert x[tok] != NEG, (sp, t)            # inside what top_k / top_p / min_p leave
            if sp.logprobs is not None:
                ref, lp = log_softmax(x), out.outputs[0].logprobs[t]
                assert lp.token == tok and abs(lp.logprob - ref[tok]) < TOL
                best = sorted(range(len(ref)), key=lambda v: -ref[v])[:sp.logprobs]
                assert [i for i, _ in lp.top] == best
                assert all(abs(v - ref[i]) < TOL for i, v in lp.top)
        if sp.prompt_logprobs is not None:
            plp = out.prompt_logprobs
            assert plp[0] is None and len(plp) == len(prompt)
            ref_lp = torch.log_softmax(logits[:len(prompt) - 1], -1)
            for p in range(1, len(prompt)):
                assert plp[p].token == prompt[p]
                assert abs(plp[p].logprob - float(ref_lp[p - 1, prompt[p]])) < TOL
                assert plp[p].rank == 1 + int((ref_lp[p - 1] > ref_lp[p - 1, prompt[p]]).sum())
                assert [i for i, _ in plp[p].top] == ref_lp[p - 1].topk(sp.prompt_logprobs).indices.tolist()
        else:
            assert out.prompt_logprobs is None


@pytest.mark.parametrize("budget", [2048, 7])   # one step per prompt, and prefill chunked into 7-token pieces
def test_mixed_parameters_against_hf(ckpt, hf, budget):
    outs = _llm(ckpt, budget).generate(PROMPTS, MIXED)
    check_against_hf(hf, PROMPTS, MIXED, outs)
    assert all(o.outputs[0].logprobs is None for o, sp in zip(outs, MIXED) if sp.logprobs is None)
    assert not set(outs[1].token_ids[:5]) & {EOS}


def test_min_tokens_holds_back_eos(ckpt):
    """A strong EOS bias ends the request at once, unless min_tokens holds it back."""
    llm = _llm(ckpt, 2048)
    biased = SamplingParams(max_tokens=10, temperature=0, logit_bias={EOS: 100.0})
    assert llm.generate([PROMPTS[0]], biased)[0].token_ids == [EOS]
    held = llm.generate([PROMPTS[0]], SamplingParams(max_tokens=10, temperature=0, logit_bias={EOS: 100.0},
                                                     min_tokens=4))[0]
    assert len(held.token_ids) == 5 and held.token_ids[4] == EOS and EOS not in held.token_ids[:4]
    assert held.finish_reason == "stop"


def test_greedy_logprobs_equal_hf_log_softmax(ckpt, hf):
    """Plain greedy + logprobs: the raw model distribution, token by token, equals HF's log-softmax."""
    sp = SamplingParams(max_tokens=6, temperature=0, logprobs=5, prompt_logprobs=5, ignore_eos=True)
    out = _llm(ckpt, 2048).generate([PROMPTS[1]], sp)[0]
    ref = torch.log_softmax(hf_logits(hf, PROMPTS[1] + out.token_ids), -1)
    n = len(PROMPTS[1])
    for t, lp in enumerate(out.outputs[0].logprobs):
        assert math.isclose(lp.logprob, float(ref[n - 1 + t, lp.token]), abs_tol=TOL) and lp.rank == 1
        assert [i for i, _ in lp.top] == ref[n - 1 + t].topk(5).indices.tolist()
    assert max(abs(out.prompt_logprobs[p].logprob - float(ref[p - 1, PROMPTS[1][p]])) for p in range(1, n)) < TOL
