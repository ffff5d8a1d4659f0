"""No tensor on the engine's path is created without the backend's device: generation with torch's default device
set to `meta` while the engine's device is `cpu` gives transformers' tokens (tests/distributed/device_worker.py), on
one rank and on two ranks through a layout and live switches; for a DSA model (GLM-5.x, top-k 8 below the
contexts) too, through CP's global top-k, and for GLM-5.3-Flash (KDA state + KPool; its reference is the one-rank
engine without the meta default, which test_glm5_next checks against transformers)."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from hf_models import DSA_VARIANTS, VARIANTS, hf_greedy, load_hf, make_tiny_deepseek, random_prompts  # noqa: E402
from hf_glm5_next import VARIANTS as GLM_VARIANTS  # noqa: E402
from hf_glm5_next import make_tiny_glm5_next  # noqa: E402
from mpi_util import run_mpi  # noqa: E402


_REFS: dict[str, tuple[Path, Path]] = {}   # variant -> (model_dir, ref.pt), built once (module and shared launch)


def _refs(variant: str, tmp_path_factory) -> tuple[Path, Path]:
    if variant not in _REFS:
        _REFS[variant] = _reference(tmp_path_factory.mktemp(f"device_{variant}"), variant)
    return _REFS[variant]


@pytest.fixture(scope="module")
def refs(tmp_path_factory):
    """`refs(variant) -> (model_dir, ref.pt)`."""
    return lambda variant: _refs(variant, tmp_path_factory)


def _reference(d: Path, variant: str) -> tuple[Path, Path]:
    prompts = random_prompts([3, 17, 9], seed=5)
    max_tokens = [12, 6, 12]
    if variant == "glm5_next":
        from splash.distributed import SingleRankCommunicator
        from splash.engine.llm import LLM
        from splash.engine.sampling import SamplingParams
        model_dir = make_tiny_glm5_next(d / "model", **GLM_VARIANTS["topk_low"])
        llm = LLM(str(model_dir), block_size=4, max_num_batched_tokens=16, comm=SingleRankCommunicator())
        tokens = [o.token_ids for o in llm.generate(prompts, [SamplingParams(max_tokens=m, temperature=0,
                                                                             ignore_eos=True) for m in max_tokens])]
    else:
        model_dir = make_tiny_deepseek(d / "model", **{**VARIANTS, **DSA_VARIANTS}[variant])
        tokens = hf_greedy(load_hf(model_dir), prompts, 12)
    torch.save({"prompts": prompts, "max_tokens": max_tokens, "tokens": tokens}, d / "ref.pt")
    return model_dir, d / "ref.pt"


# variant -> rank count, layout, switches; the cases of one rank count share one launch
WORKER = "tests/distributed/device_worker.py"
CASES = [("moe_yarn", 1, "tp", "dop,cp"), ("moe_yarn", 2, "tp", "dp_attn,cp,dop,tp"), ("glm_sparse", 2, "tp", "cp,dop"),
         ("glm5_next", 2, "tp", "dp_attn,cp,dop,tp")]


def _args(nprocs: int, tmp_path_factory) -> list[str]:
    """device_worker's arguments for every CASES entry of that rank count (one job per model, run in turn; each
    line names its model's directory)."""
    return [str(a) for v, n, layout, switches in CASES if n == nprocs
            for a in (*_refs(v, tmp_path_factory), layout, switches)]


def launch_jobs(nprocs: int, tmp_path_factory, tiny_ckpt) -> list[tuple[str, ...]]:
    """This file's 2-rank cases, run in tests/distributed/conftest.py's shared launch."""
    return [(WORKER, *_args(nprocs, tmp_path_factory))] if nprocs > 1 else []


@pytest.fixture(scope="module")
def launches(tmp_path_factory, shared_launches):
    """`launches(nprocs)`: the one-rank cases in a launch of their own, the others in the shared launch of their
    rank count. A failing case aborts its launch, so every test of that launch then fails with its output."""
    runs: dict[int, object] = {}

    def get(nprocs: int):
        if nprocs > 1:
            return shared_launches(nprocs)
        if nprocs not in runs:
            runs[nprocs] = run_mpi(nprocs, WORKER, *_args(nprocs, tmp_path_factory), timeout=280)
        return runs[nprocs]
    return get


@pytest.mark.parametrize("variant,nprocs,layout,switches", CASES)
def test_meta_default_device_gives_transformers_tokens(refs, launches, variant, nprocs, layout, switches):
    model_dir, _ = refs(variant)
    res = launches(nprocs)
    assert res.returncode == 0, res.stdout + res.stderr
    for r in range(nprocs):
        want = f"{model_dir.parent.name}: rank {r}/{nprocs} {layout} {switches} meta-default OK"
        assert want in res.stdout, res.stdout + res.stderr
