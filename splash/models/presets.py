"""Seeded random-weight presets (no download needed): the weights of the configs in `preset_configs`."""
from __future__ import annotations

import torch

from splash.models.preset_configs import preset_config
from splash.models.weights import expected_shapes


def preset_state_dict(name: str, seed: int = 0) -> dict[str, torch.Tensor]:
    """Deterministic random weights, scaled so activations stay O(1) and logits are well separated."""
    cfg = preset_config(name)
    g = torch.Generator().manual_seed(seed)   # made on the host (the runner moves weights to its device)
    cpu = dict(device="cpu")
    out = {}
    for key, shape in sorted(expected_shapes(cfg).items()):
        if key.endswith("norm.weight"):
            out[key] = torch.ones(shape, **cpu)
        elif key.endswith("e_score_correction_bias"):
            out[key] = 0.01 * torch.randn(shape, generator=g, **cpu)
        elif key == "model.embed_tokens.weight":
            out[key] = torch.randn(shape, generator=g, **cpu)
        else:
            out[key] = torch.randn(shape, generator=g, **cpu) / shape[-1] ** 0.5
    return out


def preset_getter(name: str, seed: int = 0, dtype: torch.dtype = torch.float32):
    sd = preset_state_dict(name, seed)
    return lambda key: sd[key].to(torch.float32 if key.endswith(("gate.weight", "bias")) else dtype)
