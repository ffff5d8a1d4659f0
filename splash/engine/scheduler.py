"""Continuous batching with chunked prefill and KV-aware admission — pure Python, no torch.

Policy: every step first gives each running request its next piece (one decode token, or the next prefill
chunk) in admission order, then admits waiting requests while the token budget, `max_num_seqs` and KV
capacity allow (a waiting request's whole prompt must fit, with a spare block per running request). When a
running request cannot grow because the pool is full, the most recently admitted running request holding blocks
on the full rank (any, in TP; the request's owner's, in DP-attn/DOP) is preempted and recomputed later (vLLM's
default "recompute"); with `preemption_mode="queue"` the request that cannot grow simply waits for this step.
A new request's owner is the rank whose requests will hold the fewest blocks at their end (`KVLedger.pick_owner`).
With ``chunked_prefill`` off, a prompt is never split: it is scheduled only in a step whose remaining token budget
holds all of it (the serving config then requires ``max_num_batched_tokens >= max_model_len``, so every prompt
fits an empty step).
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from splash.engine.ledger import KVLedger


@dataclass
class Request:
    req_id: str
    prompt: list[int]
    max_tokens: int
    stop_ids: frozenset[int] = frozenset()
    max_len: int = 1 << 30
    min_tokens: int = 0          # a stop id ends the request only after this many tokens (vLLM's min_tokens)
    output: list[int] = field(default_factory=list)
    num_cached: int = 0          # tokens whose KV is in the cache
    finish_reason: str | None = None

    @property
    def tokens(self) -> list[int]:
        return self.prompt + self.output

    @property
    def pending(self) -> int:
        return len(self.prompt) + len(self.output) - self.num_cached

    @property
    def num_tokens(self) -> int:
        return len(self.prompt) + len(self.output)

    def token_slice(self, a: int, b: int) -> tuple[int, ...]:
        """tokens[a:b] without building prompt + output (O(b - a), not O(context))."""
        p = len(self.prompt)
        if b <= p:
            return tuple(self.prompt[a:b])
        if a >= p:
            return tuple(self.output[a - p:b - p])
        return tuple(self.prompt[a:]) + tuple(self.output[:b - p])


@dataclass(frozen=True)
class Scheduled:
    req_id: str
    start_pos: int
    tokens: tuple[int, ...]
    sample: bool
    owner: int


@dataclass
class StepPlan:
    items: list[Scheduled]
    release: list[str]           # requests whose KV every rank frees before running the step


class Scheduler:
    def __init__(self, ledger: KVLedger, max_num_seqs: int = 256, max_num_batched_tokens: int = 2048,
                 preemption_mode: str = "recompute"):
        self.ledger = ledger
        self.max_num_seqs, self.budget = max_num_seqs, max_num_batched_tokens
        self.preemption_mode = preemption_mode
        self.chunked_prefill = True
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self._release: list[str] = []
        self.num_preemptions = 0

    def add(self, req: Request) -> None:
        self.requests[req.req_id] = req
        self.waiting.append(req)

    def abort(self, req_id: str) -> None:
        req = self.requests.pop(req_id, None)
        if req is None:
            return
        if req in self.waiting:
            self.waiting.remove(req)
        if req in self.running:
            self.running.remove(req)
            self._free(req)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self._release)

    def _free(self, req: Request) -> None:
        self.ledger.release(req.req_id)
        self._release.append(req.req_id)

    def _preempt(self, victim: Request) -> None:
        self.running.remove(victim)
        self._free(victim)
        victim.num_cached = 0
        self.waiting.appendleft(victim)
        self.num_preemptions += 1

    def _victim(self, req: Request, budget: int) -> Request:
        """Whom to preempt so that `req` can grow: the newest running request (`req` itself included) that holds
        blocks on a rank lacking room. In DP-attn/DOP that is the newest on `req`'s owner: the newest anywhere
        may live on another rank, and freeing it would not help."""
        owner = self.ledger.reqs.get(req.req_id, (0, 0))[1]
        short = self.ledger.short_ranks(req.req_id, req.num_cached + min(req.pending, budget), owner)
        for r in reversed(self.running):
            if r is req or any(self.ledger.holds(r.req_id, k) for k in short):
                return r
        return self.running[-1]

    def _admissible(self, req: Request) -> int | None:
        """A waiting request joins only when all of its pending tokens — the whole prompt, or a preempted request's
        whole context — fit the ranks it will live on, with one spare block there per running request (room for
        their next blocks). Admitting whatever chunk fits let a full pool take a preempted request back a chunk at
        a time, only to preempt it again a few steps later: at capacity a DP-attn rollout re-prefilled a 2,048-token
        chunk every step (5 s steps; docs/benchmarks.md, round 12). -> the owner it would get, or None."""
        owner = self.ledger.pick_owner()
        need = self.ledger.growth(req.req_id, req.num_cached + req.pending, owner)
        spare = self.ledger.holder_counts()
        cap = self.ledger.cap()
        if any(n and self.ledger.used[r] + n + spare[r] > cap for r, n in enumerate(need)):
            return None
        return owner

    def _piece(self, req: Request, budget: int, owner: int | None = None) -> Scheduled | None:
        n = min(req.pending, budget)
        if n <= 0 or (n < req.pending and not self.chunked_prefill):
            return None
        end = req.num_cached + n
        if owner is None:
            known = self.ledger.reqs.get(req.req_id)  # pick_owner is O(requests): only for new requests
            owner = known[1] if known is not None else self.ledger.pick_owner()
        if not self.ledger.can_grow(req.req_id, end, owner):
            return None
        self.ledger.grow(req.req_id, end, owner, final=min(len(req.prompt) + req.max_tokens, req.max_len))
        toks = req.token_slice(req.num_cached, end)
        return Scheduled(req.req_id, req.num_cached, toks, end == req.num_tokens, owner)

    def schedule(self) -> StepPlan:
        items: list[Scheduled] = []
        budget = self.budget
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            item = self._piece(req, budget)
            fits = self.chunked_prefill or req.pending <= budget   # else it waits for a step with room
            if item is None and req.pending > 0 and fits and self.preemption_mode == "recompute":
                self._preempt(self._victim(req, budget))
                continue  # retry the same request with more room (or, if it was the victim, the next one)
            if item is not None:
                items.append(item)
                budget -= len(item.tokens)
            i += 1
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            owner = self._admissible(self.waiting[0])
            if owner is None:
                break
            item = self._piece(self.waiting[0], budget, owner)
            if item is None:
                break
            self.running.append(self.waiting.popleft())
            items.append(item)
            budget -= len(item.tokens)
        if not items and self.running and self.preemption_mode == "queue":
            # every running request is blocked on KV and nothing can be admitted: waiting would deadlock,
            # so fall back to recompute for the newest request (the oldest alone always fits the pool)
            self._preempt(self.running[-1])
        plan = StepPlan(items, self._release)
        self._release = []
        return plan

    def update(self, plan: StepPlan, sampled: dict[str, int]) -> list[Request]:
        """Apply a step's results; returns requests that finished (their KV is released next step)."""
        done = []
        for it in plan.items:
            req = self.requests.get(it.req_id)
            if req is None:
                continue
            req.num_cached = it.start_pos + len(it.tokens)
            if it.req_id not in sampled:
                continue
            tok = sampled[it.req_id]
            req.output.append(tok)
            if tok in req.stop_ids and len(req.output) > req.min_tokens:
                req.finish_reason = "stop"
            elif len(req.output) >= req.max_tokens or req.num_tokens >= req.max_len:
                req.finish_reason = "length"
            if req.finish_reason:
                self.running.remove(req)
                self._free(req)
                del self.requests[req.req_id]
                done.append(req)
        return done
