"""The step loop shared by every rank: rank 0 schedules and samples, every rank executes the broadcast plan.

Protocol: each step rank 0 broadcasts one small message (splash.engine.messages) — a `StepMessage` (the
scheduled pieces, the requests whose KV to release first, optionally a layout switch to hand off at this
boundary, and the pieces whose prompt logits come back) or a `StopMessage` — and all ranks act on it in the same
order, so collectives always match.
"""
from __future__ import annotations

import itertools
import logging
import time
from dataclasses import dataclass, field, replace
from typing import Any, Callable

import torch

from splash.attention.batch import StepBatch
from splash.costmodel.step_cost import cached_moves_pay
from splash.engine.layout_policy.auto import make_auto_layout
from splash.engine.layout_policy.control import LayoutController
from splash.engine.ledger import KVLedger
from splash.engine.messages import (BlockHash, EngineRequest, PerRank, ReloadWeights, RequestFailure, StepMessage,
                                    StopMessage, SwitchPlan, TokenEvent)
from splash.engine.sampler import Sampler, TokenLogprobs, prompt_logprobs
from splash.engine.sampling import SamplingParams
from splash.engine.scheduler import Request, Scheduler
from splash.engine.state_snapshots import StateSnapshots, state_holders
from splash.errors import EngineBusy
from splash.kv.recurrent import SnapshotPoint
from splash.layouts.memory import state_snapshot_slots
from splash.layouts.ownership import block_holders, distinct_kv_tokens
from splash.models.weights import expected_shapes, resident_bytes

_log = logging.getLogger("splash.engine")


def step_seconds(t0: float, out: torch.Tensor) -> float:
    """Seconds from `t0` until the step that made `out` has run: on a GPU the host returns while the step's kernels
    still run, so the device is synchronised first (the sampling right after waits for the logits anyway); without
    it auto would learn launch times."""
    if out.is_cuda:
        torch.cuda.synchronize(out.device)
    return time.perf_counter() - t0


def _same_architecture(path: str, new, served) -> None:
    """ValueError naming the first difference when checkpoint `path`'s config (`new`) does not describe the
    served model's architecture: its model_type, or a tensor the loader reads, missing or of another shape."""
    if new.model_type != served.model_type:
        raise ValueError(f"{path}: model_type {new.model_type!r}, the served model is {served.model_type!r}")
    a, b = expected_shapes(new), expected_shapes(served)
    for name in sorted(a.keys() | b.keys()):
        if a.get(name) != b.get(name):
            raise ValueError(f"{path}: tensor {name} is {a.get(name)} there, {b.get(name)} in the served model "
                             "(another architecture)")


@dataclass
class _PromptLogprobs:
    """A request's prompt logprobs (`prompt_logprobs` = k), gathered piece by piece until they are delivered."""
    k: int
    got: list[TokenLogprobs] = field(default_factory=list)


