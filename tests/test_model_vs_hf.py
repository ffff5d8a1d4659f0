"""Our DeepSeek-V3 forward (absorbed MLA over the paged latent cache) against transformers' DeepseekV3ForCausalLM.

Each variant in `hf_models.VARIANTS` covers a loader/model path: dense vs MoE (group-limited routing, shared
experts), YaRN on/off, interleaved vs half-split rope, q-LoRA vs plain q_proj, tied embeddings.
"""
from __future__ import annotations

import pytest
import torch
from hf_models import VARIANTS, hf_greedy, hf_logits, random_prompts

from splash.attention.batch import StepBatch, StepRequest
from splash.engine.llm import LLM
from splash.engine.runner import ModelRunner
from splash.engine.sampling import SamplingParams
from splash.models.loader import open_checkpoint

RTOL = 1e-4  # fp32: max |ours - hf| relative to max |hf| over the compared logits


def rel_err(ours: torch.Tensor, ref: torch.Tensor) -> float:
    return float((ours - ref).abs().max() / ref.abs().max())


def make_runner(path, comm, block_size: int = 4, num_blocks: int = 64) -> ModelRunner:
    cfg, get = open_checkpoint(path)
    return ModelRunner(cfg, get, comm, "tp", "float32", block_size, num_blocks)


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_prefill_logits_match_hf(variant, tiny_ckpt, hf_ref, comm):
    prompt = random_prompts([37], seed=1)[0]
    runner = make_runner(tiny_ckpt(variant), comm)
    n = len(prompt)
    batch = StepBatch([StepRequest("a", 0, n)], torch.tensor(prompt), torch.arange(n), list(range(n)))
    ours = runner.step(batch)
    ref = hf_logits(hf_ref(variant), prompt)
    assert ours.shape == ref.shape
    assert rel_err(ours, ref) < RTOL


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_chunked_mixed_steps_match_hf(variant, tiny_ckpt, hf_ref, comm):
    """Two requests through uneven prefill chunks and decode rows in the same steps (paged, block_size 4):
    every row's logits equal HF's full-sequence logits at that position."""
    a, b = random_prompts([23, 14], seed=2)
    runner = make_runner(tiny_ckpt(variant), comm)
    # (request, start, length) per step; chunks cross block boundaries on purpose
    schedule = [[("a", 0, 7)], [("a", 7, 9), ("b", 0, 5)], [("b", 5, 9), ("a", 16, 7)]]
    seqs = {"a": a, "b": b}
    got: dict[str, dict[int, torch.Tensor]] = {"a": {}, "b": {}}
    for step in schedule:
        reqs = [StepRequest(r, s, n) for r, s, n in step]
        toks = [seqs[r][s:s + n] for r, s, n in step]
        batch = StepBatch.build(reqs, toks, [True] * len(reqs))
        batch.sample_rows = list(range(batch.num_rows))  # every row, not just the last of each request
        logits = runner.step(batch)
        row = 0
        for r, s, n in step:
            for p in range(s, s + n):
                got[r][p] = logits[row]
                row += 1
    # then decode 4 tokens for both requests in one batch per step (row order b, a)
    for _ in range(4):
        nxt = {r: int(got[r][len(seqs[r]) - 1].argmax()) for r in ("b", "a")}
        reqs = [StepRequest(r, len(seqs[r]), 1) for r in ("b", "a")]
        for r in ("b", "a"):
            seqs[r] = seqs[r] + [nxt[r]]
        logits = runner.step(StepBatch.build(reqs, [[seqs[r][-1]] for r in ("b", "a")], [True, True]))
        for i, r in enumerate(("b", "a")):
            got[r][len(seqs[r]) - 1] = logits[i]
    model = hf_ref(variant)
    for r in ("a", "b"):
        ref = hf_logits(model, seqs[r])
        ours = torch.stack([got[r][p] for p in range(len(seqs[r]))])
        assert rel_err(ours, ref) < RTOL, r


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_greedy_matches_hf_generate(variant, tiny_ckpt, hf_ref, comm):
    """32 greedy tokens for prompts of different lengths (up to 16 KV blocks of 4), chunked prefill forced by a
    16-token step budget and at most 4 running requests: identical to HF generate(do_sample=False)."""
    prompts = random_prompts([3, 17, 40, 9, 30, 64], seed=3)
    ref = hf_greedy(hf_ref(variant), prompts, 32)
    llm = LLM(str(tiny_ckpt(variant)), block_size=4, max_num_batched_tokens=16, max_num_seqs=4, comm=comm)
    outs = llm.generate(prompts, SamplingParams(max_tokens=32, temperature=0, ignore_eos=True))
    assert [o.token_ids for o in outs] == ref
    assert all(o.finish_reason == "length" for o in outs)
    assert [o.prompt_token_ids for o in outs] == prompts
    assert llm.engine.scheduler.num_preemptions == 0


def test_config_eos_ends_request(tiny_ckpt, hf_ref, comm):
    """config.json's eos_token_id ends a request (finish_reason "stop", EOS included) unless ignore_eos.
    The checkpoint reuses moe_yarn's weights (same seed) with EOS set to the 4th token HF predicts."""
    prompt = random_prompts([12], seed=4)[0]
    ref = hf_greedy(hf_ref("moe_yarn"), [prompt], 8)[0]
    eos = ref[3]
    path = tiny_ckpt(f"moe_yarn_eos{eos}", **{**VARIANTS["moe_yarn"], "eos_token_id": eos})
    llm = LLM(str(path), block_size=4, comm=comm)
    stop, full = llm.generate([prompt, prompt], [SamplingParams(max_tokens=8, temperature=0),
                                                 SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)])
    assert stop.token_ids == ref[:ref.index(eos) + 1] and stop.finish_reason == "stop"
    assert full.token_ids == ref and full.finish_reason == "length"
