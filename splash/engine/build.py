"""Building a rank's engine: `EngineArgs` (vLLM's names) and `build_engine`, the one recipe the offline `LLM` and
splash-serve both run — load the model, resolve each layout's KV dtype, size the KV pool per layout, pick the start
layout, build the `ModelRunner` and the `Engine`. Callers keep only what is theirs: where the KV budget comes from,
a progress bar, and how a failed step is worded."""
from __future__ import annotations

from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from typing import Any, Callable, ContextManager

import torch

from splash.attention.kernels import kv_rope_fp8
from splash.engine.engine import Engine
from splash.engine.runner import ModelRunner, resolve_layout_kv_dtypes
from splash.layouts.layout import LAYOUT_NAMES, heads_fit, start_layout
from splash.layouts.memory import (common_bytes, kv_block_bytes, kv_capacity_tokens, projection_bytes_per_rank,
                                   state_snapshot_slots)
from splash.models.family import describe
from splash.models.weights import expected_shapes

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def load_model(model: str | None, preset: str | None, dtype: torch.dtype, seed: int = 0,
               quantization: str | None = None):
    """(ModelConfig, getter) for a checkpoint directory or a preset name; `quantization` ("fp8"/"int8")
    quantises plain linear weights at load (a quantised checkpoint is kept as stored without it)."""
    from splash.models.loader import open_checkpoint, quantizing_getter
    if model:
        return open_checkpoint(model, dtype, quantization)
    from splash.models.presets import preset_config, preset_getter
    name = preset or "tiny-mla"
    return preset_config(name), quantizing_getter(preset_getter(name, seed, dtype), quantization, dtype)


