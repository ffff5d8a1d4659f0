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

WORKER = "tests/distributed/prefix_worker.py"


_MODELS: dict[str, Path] = {}   # variant -> checkpoint, written once


def _model(variant: str, tmp_path_factory) -> Path:
    if variant not in _MODELS:
        d = tmp_path_factory.mktemp(f"prefix_{variant}")
        _MODELS[variant] = (make_tiny_glm5_next(d / "model", **GLM_VARIANTS["topk_low"]) if variant == "glm5_next"
                            else make_tiny_deepseek(d / "model", **{**VARIANTS, **DSA_VARIANTS}[variant]))
    return _MODELS[variant]


JOBS = {
    "directions": (2, "moe_yarn", ["directions"]),
    "v32_sparse": (2, "v32_sparse", ["directions", "tp->cp,cp->dop,dop->dp_attn,dp_attn->tp"]),
    "glm_sparse": (2, "glm_sparse", ["directions", "tp->cp,cp->dop,dop->dp_attn,dp_attn->tp"]),
    "kept": (2, "moe_yarn", ["kept", "dp_attn->dop,tp->cp", "kept-moved", "dp_attn->tp,cp->dp_attn"]),
    "samples": (2, "moe_yarn", ["samples", "tp,cp"]),
    # every layout as source and as destination (all 12 directions pass too: docs/benchmarks.md, prefix caching)
    "glm5_next": (2, "glm5_next", ["directions", "tp->dp_attn,dp_attn->cp,cp->dop,dop->tp"]),
    "pressure": (4, "moe_yarn", ["pressure"]),
    # max_num_seqs 5: as many KDA state snapshots, so they are evicted for room as well as with their blocks
    "glm5_next_pressure": (4, "glm5_next", ["pressure", "5"]),
}


def launch_jobs(nprocs: int, tmp_path_factory, tiny_ckpt) -> list[tuple[str, ...]]:
    """This file's job at `nprocs` ranks, run in tests/distributed/conftest.py's shared launch: every JOBS entry of
    that rank count in turn (each rank-0 line names its JOBS label)."""
    specs = [" ".join([label, str(_model(variant, tmp_path_factory)), *args])
             for label, (n, variant, args) in JOBS.items() if n == nprocs]
    return [(WORKER, *specs)] if specs else []


@pytest.fixture(scope="module")
def launches(shared_launches):
    """`launches(nprocs)`: the shared launch of that rank count. A failing job aborts it, so every test of that
    launch then fails with its output."""
    return shared_launches


def _ok(launches, label: str, expect: int) -> list[str]:
    """The job's launch exited 0 and printed exactly `expect` OK lines for the job; returns them."""
    proc = launches(JOBS[label][0])
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith(f"rank 0: {label}: ") and " OK " in ln]
    assert len(lines) == expect, out[-4000:]
    return lines


def test_every_direction_with_and_without_the_cache(launches):
    _ok(launches, "directions", 12)


@pytest.mark.parametrize("variant", ["v32_sparse", "glm_sparse"])
def test_dsa_models_cache_their_indexer_keys(launches, variant):
    _ok(launches, variant, 4)


def test_cached_blocks_kept_across_a_switch_give_hits(launches):
    """Idle cached blocks survive a switch where they lie (DP-attn -> DOP, TP -> CP) and, when the cost verdict says
    so, travel (into TP: to every rank; CP -> DP-attn: gathered to the anchor): the next turn after the switch starts
    on them."""
    lines = "\n".join(_ok(launches, "kept", 4))
    for line in ("dp_attn->dop kept OK", "tp->cp kept OK", "dp_attn->tp kept-moved OK", "cp->dp_attn kept-moved OK"):
        assert f"rank 0: kept: {line}" in lines, lines


def test_four_ranks_under_pressure(launches):
    _ok(launches, "pressure", 1)


def test_n_samples_sent_together_prefill_their_prompt_once(launches):
    """n = 8 of one prompt at once (greedy and seeded): the same tokens with and without the cache, and one prefill
    (TP, and CP, whose anchor the cached prefix decides)."""
    _ok(launches, "samples", 2)


def test_glm5_next_resumes_kda_state_from_snapshots(launches):
    _ok(launches, "glm5_next", 4)


def test_glm5_next_four_ranks_under_pressure(launches):
    _ok(launches, "glm5_next_pressure", 1)
