"""splash-sim --trace: replay a workload through the scheduler policy, against each fixed layout. No torch.

Workload file (JSON or YAML): {"groups": [{"at_s", "count", "input_len", "output_len"}]}. The replay is an
event-stepped model of the engine: requests arrive at ``at_s``, are admitted in order while the current
layout's KV holds their whole length (input + output), each step gives every running request its next piece
(prefill chunk from the budget, or one decode row), and the step takes the cost model's predicted time.
``auto`` is the engine's scheduler itself (splash.engine.layout_policy.auto.AutoLayout, on the same cost model): at
each boundary it is asked, as the engine asks it, whether a re-evaluation is due, and if so for its proposal
over the running and arrived-but-waiting requests (feasible = the live KV fits the layout), vetted with the live
exposed cost of the manifest planned for the running requests; the replay pays that cost when it switches. By
default its predictions are the replay's own step times and switch costs, so there is nothing to learn online (no
observations, switch-cost ratio 1, no overhead budget). With a *truth* model (``replay(..., truth=)``,
splash/sim/model_error.py) the replay charges the truth, auto still plans with the nominal model and is fed every
step's charged time as the engine feeds it measured ones.
Decode-only stretches are advanced a few steps at a time at one predicted cost.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace

from splash.costmodel.step_cost import LAYOUTS, RowLoad
from splash.layouts.ownership import blocks_held
from splash.engine.layout_policy.correction import SwitchCorrection
from splash.engine.layout_policy.auto import AutoLayout, ReqView
from splash.sim.serving import step_seconds

FAST_FORWARD = 16


@dataclass
class Req:
    rid: str
    arrive: float
    input_len: int
    output_len: int
    owner: int = 0
    cached: int = 0
    generated: int = 0

    @property
    def total(self) -> int:
        return self.input_len + self.output_len

    @property
    def prefilling(self) -> bool:
        return self.cached < self.input_len


@dataclass
class Result:
    mode: str
    total_s: float = 0.0
    output_tokens: int = 0
    switches: int = 0
    timeline: list[tuple[float, str, str]] = field(default_factory=list)

    @property
    def output_tokens_per_s(self) -> float:
        return self.output_tokens / self.total_s if self.total_s > 0 else 0.0


def load_workload(path: str) -> list[Req]:
    p = Path(path)
    text = p.read_text()
    if p.suffix in (".yaml", ".yml"):
        import yaml
        raw = yaml.safe_load(text)
    else:
        raw = json.loads(text)
    if not isinstance(raw, dict) or not isinstance(raw.get("groups"), list):
        raise ValueError(f"{path}: expected {{'groups': [{{at_s, count, input_len, output_len}}, ...]}}")
    reqs = []
    for gi, g in enumerate(raw["groups"]):
        for k in ("at_s", "count", "input_len", "output_len"):
            if k not in g:
                raise ValueError(f"{path}: groups[{gi}] is missing {k!r}")
        for i in range(int(g["count"])):
            reqs.append(Req(f"g{gi}r{i}", float(g["at_s"]), int(g["input_len"]), int(g["output_len"])))
    reqs.sort(key=lambda r: (r.arrive, r.rid))
    return reqs


class Pool:
    """Per-rank KV blocks in use, by the layout's placement (whole requests reserved at admission)."""

    def __init__(self, setup, caps):
        self.s, self.caps = setup, caps

    def per_rank(self, layout: str, reqs: list[Req]) -> list[int]:
        """Blocks each rank holds when `reqs` run to their end (the ownership model's count)."""
        T, bs = self.s.world, self.s.block_size
        use = [0] * T
        for r in reqs:
            use = [u + n for u, n in zip(use, blocks_held(layout, r.owner, 0, -(-r.total // bs), T))]
        return use

    def fits(self, layout: str, reqs: list[Req]) -> bool:
        cap = self.caps[layout].blocks_per_rank
        return all(u <= cap for u in self.per_rank(layout, reqs))

    def place(self, layout: str, running: list[Req], new: Req) -> bool:
        """Pick ``new``'s owner as the engine's ledger does (KVLedger.pick_owner: the fewest blocks its requests
        will hold at their end, then the fewest held now, then the fewest requests, then the lowest rank) and
        admit it if the layout still fits."""
        T, bs = self.s.world, self.s.block_size
        ends = self.per_rank("dop", running)
        now, count = [0] * T, [0] * T
        for r in running:
            now[r.owner] += -(-r.cached // bs)
            count[r.owner] += 1
        new.owner = min(range(T), key=lambda o: (ends[o], now[o], count[o], o))
        return self.fits(layout, running + [new])


def _rows(running: list[Req], chunk: int) -> list[tuple[Req, RowLoad]]:
    out, budget = [], chunk
    for r in running:
        if r.prefilling:
            if budget <= 0:
                continue
            take = min(budget, r.input_len - r.cached)
            budget -= take
            out.append((r, RowLoad(take, r.cached, r.owner, samples=r.cached + take == r.input_len)))
        else:
            out.append((r, RowLoad(1, r.cached, r.owner)))
    return out


def _manifest(setup, src: str, dst: str, running: list[Req]):
    from splash.costmodel.step_cost import ELEM_BYTES
    from splash.switching.manifest import ReqState, plan_switch
    reqs = {r.rid: ReqState(max(r.cached, 1), r.owner) for r in running}
    m = setup.model
    return plan_switch(src, dst, m.cfg, setup.world, reqs, setup.block_size, ELEM_BYTES[m.weight_dtype], m.kv_dtype)


class _ReplayModel:
    """The replay's step times (cost model + the sim's linear-attention layers) as the scheduler's cost model."""

    def __init__(self, cm, setup):
        self.cm, self.setup = cm, setup

    def step(self, layout, rows):
        return SimpleNamespace(seconds=step_seconds(self.cm, self.setup.model, layout, list(rows)))

    def switch(self, manifest, mode, step_seconds=None):
        return self.cm.switch(manifest, mode, step_seconds)


def _scheduler(cm, setup, caps, margin: float, clock, learn: bool = False) -> AutoLayout:
    allowed = [k for k in LAYOUTS if k in cm.predict([RowLoad(1, 1, 0)])]
    auto = AutoLayout(_ReplayModel(cm, setup), allowed, margin, block_size=setup.block_size, world=setup.world,
                      capacity_blocks={k: caps[k].blocks_per_rank for k in allowed}, max_num_seqs=1 << 20,
                      max_num_batched_tokens=setup.chunk, row=RowLoad, clock=clock, overhead_budget=math.inf)
    if not learn:   # the replay's switch cost is the model's by construction: nothing to learn
        auto.switch_cost = SwitchCorrection(prior_ratio=1.0)
    return auto


def _views(running: list[Req], waiting: list[Req]) -> list[ReqView]:
    out = [ReqView(r.rid, r.cached, r.input_len - r.cached if r.prefilling else 1, r.output_len - r.generated,
                   r.owner) for r in running]
    return out + [ReqView(r.rid, 0, r.input_len, r.output_len, None, running=False) for r in waiting]


def replay(cm, setup, caps, workload: list[Req], mode: str, margin: float = 0.1, truth=None,
           plan=None) -> Result:
    """Serve ``workload`` in a fixed layout (``mode``) or with ``auto``. Steps and switches are charged with
    ``truth`` (default: ``cm``); auto plans with ``plan`` (default: ``cm``) and, when the charge differs from
    its model, learns from what each step was charged (AutoLayout.observe), as the engine learns from measured
    steps (splash/sim/model_error.py)."""
    import copy
    charge = truth if truth is not None else cm
    planner = plan if plan is not None else cm
    learn = charge is not planner
    pending = copy.deepcopy(workload)
    pool, res = Pool(setup, caps), Result(mode)
    layout = "tp" if mode == "auto" else mode
    running: list[Req] = []
    t = 0.0
    auto = _scheduler(planner, setup, caps, margin, lambda: t, learn) if mode == "auto" else None
    steps = 0
    while pending or running:
        while pending and pending[0].arrive <= t and pool.place(layout, running, pending[0]):
            running.append(pending.pop(0))
        if not running:
            if pending[0].arrive <= t:  # nothing runs and it still did not fit
                raise ValueError(f"request {pending[0].rid} ({pending[0].total} tokens) fits no rank in {layout}")
            t = pending[0].arrive
            continue
        rows = _rows(running, setup.chunk)
        loads = [rl for _, rl in rows]
        switch_s = 0.0
        if auto is not None:
            t0, before = t, layout
            layout, t = _auto_boundary(auto, pool, setup, res, layout, t, steps, running,
                                       [r for r in pending if r.arrive <= t], charge)
            switch_s = t - t0 if layout != before else 0.0
        dt = step_seconds(charge, setup.model, layout, loads)
        if learn and auto is not None:
            auto.observe(layout, [(rl.new_tokens, rl.context, rl.owner) for rl in loads], dt + switch_s,
                         switched=switch_s > 0)
        steps += 1
        n = 1
        if all(not r.prefilling for r in running) and not (pending and pending[0].arrive <= t + dt):
            n = max(1, min(FAST_FORWARD, min(r.output_len - r.generated for r in running)))
            if pending:
                n = max(1, min(n, int((pending[0].arrive - t) / dt)))
        t += n * dt
        for r, rl in rows:
            if r.prefilling:
                r.cached += rl.new_tokens
                if not r.prefilling:
                    r.generated += 1
            else:
                r.cached += n
                r.generated += n
        done = [r for r in running if r.generated >= r.output_len]
        res.output_tokens += sum(r.output_len for r in done)
        running = [r for r in running if r.generated < r.output_len]
    res.total_s = t
    return res


def _auto_boundary(auto: AutoLayout, pool, setup, res: Result, layout: str, t: float, step: int,
                   running: list[Req], waiting: list[Req], charge=None) -> tuple[str, float]:
    """One step boundary of ``auto``: (the layout to run the step in, the time after any switch, charged with
    ``charge``'s switch cost when given, else the vetted prediction)."""
    views = _views(running, waiting)
    if not auto.due(step, views):
        return layout, t
    usage = {k: pool.per_rank(k, running) for k in auto.allowed}
    d = auto.propose(step, layout, views, usage)
    if d.verdict != "switch":
        auto.record(d)
        return layout, t
    man = _manifest(setup, layout, d.target, running)
    v = auto.record(auto.vet(d, man))
    if v.verdict != "switch":
        return layout, t
    cost = v.switch_raw_s
    if charge is not None and hasattr(charge, "switch_factor"):
        cost *= charge.switch_factor.get((layout, d.target), 1.0)
    t += cost
    res.switches += 1
    why = v.reason if v.reason.startswith("switch") else f"switch: {v.reason}"
    res.timeline.append((t, f"{layout}→{d.target}", why))
    return d.target, t
