"""Load an HF checkpoint (config.json + safetensors, single or sharded with an index) into a rank's weights.

BF16/F16/F32 tensors; FP8 block-scaled (`weight_scale_inv`, 128×128) and compressed-tensors INT8 (`weight_scale`
per output channel, symmetric) weights kept in stored form (splash.models.qweight); `quantization="fp8"|"int8"`
quantises a plain checkpoint's linear weights at load. Any other quantised or integer form is an error naming the
tensor and its format, never a cast; every error names the file and the tensor or field.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Callable

import torch
from safetensors import SafetensorError, safe_open

from splash.models.config import ConfigError, ModelConfig, load_model_config
from splash.models.qweight import BLOCK, FP8, INT8, WEIGHT_QUANTS, QuantWeight, is_linear_weight, quantize, \
    quantized_at_load
from splash.models.weights import expected_shapes

SUPPORTED = ("supported: BF16/F16/F32; FP8 E4M3 + weight_scale_inv per 128×128 block; "
             "INT8 + weight_scale per output channel (compressed-tensors int-quantized)")


class CheckpointError(ConfigError):
    """A checkpoint file is missing, unreadable, or disagrees with config.json."""


def _weight_map(model_dir: Path) -> dict[str, Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        try:
            wm = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise CheckpointError(f"{index}: not a valid safetensors index ({e})") from None
        if not isinstance(wm, dict) or not all(isinstance(f, str) for f in wm.values()):
            raise CheckpointError(f"{index}: not a valid safetensors index ('weight_map' must map tensor names to "
                                  "file names)")
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


class CheckpointReader:
    """Reads tensors by name from a model dir, checking shapes against config.json."""

    def __init__(self, model_dir: str | Path, cfg: ModelConfig, dtype: torch.dtype = torch.float32,
                 quantization: str | None = None):
        self.dir = Path(model_dir)
        self.cfg, self.dtype, self.quantize = cfg, dtype, check_quantization(quantization, cfg)
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

    def get(self, name: str):
        """A tensor in the compute dtype, or a QuantWeight for a linear weight stored (or asked for) quantised."""
        if name not in self.map and name + "_packed" in self.map:
            raise CheckpointError(f"{self.map[name + '_packed']}: tensor {name!r} is stored as {name + '_packed'!r} "
                                  f"(compressed-tensors pack-quantized), which is not supported ({SUPPORTED})")
        t = self._raw(name)
        want = self.shapes.get(name)
        if want is not None and tuple(t.shape) != want:
            raise CheckpointError(f"{self.map[name]}: tensor {name!r} has shape {tuple(t.shape)} but config.json "
                                  f"implies {want}")
        if t.dtype in (torch.float8_e4m3fn, torch.float8_e5m2, torch.int8) or not t.is_floating_point():
            return self._quantized(name, t)
        keep_fp32 = name.endswith(("gate.weight", "e_score_correction_bias")) and ".mlp." in name
        t = t.to(torch.float32 if keep_fp32 else self.dtype)
        if self.quantize and quantized_at_load(name):
            return quantize(t, self.quantize, self.dtype)
        return t

    def _fail(self, name: str, what: str) -> CheckpointError:
        return CheckpointError(f"{self.map[name]}: tensor {name!r} {what}")

    def _quantized(self, name: str, t: torch.Tensor) -> QuantWeight:
        base = name[: -len("weight")]
        if not is_linear_weight(name) or t.dim() != 2:
            raise self._fail(name, f"is stored as {t.dtype}, but only linear projection weights may be stored "
                                   f"quantised ({SUPPORTED})")
        if t.dtype == torch.float8_e4m3fn and base + "weight_scale_inv" in self.map:
            fmt, scale = FP8, self._raw(base + "weight_scale_inv")
            want = (-(-t.shape[0] // BLOCK), -(-t.shape[1] // BLOCK))
            if tuple(scale.shape) != want:
                raise self._fail(name, f"is FP8 with weight_scale_inv of shape {tuple(scale.shape)}, not the "
                                       f"{want} of 128×128 blocks ({SUPPORTED})")
        elif t.dtype == torch.int8 and base + "weight_scale" in self.map:
            fmt, scale = INT8, self._int8_scale(name, t, self._raw(base + "weight_scale"))
        elif t.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
            other = " (compressed-tensors float-quantized)" if base + "weight_scale" in self.map else ""
            if t.dtype == torch.float8_e5m2 or other:
                raise self._fail(name, f"is {t.dtype} with weight_scale{other}: not a supported format ({SUPPORTED})")
            raise CheckpointError(f"{self.map[name]}: FP8 tensor {name!r} has no {base + 'weight_scale_inv'!r}")
        elif t.dtype == torch.int8:
            raise self._fail(name, f"is INT8 with no {base + 'weight_scale'!r}: an unscaled integer weight cannot be "
                                   f"used ({SUPPORTED})")
        else:
            raise self._fail(name, f"is stored as {t.dtype}, which is not a weight format this loader knows "
                                   f"({SUPPORTED})")
        if self.quantize and self.quantize != fmt:
            raise self._fail(name, f"is stored as {fmt}; re-quantising it to {self.quantize} is not supported")
        if base + "weight_zero_point" in self.map and self._raw(base + "weight_zero_point").any():
            raise self._fail(name, "has a non-zero weight_zero_point (asymmetric INT8), which is not supported")
        return QuantWeight(t, scale.float().contiguous(), fmt, self.dtype)

    def _int8_scale(self, name: str, t: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        """compressed-tensors scale: [out, 1] per channel, or one value per tensor (broadcast to every row)."""
        if scale.numel() == 1:
            return scale.float().reshape(1, 1).expand(t.shape[0], 1)
        if tuple(scale.shape) == (t.shape[0], 1):
            return scale
        raise self._fail(name, f"is INT8 with weight_scale of shape {tuple(scale.shape)}; only per-output-channel "
                               f"[{t.shape[0]}, 1] or per-tensor scales are supported (group-wise is not)")


def check_quantization(quantization: str | None, cfg: ModelConfig | None = None) -> str | None:
    """Validate a requested `quantization` (vLLM's name) against the checkpoint's own; None = keep as stored."""
    if quantization is None:
        return None
    if quantization not in WEIGHT_QUANTS:
        raise ConfigError(f"quantization {quantization!r} is not one of {', '.join(WEIGHT_QUANTS)}")
    if cfg is not None and cfg.quantization not in (None, quantization):
        raise ConfigError(f"quantization {quantization!r} was asked for, but the checkpoint is already quantised "
                          f"as {cfg.quantization} (config.json quantization_config); re-quantising is not supported")
    return quantization


def quantizing_getter(get: Callable, quantization: str | None, dtype: torch.dtype) -> Callable:
    """`get` with linear weights quantised at load (for presets; checkpoints do it in CheckpointReader)."""
    fmt = check_quantization(quantization)
    if fmt is None:
        return get
    return lambda name: quantize(get(name), fmt, dtype) if quantized_at_load(name) else get(name)


def open_checkpoint(model_dir: str | Path, dtype: torch.dtype = torch.float32,
                    quantization: str | None = None) -> tuple[ModelConfig, Callable]:
    """(config, getter) for a model directory; errors name the file/field."""
    cfg = load_model_config(model_dir)
    if cfg.attention_bias:
        raise ConfigError(f"{Path(model_dir) / 'config.json'}: field 'attention_bias' = true is not supported")
    reader = CheckpointReader(model_dir, cfg, dtype, quantization)
    return cfg, reader.get
