"""Worker for test_sampling_dist: every sampling parameter, logprobs and prompt logprobs on real ranks while the
layout switches live tp -> dp_attn -> cp -> dop -> tp mid-run (first switch mid-prefill). Rank 0 checks the
result against transformers with the reference sampler (tests/test_logprobs.check_against_hf) and against one
rank without switches (same tokens; logprobs within 1e-4).

argv: model_dir
"""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from mpi_util import run_worker  # noqa: E402

SWITCHES = {1: "dp_attn", 4: "cp", 7: "dop", 10: "tp"}


def drive(llm, prompts, params):
    """The engine loop with pinned switches at SWITCHES' steps; rank 0 returns vLLM-shaped outputs."""
    from splash.engine.llm import CompletionOutput, RequestOutput

    eng = llm.engine
    if llm.comm.rank != 0:
        eng.follow()
        return None
    outs = [RequestOutput(str(i), p, [CompletionOutput(0, [], logprobs=None if sp.logprobs is None else [])])
            for i, (p, sp) in enumerate(zip(prompts, params))]
    ids = {eng.add_request(p, sp): o for p, sp, o in zip(prompts, params, outs)}
    k = 0
    while eng.has_work():
        if k in SWITCHES:
            eng.request_layout(SWITCHES[k])
        for ev in eng.step():
            o = ids[ev.req_id]
            o.outputs[0].token_ids.append(ev.token)
            if ev.logprobs is not None:
                o.outputs[0].logprobs.append(ev.logprobs)
            if ev.prompt_logprobs is not None:
                o.prompt_logprobs = [None, *ev.prompt_logprobs]
        k += 1
    eng.stop()
    assert sum(eng.control.switch_counts.values()) == len(SWITCHES), eng.control.switch_counts
    return outs


def main() -> None:
    from hf_models import load_hf, random_prompts
    from test_logprobs import MIXED, TOL, check_against_hf

    from splash.distributed.communicator import SingleRankCommunicator
    from splash.engine.llm import LLM

    model_dir = sys.argv[1]
    prompts = random_prompts([9, 21, 4, 33], seed=5)
    llm = LLM(model_dir, layout="tp", block_size=4, max_num_batched_tokens=16, num_kv_blocks=128)
    got = drive(llm, prompts, MIXED)
    if got is None:
        print(f"rank {llm.comm.rank}: sampling OK", flush=True)
        return
    check_against_hf(load_hf(model_dir), prompts, MIXED, got)
    one = LLM(model_dir, block_size=4, max_num_batched_tokens=16, num_kv_blocks=128,
              comm=SingleRankCommunicator()).generate(prompts, MIXED)
    for a, b in zip(got, one):
        assert a.token_ids == b.token_ids, (a.token_ids, b.token_ids)
        for x, y in zip(a.outputs[0].logprobs or [], b.outputs[0].logprobs or []):
            assert abs(x.logprob - y.logprob) < TOL and [t for t, _ in x.top] == [t for t, _ in y.top]
        for x, y in zip((a.prompt_logprobs or [None])[1:], (b.prompt_logprobs or [None])[1:]):
            assert abs(x.logprob - y.logprob) < TOL and x.rank == y.rank
    print("rank 0: sampling OK", flush=True)


if __name__ == "__main__":
    run_worker(main)
