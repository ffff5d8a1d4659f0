"""ModelRunner: one rank's weights, paged KV pool, block manager and current layout executor.

Each layout may store KV in its own dtype (`layout_kv_dtypes`, e.g. fp8 in DOP for capacity, bf16 in TP); a
switch converts the pool (see splash.switching.executor). The pool keeps its block count across formats, so a
layout with a narrower KV dtype leaves bytes spare: per-layout capacity stays counted in blocks.
"""
from __future__ import annotations

from collections.abc import Mapping

import torch

from splash.attention.batch import StepBatch, StepRequest
from splash.kv import quant
from splash.kv.block_manager import BlockManager
from splash.kv.page_table import PageTable, ensure_step_pages
from splash.kv.paged_cache import PagedLatentCache
from splash.layouts.layout import LAYOUT_NAMES as LAYOUTS
from splash.models.build import build_weights, on_device
from splash.models.config import ModelConfig
from splash.models.deepseek import DeepseekV3Model


def resolve_layout_kv_dtypes(default: str, overrides: Mapping[str, str] | None = None,
                             field: str = "layout_kv_dtypes") -> dict[str, str]:
    """KV dtype of every layout: `default`, replaced per layout by `overrides` (layout name → KV dtype).
    ValueError naming `field` on an unknown layout or dtype."""
    from splash.layouts.layout import parse_layout

    if default not in quant.KV_DTYPES:
        raise ValueError(f"kv_cache_dtype {default!r} is not one of {', '.join(quant.KV_DTYPES)}")
    out = dict.fromkeys(LAYOUTS, default)
    for name, kv in (overrides or {}).items():
        try:
            lay = parse_layout(name).value
        except ValueError:
            raise ValueError(f"{field}: unknown layout {name!r} (layouts: {', '.join(LAYOUTS)})") from None
        if kv not in quant.KV_DTYPES:
            raise ValueError(f"{field}[{name!r}] = {kv!r} is not one of {', '.join(quant.KV_DTYPES)}")
        out[lay] = kv
    return out


class ModelRunner:
    def __init__(self, cfg: ModelConfig, get, comm, layout: str = "tp", kv_dtype: str = "float32",
                 block_size: int = 16, num_blocks: int = 256, dtype: torch.dtype = torch.float32,
                 layout_kv_dtypes: Mapping[str, str] | None = None, attention_backend: str = "torch",
                 device: str | torch.device = "cpu", streams=None):
        from splash.attention.executors import head_range_for, make_executor
        from splash.attention.kernels import kv_rope_fp8, make_kernel
        from splash.layouts.layout import parse_layout

        layout = parse_layout(layout).value
        self.cfg, self.comm, self.layout = cfg, comm, layout
        # every tensor of this rank lives on `device`; `streams` (backends.base) runs switch transfers on a side
        # stream (None: inline, as on CPU)
        self.device, self.streams = torch.device(device), streams
        self.layout_kv_dtypes = resolve_layout_kv_dtypes(kv_dtype, layout_kv_dtypes)
        # the current layout's KV dtype (a switch sets the destination's)
        self.block_size, self.kv_dtype, self.dtype = block_size, self.layout_kv_dtypes[layout], dtype
        self.heads = head_range_for(layout, cfg.num_attention_heads, comm.size, comm.rank)
        self.states = None  # per-request recurrent state (KDA layers of glm5_next), see splash.kv.recurrent
        if cfg.hybrid is not None:
            from splash.engine.hybrid_setup import setup_hybrid
            setup_hybrid(self, get, num_blocks)
        else:
            self.weights = build_weights(cfg, on_device(get, self.device), self.heads, comm.rank, comm.size)
            q_b = self.weights.layers[0].attn.q_b if self.weights.layers else None
            self.weight_quant: str | None = getattr(q_b, "fmt", None)  # "fp8"/"int8": projections stored quantised
            self.model = DeepseekV3Model(cfg, self.weights, comm, self.device)
            indexed = [i for i in range(cfg.num_hidden_layers) if cfg.has_indexer(i)]
            self.cache = PagedLatentCache(cfg.num_hidden_layers, num_blocks, block_size, cfg.kv_lora_rank,
                                          cfg.qk_rope_head_dim, self.kv_dtype, index_dim=cfg.index_head_dim,
                                          index_layers=indexed, device=self.device,
                                          rope_fp8=kv_rope_fp8(attention_backend, self.device))
        self.bm = BlockManager(num_blocks, block_size)
        # the block manager's tables as tensors, for the attention kernel
        self.tables = PageTable(block_size, device=self.device)
        self.attention_backend = attention_backend
        self.attn = make_kernel(attention_backend, cfg.softmax_scale)
        self.executor = make_executor(layout, self)

    def ensure_blocks(self, req: str, logical: list[int]) -> None:
        """Allocate `req`'s missing blocks among `logical` and append them to its page-table row."""
        new = self.bm.ensure(req, logical)
        if new:
            self.tables.append(req, new)

    def attach(self, req: str, blocks: list[tuple[int, int]]) -> None:
        """Give `req` cached blocks [(logical, prefix hash)] of this rank's pool by reference (a prefix-cache hit)."""
        new = self.bm.attach(req, blocks)
        if new:
            self.tables.append(req, new)

    def ensure_step_blocks(self, reqs, keep=None) -> None:
        """Allocate the blocks the new tokens of `reqs` touch (those `keep(q, block)` accepts, if given) and append
        them to the page table (`splash.kv.page_table.ensure_step_pages`)."""
        ensure_step_pages(self.bm, self.tables, reqs, keep)

    def sync_tables(self, reqs) -> None:
        """Rewrite the page-table rows of `reqs` from the block manager (after a switch moved their blocks)."""
        for req in reqs:
            self.tables.rewrite(req, self.bm.table(req))

    def new_logical_blocks(self, q: StepRequest) -> list[int]:
        """Logical blocks touched by the new tokens of `q`."""
        if q.num_new == 0 or (q.num_new == 1 and q.start_pos % self.block_size):
            return []  # a decode token inside a page: its page holds the previous position, so is held already
        return list(range(q.start_pos // self.block_size, (q.end_pos - 1) // self.block_size + 1))

    @torch.inference_mode()
    def step(self, batch: StepBatch | None, switch=None) -> torch.Tensor:
        """Execute one step on this rank; returns logits [len(sample_rows), vocab] (identical on all ranks).

        `switch` (a SwitchExecutor) hands off to a new layout at this step boundary: the step runs in the
        destination layout and each layer waits only for its own transferred state."""
        before = None
        if switch is not None:
            switch.begin()
            before = switch.before_layer
        if batch is None or not batch.reqs:
            if switch is not None:
                for layer in range(self.cfg.num_hidden_layers):
                    switch.before_layer(layer)
                switch.end()
            return torch.empty(0, self.cfg.vocab_size, device=self.device)
        self.executor.prepare(batch)
        hidden = self.model.forward(batch, self.executor, before)
        if switch is not None:
            switch.end()
        return self.model.logits(hidden)

    def release(self, req_id: str) -> None:
        self.bm.release(req_id)
        self.tables.release(req_id)
        if self.states is not None:
            self.states.release(req_id)
