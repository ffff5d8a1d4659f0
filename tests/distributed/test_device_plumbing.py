"""No tensor on the engine's path is created without the backend's device: generation with torch's default device
set to `meta` while the engine's device is `cpu` gives transformers' tokens (tests/distributed/device_worker.py), on
one rank and on two ranks through a layout and live switches."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from hf_models import VARIANTS, hf_greedy, load_hf, make_tiny_deepseek, random_prompts  # noqa: E402
from mpi_util import run_mpi  # noqa: E402


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> tuple[Path, Path]:
    d = tmp_path_factory.mktemp("device")
    model_dir = make_tiny_deepseek(d / "model", **VARIANTS["moe_yarn"])
    hf = load_hf(model_dir)
    prompts = random_prompts([3, 17, 9], seed=5)
    max_tokens = [12, 6, 12]
    torch.save({"prompts": prompts, "max_tokens": max_tokens, "tokens": hf_greedy(hf, prompts, 12)}, d / "ref.pt")
    return model_dir, d / "ref.pt"


@pytest.mark.parametrize("nprocs,layout,switches", [(1, "tp", "dop,cp"), (2, "tp", "dp_attn,cp,dop,tp")])
def test_meta_default_device_gives_transformers_tokens(reference, nprocs, layout, switches):
    model_dir, ref = reference
    res = run_mpi(nprocs, "tests/distributed/device_worker.py", str(model_dir), str(ref), layout, switches,
                  timeout=180)
    assert res.returncode == 0, res.stdout + res.stderr
    for r in range(nprocs):
        assert f"rank {r}/{nprocs} {layout} {switches} meta-default OK" in res.stdout, res.stdout + res.stderr
