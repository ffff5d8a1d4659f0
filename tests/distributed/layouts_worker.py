"""Worker for test_layouts_dist: every layout on real ranks must reproduce the reference tokens and logits.

argv: model_dir ref.pt kv_dtype layout[,layout...] [communicator: mpi (default) | torch]
model_dir and ref.pt may each be several, joined by "," (one launch checks each model in turn; its lines then
start with its model directory's parent's name); so may the communicator, one per model (one: every model's)
"""
from __future__ import annotations

import sys
from pathlib import Path

import torch

from splash.attention.batch import StepBatch, StepRequest
from splash.engine.llm import LLM
from splash.engine.sampling import SamplingParams


def check_layout(model_dir: str, ref: dict, kv_dtype: str, layout: str, comm=None, tag: str = "") -> None:
    llm = LLM(model_dir, layout=layout, kv_cache_dtype=kv_dtype, block_size=4, max_num_batched_tokens=16,
              num_kv_blocks=256, comm=comm)
    rank = llm.comm.rank
    for phase in ("a", "b"):
        prompts, max_tokens = ref[f"prompts_{phase}"], ref[f"max_tokens_{phase}"]
        params = [SamplingParams(max_tokens=m, temperature=0, ignore_eos=True) for m in max_tokens]
        outs = llm.generate(prompts, params)
        for i, (o, m) in enumerate(zip(outs, max_tokens)):
            want = ref[f"tokens_{phase}"][i][:m]
            assert o.token_ids == want, f"{layout} phase {phase} req {i}: {o.token_ids} != {want}"
    bm = llm.runner.bm
    assert bm.num_free + bm.num_evictable == bm.num_blocks, f"{layout}: rank {rank} leaked {bm.num_used} blocks"
    probe = ref["probe"]
    batch = StepBatch.build([StepRequest("probe", 0, len(probe), owner=llm.comm.size - 1)], [probe], [True])
    batch.sample_rows = list(range(len(probe)))
    logits = llm.runner.step(batch)
    llm.runner.release("probe")
    want = ref["probe_logits"]
    err = ((logits - want).abs().max() / want.abs().max()).item()
    assert err < 1e-4, f"{layout}: probe logits rel err {err}"
    kind = type(llm.comm).__name__
    print(f"{tag}rank {rank}/{llm.comm.size} {layout} {kv_dtype} OK ({kind}, logit rel err {err:.2e})", flush=True)


def main() -> None:
    model_dirs, ref_paths, kv_dtype, layouts = sys.argv[1:5]
    kinds = (sys.argv[5] if len(sys.argv) > 5 else "mpi").split(",")
    models = model_dirs.split(",")
    comms: dict[str, object] = {}   # torch.distributed starts once, for the first model on it
    several = len(models) > 1
    for i, (model_dir, ref_path) in enumerate(zip(models, ref_paths.split(","), strict=True)):
        kind = kinds[i] if len(kinds) > 1 else kinds[0]
        if kind not in comms:
            comms[kind] = comm_from_argv([kind])
        ref = torch.load(ref_path)
        tag = f"{Path(model_dir).parent.name}: " if several else ""
        for layout in layouts.split(","):
            check_layout(model_dir, ref, kv_dtype, layout, comms[kind], tag)


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from mpi_util import comm_from_argv, run_worker

    run_worker(main)
