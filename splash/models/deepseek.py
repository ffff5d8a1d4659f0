"""DeepSeek-V3 family forward pass over one step batch; the attention block is delegated to a layout executor."""
from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

import torch

from splash.models import ffn
from splash.models.config import ModelConfig
from splash.models.linear import linear
from splash.models.norm import rms_norm
from splash.models.rope import Rope
from splash.models.weights import MLPWeights, ModelWeights

if TYPE_CHECKING:   # the engine hands the model a batch; the model never builds one
    from splash.attention.batch import StepBatch


class AttentionExecutor(Protocol):
    def attention(self, layer: int, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x [N, hidden] (normed, replicated) -> attention output [N, hidden] (replicated)."""


class DeepseekV3Model:
    swiglu_limit: float | None = None

    def __init__(self, cfg: ModelConfig, weights: ModelWeights, comm, device=None):
        if cfg.hidden_act != "silu":
            raise ValueError(f"hidden_act {cfg.hidden_act!r} is not supported (only silu)")
        self.cfg, self.w, self.comm = cfg, weights, comm
        self.device = device if device is not None else weights.embed.device
        self.rope = Rope(cfg, self.device)

    def _ffn(self, layer: int, x: torch.Tensor) -> torch.Tensor:
        fw = self.w.layers[layer].ffn
        lim = self.swiglu_limit
        y = ffn.mlp(fw, x, lim) if isinstance(fw, MLPWeights) else ffn.moe(self.cfg, fw, x, lim)
        return self.comm.all_reduce(y) if self.comm.size > 1 else y

    def forward(self, batch: StepBatch, attn: AttentionExecutor, before_layer=None) -> torch.Tensor:
        """Run every layer; returns final-normed hidden states of `batch.sample_rows` [S, hidden].

        `before_layer(l)` (optional) is called before layer l runs — the switch executor waits there for the
        layer's transferred state."""
        cfg = self.cfg
        x = self.w.embed[batch.token_ids]
        cos, sin = self.rope.cos_sin(batch.positions)
        for i, lw in enumerate(self.w.layers):
            if before_layer is not None:
                before_layer(i)
            x = x + attn.attention(i, rms_norm(x, lw.input_norm, cfg.rms_norm_eps), cos, sin)
            x = x + self._ffn(i, rms_norm(x, lw.post_norm, cfg.rms_norm_eps))
        rows = torch.tensor(batch.sample_rows, dtype=torch.long, device=x.device)
        return rms_norm(x[rows], self.w.norm, cfg.rms_norm_eps)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return linear(hidden, self.w.lm_head).float()
