"""What a batch would cost in a layout, for the `layout: auto` scheduler (`auto`) — pure Python.

`BatchForecast.waves` runs the engine's own `Scheduler` and `KVLedger` — the same admission, chunked prefill,
preemption and owner placement, with the engine scheduler's settings — on clones of the running and waiting requests
under each layout's KV pool, step by step until every request has finished (each request makes its remaining output
tokens; stop tokens cannot be foreseen), and charges the steps it ran with the cost model. So a layout whose pool
must queue or preempt requests pays exactly as the engine will make it pay, and there is one admission policy to
change, not a copy per predictor.

Its cost is bounded two ways. Decode steps in which nothing but one token per running request can happen
(`Scheduler.steady_decode_steps`) are applied at once and charged as one step at their middle context times their
count. Pricing is sampled: every run of steady decode steps is priced, up to MAX_DECODE_PRICED of them (the longest
first), and up to MAX_PREFILL_PRICED steps that carry prefill chunks, evenly spaced; an unpriced step costs what the
nearest priced one of its kind does. At most MAX_STEPS scheduler steps are replayed (a steady run counting as one);
work beyond them is left out (the forecast is then for the requests served so far).

With the engine's prefix cache on, the replay starts from a fork of the engine's ledger (`KVLedger.fork`): the blocks
its ranks cache and which requests share them, switched to the forecast layout as a switch would switch them. The
clones carry their originals' block hashes (a clone's blocks past its original's tokens get hashes of their own), so
the replay finds the hits the engine will find — a request whose prefix is cached is admitted on its new blocks and
charged for its uncached tokens only — and waits, as the engine does, for the blocks a running request is computing.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from splash.engine.layout_policy.decision import CostModelLike, ReqView
from splash.engine.ledger import KVLedger
from splash.engine.scheduler import Request, Scheduler

MAX_STEPS = 4096          # scheduler steps replayed per forecast (a steady decode run counts as one)
MAX_DECODE_PRICED = 24    # steady decode runs priced with the cost model per forecast
MAX_PREFILL_PRICED = 8    # steps carrying prefill chunks priced per forecast
_TOKEN = -1               # what the clones "sample": never a stop token


@dataclass(frozen=True)
class Forecast:
    """A layout's predicted seconds (uncorrected) for the requests it serves."""
    prefill_s: float     # steps carrying prefill chunks (decode rows riding in them included)
    decode_s: float      # decode-only steps
    first_step_s: float  # the first decode-only step
    work: int            # output tokens made
    admitted: int        # the most requests running at once
    served: int          # requests that ran at all


@dataclass
class Segment:
    """`count` consecutive steps of one shape, charged as `count` x the step of `rows` (new tokens, context,
    owner); `work`: the output tokens they sample."""
    rows: list[tuple[int, int, int | None]]
    count: int
    prefill: bool
    work: int = 0


@dataclass
class Replay:
    """What the scheduler did with the cloned requests: the steps it ran and, when traced, its decisions."""
    segments: list[Segment]
    work: int
    admitted: int                        # the most requests running at once
    served: set[str]
    events: list[tuple] | None = None    # (step, "admit" | "preempt" | "finish", request, owner)


@dataclass
class _Clone(Request):
    """A forecast's copy of a request: its tokens are a `range` (their values never matter), its block hashes its
    original's as far as the original's tokens go, and its own past them (the forecast's made-up output)."""
    original: Request | None = None

    def block_hash(self, i: int, block_size: int) -> int:
        o = self.original
        if o is not None:
            if i < len(o.hashes):
                return o.hashes[i]
            if (i + 1) * block_size <= o.num_tokens:
                return o.block_hash(i, block_size)
        return hash((self.req_id, i))


def clone_requests(reqs: Sequence[ReqView], ledger: KVLedger, sched: Scheduler,
                   originals: Mapping[str, Request] | None = None) -> None:
    """Put `reqs` into an empty `sched` over `ledger`: running ones with their KV on their owners (unless `ledger`
    holds them already: a fork of the engine's), waiting ones queued in order. A clone's output to make is the
    view's `remaining`; `originals` (the engine's requests by id) give the clones their block hashes."""
    for r in reqs:
        o = originals.get(r.req_id) if originals is not None else None
        req = _Clone(r.req_id, range(r.cached + r.pending), max(0, r.remaining), original=o)
        req.cacheable = o.cacheable if o is not None else False
        if r.running:
            req.num_cached = r.cached
            if r.req_id not in ledger.reqs:
                ledger.grow(r.req_id, r.cached, r.owner if r.owner is not None else 0,
                            final=r.cached + r.pending + r.remaining)
            sched.requests[r.req_id] = req
            sched.running.append(req)
        else:
            sched.add(req)


