"""The step loop shared by every rank: rank 0 schedules and samples, every rank executes the broadcast plan.

Protocol: each step rank 0 broadcasts one small message — a step plan (`kind="step"`), a layout switch
(`kind="switch"`) or `kind="stop"` — and all ranks act on it in the same order, so collectives always match.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch

from splash.attention.batch import StepBatch, StepRequest
from splash.engine.ledger import KVLedger
from splash.engine.sampling import SamplingParams, make_generator, sample
from splash.engine.scheduler import Request, Scheduler, StepPlan


@dataclass
class TokenEvent:
    req_id: str
    token: int
    finish_reason: str | None


class Engine:
    def __init__(self, runner, comm, blocks_per_rank: int, max_num_seqs: int = 256,
                 max_num_batched_tokens: int = 2048, preemption_mode: str = "recompute",
                 max_model_len: int | None = None):
        self.runner, self.comm = runner, comm
        # A request must fit the KV pool on its own, or recompute-preemption would loop forever (it preempts
        # itself and is re-admitted); cap the length at one request's share of the pool, as vLLM requires.
        kv_tokens = blocks_per_rank * runner.block_size * (comm.size if runner.layout == "cp" else 1)
        self.max_model_len = min(max_model_len or runner.cfg.max_position_embeddings, kv_tokens)
        self.ledger = KVLedger(comm.size, blocks_per_rank, runner.block_size, runner.layout)
        self.scheduler = Scheduler(self.ledger, max_num_seqs, max_num_batched_tokens, preemption_mode)
        self.params: dict[str, SamplingParams] = {}
        self.gens: dict[str, torch.Generator | None] = {}
        self.num_steps = 0
        self._ids = itertools.count()

    # ---- rank 0 API ------------------------------------------------------------------------------------
    def add_request(self, prompt: list[int], params: SamplingParams, req_id: str | None = None) -> str:
        req_id = req_id or f"req-{next(self._ids)}"
        if not prompt:
            raise ValueError("prompt must contain at least one token")
        if len(prompt) >= self.max_model_len:
            raise ValueError(f"prompt has {len(prompt)} tokens; max_model_len is {self.max_model_len} "
                             "(capped by the KV pool size)")
        stop = set(params.stop_token_ids)
        if not params.ignore_eos:
            stop |= set(self.runner.cfg.eos_ids)
        self.scheduler.add(Request(req_id, list(prompt), params.max_tokens, frozenset(stop), self.max_model_len))
        self.params[req_id] = params
        self.gens[req_id] = make_generator(params)
        return req_id

    def abort(self, req_id: str) -> None:
        self.scheduler.abort(req_id)
        self._forget(req_id)

    def has_work(self) -> bool:
        return self.scheduler.has_work()

    def step(self) -> list[TokenEvent]:
        plan = self.scheduler.schedule()
        msg = {"kind": "step", "items": [(s.req_id, s.start_pos, s.tokens, s.sample, s.owner) for s in plan.items],
               "release": plan.release}
        self.comm.broadcast_obj(msg)
        logits = self._execute(msg)
        sampled: dict[str, int] = {}
        rows = iter(range(logits.shape[0]))
        for s in plan.items:
            if s.sample:
                sampled[s.req_id] = sample(logits[next(rows)], self.params[s.req_id], self.gens[s.req_id])
        done = {r.req_id: r.finish_reason for r in self.scheduler.update(plan, sampled)}
        for rid in done:
            self._forget(rid)
        return [TokenEvent(rid, tok, done.get(rid)) for rid, tok in sampled.items()]

    def stop(self) -> None:
        self.comm.broadcast_obj({"kind": "stop"})

    # ---- every rank --------------------------------------------------------------------------------------
    def follow(self) -> None:
        """Non-zero ranks: execute broadcast messages until told to stop."""
        while True:
            msg = self.comm.broadcast_obj(None)
            if msg["kind"] == "stop":
                return
            self._execute(msg)

    def _execute(self, msg: dict) -> torch.Tensor:
        for rid in msg["release"]:
            self.runner.release(rid)
        self.num_steps += 1
        items = msg["items"]
        if not items:
            return torch.empty(0)
        reqs = [StepRequest(rid, start, len(toks), owner) for rid, start, toks, _, owner in items]
        batch = StepBatch.build(reqs, [list(t) for _, _, t, _, _ in items], [s for _, _, _, s, _ in items])
        return self.runner.step(batch)

    def _forget(self, req_id: str) -> None:
        self.params.pop(req_id, None)
        self.gens.pop(req_id, None)

    # ==== BEGIN server accessors (issue 5) — thin read-only views for splash-serve's metrics/console/API. ====
    # Temporary: replace with the switching engine's own attributes when live switching lands (its
    # `layout`, `layout_mode`, `switch_counts`, `kv_capacity_tokens()`... supersede these; `request_layout`
    # is deliberately NOT defined here, so POST /v1/layout answers 501 until the real switch exists).
    @property
    def layout(self) -> str:
        return self.runner.layout

    @property
    def layout_mode(self) -> str:
        return "pinned"  # no scheduler switches layouts yet

    @property
    def switch_counts(self) -> dict[tuple[str, str], int]:
        return {}

    def kv_capacity_tokens(self) -> dict[str, int]:
        """Distinct KV tokens the pool could hold in each layout (TP replicates every token on every rank)."""
        per_rank = self.ledger.blocks_per_rank * self.ledger.block_size
        return {lay: per_rank * (1 if lay == "tp" else self.ledger.world) for lay in ("tp", "dp_attn", "cp", "dop")}

    def kv_used_tokens(self) -> int:
        return sum(tokens for tokens, _ in self.ledger.reqs.values())

    def kv_used_blocks_per_rank(self) -> list[int]:
        return list(self.ledger.used)
    # ==== END server accessors (issue 5) ====
