"""Each of TP, DP-attn, CP and DOP on real ranks (mpiexec -n 1/2/4) gives the tokens of transformers'
DeepseekV3ForCausalLM and of one rank, for a mixed batch: prompts of different lengths (several KV blocks),
chunked prefill mixed with decode, requests finishing mid-batch, and ranks that own zero requests.

Parametrised by architecture: the DSA models (DeepSeek-V3.2, GLM-5.x with a shared indexer layer, top-k 8 below
the context) run a lighter batch, 32 greedy tokens, under -n 2 and -n 4 (one rank: tests/test_dsa_vs_hf.py);
GLM-5.3-Flash (Glm5NextForConditionalGeneration's text model, index_topk below the contexts, the KPool selection
active from the third pool on) a smaller batch, 32 greedy tokens, under -n 2 and -n 4 (one rank:
tests/test_glm5_next.py; transformers' KDA fallback makes its reference slow, so each prompt is generated only
as far as the engine runs it). Tokens are compared with transformers' cached generate (see test_dsa_vs_hf for
why that is like with like)."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from hf_glm5_next import VARIANTS as GLM_VARIANTS  # noqa: E402
from hf_glm5_next import load_hf_glm5_next, make_tiny_glm5_next  # noqa: E402
from hf_models import DSA_VARIANTS, VARIANTS, hf_greedy, hf_logits, load_hf, make_tiny_deepseek, random_prompts  # noqa: E402
from mpi_util import run_mpi  # noqa: E402

LAYOUTS = "tp,dp_attn,cp,dop"


def _deepseek(variant: str):
    return lambda d: make_tiny_deepseek(d, **{**VARIANTS, **DSA_VARIANTS}[variant])


# architecture -> (checkpoint maker, HF loader, (prompt lengths, max tokens) of phases a and b, greedy steps,
# rank counts)
ARCH_CASES = {
    "deepseek_v3": (_deepseek("moe_yarn"), load_hf, ([3, 17, 9, 30, 1, 12], [24, 5, 24, 24, 13, 24]),
                    ([7, 21], [24, 24]), 24, [1, 2, 4]),
    "deepseek_v32": (_deepseek("v32_sparse"), load_hf, ([5, 19, 1], [32, 7, 32]), ([9], [32]), 32, [2, 4]),
    "glm_moe_dsa": (_deepseek("glm_sparse"), load_hf, ([5, 19, 1], [32, 7, 32]), ([9], [32]), 32, [2, 4]),
    "glm5_next": (lambda d: make_tiny_glm5_next(d, **GLM_VARIANTS["topk_low"]), load_hf_glm5_next,
                  ([3, 17, 30, 1], [32, 5, 32, 9]), ([21], [8]), 32, [2, 4]),
}


def _greedy(hf, prompts: list[list[int]], max_tokens: list[int]) -> list[list[int]]:
    """transformers' greedy tokens, each prompt as many as the engine generates for it (its max_tokens)."""
    return [hf_greedy(hf, [p], m)[0] for p, m in zip(prompts, max_tokens)]


def _reference(arch: str, tmp_path_factory) -> tuple[Path, Path]:
    make, load, (len_a, max_a), (len_b, max_b), steps, _ = ARCH_CASES[arch]
    d = tmp_path_factory.mktemp(f"layouts_{arch}")
    model_dir = make(d / "model")
    hf = load(model_dir)
    prompts_a = random_prompts(len_a, seed=1)
    prompts_b = random_prompts(len_b, seed=2)
    probe = random_prompts([13], seed=3)[0]
    assert max(max_a) == steps  # the longest request runs `steps` greedy steps; each prompt only its own max_tokens
    ref = {"prompts_a": prompts_a, "max_tokens_a": max_a, "tokens_a": _greedy(hf, prompts_a, max_a),
           "prompts_b": prompts_b, "max_tokens_b": max_b, "tokens_b": _greedy(hf, prompts_b, max_b),
           "probe": probe, "probe_logits": hf_logits(hf, probe)}
    torch.save(ref, d / "ref.pt")
    return model_dir, d / "ref.pt"


def _archs(nprocs: int, communicator: str) -> list[str]:
    """The architectures run at `nprocs` ranks on `communicator` (torch: one architecture checks it)."""
    return [a for a in sorted(ARCH_CASES) if nprocs in ARCH_CASES[a][5] and
            (communicator == "mpi" or a == "deepseek_v3")]


def _jobs(nprocs: int) -> list[tuple[str, str]]:
    """(architecture, communicator) of the one launch at `nprocs` ranks: each architecture of that rank count over
    MPI, then (4 ranks) the torch communicator's."""
    return [(a, c) for c in ("mpi", "torch") for a in _archs(nprocs, c) if c == "mpi" or nprocs == 4]


@pytest.fixture(scope="module")
def launches(tmp_path_factory):
    """`launches(nprocs) -> (result, {arch: model_dir})`: one launch checks every _jobs(nprocs) job in turn (rank
    start-up once per rank count, not per architecture or communicator; each line names its model's directory and
    its communicator). A failing job aborts the launch, so every test of that launch then fails with its output."""
    refs: dict[str, tuple[Path, Path]] = {}
    runs: dict[int, object] = {}

    def get(nprocs: int):
        if nprocs not in runs:
            jobs = _jobs(nprocs)
            for a, _ in jobs:
                if a not in refs:
                    refs[a] = _reference(a, tmp_path_factory)
            runs[nprocs] = run_mpi(
                nprocs, "tests/distributed/layouts_worker.py", ",".join(str(refs[a][0]) for a, _ in jobs),
                ",".join(str(refs[a][1]) for a, _ in jobs), "float32", LAYOUTS, ",".join(c for _, c in jobs),
                timeout=280)
        return runs[nprocs], {a: refs[a][0] for a in refs}
    return get


@pytest.mark.parametrize("nprocs,communicator", [(1, "mpi"), (2, "mpi"), (4, "mpi"), (4, "torch")])
@pytest.mark.parametrize("arch", sorted(ARCH_CASES))
def test_every_layout_matches_transformers(launches, arch, nprocs, communicator):
    """communicator torch: the data plane on torch.distributed (gloo here), the control plane on MPI."""
    if arch not in _archs(nprocs, communicator):
        pytest.skip(f"{arch} on {nprocs} rank(s) over {communicator} is covered elsewhere")
    res, model_dirs = launches(nprocs)
    assert res.returncode == 0, res.stdout + res.stderr
    tag = f"{model_dirs[arch].parent.name}: " if len(_jobs(nprocs)) > 1 else ""
    kind = {"mpi": "MPICommunicator" if nprocs > 1 else "SingleRankCommunicator", "torch": "TorchCommunicator"}
    for layout in LAYOUTS.split(","):
        for r in range(nprocs):
            want = f"{tag}rank {r}/{nprocs} {layout} float32 OK ({kind[communicator]}"
            assert want in res.stdout, res.stdout + res.stderr
