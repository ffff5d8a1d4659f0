"""The prefix cache on real ranks (mpiexec -n 2 / -n 4): the same greedy tokens with the cache as without it, in
every layout and through live switches in all 12 directions, while later requests (multi-turn conversations, n
samples of one prompt) start on cached blocks; under a pool so small that requests are preempted and cached blocks
evicted, with switches every few steps; for DeepSeek-V3 (MoE, YaRN) and the DSA models (DeepSeek-V3.2, GLM-5.x:
their indexer keys are cached with their blocks). Every rank ends holding no request's block and leaking none."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from hf_models import DSA_VARIANTS, VARIANTS, make_tiny_deepseek  # noqa: E402
from mpi_util import run_mpi  # noqa: E402

WORKER = "tests/distributed/prefix_worker.py"


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    cache: dict[str, Path] = {}

    def get(variant: str) -> Path:
        if variant not in cache:
            d = tmp_path_factory.mktemp(f"prefix_{variant}")
            cache[variant] = make_tiny_deepseek(d / "model", **{**VARIANTS, **DSA_VARIANTS}[variant])
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
    _ok(run_mpi(2, WORKER, models("moe_yarn"), "kept", "dp_attn->dop,tp->cp", timeout=600), 2)
    _ok(run_mpi(2, WORKER, models("moe_yarn"), "kept-moved", "dp_attn->tp,cp->dp_attn", timeout=600), 2)


def test_four_ranks_under_pressure(models):
    _ok(run_mpi(4, WORKER, models("moe_yarn"), "pressure", timeout=600), 1)
