"""The prefix cache on real ranks (mpiexec -n 2 / -n 4): the same greedy tokens with the cache as without it, in
every layout and through live switches in all 12 directions, while later requests (multi-turn conversations, n
samples of one prompt) start on cached blocks; under a pool so small that requests are preempted and cached blocks
evicted, with switches every few steps; for DeepSeek-V3 (MoE, YaRN) and the DSA models (DeepSeek-V3.2, GLM-5.x:
their indexer keys are cached with their blocks) and GLM-5.3-Flash (hybrid: a hit resumes its KDA layers from the state
snapshot at the hit's end). Every rank ends holding no request's block and leaking none, and (hybrid) exactly the
snapshots rank 0 records."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from hf_glm5_next import VARIANTS as GLM_VARIANTS  # noqa: E402
from hf_glm5_next import make_tiny_glm5_next  # noqa: E402
from hf_models import DSA_VARIANTS, VARIANTS, make_tiny_deepseek  # noqa: E402
from mpi_util import run_mpi  # noqa: E402

WORKER = "tests/distributed/prefix_worker.py"


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    cache: dict[str, Path] = {}

    def get(variant: str) -> Path:
        if variant not in cache:
            d = tmp_path_factory.mktemp(f"prefix_{variant}")
            cache[variant] = (make_tiny_glm5_next(d / "model", **GLM_VARIANTS["topk_low"]) if variant == "glm5_next"
                              else make_tiny_deepseek(d / "model", **{**VARIANTS, **DSA_VARIANTS}[variant]))
        return cache[variant]
    return get


def _ok(proc, expect: int) -> None:
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    assert out.count(" OK ") == expect, out[-4000:]


def test_every_direction_with_and_without_the_cache(models):
    _ok(run_mpi(2, WORKER, models("moe_yarn"), "directions", timeout=600), 12)


@pytest.mark.parametrize("variant", ["v32_sparse", "glm_sparse"])
def test_dsa_models_cache_their_indexer_keys(models, variant):
    _ok(run_mpi(2, WORKER, models(variant), "directions", "tp->cp,cp->dop,dop->dp_attn,dp_attn->tp",
                timeout=600), 4)


def test_cached_blocks_kept_across_a_switch_give_hits(models):
    """Idle cached blocks survive a switch where they lie (DP-attn -> DOP, TP -> CP) and, when the cost verdict says
    so, travel (into TP: to every rank; CP -> DP-attn: gathered to the anchor): the next turn after the switch starts
    on them."""
    out = run_mpi(2, WORKER, models("moe_yarn"), "kept", "dp_attn->dop,tp->cp", "kept-moved", "dp_attn->tp,cp->dp_attn",
                  timeout=600)
    _ok(out, 4)
    for line in ("dp_attn->dop kept OK", "tp->cp kept OK", "dp_attn->tp kept-moved OK", "cp->dp_attn kept-moved OK"):
        assert f"rank 0: {line}" in out.stdout, out.stdout


def test_four_ranks_under_pressure(models):
    _ok(run_mpi(4, WORKER, models("moe_yarn"), "pressure", timeout=600), 1)


def test_n_samples_sent_together_prefill_their_prompt_once(models):
    """n = 8 of one prompt at once (greedy and seeded): the same tokens with and without the cache, and one prefill
    (TP, and CP, whose anchor the cached prefix decides)."""
    _ok(run_mpi(2, WORKER, models("moe_yarn"), "samples", "tp,cp", timeout=600), 2)


def test_glm5_next_resumes_kda_state_from_snapshots(models):
    # every layout as source and as destination (all 12 directions pass too: docs/benchmarks.md, prefix caching)
    _ok(run_mpi(2, WORKER, models("glm5_next"), "directions", "tp->dp_attn,dp_attn->cp,cp->dop,dop->tp",
                timeout=600), 4)


def test_glm5_next_four_ranks_under_pressure(models):
    # max_num_seqs 5: as many KDA state snapshots, so they are evicted for room as well as with their blocks
    _ok(run_mpi(4, WORKER, models("glm5_next"), "pressure", "5", timeout=600), 1)
