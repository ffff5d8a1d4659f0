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

import hashlib
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

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
    # per regime, the other regime's seconds run before that regime's first step (inf: it has none), so a probe
    # for a regime the next steps do not run in can be priced by what it must run before it measures anything
    until_s: dict = field(default_factory=dict)


@dataclass
class Segment:
    """`count` consecutive steps of one shape, charged as `count` x the step of `rows` (new tokens, context,
    owner); `work`: the output tokens they sample, `running`: the requests running in them, `admitted`: those that
    started running with them, `joins`: whether a request was admitted in them (also one preempted and taken back in
    the same step, which `admitted` does not name)."""
    rows: list[tuple[int, int, int | None]]
    count: int
    prefill: bool
    work: int = 0
    running: int = 0
    admitted: tuple[str, ...] = ()
    joins: bool = False


@dataclass
class Replay:
    """What the scheduler did with the cloned requests: the steps it ran and, when traced, its decisions."""
    segments: list[Segment]
    work: int
    admitted: int                        # the most requests running at once
    served: set[str]
    events: list[tuple] | None = None    # (step, "admit" | "preempt" | "finish", request, owner)
    complete: bool = True                # every request finished (not cut at max_steps)


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
        # not Python's hash(): a str's is salted per process, and the ledger breaks eviction ties by block hash,
        # so a forecast (and auto's decision) would depend on PYTHONHASHSEED
        h = hashlib.blake2b(f"{self.req_id}\0{i}".encode(), digest_size=8, person=b"forecast")
        return int.from_bytes(h.digest(), "little")


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


