"""Seeded random-weight presets (no download needed): the weights of the configs in `preset_configs`."""
from __future__ import annotations

import json
from pathlib import Path

import torch

from splash.models.preset_configs import PRESETS, preset_config  # noqa: F401 — the presets' API
from splash.models.weights import expected_shapes
from splash.tokenizer import save_byte_tokenizer

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


def save_preset(name: str, out_dir: str | Path, seed: int = 0) -> Path:
    """Write the preset as an HF checkpoint directory (config.json + model.safetensors + tokenizer.json)."""
    from safetensors.torch import save_file

    d = Path(out_dir)
    d.mkdir(parents=True, exist_ok=True)
    (d / "config.json").write_text(json.dumps(PRESETS[name], indent=2))
    save_file(preset_state_dict(name, seed), str(d / "model.safetensors"))
    save_byte_tokenizer(d)
    return d
