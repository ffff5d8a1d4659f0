"""Weight updates on one rank (`LLM.update_weights`; the multi-rank case: tests/distributed/test_reload_dist.py):
quantised at load as the served weights were, and a checkpoint of another shape refused with nothing changed."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent / "server"))
from server_util import save_preset  # noqa: E402

from splash.distributed import SingleRankCommunicator  # noqa: E402
from splash.engine.llm import LLM  # noqa: E402
from splash.engine.sampling import SamplingParams  # noqa: E402

PROMPT = [[(7 * j + 3) % 200 + 1 for j in range(21)]]
SP = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)


def _tokens(llm: LLM) -> list[int]:
    return llm.generate(PROMPT, SP)[0].token_ids


@pytest.mark.parametrize("quantization", [None, "fp8", "int8"])
def test_new_weights_are_read_as_the_served_ones_were(tmp_path, quantization):
    new = str(save_preset("tiny-mla", tmp_path / "b", seed=7))
    want = _tokens(LLM(model=new, comm=SingleRankCommunicator(), quantization=quantization))
    llm = LLM(preset="tiny-mla", comm=SingleRankCommunicator(), quantization=quantization)
    assert _tokens(llm) != want
    llm.update_weights(new)
    assert _tokens(llm) == want


def test_a_checkpoint_of_another_shape_is_refused_and_nothing_changes(tmp_path):
    other = str(save_preset("small-mla", tmp_path / "other", seed=1))
    llm = LLM(preset="tiny-mla", comm=SingleRankCommunicator())
    before = _tokens(llm)
    with pytest.raises(ValueError, match="rank 0: ValueError: .*tensor .* in the served model"):
        llm.update_weights(other)
    assert _tokens(llm) == before


@pytest.mark.parametrize("weight_map", [[1], {"lm_head.weight": 5}, "model.safetensors"])
def test_a_malformed_index_is_an_error_naming_it_and_nothing_changes(tmp_path, weight_map):
    """A sharded checkpoint's index whose weight_map is not names -> file names (it raised AttributeError /
    TypeError out of the load: on a server, the engine thread's death and the job's)."""
    import json
    new = save_preset("tiny-mla", tmp_path / "b", seed=7)
    (new / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    llm = LLM(preset="tiny-mla", comm=SingleRankCommunicator())
    before = _tokens(llm)
    with pytest.raises(ValueError, match=r"rank 0: CheckpointError: .*index\.json: not a valid safetensors index"):
        llm.update_weights(str(new))
    assert _tokens(llm) == before


def test_any_failure_while_reading_is_an_error_and_nothing_changes(tmp_path, monkeypatch):
    """Whatever a rank's read raises (here an IndexError, as a reader's bug would) is its answer to the others:
    raised instead, it ended rank 0's engine thread (or a follower) with the other ranks inside the all-gather."""
    new = str(save_preset("tiny-mla", tmp_path / "b", seed=7))
    llm = LLM(preset="tiny-mla", comm=SingleRankCommunicator())
    before = _tokens(llm)

    def broken(get):
        raise IndexError("list index out of range")
    monkeypatch.setattr(llm.engine.runner, "load_weights", broken)
    with pytest.raises(ValueError, match="rank 0: IndexError: list index out of range"):
        llm.update_weights(new)
    assert _tokens(llm) == before


def test_a_good_checkpoint_after_a_nan_one_serves_its_own_tokens(tmp_path, torch_kernels):
    """An RL policy that diverged to NaN, then a good one: the good one's tokens (the NaN run's KV stayed in the
    pool's blocks; torch's kernel, which runs with more than one thread, weighs the slots past a later request's
    tokens 0, and 0 × NaN made its output NaN)."""
    import torch
    from safetensors.torch import load_file, save_file
    good = save_preset("tiny-mla", tmp_path / "good", seed=7)
    nan = save_preset("tiny-mla", tmp_path / "nan", seed=7)
    sd = load_file(str(nan / "model.safetensors"))
    save_file({k: torch.full_like(v, float("nan")) for k, v in sd.items()}, str(nan / "model.safetensors"))
    want = _tokens(LLM(model=str(good), comm=SingleRankCommunicator()))
    llm = LLM(preset="tiny-mla", comm=SingleRankCommunicator(), num_kv_blocks=2)   # both runs use both blocks
    llm.update_weights(str(nan))
    _tokens(llm)
    llm.update_weights(str(good))
    assert _tokens(llm) == want
