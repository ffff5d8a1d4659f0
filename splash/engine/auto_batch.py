"""What a batch would cost in a layout, for the `layout: auto` scheduler (splash.engine.auto_layout) — pure Python.

`BatchForecast.waves` charges every layout for the same requests — the running ones and the waiting queue — as
its KV pool would let the engine's scheduler run them: admit the waiting requests (FIFO, as the scheduler does)
while the pool holds them *to their end* — every admitted request grows by one token a step until it finishes, so
the forecast checks each rank's peak use over the batch's remaining decode, not its prompts alone — prefill them,
decode until half the batch has finished (or sooner, once the whole queue then fits), free the finished requests'
blocks, admit again — at most MAX_WAVES such rounds; a request that never fits is left out. Running requests that
the pool cannot carry to their end are shed first, newest first on the rank that overflows, to be recomputed in a
later round, as the engine's preemption would do. So a layout whose pool must queue (or preempt) requests pays for
them arriving later, overlapping the tail of those before them as continuous batching does, not for a second batch
after the first has drained; and a batch that grows past a pool — an RL rollout whose long requests fill it — is
charged where it really runs: checking prompts alone let a pool look as if it ran every long request at once until
it filled (docs/benchmarks.md, round 12). (Comparing each layout's admitted batch alone favoured whichever batch
held the requests with the most output per prompt token; draining batch after batch overcharged the layout that
queued: round 11.) A round's prefill is predicted as the chunked steps the engine's scheduler will run (token
budget per step, admission order, decode rows included), so a long prompt whose chunks land on one DP-attn/DOP
owner is charged as such; a round's decode in up to DECODE_PIECES pieces, cut where requests finish (charging a
batch's survivors for the whole round made the layout whose pool ran everything in one round — DOP's, in the RL
rollout — look twice as slow as one that ran it in several).
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace

from splash.engine.auto_types import CostModelLike, ReqView
from splash.layouts.ownership import block_shares

DECODE_PIECES = 4        # a round's decode is predicted in up to this many pieces, cut where requests finish
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


def decode_cuts(left: Sequence[int], end: int) -> list[int]:
    """Where a round's decode (to `end` output tokens) is cut into pieces, each predicted as one step of the
    requests alive at its start: where requests finish (the distinct output counts left, `left`, below `end`), at
    most DECODE_PIECES cuts — at the ends of the clusters those counts form, split at their DECODE_PIECES - 1 widest
    gaps, so a request is charged at most its cluster's width beyond its end. (Cuts spread evenly over the counts put
    three of four inside a rollout's short requests — which finish a few tokens apart after chunked prefill — and
    charged the stragglers for the long requests' whole round.)"""
    vals = sorted({v for v in left if 0 < v < end} | {end})
    if len(vals) > DECODE_PIECES:
        widest = sorted(range(len(vals) - 1), key=lambda i: vals[i + 1] - vals[i], reverse=True)[:DECODE_PIECES - 1]
        vals = sorted({vals[i] for i in widest} | {vals[-1]})
    return vals


