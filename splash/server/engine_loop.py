"""The engine thread on rank 0: the only thread that touches the Engine (and so makes MPI calls).

The HTTP side queues commands for it (add / abort / set layout / reset the prefix cache) under a condition
variable it sleeps on when idle; each step's token events go back to the asyncio loop in *one* ``post`` call.
After every step it publishes an immutable ``EngineSnapshot`` that metrics, the console and ``GET /v1/layout``
read without locking. A request that fails on its own fails alone (its sink gets the exception); an unexpected
exception inside a step is fatal for the whole job, since the other ranks may be inside a collective of it.
``add`` refuses (``Overloaded``) what would take the unfinished sequences past ``max_outstanding``.
"""
from __future__ import annotations

import gc
import threading
import time
import traceback
from collections import deque
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Callable

from splash.engine.messages import EngineRequest
from splash.errors import EngineBusy
from splash.layouts.layout import LAYOUT_NAMES

Sink = Callable[[list[Any]], None]   # receives TokenEvents (or one Exception) in the asyncio thread


class EngineStopped(RuntimeError):
    """The engine stopped (server shutting down) before the request finished."""


class Overloaded(RuntimeError):
    """Too many sequences are queued; the client should retry later."""


@dataclass(frozen=True)
class Aborted:
    """Delivered to a sequence's sink when an admin aborted it (POST /abort_request): it ends with what it has."""
    req_id: str


@dataclass(frozen=True)
class EngineSnapshot:
    layout: str
    mode: str
    target: str | None
    allowed_layouts: tuple[str, ...]
    switch_counts: dict[tuple[str, str], int]
    kv_capacity: dict[str, int]
    kv_used_tokens: int
    kv_used_blocks: list[int]
    kv_blocks_per_rank: int
    running: int
    waiting: int
    steps: int
    generated_tokens: int
    scheduler: dict | None = None    # the cost-model scheduler's AutoLayout.summary() (None: no scheduler)
    weight_bytes: dict[int, int] = field(default_factory=dict)  # rank -> resident weight bytes (measured)
    prefix_queries: int = 0      # prompt tokens looked up in the prefix cache
    prefix_hits: int = 0         # ... of them found cached
    prefix_cached_blocks: list[int] = field(default_factory=list)   # per rank: blocks the prefix cache names

    @property
    def total_switches(self) -> int:
        return sum(self.switch_counts.values())


def _failure(req_id: str, err: Exception) -> Exception:
    """What the request's client is told about its failed row: a ValueError is the request's own input at fault
    (its grammar reached a dead end) and stays one, so that the client gets a 400; anything else is ours (500)."""
    cls = ValueError if isinstance(err, ValueError) else RuntimeError
    return cls(f"sampling request {req_id} failed: {type(err).__name__}: {err}")


