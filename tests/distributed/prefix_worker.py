"""Worker for test_prefix_dist: the prefix cache changes no token, in every layout and through live switches.

argv: job [job ...], each job one argument "label model_dir mode [arg ...]" (space-separated), run in turn in one
  launch; rank 0 prints each job's lines as "rank 0: label: ...".
  mode "directions" [directions]: for each "src->dst" (comma-separated; default all 12), one run with the cache
      and one without, each starting in src (the switch live, or blocking for every other direction): requests
      sharing a long stem arrive over the run (a multi-turn agent's growing conversation and n samples of one
      prompt), the layout switches live to dst part way through, and later arrivals find the earlier ones' blocks
      cached; the greedy tokens of both runs must be equal and the cached run must have hit. Pools end with every
      request's blocks released (cached blocks only).
  mode "pressure" [max_num_seqs]: a pool too small for the batch (preemption + eviction + n samples + switches every
      few steps); same check.
  mode "samples" [layouts]: 8 samples of one 37-token prompt sent together (4 greedy, 4 seeded random), in each
      layout: the same tokens with and without the cache, and with it the prompt is prefilled once — the other 7
      samples find all its 9 full blocks (block size 4) cached, computing only their last token's block.
  mode "kept" / "kept-moved" directions [mode directions ...]: for each direction, one request finishes (its blocks
      cached, idle), the layout switches with nothing running, and the same conversation's next turn arrives after
      the switch: it must start on the blocks the switch kept (kept-moved: the cost verdict forced to "send", so
      blocks that must travel are moved too), with the same greedy tokens as without the cache.
With a hybrid model (glm5_next) hits resume the KDA layers from state snapshots; every rank's snapshots must match
rank 0's record of them at the end.
"""
from __future__ import annotations

import sys
from pathlib import Path

from splash.engine.llm import LLM
from splash.engine.sampling import SamplingParams

LAYOUTS = ("tp", "dp_attn", "cp", "dop")


def stem(n: int, seed: int) -> list[int]:
    return [(seed * 31 + 7 * j) % 250 + 1 for j in range(n)]


def workload():
    """(arrival step, prompt, max_tokens): turn 1 of two conversations, n=3 samples of one prompt, then turns that
    resend the conversation so far plus new text, and a prompt sharing only part of a block."""
    a, b = stem(37, 1), stem(29, 2)
    return [(0, a, 8), (0, b, 6), (1, a + [11, 12, 13], 6), (1, a + [11, 12, 13], 6), (1, a + [11, 12, 13], 6),
            (5, a + [3] * 9 + stem(5, 3), 7), (9, b + [4] * 13, 5), (12, a[:18] + [9, 9], 6),
            (14, a + [11, 12, 13] + [8] * 6, 5)]


def long_outputs():
    """The same prompts generating 40 tokens each: their growth, not their prompts, fills a small pool."""
    return [(at, p, 40) for at, p, _ in workload()]


def samples_workload():
    """(arrival step, prompt, max_tokens, seed): n = 8 of one prompt at once, half greedy, half seeded."""
    p = stem(37, 5)
    return [(0, p, 6, None if j < 4 else 100 + j) for j in range(8)]


def params(m: int, seed: int | None = None) -> SamplingParams:
    if seed is None:
        return SamplingParams(max_tokens=m, temperature=0, ignore_eos=True)
    return SamplingParams(max_tokens=m, temperature=1.0, seed=seed, ignore_eos=True)


def drive(llm: LLM, arrivals, switches: dict[int, str]) -> list[list[int]] | None:
    eng = llm.engine
    if llm.comm.rank != 0:
        eng.follow()
        return None
    pending = sorted(arrivals, key=lambda x: x[0])
    ids, outs, k = [], {}, 0
    while pending or eng.has_work():
        while pending and pending[0][0] <= k:
            _, p, m, *seed = pending.pop(0)
            rid = eng.add_request(p, params(m, *seed))
            ids.append(rid)
            outs[rid] = []
        if k in switches:
            eng.request_layout(switches[k])
        for ev in eng.step():
            outs[ev.req_id].append(ev.token)
        k += 1
        assert k < 2000, "the run does not finish"
    eng.stop()
    return [outs[i] for i in ids]


def one_turn_then_next():
    """A 37-token turn finishes (8 steps), the switch comes at step 10 with nothing running, the next turn at 12."""
    a = stem(37, 1)
    return [(0, a, 4), (12, a + [5, 6, 7], 4)]


def run(model_dir: str, src: str, switches: dict[int, str], cache: bool, work=workload, move_cached=None, **kw):
    llm = LLM(model_dir, layout=src, block_size=4, max_num_batched_tokens=24, enable_prefix_caching=cache,
              hardware_profile=None, **kw)
    if move_cached is not None:   # the cost verdict, forced (it is unit-tested in tests/test_switch_prefix.py)
        llm.engine._cached_moves_pay = lambda dst: move_cached
    toks = drive(llm, work(), switches)
    stats = None
    if llm.comm.rank == 0:
        s = llm.engine.scheduler
        stats = (s.prefix_hits, s.prefix_queries, s.num_preemptions, sum(llm.engine.switch_counts.values()))
    bm = llm.engine.runner.bm
    assert not bm.requests(), f"rank {llm.comm.rank}: blocks still held by {bm.requests()}"
    assert bm.num_free + bm.num_evictable == bm.num_blocks, "a block leaked"
    check_snapshots(llm)
    return toks, stats


