"""Continuous batching with chunked prefill and KV-aware admission — pure Python, no torch.

Each step gives every running request its next piece (a decode token or the next prefill chunk) in admission order,
then admits waiting requests while the token budget, `max_num_seqs` and KV capacity allow: a joining request's whole
pending context must fit its ranks, with a spare block there per running request, so a full pool never takes a
request back a chunk at a time only to preempt it again. A running request that cannot grow preempts the newest
running request whose release frees blocks on the rank lacking room (vLLM's "recompute"; blocks shared with other
requests free nothing); `preemption_mode="queue"` makes it wait a step instead. A new request's owner is
`KVLedger.pick_owner`'s. Without chunked prefill a prompt is scheduled only in a step whose budget holds all of it.

With the prefix cache on, a joining request starts on the longest cached run of its leading full blocks where it
would live (its last token is always computed), and a request whose next uncached block a running request is
computing there right now waits (keeping its place) until that block is registered, so a prompt sent n times is
prefilled once. Each step's plan carries the hits (`attach`), the last step's registrations and the evictions to
every rank. docs/architecture.md (splash.engine) tells the policy at length.
"""
from __future__ import annotations

import bisect
import hashlib
from array import array
from collections import deque
from dataclasses import dataclass, field

from splash.engine.ledger import KVLedger
from splash.engine.messages import BlockHash, CacheHit, StepItem, StepMessage
from splash.layouts.layout import KV_ALL, kv_ownership_of


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
    cacheable: bool = True       # may start on cached blocks (not when every prompt row's logits are wanted)
    cached_prompt_tokens: int = 0   # prompt tokens its first admission found cached
    counted: bool = False        # in the prefix-cache statistics already
    hashes: list[int] = field(default_factory=list)   # prefix hashes of its full blocks, as far as computed

    def block_hash(self, i: int, block_size: int) -> int:
        """Prefix hash of full block `i`: of its tokens and of the blocks before it (computed once each)."""
        hs = self.hashes
        while len(hs) <= i:
            j = len(hs)
            h = hashlib.blake2b((hs[-1] if hs else 0).to_bytes(8, "little"), digest_size=8)
            h.update(array("q", self.token_slice(j * block_size, (j + 1) * block_size)).tobytes())
            hs.append(int.from_bytes(h.digest(), "little"))
        return hs[i]

    @property
    def final_tokens(self) -> int:
        """The tokens it may reach (prompt + max_tokens, within max_len)."""
        return min(len(self.prompt) + self.max_tokens, self.max_len)

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