def replay(sched: Scheduler, max_steps: int = MAX_STEPS, trace: bool = False) -> Replay:
    """Run `sched` until its requests have finished (or `max_steps` replayed, a steady decode run applied at once
    counting as one)."""
    segments, served, events = [], {r.req_id for r in sched.running}, [] if trace else None
    work, admitted, step, replayed = 0, len(sched.running), 0, 0
    led = sched.ledger
    while sched.running or sched.waiting:
        if replayed >= max_steps:
            break
        replayed += 1
        run = sched.steady_decode_steps(1 << 30)
        if run > 0:
            rows = [(1, r.num_cached + run // 2, led.reqs[r.req_id][1]) for r in sched.running]
            segments.append(Segment(rows, run, False, run * len(rows)))
            work += run * len(sched.running)
            sched.advance_decode(run, _TOKEN)
            step += run
            continue
        before = {r.req_id for r in sched.running}
        preempted = sched.num_preemptions
        plan = sched.schedule()
        step += 1
        now = {r.req_id for r in sched.running}
        admitted = max(admitted, len(now))
        served |= now
        if trace:
            if sched.num_preemptions != preempted:
                events += [(step, "preempt", rid, None) for rid in sorted(before - now)]
            events += [(step, "admit", rid, led.reqs[rid][1]) for rid in sorted(now - before)]
        if not plan.items:
            if not sched.running and sched.waiting:   # fits no empty pool: left out, not waited for
                gone = sched.waiting.popleft()
                sched.requests.pop(gone.req_id, None)
            continue
        rows = [(len(it.tokens), it.start_pos, it.owner) for it in plan.items]
        sampled = {it.req_id: _TOKEN for it in plan.items if it.sample}
        segments.append(Segment(rows, 1, any(n > 1 for n, _, _ in rows), len(sampled)))
        work += len(sampled)
        done = sched.update(plan, sampled)
        if trace:
            events += [(step, "finish", r.req_id, None) for r in done]
    return Replay(segments, work, admitted, served, events)


@dataclass
class _Kept:
    """A layout's last replayed forecast from a decode-only boundary, and where it started."""
    key: tuple                                   # (the engine's layout, the forecast layout's pool blocks)
    start: dict[str, tuple[int, int, int | None]]   # request -> (cached tokens, output tokens left, owner) then
    segments: list[Segment]
    secs: list[float]                       # one step of each segment


class BatchForecast:
    def __init__(self, model: CostModelLike, row, *, world: int, block_size: int, scheduler: Scheduler):
        """`scheduler`: the engine's (its settings — token budget, max_num_seqs, preemption mode, chunked prefill —
        are read at each forecast)."""
        self.model, self.row, self.world, self.block_size = model, row, world, block_size
        self.scheduler = scheduler
        self._kept: dict[str, _Kept] = {}
        self.replayed = 0   # forecasts replayed in full
        self.followed = 0   # ... and answered from a kept one the engine followed (`_followed`)

    def replay(self, lay: str, reqs: Sequence[ReqView], cap: int, trace: bool = False) -> Replay:
        live = self.scheduler.ledger
        if live.prefix:   # the engine's cache and the requests sharing it (the module docstring)
            ledger = live.fork(lay, cap)
            sched = self.scheduler.sibling(ledger)
            clone_requests(reqs, ledger, sched, self.scheduler.requests)
        else:
            ledger = KVLedger(self.world, cap, self.block_size, lay)
            sched = self.scheduler.sibling(ledger)
            clone_requests(reqs, ledger, sched)
        return replay(sched, trace=trace)

    def waves(self, lay: str, reqs: Sequence[ReqView], cap: int) -> Forecast | None:
        """`lay`'s forecast for `reqs` (see the module docstring); None when it would serve nothing."""
        kept = self._followed(lay, reqs, cap)
        if kept is not None:
            self.followed += 1
            segments, secs = kept
        else:
            rp = self.replay(lay, reqs, cap)
            self.replayed += 1
            if not rp.served or rp.work <= 0:
                self._kept.pop(lay, None)
                return None
            segments, secs = rp.segments, self.price(lay, rp.segments)
            self._keep(lay, reqs, cap, segments, secs)
        pre = sum(s * seg.count for s, seg in zip(secs, segments) if seg.prefill)
        dec = sum(s * seg.count for s, seg in zip(secs, segments) if not seg.prefill)
        first = next((s for s, seg in zip(secs, segments) if not seg.prefill), 0.0)
        if kept is not None:   # every request running, none waiting (`_keep`): all of them served, at once
            return Forecast(pre, dec, first, sum(seg.work for seg in segments), len(reqs), len(reqs))
        return Forecast(pre, dec, first, rp.work, rp.admitted, len(rp.served))

    # ---- a forecast the engine followed ----------------------------------------------------------------------
    # From a boundary where every request runs in decode and none waits, the engine's scheduler makes exactly the
    # steps the replay made (the same policy on the same state): each request makes a token a step and leaves once
    # it has made its last. What the replay cannot foresee — a request arriving, stopping early on a stop token,
    # being aborted — changes the requests the next boundary shows; a preemption shows there too (its request
    # waits, or was prefilled again). A forecast asked at a later boundary that shows exactly the replay's state
    # after k >= 1 steps — the requests with more than k tokens to make, each k tokens further, on its owner, every
    # one decoding — is the kept replay past its first k steps: answered from it (the run cut at k re-priced at its
    # new middle context) instead of replayed and priced again. (Asked again with no step run, it is replayed.)
    def _keep(self, lay: str, reqs: Sequence[ReqView], cap: int, segments: list[Segment], secs: list[float]):
        if not reqs or any(not r.running or r.pending != 1 for r in reqs):
            self._kept.pop(lay, None)
            return
        start = {r.req_id: (r.cached, r.remaining, r.owner) for r in reqs}
        self._kept[lay] = _Kept((self.scheduler.ledger.layout, cap), start, segments, secs)

    def _followed(self, lay: str, reqs: Sequence[ReqView], cap: int) -> tuple[list[Segment], list[float]] | None:
        """(segments, seconds per step) of the kept forecast past the k steps the engine ran since, or None when
        the engine did not follow it (or none is kept)."""
        kept = self._kept.get(lay)
        if (kept is None or kept.key != (self.scheduler.ledger.layout, cap) or not reqs
                or any(not r.running or r.pending != 1 or r.req_id not in kept.start for r in reqs)):
            return None
        c0, left0, owner0 = kept.start[reqs[0].req_id]
        k = reqs[0].cached - c0
        if k <= 0 or sum(left > k for _, left, _ in kept.start.values()) != len(reqs):
            return None
        for r in reqs:
            c0, left0, owner0 = kept.start[r.req_id]
            if r.cached != c0 + k or r.remaining != left0 - k or r.owner != owner0:
                return None
        out_seg, out_secs, at = [], [], 0
        for seg, s in zip(kept.segments, kept.secs):
            if at < k and seg.prefill:   # the replay preempted and re-admitted someone in those steps
                return None
            if at + seg.count <= k:
                at += seg.count
                continue
            cut = max(0, k - at)
            at += seg.count
            if cut:   # a steady decode run (the only segments longer than a step) entered part way
                left = seg.count - cut
                rows = [(n, c - seg.count // 2 + cut + left // 2, o) for n, c, o in seg.rows]
                seg = Segment(rows, left, seg.prefill, left * len(rows))
                s = self.model.step(lay, [self.row(*r) for r in rows]).seconds
            out_seg.append(seg)
            out_secs.append(s)
        if not out_seg:
            return None
        return out_seg, out_secs

    def price(self, lay: str, segments: Sequence[Segment]) -> list[float]:
        """Seconds of one step of each segment: a sample priced with the cost model (see the module docstring), the
        rest from the nearest priced segment of the same kind."""
        out: list[float | None] = [None] * len(segments)
        for prefill, budget in ((True, MAX_PREFILL_PRICED), (False, MAX_DECODE_PRICED)):
            idx = [i for i, s in enumerate(segments) if s.prefill == prefill]
            if not idx:
                continue
            if len(idx) <= budget:
                picks = idx
            elif prefill:
                picks = [idx[round(k * (len(idx) - 1) / (budget - 1))] for k in range(budget)]
            else:   # the longest runs carry the time; the first one is the step the switch cost hides behind
                picks = sorted({idx[0], *sorted(idx, key=lambda i: -segments[i].count)[:budget - 1]})
            for i in picks:
                out[i] = self.model.step(lay, [self.row(*r) for r in segments[i].rows]).seconds
            for i in idx:
                if out[i] is None:
                    out[i] = out[min(picks, key=lambda p: abs(p - i))]
        return [s or 0.0 for s in out]
