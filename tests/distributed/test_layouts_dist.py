"""Each of TP, DP-attn, CP and DOP on real ranks (mpiexec -n 1/2/4) gives the tokens of transformers'
DeepseekV3ForCausalLM and of one rank, for a mixed batch: prompts of different lengths (several KV blocks),
chunked prefill mixed with decode, requests finishing mid-batch, and ranks that own zero requests."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from hf_models import VARIANTS, hf_greedy, hf_logits, load_hf, make_tiny_deepseek, random_prompts  # noqa: E402
from mpi_util import run_mpi  # noqa: E402

LAYOUTS = "tp,dp_attn,cp,dop"


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> tuple[Path, Path]:
    d = tmp_path_factory.mktemp("layouts")
    model_dir = make_tiny_deepseek(d / "model", **VARIANTS["moe_yarn"])
    hf = load_hf(model_dir)
    prompts_a = random_prompts([3, 17, 9, 30, 1, 12], seed=1)
    max_a = [24, 5, 24, 24, 13, 24]
    prompts_b = random_prompts([7, 21], seed=2)
    probe = random_prompts([13], seed=3)[0]
    ref = {"prompts_a": prompts_a, "max_tokens_a": max_a, "tokens_a": hf_greedy(hf, prompts_a, 24),
           "prompts_b": prompts_b, "max_tokens_b": [24, 24], "tokens_b": hf_greedy(hf, prompts_b, 24),
           "probe": probe, "probe_logits": hf_logits(hf, probe)}
    torch.save(ref, d / "ref.pt")
    return model_dir, d / "ref.pt"


@pytest.mark.parametrize("nprocs,communicator", [(1, "mpi"), (2, "mpi"), (4, "mpi"), (4, "torch")])
def test_every_layout_matches_transformers(reference, nprocs, communicator):
    """communicator torch: the data plane on torch.distributed (gloo here), the control plane on MPI."""
    model_dir, ref = reference
    res = run_mpi(nprocs, "tests/distributed/layouts_worker.py", str(model_dir), str(ref), "float32", LAYOUTS,
                  communicator, timeout=240)
    assert res.returncode == 0, res.stdout + res.stderr
    kind = {"mpi": "MPICommunicator" if nprocs > 1 else "SingleRankCommunicator", "torch": "TorchCommunicator"}
    for layout in LAYOUTS.split(","):
        for r in range(nprocs):
            want = f"rank {r}/{nprocs} {layout} float32 OK ({kind[communicator]}"
            assert want in res.stdout, res.stdout + res.stderr