IN_FLIGHT = "in flight"   # `Scheduler._admissible`: the request waits for blocks a running request is computing


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
        self._registered: list[BlockHash] = []
        self._evict: list[list[int]] = []   # per rank, cached blocks the next plan frees
        self._computing: dict[int, str] = {}      # prefix hash -> the running request computing that block now
        self.num_preemptions = 0
        self.prefix_queries = self.prefix_hits = 0   # prompt tokens looked up / found cached, at first admission

    def sibling(self, ledger: KVLedger) -> "Scheduler":
        """An empty scheduler with this one's policy settings over `ledger` (the auto forecast replays the same
        policy on cloned requests)."""
        s = Scheduler(ledger, self.max_num_seqs, self.budget, self.preemption_mode)
        s.chunked_prefill = self.chunked_prefill
        s._computing = dict(self._computing)   # blocks in flight: requests sent with them wait for them there too
        return s

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
        return bool(self.waiting or self.running or self._release or self._evict)

    def _free(self, req: Request) -> None:
        self.ledger.release(req.req_id)
        self._release.append(req.req_id)
        self._stop_computing(req.req_id)

    def _stop_computing(self, req_id: str) -> None:
        if self._computing:
            for h in [h for h, r in self._computing.items() if r == req_id]:
                del self._computing[h]

    def _start_computing(self, req: Request, first: int) -> None:
        """`req` (just admitted, its first `first` blocks cached) computes the rest of its context's full blocks."""
        bs = self.ledger.block_size
        for i in range(first, req.num_tokens // bs):
            self._computing.setdefault(req.block_hash(i, bs), req.req_id)

    def _preempt(self, victim: Request) -> None:
        self.running.remove(victim)
        self._free(victim)
        victim.num_cached = 0
        self.waiting.appendleft(victim)
        self.num_preemptions += 1

    def _victim(self, req: Request, budget: int) -> Request:
        """Whom to preempt so that `req` can grow: the newest running request (`req` itself included) whose release
        frees blocks on a rank lacking room — blocks it holds that no other running request shares (a shared block
        stays with the others, so preempting a request for it frees nothing). In DP-attn/DOP that is the newest on
        `req`'s owner: the newest anywhere may live on another rank, and freeing it would not help."""
        owner = self.ledger.owner(req.req_id) or 0
        short = self.ledger.short_ranks(req.req_id, req.num_cached + min(req.pending, budget), owner)
        for r in reversed(self.running):
            if r is req:
                return r
            if short and r.req_id in self.ledger.reqs:
                freed = self.ledger.frees(r.req_id)
                if any(freed[k] for k in short):
                    return r
        return self.running[-1]

    def _admissible(self, req: Request) -> tuple[int, list[int]] | None:
        """Whether all of `req`'s pending tokens fit where it would live (`_fits`; cached blocks it starts on are not
        needed again, but evictable ones come back into use) -> (its owner, the cached blocks' hashes it starts on),
        None, or IN_FLIGHT when its next block is one a running request is computing there now."""
        led = self.ledger
        hashes = self._prefix(req)
        found = {}
        if hashes:   # TP: every rank caches the same blocks, so one owner's lookup answers for all
            same = kv_ownership_of(led.layout) == KV_ALL
            first = led.lookup(hashes, 0) if same else None
            found = {o: first if same else led.lookup(hashes, o) for o in range(led.world)}
        end = -(-req.final_tokens // led.block_size)
        # blocks in flight where it would hold them save as much as cached ones, once it has waited for them
        reach = {o: self._in_flight(hashes, k, o) for o, (k, _) in found.items()}
        owner = led.pick_owner(reach, end)
        k, revive = found.get(owner, (0, None))
        if reach.get(owner, 0) > k:   # its next block is being computed where it would hold it: wait for it
            return IN_FLIGHT
        need = led.blocks_needed(owner, k, -(-(req.num_cached + req.pending) // led.block_size))
        if revive:
            need = [a + b for a, b in zip(need, revive)]
        return (owner, hashes[:k]) if self._fits(need, led.holder_counts()) else None

    def _fits(self, need: list[int], spare: list[int]) -> bool:
        """Whether a joining request needing `need` blocks per rank fits, with a spare block per request holding
        blocks there (`spare`: `KVLedger.holder_counts`, room for their next blocks) on each rank it needs."""
        used, cap = self.ledger.used, self.ledger.cap()
        return not any(n and used[r] + n + spare[r] > cap for r, n in enumerate(need))

    def _in_flight(self, hashes: list[int], k: int, owner: int) -> int:
        """How far `hashes` reach past their `k` cached blocks with blocks running requests are computing now where
        a request with `owner` would hold them."""
        led = self.ledger
        if not self._computing:
            return k
        anywhere = kv_ownership_of(led.layout) == KV_ALL   # else a block lives where its request's owner puts it
        while k < len(hashes):
            rid = self._computing.get(hashes[k])
            if rid not in led.reqs or not (anywhere or led.reqs[rid].owner == owner):
                break
            k += 1
        return k

    def _prefix(self, req: Request) -> list[int]:
        """The hashes of the full blocks a joining request could find cached: all but the block of its last token,
        which is always computed (it gives the logits to sample from)."""
        if not self.ledger.prefix or not req.cacheable or req.num_cached:
            return []
        bs = self.ledger.block_size
        return [req.block_hash(i, bs) for i in range((req.num_tokens - 1) // bs)]

    def _piece(self, req: Request, budget: int, owner: int | None = None) -> StepItem | None:
        n = min(req.pending, budget)
        if n <= 0 or (n < req.pending and not self.chunked_prefill):
            return None
        end = req.num_cached + n
        if owner is None:
            owner = self.ledger.owner(req.req_id)
            if owner is None:   # a new request (pick_owner is O(requests))
                owner = self.ledger.pick_owner()
        if self.ledger.short_ranks(req.req_id, end, owner):
            return None
        self.ledger.grow(req.req_id, end, owner, final=req.final_tokens)
        toks = req.token_slice(req.num_cached, end)
        return StepItem(req.req_id, req.num_cached, toks, end == req.num_tokens, owner)

    def schedule(self) -> StepMessage:
        """The next step as rank 0 broadcasts it (the engine adds a layout switch and the prompt-logit items)."""
        items: list[StepItem] = []
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
        attach: list[CacheHit] = []
        w = 0   # the first waiting request not waiting for blocks in flight
        while w < len(self.waiting) and budget > 0 and len(self.running) < self.max_num_seqs:
            req = self.waiting[w]
            got = self._admissible(req)
            if got is IN_FLIGHT:
                w += 1
                continue
            if got is None:
                break
            owner, hit = got
            first = not req.counted and self.ledger.prefix and req.cacheable
            if hit:
                self.ledger.attach(req.req_id, owner, hit, final=req.final_tokens)
                req.num_cached = len(hit) * self.ledger.block_size
            item = self._piece(req, budget, owner)
            if item is None:
                if hit:
                    self.ledger.release(req.req_id)
                    req.num_cached = 0
                break
            if first:
                req.counted = True
                req.cached_prompt_tokens = req.num_cached
                self.prefix_queries += len(req.prompt)
                self.prefix_hits += req.num_cached
            if hit:
                attach.append(CacheHit(req.req_id, owner, tuple(hit)))
            if self.ledger.prefix:
                self._start_computing(req, len(hit))
            del self.waiting[w]
            self.running.append(req)
            items.append(item)
            budget -= len(item.tokens)
        if not items and self.running and self.preemption_mode == "queue":
            # every running request is blocked on KV and nothing can be admitted: waiting would deadlock,
            # so fall back to recompute for the newest request (the oldest alone always fits the pool)
            self._preempt(self.running[-1])
        if self.ledger.prefix:
            self._add_evictions(self.ledger.evictions())
        plan = StepMessage(tuple(items), tuple(self._release), attach=tuple(attach), register=tuple(self._registered),
                           evict=tuple(map(tuple, self._evict)))
        self._release, self._registered, self._evict = [], [], []
        return plan

    def _register(self, req: Request) -> None:
        """Register the full blocks `req` has computed since its last ones (for the ranks, in the next plan)."""
        led, bs = self.ledger, self.ledger.block_size
        shared = led.shared.get(req.req_id, ())
        for i in range(len(shared), req.num_cached // bs):
            h = req.block_hash(i, bs)
            if not led.register(req.req_id, i, h):
                self._stop_computing(req.req_id)   # it registers nothing more: nobody may wait for its blocks
                return
            self._registered.append(BlockHash(req.req_id, i, h))
            if self._computing.get(h) == req.req_id:
                del self._computing[h]

    def pending_evictions(self) -> bool:
        """Whether evictions asked for between steps (`reset_prefix_cache`) still wait for the next step."""
        return any(self._evict)

    def reset_prefix_cache(self) -> int:
        """Forget every cached block no request uses (POST /reset_prefix_cache; the ranks free them with the next
        step); -> how many, over the ranks."""
        if not self.ledger.prefix:
            return 0
        gone = self.ledger.evict_unused()
        self._add_evictions(gone)
        return sum(map(len, gone))

    def _add_evictions(self, gone: list[list[int]]) -> None:
        """Per rank, cached blocks the next plan frees (after those asked for before)."""
        self._evict = [a + b for a, b in zip(self._evict, gone)] if self._evict else gone

    def handoff_reserve_blocks(self) -> int:
        """Blocks per rank the step that carries a layout switch may append: its tokens in whole blocks, plus a
        partial one per request it may touch (the switch's headroom rule counts them)."""
        pending = sum(r.pending for r in self.running) + sum(r.num_tokens for r in self.waiting)
        bs = self.ledger.block_size
        return -(-min(self.budget, pending) // bs) + min(len(self.running) + len(self.waiting), self.max_num_seqs)

    def steady_decode_steps(self, limit: int) -> int:
        """How many of the next steps (at most `limit`) `schedule` would only give each running request its next
        decode token — admitting, finishing, chunking and preempting nobody — so `advance_decode` may apply them at
        once. Only a request crossing into a new block changes the ledger: with a request waiting for KV the run ends
        before the first crossing (with the prefix cache on, whatever the owners: growth may evict the blocks a hit
        would save), else before the first step some rank would lack a block for. A run admits and releases nothing,
        so registering and evicting at its end (`advance_decode`) leaves what step by step would."""
        run = self.running
        if not run or len(run) > self.budget or any(r.pending != 1 for r in run):
            return 0
        steps = min(limit, min(min(r.max_tokens - len(r.output), r.max_len - r.num_tokens) for r in run) - 1)
        if steps <= 0:
            return 0
        led, bs = self.ledger, self.ledger.block_size
        if self.waiting and len(run) < self.max_num_seqs and len(run) < self.budget:   # a request waits for KV
            w, end = self.waiting[0], self.waiting[0].num_cached + self.waiting[0].pending
            if self._admissible(w) is not None:
                return 0
            # unless no rank would take it (decode only adds blocks), it may fit once the owner choice moves (or the
            # cached blocks it would start on are evicted): stop before any request's next block
            spare = None if led.prefix else led.holder_counts()
            if spare is None or any(self._fits(led.growth(w.req_id, end, o), spare) for o in range(led.world)):
                return min(steps, min(-r.num_cached % bs for r in run))
        owners, cap = [led.reqs[r.req_id].owner for r in run], led.cap()

        def fits(j: int) -> bool:   # every rank has room for every running request's next j tokens
            need = zip(*(led.growth(r.req_id, r.num_cached + j, o) for r, o in zip(run, owners)))
            return all(u + sum(n) <= cap for u, n in zip(led.used, need))

        # the largest j with fits(j): growth only adds blocks, so fits is monotone
        return bisect.bisect_left(range(1, steps + 1), True, key=lambda j: not fits(j))

    def advance_decode(self, steps: int, token: int) -> None:
        """Apply `steps` steady decode steps (`steady_decode_steps`) at once, each request sampling `token`: what
        `steps` rounds of `schedule` + `update` would do."""
        for r in self.running:
            self.ledger.grow(r.req_id, r.num_cached + steps, self.ledger.reqs[r.req_id].owner)
            r.num_cached += steps
            r.output.extend([token] * steps)
        if self.ledger.prefix:   # what the run's steps' evictions and registrations leave (steady_decode_steps)
            self._add_evictions(self.ledger.evictions())
            for r in self.running:
                self._register(r)

    def update(self, plan: StepMessage, sampled: dict[str, int]) -> list[Request]:
        """Apply a step's results; returns requests that finished (their KV is released next step)."""
        done = []
        for it in plan.items:
            req = self.requests.get(it.req_id)
            if req is None:
                continue
            req.num_cached = it.start_pos + len(it.tokens)
            if self.ledger.prefix:
                self._register(req)
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
