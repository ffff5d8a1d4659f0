"""Claims the README, `--help` texts and configs/*.yaml make that code can check: each test names the claim."""
from __future__ import annotations

from splash.engine.sampling import SamplingParams


def _sampled(seed: int) -> list[list[int]]:
    from splash.distributed import SingleRankCommunicator
    from splash.engine.llm import LLM

    llm = LLM(preset="tiny-mla", comm=SingleRankCommunicator(), num_kv_blocks=32, seed=seed)
    params = SamplingParams(max_tokens=8, temperature=1.0, ignore_eos=True)   # no per-request seed
    return [out.token_ids for out in llm.generate([[5, 6, 7], [8, 9]], params)]


def test_the_seed_seeds_sampling_of_unseeded_requests():
    """`--seed N`: "random seed (preset weights, sampling)" (configs/cpu.yaml: "seeds the preset's weights and
    sampling"), as vLLM's --seed: the same seed samples the same tokens for requests that bring no seed."""
    assert _sampled(3) == _sampled(3)
    assert _sampled(3) != _sampled(4)
