"""Worker for test_reload_dist: weights updated in place on real ranks give the new checkpoint's tokens.

argv: job [job ...], each "label dir_a dir_b dir_c" (three checkpoints of one architecture, different seeds), run in
  turn in one launch; rank 0 prints "rank 0: label: <step> OK" per passed step. An engine serving A in TP (its
  prefix cache warm) takes B's weights and must give a one-rank engine's tokens for B (not hits on A's cached KV);
  then switched to DOP it must still; it takes C's weights in DOP, then DP-attn and CP must give C's tokens; it
  takes B's in CP and C's in DP-attn (layouts a switch entered: some tensors were made in inference mode). A
  missing checkpoint, and a load that fails on rank 1 only, are a ValueError on every rank with nothing changed;
  an update while a request waits is refused (EngineBusy).
"""
from __future__ import annotations

import sys
from pathlib import Path

from splash.distributed import SingleRankCommunicator
from splash.errors import EngineBusy
from splash.engine.llm import LLM, on_rank0
from splash.engine.sampling import SamplingParams

SP = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
# prompts longer than a few 4-token blocks: the repeat run starts on cached blocks
PROMPTS = [[(7 * j + 3) % 200 + 1 for j in range(21)], [(5 * j + 11) % 200 + 1 for j in range(13)]]


def tokens(llm: LLM) -> list[list[int]]:
    return [o.token_ids for o in llm.generate(PROMPTS, SP)]


def refuses(llm: LLM, path: str, needle: str) -> bool:
    try:
        llm.update_weights(path)
    except ValueError as e:
        return needle in str(e)
    return False


def job(dirs: list[str], say) -> None:
    ref = {d: tokens(LLM(model=d, comm=SingleRankCommunicator(), block_size=4)) for d in dirs}
    a, b, c = dirs
    assert ref[a] != ref[b] != ref[c], ref
    llm = LLM(model=a, layout="tp", block_size=4)
    rank = llm.comm.rank
    say = say if rank == 0 else (lambda msg: None)
    for _ in range(2):   # the second run hits A's cached blocks
        assert tokens(llm) == ref[a]
    assert llm.engine.scheduler.prefix_hits or rank, "the prefix cache was not warm"
    llm.update_weights(b)
    assert tokens(llm) == ref[b]
    say("tp a->b OK")
    llm.engine.request_layout("dop")
    assert tokens(llm) == ref[b] and llm.engine.layout == "dop"
    say("b then dop OK")
    llm.update_weights(c)
    for lay in ("dop", "dp_attn", "cp"):
        llm.engine.request_layout(lay)
        assert tokens(llm) == ref[c] and llm.engine.layout == lay, lay
    say("dop b->c, then dp_attn, cp OK")
    for lay, d in (("cp", b), ("dp_attn", c)):   # layouts a switch entered (their tensors made in inference mode)
        llm.engine.request_layout(lay)
        llm.update_weights(d)
        assert tokens(llm) == ref[d] and llm.engine.layout == lay, lay
    say("cp c->b, dp_attn b->c OK")
    assert refuses(llm, a + "-missing", "rank 0")
    if rank == 1:
        def broken(get):
            raise RuntimeError("disk gone")
        llm.runner.load_weights = broken
    assert refuses(llm, a, "rank 1: RuntimeError: disk gone")
    llm.runner.__dict__.pop("load_weights", None)
    assert tokens(llm) == ref[c]
    say("failed updates change nothing OK")

    def busy():
        eng = llm.engine
        eng.add_request(PROMPTS[0], SP, "waiting")
        try:
            eng.update_weights(a)
        except EngineBusy:
            refused = True
        else:
            refused = False
        while eng.has_work():
            eng.step()
        return refused
    assert on_rank0(llm.comm, llm.engine, busy)
    assert tokens(llm) == ref[c]
    say("busy engine refuses OK")


def main() -> None:
    for spec in sys.argv[1:]:
        label, *dirs = spec.split(" ")
        job(dirs, lambda msg, label=label: print(f"rank 0: {label}: {msg}", flush=True))


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from mpi_util import run_worker

    run_worker(main)
