"""Load an HF checkpoint (config.json + safetensors, single or sharded with an index) into a rank's weights.

Handles BF16/F16/F32 tensors and DeepSeek-style FP8 block-scaled weights (`weight_scale_inv`, 128×128 blocks),
dequantised at load. Every error names the file and the tensor or field.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Callable

import torch
from safetensors import SafetensorError, safe_open

from splash.models.config import ConfigError, ModelConfig, load_model_config
from splash.models.weights import expected_shapes

FP8_BLOCK = 128


class CheckpointError(ConfigError):
    """A checkpoint file is missing, unreadable, or disagrees with config.json."""


def _weight_map(model_dir: Path) -> dict[str, Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        try:
            wm = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise CheckpointError(f"{index}: not a valid safetensors index ({e})") from None
        return {name: model_dir / fname for name, fname in wm.items()}
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"{model_dir}: no *.safetensors files (and no model.safetensors.index.json)")
    out: dict[str, Path] = {}
    for f in files:
        for name in _open(f).keys():
            out[name] = f
    return out


def _open(path: Path):
    if not path.is_file():
        raise CheckpointError(f"{path}: checkpoint file is missing")
    try:
        return safe_open(str(path), framework="pt")
    except (SafetensorError, OSError, ValueError) as e:
        raise CheckpointError(f"{path}: cannot read safetensors file ({e})") from None


def dequant_fp8_blocks(w: torch.Tensor, scale_inv: torch.Tensor) -> torch.Tensor:
    """w [out, in] fp8 with scale_inv [ceil(out/128), ceil(in/128)] -> fp32."""
    out, inn = w.shape
    s = scale_inv.float().repeat_interleave(FP8_BLOCK, 0)[:out].repeat_interleave(FP8_BLOCK, 1)[:, :inn]
    return w.float() * s


class CheckpointReader:
    """Reads tensors by name from a model dir, checking shapes against config.json."""

    def __init__(self, model_dir: str | Path, cfg: ModelConfig, dtype: torch.dtype = torch.float32):
        self.dir = Path(model_dir)
        self.cfg, self.dtype = cfg, dtype
        self.map = _weight_map(self.dir)
        self.shapes = expected_shapes(cfg)
        self._handles: dict[Path, object] = {}

    def _handle(self, path: Path):
        if path not in self._handles:
            self._handles[path] = _open(path)
        return self._handles[path]

    def _raw(self, name: str) -> torch.Tensor:
        path = self.map.get(name)
        if path is None:
            raise CheckpointError(f"{self.dir}: tensor {name!r} is missing from the checkpoint")
        try:
            return self._handle(path).get_tensor(name)
        except (SafetensorError, OSError, ValueError, RuntimeError) as e:
            raise CheckpointError(f"{path}: cannot read tensor {name!r} ({e})") from None

    def get(self, name: str) -> torch.Tensor:
        t = self._raw(name)
        want = self.shapes.get(name)
        if want is not None and tuple(t.shape) != want:
            raise CheckpointError(f"{self.map[name]}: tensor {name!r} has shape {tuple(t.shape)} but config.json "
                                  f"implies {want}")
        if t.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
            sname = name[: -len("weight")] + "weight_scale_inv"
            if sname not in self.map:
                raise CheckpointError(f"{self.map[name]}: FP8 tensor {name!r} has no {sname!r}")
            t = dequant_fp8_blocks(t, self._raw(sname))
        keep_fp32 = name.endswith(("gate.weight", "e_score_correction_bias")) and ".mlp." in name
        return t.to(torch.float32 if keep_fp32 else self.dtype)


def open_checkpoint(model_dir: str | Path, dtype: torch.dtype = torch.float32) -> tuple[ModelConfig, Callable]:
    """(config, getter) for a model directory; errors name the file/field."""
    cfg = load_model_config(model_dir)
    if cfg.attention_bias:
        raise ConfigError(f"{Path(model_dir) / 'config.json'}: field 'attention_bias' = true is not supported")
    reader = CheckpointReader(model_dir, cfg, dtype)
    return cfg, reader.get