def replay(sched: Scheduler, max_steps: int = MAX_STEPS, trace: bool = False,
           bounds: list | None = None) -> Replay:
    """Run `sched` until its requests have finished (or `max_steps` replayed, a steady decode run applied at once
    counting as one). `bounds`, when given, gets each boundary as (the segments before it, `boundary(sched)`)."""
    segments, served, events = [], {r.req_id for r in sched.running}, [] if trace else None
    work, admitted, step, replayed = 0, len(sched.running), 0, 0
    led = sched.ledger
    while sched.running or sched.waiting:
        if bounds is not None:
            bounds.append((len(segments), boundary(sched)))
        if replayed >= max_steps:
            break
        replayed += 1
        run = sched.steady_decode_steps(1 << 30)
        if run > 0:
            rows = [(1, r.num_cached + run // 2, led.owner(r.req_id)) for r in sched.running]
            segments.append(Segment(rows, run, False, run * len(rows), len(rows)))
            work += run * len(sched.running)
            sched.advance_decode(run, _TOKEN)
            step += run
            continue
        before = {r.req_id for r in sched.running}
        preempted, waiting = sched.num_preemptions, len(sched.waiting)
        plan = sched.schedule()
        step += 1
        now = {r.req_id for r in sched.running}
        admitted = max(admitted, len(now))
        served |= now
        if trace:
            if sched.num_preemptions != preempted:
                events += [(step, "preempt", rid, None) for rid in sorted(before - now)]
            events += [(step, "admit", rid, led.owner(rid)) for rid in sorted(now - before)]
        if not plan.items:
            if not sched.running and sched.waiting:   # fits no empty pool: left out, not waited for
                gone = sched.waiting.popleft()
                sched.requests.pop(gone.req_id, None)
            continue
        rows = [(len(it.tokens), it.start_pos, it.owner) for it in plan.items]
        sampled = {it.req_id: _TOKEN for it in plan.items if it.sample}
        # admissions leave the queue shorter than it was with this step's preempted requests added
        joins = len(sched.waiting) < waiting + sched.num_preemptions - preempted
        segments.append(Segment(rows, 1, any(n > 1 for n, _, _ in rows), len(sampled), len(now),
                                tuple(sorted(now - before)), joins))
        work += len(sampled)
        done = sched.update(plan, sampled)
        if trace:
            events += [(step, "finish", r.req_id, None) for r in done]
    return Replay(segments, work, admitted, served, events, not (sched.running or sched.waiting))


def _until(secs: Sequence[float], segments: Sequence[Segment], prefill: bool) -> float:
    """Seconds of the steps before the first one of the `prefill` kind (inf when none comes)."""
    t = 0.0
    for s, seg in zip(secs, segments):
        if seg.prefill == prefill:
            return t
        t += s * seg.count
    return math.inf


def boundary(sched: Scheduler) -> tuple[tuple, ...]:
    """The requests of `sched` as `request_views` shows them at a boundary: (request, cached tokens, pending, output
    tokens left, owner, running) each; a waiting request has none cached and no owner."""
    led = sched.ledger
    return (*((r.req_id, r.num_cached, r.pending, output_left(r), led.owner(r.req_id), True) for r in sched.running),
            *((r.req_id, 0, r.pending, output_left(r), None, False) for r in sched.waiting))


def output_left(r: Request) -> int:
    """Output tokens `r` may still make: its max_tokens, bounded by its max_len."""
    return max(0, min(r.max_tokens - len(r.output), r.max_len - len(r.prompt) - len(r.output)))


def _along_decode(state) -> tuple[frozenset, tuple]:
    """What a boundary keeps through decode steps (each running request's cached tokens + output left, and all
    else), and the waiting queue's order (admission is first come, first served): the key boundaries of one steady
    decode run share."""
    state = tuple(state)
    return (frozenset((rid, c + left if run else left, p, o, run) for rid, c, p, left, o, run in state),
            tuple(rid for rid, *_, run in state if not run))


def _last_admit(segments: Sequence[Segment]) -> int:
    return next((i for i in range(len(segments) - 1, -1, -1) if segments[i].joins), -1)


@dataclass
class _Kept:
    """A layout's last replayed forecast and the boundaries it passed."""
    key: tuple                           # (the engine's layout, the forecast layout's pool blocks)
    segments: list[Segment]
    secs: list[float]                    # one step of each segment
    bounds: list[tuple[int, tuple]]      # (segments before it, `boundary`) of each boundary, in order
    ids: frozenset                       # the requests it replayed
    complete: bool = True                # ... to their end (a replay cut at MAX_STEPS ends where a fresh one would not)
    last_admit: int = -1                 # the last segment that admits a request (-1: none does)
    index: dict[tuple, list[int]] | None = None   # `_along_decode` -> boundaries (built when first asked)


class BatchForecast:
    def __init__(self, model: CostModelLike, row, *, world: int, block_size: int, scheduler: Scheduler):
        """`scheduler`: the engine's (its settings — token budget, max_num_seqs, preemption mode, chunked prefill —
        are read at each forecast)."""
        self.model, self.row, self.world, self.block_size = model, row, world, block_size
        self.scheduler = scheduler
        self._kept: dict[str, _Kept] = {}
        self.replayed = 0   # forecasts replayed in full
        self.followed = 0   # ... and answered from a kept one the engine followed (`_followed`)

    def replay(self, lay: str, reqs: Sequence[ReqView], cap: int, trace: bool = False,
               bounds: list | None = None) -> Replay:
        live = self.scheduler.ledger
        if live.prefix:   # the engine's cache and the requests sharing it (the module docstring)
            ledger = live.fork(lay, cap)
            sched = self.scheduler.sibling(ledger)
            clone_requests(reqs, ledger, sched, self.scheduler.requests)
        else:
            ledger = KVLedger(self.world, cap, self.block_size, lay)
            sched = self.scheduler.sibling(ledger)
            clone_requests(reqs, ledger, sched)
        return replay(sched, trace=trace, bounds=bounds)

    def waves(self, lay: str, reqs: Sequence[ReqView], cap: int) -> Forecast | None:
        """`lay`'s forecast for `reqs` (see the module docstring); None when it would serve nothing."""
        kept = self._followed(lay, reqs, cap)
        if kept is not None:
            self.followed += 1
            segments, secs, admitted, served = kept
        else:
            bounds: list = []
            rp = self.replay(lay, reqs, cap, bounds=bounds)
            self.replayed += 1
            if not rp.served or rp.work <= 0:
                self._kept.pop(lay, None)
                return None
            segments, secs = rp.segments, self.price(lay, rp.segments)
            admitted, served = rp.admitted, len(rp.served)
            self._kept[lay] = _Kept((self.scheduler.ledger.layout, cap), segments, secs, bounds,
                                    frozenset(r.req_id for r in reqs), rp.complete, _last_admit(segments))
        pre = sum(s * seg.count for s, seg in zip(secs, segments) if seg.prefill)
        dec = sum(s * seg.count for s, seg in zip(secs, segments) if not seg.prefill)
        first = next((s for s, seg in zip(secs, segments) if not seg.prefill), 0.0)
        return Forecast(pre, dec, first, sum(seg.work for seg in segments), admitted, served,
                        {"decode": _until(secs, segments, False), "prefill": _until(secs, segments, True)})

    # ---- a forecast the engine followed ----------------------------------------------------------------------
    # The engine's scheduler runs the same policy on the same state as the replay did, so it makes the replay's
    # steps until something the replay could not foresee happens: a request arrives, stops early on a stop token
    # or is aborted. A forecast asked at a later boundary whose requests are exactly as the replay had them at one
    # of its boundaries (or k steps into one of its steady decode runs) — each request's cached tokens, pending
    # tokens, output left, owner, running or waiting, the waiting ones in the same order — is the kept replay from
    # there: answered from it (a run cut part way re-priced at its new middle context) instead of replayed and
    # priced again. Not at the replay's start (asked again with no step run, it is replayed). While a request waits,
    # only for the engine's own layout: its replay started from the engine's whole ledger, so the cache it evolved
    # is the engine's; another layout's replay started from a fork that dropped the blocks idle then, and a fresh
    # fork now would drop those idle now — blocks a waiting request's admission may or may not find. Those steps
    # (admissions, their prefill chunks) are priced again, as `price` samples them for a fresh replay, and kept from
    # here as a fresh replay would be kept: the figures, and so the decisions, are a fresh replay's; only the
    # scheduler's replay is saved. With none waiting, another layout's kept replay (the cache on) is followed only
    # where no request joins the running ones from there on: a request preempted later is taken back on the blocks
    # that replay's cache holds, and it holds blocks a fresh fork would drop (those it left idle itself).
    def _followed(self, lay: str, reqs: Sequence[ReqView], cap: int):
        """(segments, seconds per step, admitted, served) of the kept forecast from the boundary the engine is at,
        or None when the engine did not follow it (or none is kept)."""
        kept = self._kept.get(lay)
        if kept is None or kept.key != (self.scheduler.ledger.layout, cap) or not reqs:
            return None
        if any(r.req_id not in kept.ids for r in reqs):   # arrived since
            return None
        if any(not r.running for r in reqs) and (lay != kept.key[0] or not kept.complete):
            return None
        if kept.index is None:
            kept.index = {}
            for i, (_, state) in enumerate(kept.bounds):
                kept.index.setdefault(_along_decode(state), []).append(i)
        # another layout's replay, prefix cache on: its cache holds blocks a fresh fork would drop (idle in the
        # engine now, or left idle by the replay itself), so only a tail that admits nothing (no request waiting
        # nor taken back after a preemption: admission is all that reads the cache) is a fresh replay's
        cache_blind = lay == kept.key[0] or not self.scheduler.ledger.prefix
        now = {r.req_id: r.cached for r in reqs if r.running}
        for b in kept.index.get(_along_decode((r.req_id, r.cached, r.pending, r.remaining, r.owner, r.running)
                                              for r in reqs), ()):
            seg_i, state = kept.bounds[b]
            ks = {now[rid] - c for rid, c, *_, run in state if run}
            k = ks.pop() if ks else 0
            if ks or k < 0 or (b == 0 and k == 0) or (not cache_blind and seg_i <= kept.last_admit):
                continue
            if k:   # k steps into a steady decode run that starts at this boundary
                if seg_i >= len(kept.segments) or kept.segments[seg_i].prefill or k >= kept.segments[seg_i].count:
                    continue
            out_seg, out_secs = list(kept.segments[seg_i:]), list(kept.secs[seg_i:])
            if not out_seg:
                return None
            if k:
                seg = out_seg[0]
                left = seg.count - k
                rows = [(n, c - seg.count // 2 + k + left // 2, o) for n, c, o in seg.rows]
                out_seg[0] = Segment(rows, left, False, left * len(rows), seg.running)
                out_secs[0] = self.model.step(lay, [self.row(*r) for r in rows]).seconds
            if len(now) < len(reqs):   # requests wait: priced, and kept, as a fresh replay from here would be
                out_secs = self.price(lay, out_seg)
                here = tuple((r.req_id, r.cached, r.pending, r.remaining, r.owner, r.running) for r in reqs)
                bounds = [(0, here), *((i - seg_i, st) for i, st in kept.bounds[b + 1:])]
                self._kept[lay] = _Kept(kept.key, out_seg, out_secs, bounds, frozenset(r.req_id for r in reqs),
                                        last_admit=_last_admit(out_seg))
            admitted = max([len(now), *(seg.running for seg in out_seg)])
            served = len(now.keys() | {rid for seg in out_seg for rid in seg.admitted})
            return out_seg, out_secs, admitted, served
        return None

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
