"""What a batch would cost in a layout, for the `layout: auto` scheduler (splash.engine.auto_layout) — pure Python.

`BatchForecast.waves` charges every layout for the same requests — the running ones and the waiting queue — as
its KV pool would let the engine's scheduler run them: admit the waiting requests whose prompts fit the free
blocks (FIFO, as the scheduler does), prefill them, decode until half the batch has finished (or sooner, once
the whole queue then fits), free the finished requests' blocks, admit again — at most MAX_WAVES such rounds; a
request that never fits is left out. So a layout whose pool must queue requests pays for them arriving later,
overlapping the tail of those before them as continuous batching does, not for a second batch after the first
has drained. (Comparing each layout's admitted batch alone favoured whichever batch happened to hold the requests
with the most output per prompt token, and sent the shifting workload's burst into DP-attn; draining batch after
batch overcharged the layout that queued: docs/benchmarks.md, round 11.) A round's prefill is predicted as the
chunked steps the engine's scheduler will run (token budget per step, admission order, decode rows included),
so a long prompt whose chunks land on one DP-attn/DOP owner is charged as such; the last round's decode in up
to DECODE_SEGMENTS + 1 pieces as the requests with the least output left finish.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace

from splash.engine.auto_types import CostModelLike, ReqView

DECODE_SEGMENTS = 1      # remaining decode is predicted in up to this many + 1 pieces (the batch, then survivors)
MAX_PREFILL_SAMPLES = 3  # chunked prefill steps predicted one by one; more are sampled (see steps_seconds)
MAX_PLAN_STEPS = 4096    # prefill steps simulated per prediction (bounds the plan's pure-Python cost)
MAX_WAVES = 6            # admission rounds predicted per layout; requests beyond them are left out


@dataclass(frozen=True)
class Forecast:
    """A layout's predicted seconds (uncorrected) for the requests it serves in `waves`."""
    prefill_s: float     # the waves' prefill steps (decode rows riding in them included)
    decode_s: float      # their decode after the prefill
    first_step_s: float  # the first wave's first decode step
    work: int            # output tokens of the requests served
    admitted: int        # requests in the first wave (running + admitted now)
    served: int          # requests in all waves


