"""`splash-sim --trace` prefills as the engine does: the rows it prices are the engine's Scheduler's items on the
owners its KVLedger picked (splash/sim/trace.py)."""
from splash.costmodel import load_profile
from splash.costmodel.step_cost import CostModel
from splash.engine.ledger import KVLedger
from splash.engine.scheduler import Request, Scheduler
from splash.sim import trace
from splash.sim.presets import load_sim_model
from splash.sim.serving import SimSetup, capacities


def test_trace_prefill_rows_are_the_engines_items_on_the_ledgers_owners(monkeypatch):
    """A DP-attn replay prices, step for step until decode runs alone, exactly the (tokens, start, owner) rows the
    engine's Scheduler and KVLedger produce for the same requests — and those spread a step's prefill over several
    owners. (test_sim.py::test_trace_runs_the_engines_scheduler compares total times within 1%; an owner split
    dropped moves them only ~2%.)"""
    m = load_sim_model("glm-5.3")
    s = SimSetup(m, load_profile("b200"), 8)
    caps = capacities(s)
    cm = CostModel(m.cfg, 8, s.profile, m.weight_dtype, m.kv_dtype, s.block_size)
    work = [trace.Req(f"r{i:02d}", 0.0, 3000 + 500 * i, 4) for i in range(10)]
    priced = []
    real = trace.step_seconds

    def spy(cm_, model, layout, rows):
        priced.append(sorted((r.new_tokens, r.context, r.owner) for r in rows))
        return real(cm_, model, layout, rows)
    monkeypatch.setattr(trace, "step_seconds", spy)
    trace.replay(cm, s, caps, work, "dp_attn")

    blocks = {k: c.blocks_per_rank for k, c in caps.items()}
    sched = Scheduler(KVLedger(8, max(blocks.values()), s.block_size, "dp_attn", blocks), 1 << 20, s.chunk)
    for r in work:
        sched.add(Request(r.rid, [-2 - int(r.rid[1:])] * r.input_len, r.output_len))
    engine = []
    while sched.running or sched.waiting:
        plan = sched.schedule()
        engine.append(sorted((len(i.tokens), i.start_pos, i.owner) for i in plan.items))
        sched.update(plan, {i.req_id: -1 for i in plan.items if i.sample})
    k = max(j for j, rows in enumerate(engine) if any(n > 1 for n, _, _ in rows)) + 1   # the last prefill step
    assert k >= 2 and priced[:k] == engine[:k]
    assert all(len({o for _, _, o in rows}) > 1 for rows in engine[:k])
