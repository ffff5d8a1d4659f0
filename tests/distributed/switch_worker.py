"""Worker for test_switching: live/blocking layout switches mid-generation on real ranks change no token.

argv: model_dir ref.pt mode [kv_dtype]
  mode "directions": all 12 src->dst directions, live and blocking, switched at a random step (step 1 is
      mid-prefill of the chunked 30-token prompt), against transformers' tokens; pools end fully free.
  mode "chain": random switches across all four layouts every few steps over a 64-step run, against the
      unswitched run with the same KV dtype.
  mode "defer": a switch into TP that the pool cannot hold is deferred; the run continues correctly.
"""
from __future__ import annotations

import random
import sys

import torch

from splash.engine.llm import LLM
from splash.engine.sampling import SamplingParams

LAYOUTS = ("tp", "dp_attn", "cp", "dop")


def drive(llm: LLM, prompts, max_tokens, switches: dict[int, str]) -> list[list[int]] | None:
    """Run the engine loop; at step k (rank 0) pin switches[k]. Returns tokens on rank 0."""
    eng = llm.engine
    if llm.comm.rank != 0:
        eng.follow()
        return None
    ids = [eng.add_request(p, SamplingParams(max_tokens=m, temperature=0, ignore_eos=True))
           for p, m in zip(prompts, max_tokens)]
    outs: dict[str, list[int]] = {i: [] for i in ids}
    k = 0
    while eng.has_work():
        if k in switches:
            eng.request_layout(switches[k])
        for ev in eng.step():
            outs[ev.req_id].append(ev.token)
        k += 1
    eng.stop()
    return [outs[i] for i in ids]


def check_free(llm: LLM, what: str) -> None:
    bm = llm.runner.bm
    assert bm.num_free == bm.num_blocks, f"{what}: rank {llm.comm.rank} leaked {bm.num_used} blocks"


def make(model_dir, layout, kv_dtype="float32", mode="live", blocks=256) -> LLM:
    return LLM(model_dir, layout=layout, kv_cache_dtype=kv_dtype, block_size=4, max_num_batched_tokens=16,
               num_kv_blocks=blocks, switch_mode=mode)


def directions(model_dir, ref, rank_print) -> None:
    rng = random.Random(1234)
    want = [t[:m] for t, m in zip(ref["tokens_a"], ref["max_tokens_a"])]
    for src in LAYOUTS:
        for dst in LAYOUTS:
            if src == dst:
                continue
            for mode in ("live", "blocking"):
                at = rng.choice([1, 2, 5, 9, 14])
                llm = make(model_dir, src, mode=mode)
                got = drive(llm, ref["prompts_a"], ref["max_tokens_a"], {at: dst})
                if got is not None:
                    assert got == want, f"{src}->{dst} {mode} at step {at}: {got} != {want}"
                assert llm.runner.layout == dst, f"{src}->{dst}: still {llm.runner.layout}"
                check_free(llm, f"{src}->{dst} {mode}")
                rank_print(f"{src}->{dst} {mode} OK")


def chain(model_dir, ref, kv_dtype, rank_print) -> None:
    prompts, max_tokens = ref["prompts_a"], [64, 40, 64, 50, 64, 30]
    base = drive(make(model_dir, "tp", kv_dtype), prompts, max_tokens, {})
    for mode in ("live", "blocking"):
        rng = random.Random(7)
        switches, cur, k = {}, "tp", 0
        while k < 64:
            k += rng.randint(1, 5)
            cur = rng.choice([x for x in LAYOUTS if x != cur])
            switches[k] = cur
        llm = make(model_dir, "tp", kv_dtype, mode)
        got = drive(llm, prompts, max_tokens, switches)
        if got is not None:
            assert got == base, f"chain {kv_dtype} {mode}: {got} != {base}"
        n = sum(llm.engine.control.switch_counts.values()) if llm.comm.rank == 0 else 0
        check_free(llm, f"chain {kv_dtype} {mode}")
        rank_print(f"chain {kv_dtype} {mode} OK ({n} switches)")


def defer(model_dir, ref, rank_print) -> None:
    prompts, max_tokens = ref["prompts_a"], ref["max_tokens_a"]
    want = [t[:m] for t, m in zip(ref["tokens_a"], max_tokens)]
    llm = make(model_dir, "dp_attn", blocks=24)
    got = drive(llm, prompts, max_tokens, {6: "tp"})
    if got is not None:
        assert got == want, f"defer: {got} != {want}"
        assert llm.engine.control.deferrals > 0, "expected the switch into TP to be deferred"
        rank_print(f"defer OK ({llm.engine.control.deferrals} deferrals, now {llm.runner.layout})")
    check_free(llm, "defer")


def main() -> None:
    model_dir, ref_path, mode = sys.argv[1:4]
    kv_dtype = sys.argv[4] if len(sys.argv) > 4 else "float32"
    ref = torch.load(ref_path)
    import splash.distributed as dist
    rank = dist.init_dist().rank

    def rank_print(msg: str) -> None:
        print(f"rank {rank}: {msg}", flush=True)

    if mode == "directions":
        directions(model_dir, ref, rank_print)
    elif mode == "chain":
        chain(model_dir, ref, kv_dtype, rank_print)
    else:
        defer(model_dir, ref, rank_print)


if __name__ == "__main__":
    try:
        main()
    except BaseException:  # one failing rank must not leave the others waiting in a collective
        import traceback

        from mpi4py import MPI
        traceback.print_exc()
        sys.stderr.flush()
        MPI.COMM_WORLD.Abort(1)
