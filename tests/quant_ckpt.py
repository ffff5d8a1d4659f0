"""Quantised tiny checkpoints in the exact on-disk formats, written from a plain (``save_pretrained``) checkpoint.

    from quant_ckpt import write_quantized
    qdir, deqdir = write_quantized(src_dir, tmp / "q", "fp8")     # DeepSeek/GLM FP8 block-scaled
    qdir, deqdir = write_quantized(src_dir, tmp / "q", "w8a8")    # compressed-tensors INT8 W8A8 (int-quantized)
    qdir, deqdir = write_quantized(src_dir, tmp / "q", "w8a16")   # compressed-tensors INT8 weight-only

`qdir` holds the quantised checkpoint (config.json with its ``quantization_config``); `deqdir` the same model with
every quantised weight dequantised to fp32 — the reference the engine must reproduce. The quantisers here are
written independently of splash.models.qweight (loops over blocks/rows), so a shared mistake would not cancel.

Formats (as the tools that make them write them):
- fp8: ``<name>.weight`` float8_e4m3fn [out, in] + ``<name>.weight_scale_inv`` fp32 [ceil(out/128), ceil(in/128)],
  w = q × s per block; config ``{"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
  "weight_block_size": [128, 128]}`` (DeepSeek-V3 / GLM-5 FP8 releases).
- compressed-tensors INT8: ``<name>.weight`` int8 [out, in] + ``<name>.weight_scale`` [out, 1] (bf16 here, as
  llm-compressor stores it for a bf16 model), symmetric, channel strategy; format ``int-quantized``; W8A8 adds
  dynamic per-token ``input_activations``, weight-only has none; ``ignore: ["lm_head"]``.
`keep` (regular expressions of module names) leaves more modules unquantised and lists them in the config
(compressed-tensors ``ignore`` as ``re:`` entries, fp8 ``modules_to_not_convert``), as hybrid-model releases do
(tests/hf_glm5_next.py QUANT_KEEP: the vision tower and KDA's gate projections).
"""
from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

LINEAR_SUFFIXES = ("_proj.weight", "_proj_with_mqa.weight", "indexer.wq_b.weight", "indexer.wk.weight")


def is_linear(name: str, t: torch.Tensor, keep: tuple[str, ...] = ()) -> bool:
    module = name[:-len(".weight")]
    return (t.dim() == 2 and name.endswith(LINEAR_SUFFIXES) and not name.startswith("lm_head")
            and not any(re.fullmatch(k, module) for k in keep))


def fp8_blocks(w: torch.Tensor, spread: torch.Generator | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """w [out, in] -> (fp8 values, scale_inv per 128×128 block). With `spread`, blocks first get magnitudes
    10^U(-1, 1) so a misplaced scale would show."""
    out, inn = w.shape
    bo, bi = -(-out // 128), -(-inn // 128)
    w = w.float().clone()
    scale = torch.zeros(bo, bi)
    q = torch.empty(out, inn, dtype=torch.float8_e4m3fn)
    for i in range(bo):
        for j in range(bi):
            blk = w[i * 128:(i + 1) * 128, j * 128:(j + 1) * 128]
            if spread is not None:
                blk.mul_(10.0 ** (float(torch.rand(1, generator=spread)) * 2 - 1))
            s = float(blk.abs().max()) / 448.0 or 1.0
            scale[i, j] = s
            q[i * 128:(i + 1) * 128, j * 128:(j + 1) * 128] = (blk / s).to(torch.float8_e4m3fn)
    return q, scale


def int8_channels(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w [out, in] -> (int8 values, bf16 scale [out, 1]), symmetric round-to-nearest."""
    scale = (w.float().abs().amax(dim=1, keepdim=True) / 127.0).to(torch.bfloat16)
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = torch.round(w.float() / scale.float()).clamp(-127, 127).to(torch.int8)
    return q, scale


def _ct_config(activations: bool) -> dict:
    acts = {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "token", "dynamic": True} if activations \
        else None
    return {"quant_method": "compressed-tensors", "format": "int-quantized", "quantization_status": "compressed",
            "version": "0.9.0", "ignore": ["lm_head"], "kv_cache_scheme": None,
            "config_groups": {"group_0": {"targets": ["Linear"], "input_activations": acts, "output_activations": None,
                                          "weights": {"num_bits": 8, "type": "int", "symmetric": True,
                                                      "strategy": "channel", "dynamic": False, "group_size": None,
                                                      "observer": "minmax"}}}}


QUANT_CONFIGS = {
    "fp8": {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]},
    "w8a8": _ct_config(True),
    "w8a16": _ct_config(False),
}


def _config(scheme: str, keep: tuple[str, ...]) -> dict:
    qc = json.loads(json.dumps(QUANT_CONFIGS[scheme]))
    if keep and scheme == "fp8":
        qc["modules_to_not_convert"] = list(keep)
    elif keep:
        qc["ignore"] += [f"re:{k}" for k in keep]
    return qc


def write_quantized(src: Path, out: Path, scheme: str, spread_seed: int | None = None,
                    keep: tuple[str, ...] = ()) -> tuple[Path, Path]:
    """Quantise every linear weight of the checkpoint at `src` but the `keep` modules; returns (quantised dir,
    dequantised dir)."""
    sd = load_file(str(src / "model.safetensors"))
    g = torch.Generator().manual_seed(spread_seed) if spread_seed is not None else None
    qsd, deq = {}, {}
    for name, t in sd.items():
        if not is_linear(name, t, keep):
            qsd[name] = deq[name] = t
            continue
        base = name[:-len("weight")]
        if scheme == "fp8":
            q, s = fp8_blocks(t, g)
            qsd[name], qsd[base + "weight_scale_inv"] = q, s
            deq[name] = q.float() * s.repeat_interleave(128, 0)[:t.shape[0]].repeat_interleave(128, 1)[:, :t.shape[1]]
        else:
            q, s = int8_channels(t)
            qsd[name], qsd[base + "weight_scale"] = q, s
            deq[name] = q.float() * s.float()
    cfg = json.loads((src / "config.json").read_text())
    qdir, ddir = out / scheme, out / f"{scheme}-dequantized"
    for d, tensors, qc in ((qdir, qsd, _config(scheme, keep)), (ddir, deq, None)):
        d.mkdir(parents=True, exist_ok=True)
        for f in src.iterdir():
            if f.name not in ("config.json", "model.safetensors") and f.is_file():
                shutil.copy(f, d / f.name)
        c = dict(cfg)
        c.pop("quantization_config", None)
        if qc is not None:
            c["quantization_config"] = qc
        (d / "config.json").write_text(json.dumps(c, indent=2))
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(d / "model.safetensors"),
                  metadata={"format": "pt"})
    return qdir, ddir