def kv_blocks_per_layout(cfg, world: int, kv_dtype: str, block_size: int, budget_bytes: int,
                         weight_bytes: int, layouts=LAYOUT_NAMES, weight_quant: str | None = None,
                         state_requests: int = 0, rope_fp8: bool = False) -> dict[str, int]:
    """Usable KV blocks per rank in each layout (splash.layouts.memory.kv_capacity_tokens) for a per-rank budget
    that is the KV pool of the most compact layout (head-sharded projections): a layout replicating the projections
    spends the difference on them. The physical pool is the largest entry. A hybrid model's `state_requests` KDA
    states (`hybrid_states`) live in the same budget; `rope_fp8`: the pool keeps an fp8 layer's rope key in e4m3."""
    block = kv_block_bytes(cfg, kv_dtype, block_size, rope_fp8)
    usable = [lay for lay in layouts if heads_fit(lay, cfg.num_attention_heads, world)]  # others: not at this world
    base = min(projection_bytes_per_rank(cfg, lay, world, weight_bytes, weight_quant) for lay in usable)
    rank_bytes = (budget_bytes // block) * block + base + common_bytes(cfg, world, weight_bytes, weight_quant)
    return {lay: kv_capacity_tokens(cfg, lay, world, rank_bytes, weight_bytes, kv_dtype, block_size,
                                    weight_quant=weight_quant, state_requests=state_requests,
                                    rope_fp8=rope_fp8).blocks_per_rank
            for lay in usable}


def hybrid_states(cfg, max_num_seqs: int, prefix_caching: bool) -> int:
    """KDA states a hybrid model's budget holds: every running request's, and the prefix cache's snapshots."""
    if not describe(cfg).recurrent:
        return 0
    return max_num_seqs + state_snapshot_slots(cfg, max_num_seqs, prefix_caching)


@dataclass(frozen=True)
class EngineArgs:
    """What an engine is built from. `layout` pins one or is "auto": start in TP (DP-attn when the world does not
    divide the heads) and let the cost model on `hardware_profile` switch among `allowed_layouts`.
    `layout_kv_dtypes` gives a layout its own KV dtype (e.g. {"dop": "fp8_e4m3"}), the others use `kv_cache_dtype`;
    the pool, sized in the widest, is `num_kv_blocks` pages per rank, else what `kv_cache_memory_bytes` per rank
    holds. `quantization` ("fp8" | "int8") quantises a plain checkpoint's linear weights at load (splash.models.
    qweight). `attention_backend`: splash.attention.kernels; `device`: where the engine's tensors live."""
    model: str | None = None
    preset: str | None = None
    dtype: str = "float32"
    layout: str = "tp"
    kv_cache_dtype: str = "float32"
    block_size: int = 16
    num_kv_blocks: int | None = None
    kv_cache_memory_bytes: int = 64 << 20
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    preemption_mode: str = "recompute"
    max_model_len: int | None = None
    seed: int = 0
    switch_mode: str = "live"
    layout_kv_dtypes: dict[str, str] | None = None
    quantization: str | None = None
    attention_backend: str = "torch"
    allowed_layouts: tuple[str, ...] = ("tp", "dp_attn", "cp", "dop")
    hardware_profile: str | None = "cpu"
    switch_margin: float = 0.10
    device: str = "cpu"
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True

    def __post_init__(self):
        if torch.device(self.device).type != "cpu":   # refused before anything touches the device
            from splash.config.serve_config import gpu_block_size_error
            error = gpu_block_size_error(self.block_size, self.attention_backend)
            if error:
                raise ValueError(f"block_size = {self.block_size}: {error}")

    @property
    def weight_bytes(self) -> int:
        return torch.finfo(DTYPES[self.dtype]).bits // 8

    def initial_layout(self, world: int = 1, num_heads: int | None = None) -> str:
        """The pinned layout, or auto's starting one (splash.layouts.layout.start_layout)."""
        if self.layout != "auto":
            return self.layout
        return start_layout(self.allowed_layouts, num_heads, world).value

    def kv_dtypes(self) -> dict[str, str]:
        """Every layout's KV dtype; ValueError naming kv_cache_dtype or layout_kv_dtypes on a bad one."""
        return resolve_layout_kv_dtypes(self.kv_cache_dtype, self.layout_kv_dtypes)

    def pool_kv_dtype(self, mcfg) -> str:
        """The widest of the layouts' KV dtypes: the pool is sized in it, so every layout's format fits the budget
        with the same block count (a narrower layout leaves bytes spare)."""
        return max(dict.fromkeys(self.kv_dtypes().values()), key=lambda d: kv_block_bytes(mcfg, d, 1))

    def weight_quant(self, mcfg) -> str | None:
        return self.quantization or mcfg.quantization

    def kv_blocks(self, mcfg, world: int, budget_bytes: int, rope_fp8: bool) -> dict[str, int]:
        """Usable KV blocks per rank in each layout from a per-rank KV budget, in the widest layout KV dtype."""
        return kv_blocks_per_layout(mcfg, world, self.pool_kv_dtype(mcfg), self.block_size, budget_bytes,
                                    self.weight_bytes, weight_quant=self.weight_quant(mcfg), rope_fp8=rope_fp8,
                                    state_requests=hybrid_states(mcfg, self.max_num_seqs, self.enable_prefix_caching))


class BuildStep(ValueError):
    """A ValueError from one build step: "model", "pool", "runner" (`layout`: the one built) or "engine"."""

    def __init__(self, step: str, message: str, layout: str | None = None):
        super().__init__(message)
        self.step, self.layout = step, layout


@contextmanager
def _step(name: str, strict: bool, layout: str | None = None):
    try:
        yield
    except ValueError as e:
        raise BuildStep(name, str(e), layout) if strict else e


def build_engine(args: EngineArgs, comm: Any, step_comm: Any = None, *,
                 kv_budget: Callable[[Any], int | None] | None = None,
                 loading: Callable[[int], ContextManager[Callable[[], None]]] | None = None, streams: Any = None,
                 strict: bool = False) -> Engine:
    """This rank's Engine. `step_comm` carries step plans (default `comm`); `kv_budget(model_cfg)`: the KV bytes
    per rank (None: `args.kv_cache_memory_bytes`); `loading(tensors)` yields an `advance()` per tensor read;
    `streams` run switch transfers (backends.base). `strict` (splash-serve): a pool without a page is refused before
    the weights load, and a ValueError comes as a `BuildStep` for the caller to word."""
    with _step("model", strict):
        mcfg, get = load_model(args.model, args.preset, DTYPES[args.dtype], args.seed, args.quantization)
    blocks: int | dict[str, int] = args.num_kv_blocks or args.kv_blocks(
        mcfg, comm.size, (kv_budget and kv_budget(mcfg)) or args.kv_cache_memory_bytes,
        kv_rope_fp8(args.attention_backend, args.device))
    physical = max(blocks.values()) if isinstance(blocks, dict) else blocks
    if strict and physical < 1:
        raise BuildStep("pool", "the KV budget holds no KV page")
    layout = args.initial_layout(comm.size, mcfg.num_attention_heads)
    with loading(len(expected_shapes(mcfg))) if loading else nullcontext(lambda: None) as advance:
        def counted(tensor: str) -> Any:   # each tensor read moves the progress bar
            out = get(tensor)
            advance()
            return out
        with _step("runner", strict, layout):
            runner = ModelRunner(mcfg, counted, comm, layout, args.kv_cache_dtype, args.block_size, physical,
                                 DTYPES[args.dtype], args.kv_dtypes(), args.attention_backend, device=args.device,
                                 streams=streams)
    with _step("engine", strict):
        engine = Engine(runner, comm if step_comm is None else step_comm, blocks, args.max_num_seqs,
                        args.max_num_batched_tokens, args.preemption_mode, args.max_model_len, args.switch_mode,
                        tuple(args.allowed_layouts), hardware_profile=args.hardware_profile,
                        switch_margin=args.switch_margin, enable_prefix_caching=args.enable_prefix_caching,
                        seed=args.seed)
        engine.request_layout(args.layout)   # a pinned layout stays unless request_layout moves it; or auto
    engine.loader = lambda path: load_model(path, None, DTYPES[args.dtype], args.seed, args.quantization)
    engine.scheduler.chunked_prefill = args.enable_chunked_prefill
    return engine
