"""`layout: auto` on real ranks: the scheduler switches live by itself, tokens equal transformers'."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from hf_models import VARIANTS, hf_greedy, load_hf, make_tiny_deepseek, random_prompts  # noqa: E402


_REF: list[tuple[str, ...]] = []   # built once, for both rank counts


def launch_jobs(nprocs: int, tmp_path_factory, tiny_ckpt) -> list[tuple[str, ...]]:
    """This file's worker job (script, model, transformers' tokens), run in tests/distributed/conftest.py's shared
    launch at each rank count."""
    if not _REF:
        d = tmp_path_factory.mktemp("auto")
        model_dir = make_tiny_deepseek(d / "model", **VARIANTS["moe_yarn"])
        prompts = random_prompts([5, 9, 7, 30], seed=3)
        max_tokens = [6, 8, 10, 40]
        ref = {"prompts": prompts, "max_tokens": max_tokens, "tokens": hf_greedy(load_hf(model_dir), prompts, 40)}
        torch.save(ref, d / "ref.pt")
        _REF.append(("tests/distributed/auto_worker.py", str(model_dir), str(d / "ref.pt")))
    return _REF[:]


@pytest.mark.parametrize("nprocs", [2, 4])
def test_auto_switches_live_and_keeps_tokens(shared_launches, nprocs):
    res = shared_launches(nprocs)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert "rank 0: auto OK" in res.stdout, res.stdout