class BatchForecast:
    def __init__(self, model: CostModelLike, row, *, world: int, block_size: int, max_num_seqs: int,
                 max_num_batched_tokens: int):
        self.model, self.row, self.world, self.block_size = model, row, world, block_size
        self.max_num_seqs, self.budget = max_num_seqs, max_num_batched_tokens

    def waves(self, lay: str, reqs: Sequence[ReqView], used: Sequence[int], cap: int) -> Forecast | None:
        """`lay`'s forecast for `reqs` (see the module docstring); None when it would serve nothing."""
        active = [r for r in reqs if r.running]
        waiting = [r for r in reqs if not r.running]
        free = [cap - u for u in used]
        held: dict[str, list[int]] = {}
        pre = dec = first = 0.0
        work = 0
        admitted, seen = None, {r.req_id for r in active}
        for _ in range(MAX_WAVES):
            while waiting and len(active) < self.max_num_seqs:   # FIFO admission into the free blocks
                r = waiting[0]
                owner, vec = self._blocks(lay, r, free)
                if any(f < v for f, v in zip(free, vec)):
                    break
                free = [f - v for f, v in zip(free, vec)]
                held[r.req_id] = vec
                active.append(replace(r, owner=owner, running=True))
                seen.add(r.req_id)
                waiting.pop(0)
            if admitted is None:
                admitted = len(active)
            if not active:
                break
            owners = self.place(active)
            steps, made = self.prefill_plan(active, owners)
            pre += self.steps_seconds(lay, steps)
            work += sum(min(made[r.req_id], r.remaining) for r in active)
            active = [replace(r, cached=r.cached + r.pending - 1 + made[r.req_id], pending=1, owner=owners[r.req_id],
                              remaining=r.remaining - made[r.req_id]) for r in active]
            active, free = self._release(lay, active, free, held)
            if not active:
                continue
            left = sorted(r.remaining for r in active)
            if waiting:   # decode until half the batch has finished, or sooner when the whole queue then fits
                cuts = [max(left[0], min(left[(len(left) - 1) // 2], self._all_fit_at(lay, active, waiting, free, held)))]
            else:
                cuts = sorted({left[min(len(left) - 1, (len(left) * k) // DECODE_SEGMENTS)]
                               for k in range(DECODE_SEGMENTS)} | {left[-1]})
            done = 0
            for cut in cuts:
                alive = [r for r in active if r.remaining > done]
                if not alive or cut <= done:
                    continue
                mid = (done + cut) / 2
                one = self.model.step(lay, [self.row(1, r.cached + int(mid), r.owner) for r in alive]).seconds
                first = first or one
                dec += (cut - done) * one
                done = cut
            work += sum(min(done, r.remaining) for r in active)
            active = [replace(r, cached=r.cached + done, remaining=r.remaining - done) for r in active]
            active, free = self._release(lay, active, free, held)
            if not active and not waiting:
                break
        if not seen or work <= 0:
            return None
        return Forecast(pre, dec, first, work, admitted or 0, len(seen))

    def _blocks(self, lay: str, r: ReqView, free: Sequence[int]) -> tuple[int | None, list[int]]:
        """(owner, blocks per rank) a request's prompt takes in `lay` (TP: on every rank; CP: spread; DP-attn and
        DOP: on its owner, the rank with the most free blocks for a waiting one)."""
        need = -(-(r.cached + r.pending) // self.block_size)
        w = len(free)
        if lay == "tp":
            return r.owner, [need] * w
        if lay == "cp":
            return r.owner, [-(-need // w)] * w
        o = r.owner if r.owner is not None and 0 <= r.owner < w else max(range(w), key=lambda k: free[k])
        return o, [need if k == o else 0 for k in range(w)]

    def _release(self, lay: str, active: list, free: list[int], held: dict) -> tuple[list, list[int]]:
        """Drop the finished requests from `active`, their blocks back to `free`."""
        alive = []
        for r in active:
            if r.remaining > 0:
                alive.append(r)
                continue
            vec = held.pop(r.req_id, None) or self._blocks(lay, r, free)[1]
            free = [f + v for f, v in zip(free, vec)]
        return alive, free

    def _all_fit_at(self, lay: str, active: Sequence[ReqView], waiting: Sequence[ReqView], free: Sequence[int],
                    held: dict) -> int:
        """Output tokens after which enough of `active` has finished for the whole queue's prompts to fit (per rank
        in TP/CP; in total in DP-attn/DOP, whose new requests go where the room is)."""
        w = len(free)
        want = [0] * w
        for r in waiting:
            want = [a + b for a, b in zip(want, self._blocks(lay, r, [0] * w)[1])]
        def fits(have):
            return all(h >= x for h, x in zip(have, want)) if lay in ("tp", "cp") else sum(have) >= sum(want)
        have = list(free)
        for r in sorted(active, key=lambda x: x.remaining):
            if fits(have):
                return r.remaining
            have = [h + v for h, v in zip(have, held.get(r.req_id) or self._blocks(lay, r, have)[1])]
        return max(r.remaining for r in active)

    def place(self, batch: Sequence[ReqView]) -> dict[str, int | None]:
        """Owners (CP anchors) of the batch: the ledger's for running requests; a waiting one goes to the rank
        holding the fewest tokens, as the ledger will place it."""
        load = [0] * self.world
        for r in batch:
            if r.owner is not None and 0 <= r.owner < self.world:
                load[r.owner] += r.cached + r.pending
        out: dict[str, int | None] = {}
        for r in batch:
            o = r.owner
            if o is None:
                o = min(range(self.world), key=lambda k: load[k])
                load[o] += r.cached + r.pending
            out[r.req_id] = o
        return out

    def prefill_plan(self, batch: Sequence[ReqView], owners: Mapping[str, int | None]):
        """The steps the engine's scheduler runs until every prompt of `batch` is prefilled: each step gives each
        decoding request its next token, then fills the token budget with prompt chunks in admission order (so in
        DP-attn/DOP a long prompt's chunks land on one owner). -> (steps as (new, context, owner) rows, output
        tokens each request makes meanwhile)."""
        made = {r.req_id: 0 for r in batch}
        todo = [[r, r.pending, r.cached] for r in batch if r.pending > 1]
        decoding = [r for r in batch if r.pending <= 1]
        steps = []
        while todo:
            if len(steps) >= MAX_PLAN_STEPS:   # (a budget far below the decode rows) the rest as one step
                steps.append([(ent[1], ent[2], owners[ent[0].req_id]) for ent in todo])
                for ent in todo:
                    made[ent[0].req_id] += 1 if ent[0].remaining > 0 else 0
                break
            rows = []
            for r in decoding:
                if made[r.req_id] < r.remaining:
                    rows.append((1, r.cached + r.pending - 1 + made[r.req_id], owners[r.req_id]))
                    made[r.req_id] += 1
            budget = max(1, self.budget - len(rows))
            while todo and budget > 0:
                ent = todo[0]
                take = min(budget, ent[1])
                rows.append((take, ent[2], owners[ent[0].req_id]))
                ent[1], ent[2], budget = ent[1] - take, ent[2] + take, budget - take
                if ent[1] == 0:
                    todo.pop(0)
                    made[ent[0].req_id] += 1 if ent[0].remaining > 0 else 0
                    decoding.append(ent[0])
            steps.append(rows)
        return steps, made

    def steps_seconds(self, lay: str, steps: Sequence[Sequence[tuple]]) -> float:
        """Predicted seconds of `steps`: each one when few, else MAX_PREFILL_SAMPLES evenly spaced samples, each
        standing for its share of the steps (a prediction costs ~1 ms)."""
        n = len(steps)
        if n == 0:
            return 0.0
        k = min(n, MAX_PREFILL_SAMPLES)
        picks = [round(i * (n - 1) / (k - 1)) for i in range(k)] if k > 1 else [0]
        return sum(self.model.step(lay, [self.row(*row) for row in steps[i]]).seconds for i in picks) * n / k
