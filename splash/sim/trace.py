"""splash-sim --trace: replay a workload through the engine's own scheduling code on a predicted clock. No torch.

A workload file's requests are the ones `splash-bench workload` sends (`splash.workload`); they arrive into the
engine's `Scheduler` and `KVLedger` and each step takes the cost model's predicted time. ``auto`` is the engine's
`AutoLayout` behind its `LayoutController`, asked at each boundary as the engine asks it; a switch costs its
predicted time. Without a *truth* model auto's predictions are the replay's own times, so there is nothing to learn
online; with one (splash/sim/model_error.py) the replay charges the truth and auto learns from what it is charged.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from types import SimpleNamespace

from splash.costmodel.step_cost import ELEM_BYTES, LAYOUTS, RowLoad
from splash.engine.ledger import KVLedger
from splash.engine.messages import StepItem
from splash.engine.scheduler import Request, Scheduler
from splash.engine.layout_policy.correction import SwitchCorrection
from splash.engine.layout_policy.auto import AutoLayout
from splash.engine.layout_policy.control import LayoutController
from splash.sim.serving import step_seconds, step_stages
from splash.workload import load_workload as read_workload, make_requests


@dataclass(frozen=True)
class Req:
    """A request — with later turns, a conversation — arriving at `arrive` s with an `input_len`-token prompt for
    `output_len` tokens a turn. `parts`: a workload file's token ids (`splash.workload.make_requests`: the prompt, then
    what each turn adds to the conversation so far); without them the prompt shares no token with another's."""
    rid: str
    arrive: float
    input_len: int
    output_len: int
    parts: tuple[tuple[int, ...], ...] = ()


@dataclass
class Result:
    mode: str
    total_s: float = 0.0
    output_tokens: int = 0
    switches: int = 0
    prompt_tokens: int = 0          # prompt tokens looked up in the prefix cache (at a request's first admission)
    cached_prompt_tokens: int = 0   # ... and found there
    timeline: list[tuple[float, str, str]] = field(default_factory=list)

    @property
    def output_tokens_per_s(self) -> float:
        return self.output_tokens / self.total_s if self.total_s > 0 else 0.0


def load_workload(path: str) -> list[Req]:
    """A workload file's requests as `splash-bench workload` sends them (its prompts, shared prefixes, samples,
    stagger and turns: `splash.workload`, with its default vocabulary and seed)."""
    return [Req(f"w{i:05d}", at, len(parts[0]), out, tuple(map(tuple, parts)))
            for i, (at, parts, out) in enumerate(make_requests(read_workload(path)))]


def _scheduler(cm, setup, caps, margin: float, clock, sched: Scheduler, learn: bool = False) -> AutoLayout:
    allowed = [k for k in LAYOUTS if k in cm.predict([RowLoad(1, 1, 0)])]
    auto = AutoLayout(_ReplayModel(cm, setup), allowed, margin, block_size=setup.block_size, world=setup.world,
                      capacity_blocks={k: caps[k].blocks_per_rank for k in allowed}, max_num_seqs=sched.max_num_seqs,
                      max_num_batched_tokens=sched.budget, row=RowLoad, clock=clock, overhead_budget=math.inf,
                      scheduler=sched)
    if not learn:   # the replay's switch cost is the model's by construction: nothing to learn
        auto.switch_cost = SwitchCorrection(prior_ratio=1.0)
    return auto


class _ReplayModel:
    """The replay's step times (cost model + the sim's linear-attention layers) as the scheduler's cost model."""

    def __init__(self, cm, setup):
        self.cm, self.setup = cm, setup

    def step(self, layout, rows):
        seconds, stages = step_stages(self.cm, self.setup.model, layout, list(rows))
        return SimpleNamespace(seconds=seconds, stages=stages)

    def switch(self, manifest, mode, step_seconds=None):
        return self.cm.switch(manifest, mode, step_seconds)