def check_snapshots(llm: LLM) -> None:
    """A hybrid model's ranks keep exactly the KDA state snapshots rank 0's ledger records (plus those its last
    step dropped, which no later message carried), never more than its bound, and no request's state."""
    states, me = llm.engine.runner.states, llm.comm.rank
    if states is None:
        return
    snaps = llm.engine.ledger.snapshots
    mine = ([list(d) for d in snaps.held], snaps.drops, snaps.per_rank) if me == 0 and snaps is not None else None
    mirror = llm.comm.broadcast_obj(mine)
    assert not states.states, f"rank {me}: KDA state left for {sorted(states.states)}"
    if mirror is None:
        assert not states.snapshots, f"rank {me}: snapshots kept with the prefix cache off"
        return
    held, drops, bound = mirror
    have = set(states.snapshots)
    assert set(held[me]) <= have <= set(held[me]) | set(drops[me]), (me, have, held[me], drops[me])
    assert len(held[me]) <= bound, (me, len(held[me]), bound)


def job(model_dir: str, args: list[str], say) -> None:
    """One job: mode args[0] with its arguments args[1:] on the model in model_dir; `say` prints a rank-0 line."""
    mode = args[0]
    if mode == "directions":
        dirs = args[1].split(",") if len(args) > 1 else [f"{s}->{d}" for s in LAYOUTS for d in LAYOUTS if s != d]
        for i, d in enumerate(dirs):
            src, dst = d.split("->")
            at = {2 + i % 5: dst}
            mode = ("live", "blocking")[i % 2]   # every other direction hands off blocking (all state moved first)
            on, st = run(model_dir, src, at, True, switch_mode=mode)
            off, _ = run(model_dir, src, at, False, switch_mode=mode)
            if on is not None:
                assert on == off, f"{d}: tokens differ with the prefix cache\n{on}\n{off}"
                assert st[0] > 0, f"{d}: no prefix-cache hit {st}"
                say(f"{d} {mode} OK hits {st[0]}/{st[1]} prompt tokens")
    elif mode in ("kept", "kept-moved"):
        # args: (mode, directions) pairs, each mode's directions in turn
        pairs = list(zip(args[::2], args[1::2]))
        for mode, d in [(m, d) for m, dirs in pairs for d in dirs.split(",")]:
            src, dst = d.split("->")
            move = mode == "kept-moved"
            on, st = run(model_dir, src, {10: dst}, True, one_turn_then_next, move_cached=move)
            off, _ = run(model_dir, src, {10: dst}, False, one_turn_then_next)
            if on is not None:
                assert on == off, f"{d}: tokens differ with the prefix cache\n{on}\n{off}"
                assert st[3] == 1 and st[0] == 36, f"{d}: the next turn did not start on the kept blocks {st}"
                say(f"{d} {mode} OK hits {st[0]}/{st[1]} prompt tokens")
    elif mode == "pressure":
        seq = {25: "dop", 40: "cp", 55: "tp"}
        # args[1]: max_num_seqs (a hybrid model keeps as many KDA state snapshots: a few make them compete too)
        kw = {"max_num_seqs": int(args[1])} if len(args) > 1 else {}
        on, st = run(model_dir, "tp", seq, True, long_outputs, num_kv_blocks=64, **kw)
        off, st_off = run(model_dir, "tp", seq, False, long_outputs, num_kv_blocks=64, **kw)
        if on is not None:
            assert on == off, f"tokens differ with the prefix cache under pressure\n{on}\n{off}"
            assert st[0] > 0 and st[2] + st_off[2] > 0 and st[3] >= 2, (st, st_off)
            say(f"pressure OK hits {st[0]}/{st[1]} preemptions {st[2]}/{st_off[2]} switches {st[3]}")
    elif mode == "samples":
        for lay in args[1].split(",") if len(args) > 1 else LAYOUTS:
            on, st = run(model_dir, lay, {}, True, samples_workload)
            off, _ = run(model_dir, lay, {}, False, samples_workload)
            if on is not None:
                assert on == off, f"{lay}: tokens differ with the prefix cache\n{on}\n{off}"
                assert st[0] == 7 * 36, f"{lay}: the prompt was prefilled more than once: hits {st}"
                say(f"samples {lay} OK hits {st[0]}/{st[1]} prompt tokens")
    else:
        raise SystemExit(f"unknown mode {mode}")


def main() -> None:
    for spec in sys.argv[1:]:   # several jobs (models, modes) share one launch: rank start-up once
        label, model_dir, *args = spec.split(" ")
        job(model_dir, args, lambda msg, label=label: print(f"rank 0: {label}: {msg}", flush=True))


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from mpi_util import run_worker

    run_worker(main)
