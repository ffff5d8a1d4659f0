"""ModelRunner: one rank's weights, paged KV pool, block manager and current layout executor.

Each layout may store KV in its own dtype (`layout_kv_dtypes`, e.g. fp8 in DOP for capacity, bf16 in TP); a
switch converts the pool (see splash.switching.executor). The pool keeps its block count across formats, so a
layout with a narrower KV dtype leaves bytes spare: per-layout capacity stays counted in blocks.
"""
from __future__ import annotations

from collections.abc import Mapping

import torch

from splash.attention.batch import StepBatch
from splash.attention.context import LayoutState, RankContext, layout_state
from splash.engine.hybrid_setup import build_hybrid
from splash.engine.rank_model import build_dense, rank_weights
from splash.kv import quant
from splash.kv.block_manager import BlockManager
from splash.kv.page_table import PageTable
from splash.layouts.layout import LAYOUT_NAMES as LAYOUTS, parse_layout
from splash.models.config import ModelConfig
from splash.models.family import describe
from splash.models.weights import weight_tensors


def resolve_layout_kv_dtypes(default: str, overrides: Mapping[str, str] | None = None) -> dict[str, str]:
    """KV dtype of every layout: `default`, replaced per layout by `overrides` (layout name → KV dtype).
    ValueError naming layout_kv_dtypes on an unknown layout or dtype."""
    if default not in quant.KV_DTYPES:
        raise ValueError(f"kv_cache_dtype {default!r} is not one of {', '.join(quant.KV_DTYPES)}")
    out = dict.fromkeys(LAYOUTS, default)
    for name, kv in (overrides or {}).items():
        try:
            lay = parse_layout(name).value
        except ValueError:
            raise ValueError(f"layout_kv_dtypes: unknown layout {name!r} (layouts: {', '.join(LAYOUTS)})") from None
        if kv not in quant.KV_DTYPES:
            raise ValueError(f"layout_kv_dtypes[{name!r}] = {kv!r} is not one of {', '.join(quant.KV_DTYPES)}")
        out[lay] = kv
    return out


