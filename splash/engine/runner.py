"""ModelRunner: one rank's weights, paged KV pool, block manager and current layout executor."""
from __future__ import annotations

import torch

from splash.attention.batch import StepBatch, StepRequest
from splash.kv.block_manager import BlockManager
from splash.kv.paged_cache import PagedLatentCache
from splash.models.build import build_weights
from splash.models.config import ModelConfig
from splash.models.deepseek import DeepseekV3Model


class ModelRunner:
    def __init__(self, cfg: ModelConfig, get, comm, layout: str = "tp", kv_dtype: str = "float32",
                 block_size: int = 16, num_blocks: int = 256, dtype: torch.dtype = torch.float32):
        from splash.attention.executors import head_range_for, make_executor

        self.cfg, self.comm, self.layout = cfg, comm, layout
        self.block_size, self.kv_dtype, self.dtype = block_size, kv_dtype, dtype
        self.heads = head_range_for(layout, cfg.num_attention_heads, comm.size, comm.rank)
        self.weights = build_weights(cfg, get, self.heads, comm.rank, comm.size)
        self.model = DeepseekV3Model(cfg, self.weights, comm)
        self.cache = PagedLatentCache(cfg.num_hidden_layers, num_blocks, block_size, cfg.kv_lora_rank,
                                      cfg.qk_rope_head_dim, kv_dtype)
        self.bm = BlockManager(num_blocks, block_size)
        self.executor = make_executor(layout, self)

    def new_logical_blocks(self, q: StepRequest) -> list[int]:
        """Logical blocks touched by the new tokens of `q`."""
        if q.num_new == 0:
            return []
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
            return torch.empty(0, self.cfg.vocab_size)
        self.executor.prepare(batch)
        hidden = self.model.forward(batch, self.executor, before)
        if switch is not None:
            switch.end()
        return self.model.logits(hidden)

    def release(self, req_id: str) -> None:
        self.bm.release(req_id)
