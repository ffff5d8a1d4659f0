"""Every weight a rank builds lands on the engine's device as it is read, for every family: a GPU engine never holds
host weights (the hybrid family's used to stay on the host while its pool and KDA state went to the device).
`meta` stands in for the GPU: building on it needs no data, and no tensor can be there by accident."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from hf_glm5_next import VARIANTS as GLM_VARIANTS  # noqa: E402
from hf_glm5_next import make_tiny_glm5_next  # noqa: E402

from splash.attention.context import layout_state  # noqa: E402
from splash.distributed import SingleRankCommunicator  # noqa: E402
from splash.engine.rank_model import rank_weights  # noqa: E402
from splash.models.family import describe  # noqa: E402
from splash.models.loader import open_checkpoint  # noqa: E402
from splash.models.weights import weight_tensors  # noqa: E402


@pytest.mark.parametrize("family", ["deepseek_v3", "glm5_next"])
@pytest.mark.parametrize("layout", ["tp", "dp_attn"])
def test_every_weight_is_built_on_the_engines_device(tmp_path, tiny_ckpt, family, layout):
    d = make_tiny_glm5_next(tmp_path / "m", **GLM_VARIANTS["topk_low"]) if family == "glm5_next" \
        else tiny_ckpt("moe_yarn")
    cfg, get = open_checkpoint(d, torch.float32)
    fam = describe(cfg)
    weights = rank_weights(cfg, fam, get, SingleRankCommunicator(), layout_state(layout, fam, 1, 0, "float32"),
                           torch.device("meta"))
    devices = {t.device.type for t in weight_tensors(weights)}
    assert devices == {"meta"}, devices