def replay(cm, setup, caps, workload: list[Req], mode: str, margin: float = 0.1, truth=None,
           plan=None, prefix_caching: bool | None = None) -> Result:
    """Serve ``workload`` in a fixed layout (``mode``) or with ``auto``. Steps and switches are charged with ``truth``
    (default: ``cm``); auto plans with ``plan`` (default: ``cm``) and learns from what each step was charged when
    that differs from its model. Decode runs in which nothing else can happen are charged at once
    (`Scheduler.steady_decode_steps`), up to the next arrival — and, with auto, up to its next re-evaluation
    (`AutoLayout.steps_to_due`), each step observed: auto is asked and learns at the engine's cadence. The step count
    auto sees counts every step, as the engine's does.
    ``prefix_caching``: None turns the prefix cache on where a prompt can hit (`_can_hit`); elsewhere it cannot
    change the replay, only slow it."""
    charge = truth if truth is not None else cm
    planner = plan if plan is not None else cm
    learn = charge is not planner
    pending = sorted(workload, key=lambda r: (r.arrive, r.rid))
    allowed = [k for k in LAYOUTS if k in cm.predict([RowLoad(1, 1, 0)])]
    layout = "tp" if mode == "auto" else mode
    blocks = {k: caps[k].blocks_per_rank for k in allowed}
    prefix = _can_hit(workload, setup.block_size) if prefix_caching is None else prefix_caching
    ledger = KVLedger(setup.world, max(blocks.values()), setup.block_size, layout, blocks, prefix=prefix)
    sched = Scheduler(ledger, max_num_seqs=1 << 20, max_num_batched_tokens=setup.chunk)
    res, t, steps = Result(mode), 0.0, 0
    auto = control = None
    if mode == "auto":
        auto = _scheduler(planner, setup, caps, margin, lambda: t, sched, learn)
        m = setup.model
        control = LayoutController(m.cfg, setup.world, setup.block_size, ELEM_BYTES[m.weight_dtype], m.kv_dtype,
                                   tuple(allowed))
    reqs = {r.rid: r for r in workload}

    def observe(layout, items, seconds, switched):   # auto learns what a step was charged, as from a measured one
        if learn and auto is not None:
            auto.observe(layout, items, seconds, switched=switched)
    while pending or sched.running or sched.waiting:
        while pending and pending[0].arrive <= t:
            r = pending.pop(0)   # a request of no file: a token id of its own (below the replay's sampled -1)
            sched.add(Request(r.rid, list(r.parts[0]) if r.parts else [-2 - len(pending)] * r.input_len, r.output_len))
        if not (sched.running or sched.waiting):
            t = pending[0].arrive
            continue
        switch_s = 0.0
        if auto is not None:
            t0, before = t, layout
            layout, t = _auto_boundary(auto, control, sched, res, layout, t, steps, charge)
            switch_s = t - t0 if layout != before else 0.0
        run = sched.steady_decode_steps(1 << 30)
        if run > 0:
            loads = [RowLoad(1, r.num_cached, ledger.owner(r.req_id)) for r in sched.running]
            dt = step_seconds(charge, setup.model, layout, loads)
            if pending:   # the queue changes at the next arrival
                run = max(1, min(run, math.ceil((pending[0].arrive - t) / dt)))
            # with auto the run stops where the engine would next re-evaluate (every `reeval_steps` steps while the
            # requests stay the same: contexts grow, a probe is judged), not at the next finish; each of its steps is
            # observed, as in the engine, so the dwell, a probe's deadline and the training count them
            if auto is not None:
                run = min(run, auto.steps_to_due(steps))
            mid = [RowLoad(1, r.num_cached + run // 2, ledger.owner(r.req_id)) for r in sched.running]
            each = step_seconds(charge, setup.model, layout, mid) if run > 1 else dt
            if learn:
                items = [StepItem(r.req_id, r.num_cached, (-1,), True, ledger.owner(r.req_id)) for r in sched.running]
                observe(layout, items, dt + switch_s, switch_s > 0)
                for _ in range(run - 1):
                    observe(layout, items, each, False)
            steps += run   # the engine's counter: `_due`'s minimum interval and re-evaluations count steps
            t += each * run if run > 1 else dt
            res.output_tokens += run * len(sched.running)
            sched.advance_decode(run, -1)
            continue
        steps += 1
        plan_ = sched.schedule()
        if not plan_.items:
            if not sched.running and sched.waiting:
                raise ValueError(f"request {sched.waiting[0].req_id} ({sched.waiting[0].pending} prompt tokens) "
                                 f"fits no rank in {layout}")
            continue
        loads = [RowLoad(len(it.tokens), it.start_pos, it.owner, samples=it.sample) for it in plan_.items]
        dt = step_seconds(charge, setup.model, layout, loads)
        observe(layout, plan_.items, dt + switch_s, switch_s > 0)
        t += dt
        sampled = {it.req_id: -1 for it in plan_.items if it.sample}
        res.output_tokens += len(sampled)
        for done in sched.update(plan_, sampled):   # a conversation's next turn is sent as this one answers
            rid, _, k = done.req_id.partition(".")
            r, k = reqs[rid], int(k or 0) + 1
            if k < len(r.parts):
                sched.add(Request(f"{rid}.{k}", done.prompt + done.output + list(r.parts[k]), r.output_len))
    res.total_s = t
    res.prompt_tokens, res.cached_prompt_tokens = sched.prefix_queries, sched.prefix_hits
    return res


def _can_hit(workload: list[Req], block_size: int) -> bool:
    """Whether a prompt can start on another's blocks: a conversation's later turn, or a first block two share."""
    firsts = [r.parts[0][:block_size] for r in workload if r.parts]
    return any(len(r.parts) > 1 for r in workload) or len(set(firsts)) < len(firsts)


def _auto_boundary(auto: AutoLayout, control, sched: Scheduler, res: Result, layout: str, t: float, step: int,
                   charge=None) -> tuple[str, float]:
    """One step boundary of ``auto``, as the engine runs it (`Engine._switch_decision`): (the layout to run the step
    in, the time after any switch, charged with ``charge``'s switch cost when given, else the vetted
    prediction)."""
    ledger = sched.ledger
    choice = auto.advise(step, layout, sched, ledger)
    if choice is None:
        return layout, t
    kv = {r.req_id: r.num_cached for r in sched.running if r.num_cached > 0}
    d = control.decide(layout, ledger, kv, sched.handoff_reserve_blocks(), auto_choice=choice, vet=auto.vet_pending)
    if d is None:
        return layout, t
    ledger.relayout(d.dst, d.manifest.owners, d.manifest.cached_kept)
    v = auto.last
    cost = v.switch_raw_s
    if charge is not None and hasattr(charge, "switch_factor"):
        cost *= charge.switch_factor.get((layout, d.dst), 1.0)
    t += cost
    res.switches += 1
    why = v.reason if v.reason.startswith("switch") else f"switch: {v.reason}"
    res.timeline.append((t, f"{layout}→{d.dst}", why))
    return d.dst, t
