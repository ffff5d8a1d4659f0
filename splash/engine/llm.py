"""`LLM`: the offline Python API, `LLM(model=PATH or preset=...).generate(prompt_token_ids, SamplingParams)`.

Under `mpirun -n N` every rank constructs the LLM and calls generate with the same arguments; rank 0 drives,
the others follow, and every rank returns the same outputs.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from splash.attention.kernels import kv_rope_fp8
from splash.engine.engine import Engine
from splash.engine.runner import ModelRunner, resolve_layout_kv_dtypes
from splash.engine.sampler import TokenLogprobs
from splash.engine.sampling import SamplingParams
from splash.layouts.layout import LAYOUT_NAMES, heads_fit, start_layout
from splash.layouts.memory import (common_bytes, kv_block_bytes, kv_capacity_tokens, projection_bytes_per_rank,
                                   state_snapshot_slots)
from splash.models.family import describe

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


@dataclass
class CompletionOutput:
    index: int
    token_ids: list[int]
    finish_reason: str | None = None
    logprobs: list[TokenLogprobs] | None = None   # one per token, with `SamplingParams.logprobs`


@dataclass
class RequestOutput:
    """One prompt's result; `outputs` holds the n samples (vLLM's shape), `token_ids` the first."""
    request_id: str
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    prompt_logprobs: list[TokenLogprobs | None] | None = None   # None first (vLLM's shape), with prompt_logprobs

    @property
    def token_ids(self) -> list[int]:
        return self.outputs[0].token_ids

    @property
    def finish_reason(self) -> str | None:
        return self.outputs[0].finish_reason


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


def pool_kv_dtype(cfg, kv_dtypes) -> str:
    """The widest of the layouts' KV dtypes: the pool is sized in it, so every layout's format fits the budget
    with the same block count (a narrower layout leaves bytes spare)."""
    return max(dict.fromkeys(kv_dtypes), key=lambda d: kv_block_bytes(cfg, d, 1))


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


class LLM:
    def __init__(self, model: str | None = None, preset: str | None = None, *, dtype: str = "float32",
                 layout: str = "tp", kv_cache_dtype: str = "float32", block_size: int = 16,
                 num_kv_blocks: int | None = None, kv_cache_memory_bytes: int = 64 << 20,
                 max_num_seqs: int = 256, max_num_batched_tokens: int = 2048, preemption_mode: str = "recompute",
                 max_model_len: int | None = None, seed: int = 0, switch_mode: str = "live",
                 layout_kv_dtypes: dict[str, str] | None = None, comm=None, quantization: str | None = None,
                 attention_backend: str = "torch", allowed_layouts: tuple[str, ...] = ("tp", "dp_attn", "cp", "dop"),
                 hardware_profile: str | None = "cpu", switch_margin: float = 0.10, device: str = "cpu",
                 enable_prefix_caching: bool = True):
        """`layout` pins a layout (the engine stays there unless `engine.request_layout` moves it) or is
        "auto": start in TP (DP-attn when the world does not divide the heads) and let the cost-model scheduler
        on `hardware_profile` switch among `allowed_layouts`. `layout_kv_dtypes` gives a layout its own KV dtype
        (e.g. {"dop": "fp8_e4m3"}); the others use `kv_cache_dtype`. The pool is sized in the widest of them and
        keeps its block count on a switch. `quantization` ("fp8" | "int8", vLLM's name) quantises a plain
        checkpoint's linear weights at load; FP8 and INT8 checkpoints stay quantised without it
        (splash.models.qweight). `attention_backend` names the MLA attention kernel (splash.attention.kernels:
        torch or triton). `device` is where every tensor of the engine lives (a backend's device, e.g. "cuda:0")."""
        if torch.device(device).type != "cpu":
            from splash.config.serve_config import gpu_block_size_error
            error = gpu_block_size_error(block_size, attention_backend)
            if error:
                raise ValueError(f"block_size = {block_size}: {error}")
        if comm is None:
            from splash.distributed import init_dist
            comm = init_dist().comm
        self.comm = comm
        cfg, get = load_model(model, preset, DTYPES[dtype], seed, quantization)
        auto = layout == "auto"
        if auto:
            layout = start_layout(allowed_layouts, cfg.num_attention_heads, comm.size).value
        kv_dtypes = resolve_layout_kv_dtypes(kv_cache_dtype, layout_kv_dtypes)
        blocks: int | dict[str, int] = num_kv_blocks or kv_blocks_per_layout(
            cfg, comm.size, pool_kv_dtype(cfg, kv_dtypes.values()), block_size, kv_cache_memory_bytes,
            torch.finfo(DTYPES[dtype]).bits // 8, weight_quant=quantization or cfg.quantization,
            state_requests=hybrid_states(cfg, max_num_seqs, enable_prefix_caching),
            rope_fp8=kv_rope_fp8(attention_backend, device))
        physical = max(blocks.values()) if isinstance(blocks, dict) else blocks
        self.runner = ModelRunner(cfg, get, comm, layout, kv_cache_dtype, block_size, physical, DTYPES[dtype],
                                  layout_kv_dtypes, attention_backend, device=device)
        self.engine = Engine(self.runner, comm, blocks, max_num_seqs, max_num_batched_tokens,
                             preemption_mode, max_model_len, switch_mode, tuple(allowed_layouts),
                             hardware_profile=hardware_profile if auto else None, switch_margin=switch_margin,
                             enable_prefix_caching=enable_prefix_caching)
        if not auto:
            self.engine.request_layout(layout)
        self.cfg = cfg

    def generate(self, prompts: list[list[int]],
                 params: SamplingParams | list[SamplingParams] | None = None) -> list[RequestOutput]:
        """Every rank calls this with the same arguments; every rank returns the same outputs (or raises the
        same error)."""
        if self.comm.rank != 0:
            self.engine.follow()
            result = self.comm.broadcast_obj(None)
        else:
            try:
                result = self._drive(prompts, params or SamplingParams())
            except Exception as e:  # let the followers fail the same way instead of waiting forever
                result = e
            finally:
                self.engine.stop()
            result = self.comm.broadcast_obj(result)
        if isinstance(result, Exception):
            raise result
        return result

    def _drive(self, prompts, params) -> list[RequestOutput]:
        plist = params if isinstance(params, list) else [params] * len(prompts)
        if len(plist) != len(prompts):
            raise ValueError(f"got {len(plist)} SamplingParams for {len(prompts)} prompts")
        outs: list[RequestOutput] = []
        index: dict[str, tuple[RequestOutput, CompletionOutput]] = {}
        for i, (p, sp) in enumerate(zip(prompts, plist)):
            out = RequestOutput(f"gen-{i}", list(p), [])
            for j in range(sp.n):
                seed = None if sp.seed is None else sp.seed + j
                rid = self.engine.add_request(list(p), replace(sp, n=1, seed=seed), f"gen-{i}-{j}")
                index[rid] = out, CompletionOutput(j, [], logprobs=None if sp.logprobs is None else [])
                out.outputs.append(index[rid][1])
            outs.append(out)
        while self.engine.has_work():
            for ev in self.engine.step():
                out, c = index[ev.req_id]
                c.token_ids.append(ev.token)
                if ev.logprobs is not None:
                    c.logprobs.append(ev.logprobs)
                if ev.prompt_logprobs is not None and out.prompt_logprobs is None:
                    out.prompt_logprobs = [None, *ev.prompt_logprobs]
                if ev.finish_reason:
                    c.finish_reason = ev.finish_reason
            for rid, _ in self.engine.take_failures():
                index[rid][1].finish_reason = "error"   # sampling failed for this request alone
        return outs
