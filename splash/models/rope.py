"""Decoupled rotary embedding for MLA (default and DeepSeek-style YaRN)."""
from __future__ import annotations

import math

import torch

from splash.models.config import ModelConfig, RopeConfig, yarn_mscale
from splash.native import fast_path


def _yarn_inv_freq(r: RopeConfig, dim: int, device) -> tuple[torch.Tensor, float]:
    def corr_dim(rot: float) -> float:
        return dim * math.log(r.original_max_position_embeddings / (rot * 2 * math.pi)) / (2 * math.log(r.theta))

    low, high = corr_dim(r.beta_fast), corr_dim(r.beta_slow)
    if r.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32, device=device) - low) / (high - low)).clamp(0, 1)
    pos_freqs = r.theta ** (torch.arange(0, dim, 2, dtype=torch.float32, device=device) / dim)
    extra = 1.0 - ramp  # share of the extrapolated (unscaled) frequency
    inv_freq = (1.0 / (r.factor * pos_freqs)) * (1 - extra) + (1.0 / pos_freqs) * extra
    if r.attention_factor is not None:
        att = float(r.attention_factor)
    elif r.mscale and r.mscale_all_dim:
        att = yarn_mscale(r.factor, r.mscale) / yarn_mscale(r.factor, r.mscale_all_dim)
    else:
        att = yarn_mscale(r.factor)
    return inv_freq, att


class Rope:
    """cos/sin tables per position (`rotate` applies them to the rope part of queries and keys)."""

    def __init__(self, cfg: ModelConfig, device="cpu"):
        dim = cfg.qk_rope_head_dim
        self.interleave = cfg.rope_interleave
        if cfg.rope.rope_type == "yarn":
            self.inv_freq, self.scale = _yarn_inv_freq(cfg.rope, dim, device)
        else:
            self.inv_freq = 1.0 / (cfg.rope.theta ** (torch.arange(0, dim, 2, dtype=torch.float32, device=device)
                                                      / dim))
            self.scale = 1.0

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Half-width cos/sin [n, dim/2] for the given positions (already multiplied by the YaRN factor)."""
        freqs = positions.to(torch.float32)[:, None] * self.inv_freq[None, :]
        return freqs.cos() * self.scale, freqs.sin() * self.scale


def rotate_torch(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleave: bool) -> torch.Tensor:
    """RoPE of x [n, ..., dim] by cos/sin [n, dim/2] (broadcast over the middle dims); `interleave`: DeepSeek's
    interleaved pairs (x0,x1),(x2,x3)..., output de-interleaved. `rotate` is this behind the CPU kernel; the DSA
    indexer calls it directly (its top-k breaks exact score ties, so its keys stay torch's on every path)."""
    extra = x.dim() - 2
    c = cos.view(cos.shape[0], *([1] * extra), cos.shape[1]).to(x.dtype)
    s = sin.view(sin.shape[0], *([1] * extra), sin.shape[1]).to(x.dtype)
    if interleave:
        x1, x2 = x[..., 0::2], x[..., 1::2]
    else:
        half = x.shape[-1] // 2
        x1, x2 = x[..., :half], x[..., half:]
    return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1)


rotate = fast_path("rope")(rotate_torch)