class EngineLoop:
    CAPACITY_REFRESH_S = 1.0

    def __init__(self, engine: Any, post: Callable[[Callable[[], None]], None], metrics: Any = None,
                 watchdog: Any = None, allowed_layouts: tuple[str, ...] = LAYOUT_NAMES,
                 on_fatal: Callable[[str], None] | None = None, max_outstanding: int | None = None) -> None:
        self.engine, self._post, self.metrics, self.watchdog = engine, post, metrics, watchdog
        self.allowed_layouts = tuple(allowed_layouts)
        self._on_fatal = on_fatal
        self.max_outstanding = max_outstanding
        self._cond = threading.Condition()
        self._cmds: deque[Callable[[], None]] = deque()   # run on the engine thread, in order
        self._stopping = False
        self._draining = False
        self.outstanding = 0            # sequences accepted by add() and not yet finished, failed or aborted
        self.step_started: float | None = None   # monotonic start of the step in flight (None between steps)
        self._sinks: dict[str, Sink] = {}
        self._times: dict[str, list] = {}   # req_id -> [arrival, first token or None, tokens] (latency metrics)
        self._update: tuple[str, Future] | None = None   # a weight update waiting for the admitted requests
        self._held: list[tuple[list[EngineRequest], Sink, float]] = []   # adds that arrived meanwhile
        self.steps = 0
        self.generated = 0
        self._capacity: dict[str, int] = {}
        self._capacity_at = -1e9
        self._capacity_layout: str | None = None
        self.snapshot: EngineSnapshot | None = None
        self.error: str | None = None
        self._thread = threading.Thread(target=self._run, name="splash-engine", daemon=True)

    def start(self) -> "EngineLoop":
        # The start-up heap (model, modules, app: ~200k objects) is not garbage. Frozen (as vLLM freezes its
        # engine's after start-up), the full collections a burst of new objects triggers — auto's forecasts for a
        # wave of arrivals — scan only what was made since; one over the whole heap took ~70 ms of rank 0's time.
        gc.collect()
        gc.freeze()
        self._publish()
        self._thread.start()
        return self

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and not self._stopping

    def add(self, reqs: list[EngineRequest], sink: Sink) -> None:
        """Queue requests whose events all go to ``sink``; EngineStopped while draining, Overloaded when full."""
        with self._cond:
            if self._draining:
                raise EngineStopped("the server is shutting down")
            limit = self.max_outstanding
            if limit is not None and self.outstanding + len(reqs) > limit:
                raise Overloaded(f"the server is busy: {self.outstanding} sequences are queued or running, and "
                                 f"this request adds {len(reqs)} (limit {limit}); retry later")
            self.outstanding += len(reqs)
        arrival = time.monotonic()
        try:
            self._command(lambda: self._add(reqs, sink, arrival))
        except EngineStopped:
            self._done(len(reqs))
            raise

    @property
    def draining(self) -> bool:
        """A stop signal came: no request is admitted any more."""
        return self._draining

    def begin_drain(self) -> None:
        with self._cond:
            self._draining = True

    def stalled_s(self) -> float:
        started = self.step_started
        return time.monotonic() - started if started is not None else 0.0

    def _done(self, n: int) -> None:
        with self._cond:
            self.outstanding -= n

    def abort(self, req_ids: list[str]) -> None:
        ids = list(req_ids)
        self._command(lambda: self._abort(ids))

    def set_layout(self, name: str) -> Future:
        """Ask the engine to pin ``name`` (or 'auto'); the future resolves once the engine accepted it."""
        fut: Future = Future()
        self._command(lambda: self._set_layout(name, fut))
        return fut

    def reset_prefix_cache(self) -> Future:
        """Ask the engine to forget the cached blocks no request uses; the future resolves to how many."""
        fut: Future = Future()
        self._command(lambda: fut.set_result(self.engine.reset_prefix_cache()))
        return fut

    def abort_matching(self, match: Callable[[str], bool]) -> Future:
        """Abort every unfinished sequence whose id `match`es (SGLang's /abort_request): each one's sink gets
        `Aborted`, the held ones' too; the future resolves to how many."""
        fut: Future = Future()
        self._command(lambda: fut.set_result(self._abort_matching(match)))
        return fut

    def update_weights(self, model_path: str) -> Future:
        """Ask the engine to load `model_path`'s weights (Engine.update_weights) as SGLang does: the requests
        already admitted finish on the old weights, requests that arrive meanwhile wait and run on the new ones.
        The future resolves to the cached blocks evicted, or to a ValueError (EngineBusy: another update is
        pending; EngineStopped: the server stopped first)."""
        fut: Future = Future()
        self._command(lambda: self._begin_update(model_path, fut))
        return fut

    def stop(self, timeout: float | None = None) -> None:
        """Abort what is left, broadcast stop to the followers and join the thread."""
        with self._cond:
            self._stopping = True
            self._cond.notify()
        self._thread.join(timeout)
        gc.unfreeze()

    def _command(self, cmd: Callable[[], None]) -> None:
        with self._cond:
            if self._stopping:
                raise EngineStopped("the server is shutting down")
            self._cmds.append(cmd)
            self._cond.notify()

    def _run(self) -> None:   # the engine thread
        try:
            while True:
                with self._cond:
                    while not self._cmds and not self._stopping and not self.engine.has_work():
                        self._cond.wait()
                    cmds = list(self._cmds)
                    self._cmds.clear()
                    stopping = self._stopping
                for cmd in cmds:
                    cmd()
                if stopping:
                    break
                if self.engine.has_work():
                    self._step()
                if self._update is not None:
                    self._try_update()
                self._publish()
            self._shutdown()
        except BaseException:  # noqa: BLE001 — anything here leaves the followers inside a step
            self.error = traceback.format_exc()
            if self._on_fatal is not None:
                self._on_fatal(f"splash-serve: rank 0: the engine thread failed:\n{self.error}")

    def _add(self, reqs: list[EngineRequest], sink: Sink, arrival: float) -> None:
        if self._update is not None:   # they run on the new weights, once the update is done
            self._held.append((reqs, sink, arrival))
            return
        for req in reqs:
            try:
                self.engine.add(req)
            except Exception as e:  # noqa: BLE001 — rejected before any collective: only this request fails
                self._done(1)
                self._deliver([(sink, [e])])
                continue
            self._sinks[req.req_id] = sink
            if self.metrics is not None:
                self.metrics.prompt_tokens.inc(len(req.prompt))
                self._times[req.req_id] = [arrival, None, 0]

    def _abort_matching(self, match: Callable[[str], bool]) -> int:
        hit = [(rid, sink) for rid, sink in self._sinks.items() if match(rid)]
        hit += [(r.req_id, sink) for reqs, sink, _ in self._held for r in reqs if match(r.req_id)]
        ids = [rid for rid, _ in hit]
        self._abort(ids)
        groups: dict[int, tuple[Sink, list[Any]]] = {}
        for rid, sink in hit:
            groups.setdefault(id(sink), (sink, []))[1].append(Aborted(rid))
        if groups:
            self._deliver(list(groups.values()))
        return len(ids)

    def _begin_update(self, model_path: str, fut: Future) -> None:
        if self._update is not None:
            fut.set_exception(EngineBusy(f"a weight update ({self._update[0]}) is waiting for the running requests"))
            return
        self._update = (model_path, fut)
        self._try_update()

    def _try_update(self) -> None:
        """Once no admitted request runs or waits: the update, then the requests held for it."""
        sch = self.engine.scheduler
        if sch.running or sch.waiting:
            return
        (path, fut), self._update = self._update, None
        try:
            fut.set_result(self.engine.update_weights(path))
        except ValueError as e:
            fut.set_exception(e)
        held, self._held = self._held, []
        for reqs, sink, arrival in held:
            self._add(reqs, sink, arrival)

    def _abort(self, req_ids: list[str]) -> None:
        gone = set(req_ids)
        for i, (reqs, sink, arrival) in enumerate(self._held):   # not admitted yet: nothing to abort in the engine
            kept = [r for r in reqs if r.req_id not in gone]
            self._done(len(reqs) - len(kept))
            self._held[i] = (kept, sink, arrival)
        for req_id in req_ids:
            self._times.pop(req_id, None)
            if self._sinks.pop(req_id, None) is not None:
                self.engine.abort(req_id)
                self._done(1)

    def _set_layout(self, name: str, fut: Future) -> None:
        try:
            self.engine.request_layout(name)
        except ValueError as e:
            fut.set_exception(e)
        else:
            self._publish()   # the answer to POST /v1/layout already shows the new mode
            fut.set_result(None)

    def _step(self) -> None:
        self.step_started = time.monotonic()
        t0 = time.perf_counter()
        events = self.engine.step()
        dt = time.perf_counter() - t0
        self.step_started = None
        self.steps += 1
        self.generated += len(events)
        if self.metrics is not None:
            self.metrics.step_time.observe(dt)
            self.metrics.steps.inc()
            if events:
                self.metrics.generated_tokens.inc(len(events))
                self._latencies(events)
        failed = [(req_id, _failure(req_id, err), True)
                  for req_id, err in self.engine.take_failures()]   # already aborted by the engine
        for req_id, _, _ in failed:
            self._times.pop(req_id, None)
        groups: dict[int, tuple[Sink, list[Any]]] = {}
        finished = 0
        for req_id, item, last in [(ev.req_id, ev, ev.finish_reason is not None) for ev in events] + failed:
            sink = self._sinks.pop(req_id, None) if last else self._sinks.get(req_id)
            if sink is not None:
                finished += last
                groups.setdefault(id(sink), (sink, []))[1].append(item)
        if finished:
            self._done(finished)
        if groups:
            self._deliver(list(groups.values()))

    def _latencies(self, events: list[Any]) -> None:
        """A sequence's first token gives its time to first token; its last, its end-to-end latency and its mean
        time per output token after the first."""
        now, m = time.monotonic(), self.metrics
        for ev in events:
            t = self._times.get(ev.req_id)
            if t is None:
                continue
            t[2] += 1
            if t[1] is None:
                t[1] = now
                m.ttft.observe(now - t[0])
            if ev.finish_reason is not None:
                del self._times[ev.req_id]
                m.e2e.observe(now - t[0])
                if t[2] > 1:
                    m.tpot.observe((now - t[1]) / (t[2] - 1))

    def _deliver(self, batch: list[tuple[Sink, list[Any]]]) -> None:
        def run() -> None:
            for sink, items in batch:
                sink(items)
        self._post(run)

    def _shutdown(self) -> None:
        self._times.clear()
        if self._update is not None:
            self._update[1].set_exception(EngineStopped("the server shut down before the weight update ran"))
            self._update = None
        held, self._held = [(r, s) for r, s, _ in self._held if r], []
        self._done(sum(len(r) for r, _ in held))
        if held:
            err = EngineStopped("the server shut down before the request started")
            self._deliver([(sink, [err]) for _, sink in held])
        live = list(self._sinks.items())
        for req_id, _ in live:
            self.engine.abort(req_id)
        self._sinks.clear()
        self._done(len(live))
        if live:
            err = EngineStopped("the server shut down before the request finished")
            self._deliver([(sink, [err]) for _, sink in {id(s): (r, s) for r, s in live}.values()])
        if self.watchdog is not None:
            self.watchdog.stop()   # say goodbye first: the followers leave once they get the stop message
        self.engine.stop()
        self._publish()

    def _publish(self) -> None:
        eng = self.engine
        now = time.monotonic()
        if now - self._capacity_at > self.CAPACITY_REFRESH_S or eng.layout != self._capacity_layout:
            self._capacity = dict(eng.kv_capacity_tokens())
            self._capacity_at, self._capacity_layout = now, eng.layout
        queries, hits, cached = eng.prefix_cache_stats()
        self.snapshot = EngineSnapshot(
            layout=eng.layout, mode=eng.layout_mode, target=eng.layout_target, allowed_layouts=self.allowed_layouts,
            switch_counts=dict(eng.switch_counts), kv_capacity=self._capacity, kv_used_tokens=eng.kv_used_tokens(),
            kv_used_blocks=list(eng.kv_used_blocks_per_rank()), kv_blocks_per_rank=eng.ledger.blocks_per_rank,
            running=len(eng.scheduler.running), steps=self.steps,
            waiting=len(eng.scheduler.waiting) + sum(len(reqs) for reqs, _, _ in self._held),   # held ones wait too
            generated_tokens=self.generated, weight_bytes=dict(eng.weight_bytes_per_rank),
            scheduler=eng.auto.summary() if eng.auto is not None else None,
            prefix_queries=queries, prefix_hits=hits, prefix_cached_blocks=list(cached))
