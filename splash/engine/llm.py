"""`LLM`: the offline Python API, `LLM(model=PATH or preset=...).generate(prompt_token_ids, SamplingParams)`.

Under `mpirun -n N` every rank constructs the LLM and calls generate with the same arguments; rank 0 drives,
the others follow, and every rank returns the same outputs.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

from splash.engine.build import EngineArgs, build_engine
from splash.engine.sampler import TokenLogprobs
from splash.engine.sampling import SamplingParams


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


def on_rank0(comm, engine, fn):
    """Run `fn()` on rank 0 while the other ranks follow `engine`; every rank returns its result (or raises
    its exception). `fn` drives `engine.step()`; the engine is stopped on rank 0 whatever happens."""
    if comm.rank != 0:
        engine.follow()
        res = comm.broadcast_obj(None)
    else:
        try:
            res = fn()
        except Exception as e:  # noqa: BLE001 — the followers fail the same way instead of waiting forever
            res = e
        finally:
            engine.stop()
        res = comm.broadcast_obj(res)
    if isinstance(res, Exception):
        raise res
    return res


class LLM:
    def __init__(self, model: str | None = None, preset: str | None = None, *, comm=None, **kwargs):
        """`kwargs` are `EngineArgs`' (splash.engine.build: vLLM's names); with a pinned `layout` the engine
        stays there unless `engine.request_layout` moves it, and consults no cost model."""
        args = EngineArgs(model, preset, **kwargs)
        if comm is None:
            from splash.distributed import init_dist
            comm = init_dist().comm
        self.comm = comm
        self.engine = build_engine(args if args.layout == "auto" else replace(args, hardware_profile=None), comm)
        self.runner, self.cfg = self.engine.runner, self.engine.runner.cfg

    def generate(self, prompts: list[list[int]],
                 params: SamplingParams | list[SamplingParams] | None = None) -> list[RequestOutput]:
        """Every rank calls this with the same arguments; every rank returns the same outputs (or raises the
        same error)."""
        return on_rank0(self.comm, self.engine, lambda: self._drive(prompts, params or SamplingParams()))

    def update_weights(self, model_path: str) -> None:
        """Every rank calls this: load `model_path`'s weights (the served architecture) into every rank's current
        layout, as vLLM's `collective_rpc("reload_weights")` / SGLang's `update_weights_from_disk` do between
        rollouts; the prefix cache is emptied. ValueError (nothing changed) when a rank cannot load them."""
        on_rank0(self.comm, self.engine, lambda: self.engine.update_weights(model_path))

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
