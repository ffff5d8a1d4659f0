"""Drive the engine in-process under mpirun for benchmarks: every rank builds the same `LLM`; rank 0 adds the
requests and steps the engine (queueing, chunked prefill, decode), the other ranks follow its step plans.

`run_point` times one batch of requests end to end on rank 0 and returns the same figures on every rank.
"""
from __future__ import annotations

import dataclasses
import os
import random
import statistics
import time
from typing import Any

from splash.engine.llm import on_rank0
from splash.engine.sampling import SamplingParams


def describe_model(args, mcfg) -> dict[str, Any]:
    """The model a sweep ran (`args`: its splash.engine.build.EngineArgs), for the result's environment."""
    return {"name": os.path.basename(args.model.rstrip("/")) if args.model else args.preset,
            "source": args.model or f"preset {args.preset}", "dtype": args.dtype,
            "kv_cache_dtype": args.kv_cache_dtype, "layout_kv_dtypes": args.layout_kv_dtypes,
            "block_size": args.block_size, "num_hidden_layers": mcfg.num_hidden_layers,
            "hidden_size": mcfg.hidden_size, "num_attention_heads": mcfg.num_attention_heads,
            "kv_lora_rank": mcfg.kv_lora_rank, "qk_rope_head_dim": mcfg.qk_rope_head_dim,
            "vocab_size": mcfg.vocab_size}


def pool_blocks(max_batch: int, max_tokens: int, block_size: int) -> int:
    """KV pages per rank that hold `max_batch` requests of `max_tokens` in every layout (TP holds all of them
    on every rank), with one spare page per request for the step that appends."""
    return max_batch * (-(-max_tokens // block_size) + 1) + 8


def build_llm(args, comm, layout: str, blocks: int):
    """The LLM of `args` (splash.engine.build.EngineArgs) on this rank, started in `layout` and pinned there (no
    automatic switching), with `blocks` KV pages unless `args` gives a count."""
    from splash.engine.llm import LLM

    args = dataclasses.replace(args, layout=layout, num_kv_blocks=args.num_kv_blocks or blocks)
    return LLM(comm=comm, **dataclasses.asdict(args))


def layout_unavailable(llm, layout: str) -> str | None:
    """Why `layout` cannot run on this engine (e.g. the heads do not divide over the ranks), or None."""
    try:
        llm.engine.control.request(layout)
    except ValueError as e:
        return str(e)
    finally:
        llm.engine.control.request(llm.engine.layout)
    return None


def switch_to(llm, comm, layout: str) -> None:
    """Pin `layout` and let the idle engine switch to it (untimed; nothing is resident)."""
    eng = llm.engine
    eng.request_layout(layout)

    def go():
        while eng.has_work():
            eng.step()
        return eng.layout

    got = on_rank0(comm, eng, go)
    if got != layout:
        raise RuntimeError(f"switch to {layout} did not happen (engine is in {got}; "
                           f"{eng.control.last_deferral or 'no reason logged'})")


def make_prompts(batch: int, input_len: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(input_len)] for _ in range(batch)]


def run_point(llm, comm, prompts: list[list[int]], output_len: int) -> dict[str, Any]:
    """One timed batch: add every prompt at once, step until all finish (greedy, EOS ignored)."""
    eng = llm.engine
    params = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)

    def drive():
        t0 = time.perf_counter()
        steps0 = eng.num_steps
        for i, p in enumerate(prompts):
            eng.add_request(p, params, f"bench-{i}")
        first: dict[str, float] = {}
        tokens = 0
        while eng.has_work():
            events = eng.step()
            now = time.perf_counter() - t0
            tokens += len(events)
            for ev in events:
                first.setdefault(ev.req_id, now)
        wall = time.perf_counter() - t0
        n_in = sum(map(len, prompts))
        return {"wall_s": wall, "output_tokens": tokens, "steps": eng.num_steps - steps0,
                "output_tokens_per_s": tokens / wall, "total_tokens_per_s": (tokens + n_in) / wall,
                "ttft_median_s": statistics.median(first.values()) if first else None,
                "ttft_max_s": max(first.values()) if first else None}

    comm.barrier()
    return on_rank0(comm, eng, drive)