class BatchForecast:
    def __init__(self, model: CostModelLike, row, *, world: int, block_size: int, max_num_seqs: int,
                 max_num_batched_tokens: int):
        self.model, self.row, self.world, self.block_size = model, row, world, block_size
        self.max_num_seqs, self.budget = max_num_seqs, max_num_batched_tokens

    def waves(self, lay: str, reqs: Sequence[ReqView], cap: int) -> Forecast | None:
        """`lay`'s forecast for `reqs` (see the module docstring); None when it would serve nothing."""
        active = [r for r in reqs if r.running]
        waiting = [r for r in reqs if not r.running]
        active, waiting = self._shed(lay, active, waiting, cap)
        pre = dec = first = 0.0
        work = 0
        admitted, seen = None, {r.req_id for r in active}
        for _ in range(MAX_WAVES):
            while waiting and len(active) < self.max_num_seqs:   # FIFO: admit what fits to the end
                r = waiting[0]
                cand = replace(r, owner=self._owner(r, active), running=True)
                if self._overflow(lay, [*active, cand], cap) is not None:
                    if active:
                        break
                    waiting.pop(0)   # does not fit an empty pool: left out, not waited for
                    continue
                active.append(cand)
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
                              remaining=r.remaining - made[r.req_id]) for r in active if r.remaining > made[r.req_id]]
            if not active:
                continue
            left = sorted(r.remaining for r in active)
            # decode until half the batch has finished, or sooner when the whole queue then fits; with no queue, to
            # the end
            end = self._all_fit_at(lay, active, waiting, cap, left[:(len(left) + 1) // 2]) if waiting else left[-1]
            cuts = decode_cuts(left, end)
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
            active = [replace(r, cached=r.cached + done, remaining=r.remaining - done) for r in active
                      if r.remaining > done]
            if not active and not waiting:
                break
        if not seen or work <= 0:
            return None
        return Forecast(pre, dec, first, work, admitted or 0, len(seen))

    def _overflow(self, lay: str, batch: Sequence[ReqView], cap: int) -> int | None:
        """The first rank whose pool `batch` would overflow as it runs to the end (every request one token a step
        after its prompt, a finished one freeing its blocks), or None. A rank's use peaks at some request's last
        token: with the requests by remaining output, longest first, the first k are alive at the k-th one's
        last step. Blocks are counted as tokens / block size + 1 per request (an upper bound of the rounding)."""
        w, bs = self.world, self.block_size
        tok, rate, n = [0.0] * w, [0.0] * w, [0] * w
        for r in sorted(batch, key=lambda x: -x.remaining):
            d = max(0, r.remaining - 1)
            for k, s in enumerate(block_shares(lay, r.owner, self.world)):
                if s:
                    tok[k] += s * (r.cached + r.pending)
                    rate[k] += s
                    n[k] += 1
            for k in range(w):
                if n[k] and (tok[k] + rate[k] * d) / bs + n[k] > cap:
                    return k
        return None

    def _shed(self, lay: str, active: list[ReqView], waiting: list[ReqView], cap: int):
        """Running requests that `lay`'s pool cannot carry to their end: as the engine would preempt them, the
        newest on the overflowing rank goes back to the head of the queue to recompute its context later."""
        active, waiting = list(active), list(waiting)
        while active:
            k = self._overflow(lay, active, cap)
            if k is None:
                break
            victim = next(r for r in reversed(active) if block_shares(lay, r.owner, self.world)[k])
            active.remove(victim)
            waiting.insert(0, replace(victim, cached=0, pending=victim.cached + victim.pending, owner=None,
                                      running=False))
        return active, waiting

    def _end_loads(self, batch: Sequence[ReqView]) -> list[int]:
        """Per rank, the tokens its placed requests of `batch` will hold at their end."""
        load = [0] * self.world
        for x in batch:
            if x.owner is not None and 0 <= x.owner < self.world:
                load[x.owner] += x.cached + x.pending + x.remaining
        return load

    def _owner(self, r: ReqView, active: Sequence[ReqView]) -> int | None:
        """Where a waiting request would go: the rank whose requests will hold the fewest tokens at their end
        (DP-attn/DOP owner, CP anchor), as the ledger places it."""
        if r.owner is not None and 0 <= r.owner < self.world:
            return r.owner
        load = self._end_loads(active)
        return min(range(self.world), key=lambda k: load[k])

    def _all_fit_at(self, lay: str, active: Sequence[ReqView], waiting: Sequence[ReqView], cap: int,
                    cuts: Sequence[int]) -> int:
        """The first of `cuts` (output tokens from now, ascending) after which the whole queue fits beside the
        requests still running then; the last cut when none does."""
        for cut in cuts:
            alive = [replace(r, cached=r.cached + cut, remaining=r.remaining - cut) for r in active
                     if r.remaining > cut]
            batch = list(alive)
            for r in waiting:
                batch.append(replace(r, owner=self._owner(r, batch), running=True))
            if self._overflow(lay, batch, cap) is None:
                return cut
        return cuts[-1]

    def place(self, batch: Sequence[ReqView]) -> dict[str, int | None]:
        """Owners (CP anchors) of the batch: the ledger's for running requests; a waiting one goes to the rank
        whose requests will hold the fewest tokens at their end, as the ledger will place it."""
        load = self._end_loads(batch)
        out: dict[str, int | None] = {}
        for r in batch:
            o = r.owner
            if o is None:
                o = min(range(self.world), key=lambda k: load[k])
                load[o] += r.cached + r.pending + r.remaining
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
