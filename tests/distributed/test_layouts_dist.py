"""Each of TP, DP-attn, CP and DOP on real ranks (mpiexec -n 1/2/4) gives the tokens of transformers'
DeepseekV3ForCausalLM / Glm5NextForConditionalGeneration (text model, index_topk below the contexts) and of one
rank, for a mixed batch: prompts of different lengths (several KV blocks),
chunked prefill mixed with decode, requests finishing mid-batch, and ranks that own zero requests."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from hf_models import VARIANTS, hf_greedy, hf_logits, load_hf, make_tiny_deepseek, random_prompts  # noqa: E402
from hf_glm5_next import VARIANTS as GLM_VARIANTS  # noqa: E402
from hf_glm5_next import load_hf_glm5_next, make_tiny_glm5_next  # noqa: E402
from mpi_util import run_mpi  # noqa: E402

LAYOUTS = "tp,dp_attn,cp,dop"


# architecture -> (tiny checkpoint maker, HF loader, (prompt lengths, max tokens) of phases a and b); glm5_next
# runs a smaller batch (transformers' KDA fallback makes its reference slow), still with several KV blocks,
# chunked prefill mixed with decode, a request finishing early and ranks owning none
ARCHS = {"deepseek_v3": (lambda d: make_tiny_deepseek(d, **VARIANTS["moe_yarn"]), load_hf,
                         (([3, 17, 9, 30, 1, 12], [24, 5, 24, 24, 13, 24]), ([7, 21], [24, 24]))),
         "glm5_next": (lambda d: make_tiny_glm5_next(d, **GLM_VARIANTS["topk_low"]), load_hf_glm5_next,
                       (([3, 17, 30, 1], [16, 5, 16, 9]), ([21], [16])))}


@pytest.fixture(scope="module", params=sorted(ARCHS))
def reference(request, tmp_path_factory) -> tuple[Path, Path, str]:
    make, load, ((len_a, max_a), (len_b, max_b)) = ARCHS[request.param]
    d = tmp_path_factory.mktemp(f"layouts_{request.param}")
    model_dir = make(d / "model")
    hf = load(model_dir)
    prompts_a = random_prompts(len_a, seed=1)
    prompts_b = random_prompts(len_b, seed=2)
    probe = random_prompts([13], seed=3)[0]
    ref = {"prompts_a": prompts_a, "max_tokens_a": max_a, "tokens_a": hf_greedy(hf, prompts_a, max(max_a)),
           "prompts_b": prompts_b, "max_tokens_b": max_b, "tokens_b": hf_greedy(hf, prompts_b, max(max_b)),
           "probe": probe, "probe_logits": hf_logits(hf, probe)}
    torch.save(ref, d / "ref.pt")
    return model_dir, d / "ref.pt", LAYOUTS


@pytest.mark.parametrize("nprocs", [1, 2, 4])
def test_every_layout_matches_transformers(reference, nprocs):
    model_dir, ref, layouts = reference
    res = run_mpi(nprocs, "tests/distributed/layouts_worker.py", str(model_dir), str(ref), "float32", layouts,
                  timeout=240)
    assert res.returncode == 0, res.stdout + res.stderr
    for layout in layouts.split(","):
        for r in range(nprocs):
            assert f"rank {r}/{nprocs} {layout} float32 OK" in res.stdout, res.stdout + res.stderr