class Engine:
    def __init__(self, runner, comm, blocks_per_rank: int | dict[str, int], max_num_seqs: int = 256,
                 max_num_batched_tokens: int = 2048, preemption_mode: str = "recompute",
                 max_model_len: int | None = None, switch_mode: str = "live",
                 allowed_layouts: tuple[str, ...] = ("tp", "dp_attn", "cp", "dop"),
                 hardware_profile: str | None = None, switch_margin: float = 0.10,
                 enable_prefix_caching: bool = True, seed: int | None = None):
        """`hardware_profile` (a name under configs/hardware/ or a profile .yaml) turns on the cost-model
        scheduler for `auto` mode; without one, auto stays in the start layout. `seed` seeds the sampling of the
        requests that bring no seed of their own (vLLM's --seed); None: a fresh seed each run."""
        self.runner, self.comm = runner, comm
        # blocks_per_rank: the physical pool, or per-layout usable blocks (splash.engine.build.kv_blocks_per_layout).
        caps = blocks_per_rank if isinstance(blocks_per_rank, dict) else {}
        physical = max(caps.values()) if caps else blocks_per_rank
        self.ledger = KVLedger(comm.size, physical, runner.block_size, runner.layout, dict(caps))
        # A request must fit the KV pool on its own in every allowed layout, or recompute-preemption would loop
        # forever (it preempts itself and is re-admitted); cap the length as vLLM does.
        kv_tokens = min(self.ledger.cap(a) for a in allowed_layouts) * runner.block_size
        self.max_model_len = min(max_model_len or runner.cfg.max_position_embeddings, kv_tokens)
        self.scheduler = Scheduler(self.ledger, max_num_seqs, max_num_batched_tokens, preemption_mode)
        # a hybrid (glm5_next) model's prefix cache also keeps snapshots of its KDA state at block boundaries
        # (splash.engine.state_snapshots), as many as splash.layouts.memory.state_snapshot_slots budgets for
        self.ledger.prefix = bool(enable_prefix_caching)
        slots = state_snapshot_slots(runner.cfg, max_num_seqs, self.ledger.prefix)
        if slots:
            self.ledger.snapshots = StateSnapshots(comm.size, runner.block_size, runner.layout, slots)
        device = getattr(runner, "device", "cpu")
        shared = None if seed is None else torch.Generator(device=device).manual_seed(seed)
        self.sampler = Sampler(runner.cfg.vocab_size, shared, device=device)
        self._plp: dict[str, _PromptLogprobs] = {}
        self.failed: list[RequestFailure] = []   # requests whose sampling raised (see take_failures)
        # (ModelConfig, getter) of a checkpoint directory, read as the served one was (splash.engine.build sets it)
        self.loader: Callable[[str], tuple[Any, Any]] | None = None
        self.num_steps = 0
        self._ids = itertools.count()
        wbytes = torch.finfo(runner.dtype).bits // 8
        self.control = LayoutController(runner.cfg, comm.size, runner.block_size, wbytes,
                                        runner.layout_kv_dtypes, allowed_layouts,
                                        switch_mode, rope_fp8=getattr(runner, "rope_fp8", False))
        self.auto = None if hardware_profile is None or comm.rank != 0 else make_auto_layout(
            runner, comm.size, self.control, self.ledger, hardware_profile, switch_margin, self.scheduler)
        self.control.weight_quant = getattr(runner, "weight_quant", None)
        # rank -> resident weight bytes, measured from the tensors: this rank's now, every rank's from the first
        # step on and after every switch (a collective only inside a step, where every rank is in lockstep)
        self.weight_bytes_per_rank = {comm.rank: self._local_weight_bytes()}

    # ---- rank 0 API ------------------------------------------------------------------------------------
    def add_request(self, prompt: list[int], params: SamplingParams, req_id: str | None = None) -> str:
        """`add` for offline callers (splash.engine.llm, benchmarks): names the request when `req_id` is None."""
        return self.add(EngineRequest(req_id or f"req-{next(self._ids)}", prompt, params))

    def add(self, req: EngineRequest) -> str:
        """Queue one sequence; ValueError (naming the field) before any state when the engine cannot take it."""
        req_id, prompt, params = req.req_id, req.prompt, req.params
        if not prompt:
            raise ValueError("prompt must contain at least one token")
        if len(prompt) >= self.max_model_len:
            raise ValueError(f"prompt has {len(prompt)} tokens; max_model_len is {self.max_model_len} "
                             "(capped by the KV pool size)")
        stop = set(params.stop_token_ids)
        if not params.ignore_eos or params.grammar is not None:   # a grammar ends its output with EOS
            stop |= set(self.runner.cfg.eos_ids)
        self.sampler.add(req_id, prompt, params, stop)   # ValueError (bad logit_bias id) before any state
        # a grammar says where its output ends, min_tokens or not (the sampler lets it end): held open past its
        # end, its terminated matcher would fail the request
        min_tokens = 0 if params.grammar is not None else params.min_tokens
        self.scheduler.add(Request(req_id, list(prompt), params.max_tokens, frozenset(stop), self.max_model_len,
                                   min_tokens, cacheable=params.prompt_logprobs is None))
        if params.prompt_logprobs is not None:
            self._plp[req_id] = _PromptLogprobs(params.prompt_logprobs)
        return req_id

    def reset_prefix_cache(self) -> int:
        """Forget every cached block no request uses (POST /reset_prefix_cache); -> how many, over the ranks. The
        ranks free them with the next step."""
        return self.scheduler.reset_prefix_cache()

    def update_weights(self, model_path: str) -> int:
        """Rank 0, between steps of an idle engine (an RL rollout refreshing its policy): every rank loads
        `model_path`'s weights — the served architecture, read as at start-up — into its current layout, all ranks
        or none; the prefix cache, computed with the old weights, is emptied (-> blocks evicted). EngineBusy while
        requests run or wait; ValueError naming the rank and the cause when a rank cannot load them (then nothing
        changed)."""
        if self.loader is None:
            raise ValueError("this engine was not built by splash.engine.build: it has no checkpoint loader")
        busy = len(self.scheduler.running) + len(self.scheduler.waiting)
        if busy:
            raise EngineBusy(f"{busy} request(s) are running or waiting: weights are updated on an idle engine")
        msg = ReloadWeights(model_path)
        self.comm.broadcast_obj(msg)
        errors = self._reload(msg)
        bad = next((r for r, e in enumerate(errors) if e), None)
        if bad is not None:
            raise ValueError(f"rank {bad}: {errors[bad]}")
        return self.scheduler.reset_prefix_cache()

    def _reload(self, msg: ReloadWeights) -> list[str | None]:
        """Every rank: read the new weights, agree that every rank could, then put them in place (or none does)."""
        tensors, error = None, None
        try:
            cfg, get = self.loader(msg.model_path)
            _same_architecture(msg.model_path, cfg, self.runner.cfg)
            tensors = self.runner.load_weights(get)
        except Exception as e:  # noqa: BLE001 — nothing served changed yet: any failure to read is this rank's
            error = f"{type(e).__name__}: {e}"   # answer (raised, it would leave the others in the all-gather)
        errors = self.runner.comm.all_gather_obj(error)
        if not any(errors):
            self.runner.commit_weights(tensors)
        return errors

    def abort(self, req_id: str) -> None:
        self.scheduler.abort(req_id)
        self._forget(req_id)

    def has_work(self) -> bool:
        """Requests to run, KV to release, or a pinned layout still to switch to (an idle engine switches too)."""
        if self.scheduler.has_work():
            return True
        # idle: a pinned switch still counts, unless it was just deferred (nothing would change until work comes)
        pinned = self.control.layout_mode == "pinned" and self.control.target != self.layout
        return pinned and self.control.last_deferral is None

    @property
    def layout(self) -> str:
        return self.runner.layout

    def request_layout(self, name: str) -> None:
        """Pin `name` (the switch happens live at the next step boundary) or 'auto'; ValueError on bad names."""
        self.control.request(name)

    def _switch_decision(self) -> SwitchPlan | None:
        s = self.scheduler
        if s.pending_evictions():
            # a reset's evictions (decided in this layout) reach the ranks with the next step: the switch's plan,
            # made without those blocks, waits for that step, so that the ranks hold what it was planned from
            return None
        kv = {r.req_id: r.num_cached for r in s.running if r.num_cached > 0}
        reserve = s.handoff_reserve_blocks()
        choice = None
        if self.control.layout_mode == "auto" and self.auto is not None:
            try:
                choice = self.auto.advise(self.num_steps, self.layout, s, self.ledger)
            except Exception:  # noqa: BLE001 — the scheduler only advises: a failed prediction keeps the layout
                _log.exception("auto layout: prediction failed; staying in %s", self.layout)
        d = self.control.decide(self.layout, self.ledger, kv, reserve, auto_choice=choice,
                                vet=self.auto.vet_pending if choice is not None else None,
                                move_cached=self._cached_moves_pay(choice if self.control.layout_mode == "auto"
                                                                   else self.control.target))
        if d is None:
            return None
        self.ledger.relayout(d.dst, d.manifest.owners, d.manifest.cached_kept)
        return SwitchPlan(d.dst, self.control.mode, d.reqs, d.cached,
                          d.cached_cap, d.move_cached)

    def _cached_moves_pay(self, dst: str | None) -> bool:
        """The cost verdict on sending idle cached blocks with a switch to `dst` (splash.costmodel.switch_cost):
        priced by the scheduler's cost model at the cache's hit rate so far; without one (no hardware profile) no
        transfer is priced, so none is made."""
        if self.auto is None or dst in (None, self.layout) or not self.ledger.prefix or not any(self.ledger.lru):
            return False
        s = self.scheduler
        try:
            return cached_moves_pay(self.auto.model, dst, s.prefix_hits / max(1, s.prefix_queries), s.budget)
        except Exception:  # noqa: BLE001 — a failed prediction only costs the cached blocks that would travel
            _log.exception("prefix cache: pricing cached blocks for a switch to %s failed; not moving them", dst)
            return False

    def step(self) -> list[TokenEvent]:
        switch = self._switch_decision()
        plan = self.scheduler.schedule()
        if switch is not None and plan.release and not self.ledger.prefix:
            # a request preempted or aborted by this schedule drops its KV before the handoff runs (with the prefix
            # cache the plan keeps it, as the ledger's mirror did: the ranks skip its private blocks, and its cached
            # blocks, idle now, go where the plan says)
            gone = set(plan.release)
            switch = replace(switch, reqs={rid: v for rid, v in switch.reqs.items() if rid not in gone})
        unsnap, snaps = self._plan_snapshots(plan)
        msg = replace(plan, switch=switch, logits=tuple(self._prompt_logit_items(plan)), unsnap=unsnap, snapshot=snaps)
        self.comm.broadcast_obj(msg)
        t0 = time.perf_counter()
        logits = self._execute(msg)
        if self.auto is not None and plan.items:
            try:
                self.auto.observe(self.layout, plan.items, step_seconds(t0, logits), switched=switch is not None)
            except Exception:  # noqa: BLE001 — learning is best effort; the step's results stand
                _log.exception("auto layout: online correction failed")
        rids = [s.req_id for s in plan.items if s.sample]
        n_sampled = len(rids)
        rids, toks, lps = self._sample(logits[:n_sampled], rids)
        self._take_prompt_logprobs(plan, msg.logits, logits[n_sampled:])
        sampled = dict(zip(rids, toks))
        reqs = self.scheduler.requests
        cached = [reqs[rid].cached_prompt_tokens if rid in reqs else 0 for rid in rids]
        done = {r.req_id: r.finish_reason for r in self.scheduler.update(plan, sampled)}
        if self.ledger.snapshots is not None:
            self.ledger.snapshots.settle(self.ledger.cached_anywhere, self.ledger.reqs)
        events = [TokenEvent(rid, tok, done.get(rid), lp, self._deliver_prompt_logprobs(rid), c)
                  for rid, tok, lp, c in zip(rids, toks, lps, cached)]
        for rid in done:
            self._forget(rid)
        for f in self.failed:
            self.abort(f.req_id)   # its KV is released at the next step, like any abort
        return events

    def _plan_snapshots(self, plan: StepMessage) -> tuple[PerRank, tuple[BlockHash, ...]]:
        """(per rank the KDA state snapshots to drop, the step's snapshots to take) of a hybrid model's cache."""
        snaps = self.ledger.snapshots
        if snaps is None:
            return (), ()
        take = snaps.plan(plan.items, self.scheduler.requests, self.ledger.cached_anywhere)
        return tuple(map(tuple, snaps.take_drops())), tuple(take)

    def _sample(self, logits: torch.Tensor, rids: list[str]):
        """(req ids, tokens, logprobs) of the rows that could be sampled: all rows at once
        (splash.engine.sampler); if that raises, row by row. A request whose row cannot be sampled, or whose grammar
        failed (splash.engine.grammar), fails alone (recorded in `failed`, aborted after this step)."""
        try:
            toks, lps = self.sampler.sample(logits, rids)
        except Exception:  # noqa: BLE001 — find the row(s) at fault below
            ok, toks, lps = [], [], []
            for i, rid in enumerate(rids):
                try:
                    t, lp = self.sampler.sample(logits[i:i + 1], [rid])
                except Exception as e:  # noqa: BLE001 — a request that cannot be sampled fails alone
                    self.failed.append(RequestFailure(rid, e))
                    continue
                ok.append(rid)
                toks += t
                lps += lp
            rids = ok
        bad = self.sampler.take_failed()
        self.failed += [RequestFailure(rid, e) for rid, e in bad.items()]
        keep = [i for i, r in enumerate(rids) if r not in bad]
        return [rids[i] for i in keep], [toks[i] for i in keep], [lps[i] for i in keep]

    # ---- prompt logprobs: the logits of prompt rows, only for requests that ask --------------------------
    def _prompt_logit_items(self, plan) -> list[int]:
        """Items whose rows' logits every rank returns besides the sampled rows (the step message names them)."""
        reqs, plp = self.scheduler.requests, self._plp
        return [i for i, s in enumerate(plan.items) if s.req_id in plp and s.start_pos < len(reqs[s.req_id].prompt) - 1]

    def _take_prompt_logprobs(self, plan, items: list[int], logits: torch.Tensor) -> None:
        """Row p of a piece predicts token p + 1: keep the prompt tokens 1..P-1 not yet recorded."""
        row = 0
        for i in items:
            s = plan.items[i]
            n = len(s.tokens) - (1 if s.sample else 0)
            plp, p0, prompt = self._plp[s.req_id], s.start_pos, self.scheduler.requests[s.req_id].prompt
            lo = max(len(plp.got) - p0, 0)   # rows before were recorded by an earlier piece
            stop = min(n, len(prompt) - 1 - p0)
            if stop > lo:
                plp.got += prompt_logprobs(logits[row + lo:row + stop], prompt[p0 + lo + 1:p0 + stop + 1], plp.k)
            row += n

    def _deliver_prompt_logprobs(self, req_id: str) -> list[TokenLogprobs] | None:
        acc = self._plp.pop(req_id, None)   # delivered once, with the request's first token
        return None if acc is None else acc.got

    def take_failures(self) -> list[RequestFailure]:
        """The requests whose sampling failed since the last call; they are already aborted."""
        out, self.failed = self.failed, []
        return out

    def stop(self) -> None:
        self.comm.broadcast_obj(StopMessage())

    # ---- every rank --------------------------------------------------------------------------------------
    def follow(self) -> None:
        """Non-zero ranks: execute broadcast messages until told to stop."""
        while True:
            msg = self.comm.broadcast_obj(None)
            if isinstance(msg, StopMessage):
                return
            if isinstance(msg, ReloadWeights):
                self._reload(msg)   # rank 0 reports the outcome; every rank has the same one
                continue
            self._execute(msg)

    def _execute(self, msg: StepMessage) -> torch.Tensor:
        switch = self._switch_executor(msg.switch, msg.release)
        self._apply_cache_before(msg, switch)
        self.num_steps += 1
        items = msg.items
        batch = StepBatch.build(items, [it.tokens for it in items], [it.sample for it in items],
                                getattr(self.runner, "device", "cpu"))
        if msg.logits:   # prompt-logprob rows: logits of these items' rows follow the sampled rows
            ranges = batch.row_ranges()
            batch.sample_rows = batch.sample_rows + [r for i in msg.logits
                                                     for r in ranges[i][:len(ranges[i]) - int(items[i].sample)]]
        logits = self.runner.step(batch, switch)
        if switch is not None or len(self.weight_bytes_per_rank) < self.comm.size:
            self.weight_bytes_per_rank = dict(enumerate(self.comm.all_gather_obj(self._local_weight_bytes())))
        return logits

    def _apply_cache_before(self, msg: StepMessage, switch=None) -> None:
        """The message's block bookkeeping on this rank, in the ledger's order: registrations, releases, the switch's
        handoff, evictions, cache hits (this rank's blocks of them, and a hybrid model's KDA state from the snapshot
        at their end), then the snapshots to drop and to take."""
        r, me, world = self.runner, self.comm.rank, self.comm.size
        for reg in msg.register:
            if reg.block in r.bm.table(reg.req_id):
                r.bm.register(reg.req_id, reg.block, reg.hash)
        for rid in msg.release:
            r.release(rid)
        if switch is not None:
            r.adopt(switch.begin())   # the attaches below place blocks as the destination layout holds them
            if r.states is not None:
                r.states.clear_snapshots()
        if msg.evict:
            r.bm.evict(list(msg.evict[me]))
        for hit in msg.attach:
            mine = [(i, h) for i, h in enumerate(hit.hashes) if me in block_holders(r.layout, i, hit.owner, world)]
            if mine:
                r.attach(hit.req_id, mine)
            # (no hit comes with a switch: the ledger forgets the cache at it, so r.layout is the step's layout)
            if r.states is not None and me in state_holders(r.layout, hit.owner, world):
                r.states.restore(hit.req_id, hit.hashes[-1])
        if r.states is not None:
            if msg.unsnap:
                r.states.drop_snapshots(msg.unsnap[me])
            bs = r.block_size
            r.states.plan_snapshots(SnapshotPoint(s.req_id, (s.block + 1) * bs, s.hash) for s in msg.snapshot)

    def _local_weight_bytes(self) -> int:
        return resident_bytes(getattr(self.runner, "weights", None))

    def _switch_executor(self, sw: SwitchPlan | None, gone=()):
        """`gone`: requests released before the handoff (their private blocks stay put)."""
        if sw is None:
            return None
        from splash.switching.executor import SwitchExecutor

        r, src = self.runner, self.runner.layout
        m = self.control.plan(src, sw.dst, sw.reqs, sw.cached, sw.cached_cap or None, sw.move_cached)
        self.control.record(src, sw.dst)
        return SwitchExecutor(r.ctx, m, sw.mode, r.streams, gone)

    def _forget(self, req_id: str) -> None:
        self.sampler.remove(req_id)
        self._plp.pop(req_id, None)

    # ---- read-only views for splash-serve's metrics, console and API ----
    @property
    def layout_mode(self) -> str:
        """'auto' (the scheduler decides) or 'pinned' (POST /v1/layout or a pinned config layout)."""
        return self.control.layout_mode

    @property
    def layout_target(self) -> str | None:
        """The pinned layout (None in auto); differs from `layout` until the switch has happened."""
        return self.control.target

    @property
    def switch_counts(self) -> dict[tuple[str, str], int]:
        return self.control.switch_counts

    def kv_capacity_tokens(self) -> dict[str, int]:
        """Distinct KV tokens the pool could hold in each layout (TP replicates every token on every rank)."""
        bs, w = self.ledger.block_size, self.ledger.world
        return {lay: distinct_kv_tokens(lay, self.ledger.cap(lay), bs, w) for lay in self.control.allowed}

    def kv_used_tokens(self) -> int:
        return sum(e.tokens for e in self.ledger.reqs.values())

    def prefix_cache_stats(self) -> tuple[int, int, list[int]]:
        """(prompt tokens looked up, of them found cached, cached blocks per rank) since the start."""
        s = self.scheduler
        return s.prefix_queries, s.prefix_hits, self.ledger.cached_blocks()

    def kv_used_blocks_per_rank(self) -> list[int]:
        return list(self.ledger.used)