class ModelRunner:
    """One rank: the model built for it (`RankModel`), its pool's block manager and page table, and the current
    layout's state and executor. Executors and the switch executor get `ctx` (splash.attention.context), the
    layout-independent state; the layout-dependent state changes only through `adopt`."""

    def __init__(self, cfg: ModelConfig, get, comm, layout: str = "tp", kv_dtype: str = "float32",
                 block_size: int = 16, num_blocks: int = 256, dtype: torch.dtype = torch.float32,
                 layout_kv_dtypes: Mapping[str, str] | None = None, attention_backend: str = "torch",
                 device: str | torch.device = "cpu", streams=None):
        from splash.attention.kernels import kv_rope_fp8, make_kernel   # late: tests stand in for these

        layout = parse_layout(layout).value
        # every tensor of this rank lives on `device`; `streams` (backends.base) runs switch transfers on a side
        # stream (None: inline, as on CPU)
        self.device, self.streams = torch.device(device), streams
        self.layout_kv_dtypes = resolve_layout_kv_dtypes(kv_dtype, layout_kv_dtypes)
        self.block_size, self.dtype = block_size, dtype
        # layer kinds, pools, recurrent state and shardable heads of the model's family (splash.models.family)
        family = describe(cfg)
        state = layout_state(layout, family, comm.size, comm.rank, self.layout_kv_dtypes[layout])
        build = build_hybrid if family.recurrent else build_dense
        built = build(cfg, family, get, comm, state, num_blocks, block_size, self.device,
                      rope_fp8=kv_rope_fp8(attention_backend, self.device))
        self.model, self.weight_quant = built.model, built.weight_quant
        # the block manager's tables mirrored as tensors (PageTable), for the attention kernel
        self.ctx = RankContext(cfg, family, comm, built.weights, built.cache, BlockManager(num_blocks, block_size),
                               PageTable(block_size, device=self.device),
                               make_kernel(attention_backend, cfg.softmax_scale), self.model.rope, block_size,
                               built.states)
        self.adopt(state)

    def adopt(self, state: LayoutState) -> None:
        """Enter `state`'s layout (at start-up, and when a switch hands off): the one place the layout, this
        rank's heads, the KV dtype and the executor change."""
        from splash.attention.executors import make_executor

        self._state, self._executor = state, make_executor(state, self.ctx)

    def load_weights(self, get) -> list[torch.Tensor]:
        """This rank's weights for its current layout read through `get`, built as at start-up and checked tensor
        by tensor (shape, dtype) against the served ones: ValueError naming the first that differs. Nothing served
        changes; `commit_weights` puts them in place."""
        fresh = rank_weights(self.cfg, self.family, get, self.comm, self._state, self.device)
        old, new = list(weight_tensors(self.weights)), list(weight_tensors(fresh))
        if len(old) != len(new):
            raise ValueError(f"the checkpoint's weights are {len(new)} tensors on this rank, the served model's "
                             f"{len(old)}: a different architecture or quantisation")
        for i, (a, b) in enumerate(zip(old, new)):
            if a.shape != b.shape or a.dtype != b.dtype or a.device != b.device:
                raise ValueError(f"the checkpoint's weight tensor {i} is {tuple(b.shape)} {b.dtype} on {b.device}, "
                                 f"the served model's {tuple(a.shape)} {a.dtype} on {a.device}")
        return new

    @torch.inference_mode()
    def commit_weights(self, tensors: list[torch.Tensor]) -> None:
        """Copy `load_weights`' tensors into the served ones (every holder of a weight sees the new values); the
        executors are made again over them, and what the old weights wrote goes: the KV pool is zeroed (an update
        runs on an idle engine), a hybrid model's KDA snapshots are dropped. In inference mode: the tensors a switch
        made (in a step) are inference tensors, which only it may change in place."""
        for old, new in zip(weight_tensors(self.weights), tensors):
            old.copy_(new)
        self.ctx.cache.clear()
        self.adopt(self._state)
        if self.states is not None:
            self.states.clear_snapshots()

    # this rank's layout-independent state, read through the context the executors share
    cfg = property(lambda self: self.ctx.cfg)
    comm = property(lambda self: self.ctx.comm)
    family = property(lambda self: self.ctx.family)
    weights = property(lambda self: self.ctx.weights)
    cache = property(lambda self: self.ctx.cache)
    bm = property(lambda self: self.ctx.blocks)
    tables = property(lambda self: self.ctx.tables)
    attn = property(lambda self: self.ctx.attn)
    # per-request recurrent state (KDA layers of glm5_next, see splash.kv.recurrent); None for other models
    states = property(lambda self: self.ctx.states)
    # the pool keeps an fp8 layer's rope key in e4m3 (splash.layouts.memory.rope_fp8_pool): what every byte count of
    # it — switch plans, headroom, the cost model — is handed
    rope_fp8 = property(lambda self: self.ctx.cache.rope_fp8)

    @property
    def layout_state(self) -> LayoutState:
        return self._state

    @property
    def layout(self) -> str:
        return self._state.layout

    @property
    def kv_dtype(self) -> str:
        """The current layout's KV dtype (a switch adopts the destination's)."""
        return self._state.kv_dtype

    @property
    def executor(self):
        return self._executor

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

    @torch.inference_mode()
    def step(self, batch: StepBatch | None, switch=None) -> torch.Tensor:
        """Execute one step on this rank; returns logits [len(sample_rows), vocab] (identical on all ranks).
        `switch` (a SwitchExecutor) hands off to a new layout at this step boundary: the step runs in the
        destination layout and each layer waits only for its own transferred state."""
        before = None
        if switch is not None:
            self.adopt(switch.begin())
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
