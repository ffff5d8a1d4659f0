"""Weights updated in place on real ranks (mpiexec -n 2, `LLM.update_weights` / POST /update_weights_from_disk's
engine side): the new checkpoint's greedy tokens as one rank gives them, in the layout it was taken in and after
switches into the others (DOP's sharded projections, DP-attn's and CP's replicated ones), with the prefix cache of
the old weights dropped; a failed load on any rank changes nothing on every rank; a busy engine refuses. For
DeepSeek-V3 (MoE, YaRN), DeepSeek-V3.2 (DSA: the indexer's weights) and GLM-5.3-Flash (hybrid: KDA weights)."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from hf_glm5_next import VARIANTS as GLM_VARIANTS  # noqa: E402
from hf_glm5_next import make_tiny_glm5_next  # noqa: E402
from hf_models import DSA_VARIANTS, VARIANTS, make_tiny_deepseek  # noqa: E402

WORKER = "tests/distributed/reload_worker.py"
VARIANT_NAMES = ("moe_yarn", "v32_sparse", "glm5_next")
STEPS = 6   # the OK lines of one job
_DIRS: dict[str, list[Path]] = {}


def _checkpoints(variant: str, tmp_path_factory) -> list[Path]:
    """Three checkpoints of the variant's architecture with different random weights."""
    if variant not in _DIRS:
        d = tmp_path_factory.mktemp(f"reload_{variant}")
        if variant == "glm5_next":
            _DIRS[variant] = [make_tiny_glm5_next(d / f"s{s}", seed=s, **GLM_VARIANTS["topk_low"]) for s in (1, 2, 3)]
        else:
            over = {**VARIANTS, **DSA_VARIANTS}[variant]
            _DIRS[variant] = [make_tiny_deepseek(d / f"s{s}", seed=s, **over) for s in (1, 2, 3)]
    return _DIRS[variant]


def launch_jobs(nprocs: int, tmp_path_factory, tiny_ckpt) -> list[tuple[str, ...]]:
    """This file's job at `nprocs` ranks (2 only), run in tests/distributed/conftest.py's shared launch."""
    if nprocs != 2:
        return []
    specs = [" ".join([v, *map(str, _checkpoints(v, tmp_path_factory))]) for v in VARIANT_NAMES]
    return [(WORKER, *specs)]


@pytest.mark.parametrize("variant", VARIANT_NAMES)
def test_updated_weights_give_the_new_checkpoints_tokens_in_every_layout(shared_launches, variant):
    proc = shared_launches(2)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith(f"rank 0: {variant}: ") and ln.endswith(" OK")]
    assert len(lines) == STEPS, out[-4000:]
