"""Worker for test_device_plumbing: with torch's default device set to `meta` and the engine's device `cpu`,
generation (1 rank, or a layout + live switches on several ranks) still gives transformers' tokens — so no tensor
on the engine's path is created without the engine's device (a meta tensor would fail or give no data).

argv: (model_dir ref.pt layout switch_to,...) repeated: one job per four arguments, run in turn in one launch
  (switch_to: pinned at steps 2, 5, 8, ... in order; may be empty). Each line names its job's model directory.
"""
from __future__ import annotations

import sys
from pathlib import Path

import torch

from splash.engine.llm import LLM
from splash.engine.sampling import SamplingParams


def job(model_dir: str, ref_path: str, layout: str, switches: list[str]) -> None:
    ref = torch.load(ref_path)
    from splash.distributed import init_dist
    comm = init_dist().comm
    torch.set_default_device("meta")       # anything made without a device now lands on meta
    try:
        assert torch.empty(1).device.type == "meta"
        llm = LLM(model_dir, layout=layout, block_size=4, max_num_batched_tokens=16, num_kv_blocks=128,
                  comm=comm, device="cpu")
        eng = llm.engine
        if comm.rank != 0:
            eng.follow()
        else:
            ids = [eng.add_request(p, SamplingParams(max_tokens=m, temperature=0, ignore_eos=True))
                   for p, m in zip(ref["prompts"], ref["max_tokens"])]
            outs = {i: [] for i in ids}
            step, todo = 0, list(switches)
            while eng.has_work():
                if todo and step % 3 == 2:
                    eng.request_layout(todo.pop(0))
                for ev in eng.step():
                    outs[ev.req_id].append(ev.token)
                step += 1
            eng.stop()
            got = [outs[i] for i in ids]
            want = [t[:m] for t, m in zip(ref["tokens"], ref["max_tokens"])]
            assert got == want, f"{layout} {switches}: {got} != {want}"
            assert not todo and eng.layout == (switches[-1] if switches else layout), (todo, eng.layout)
    finally:
        torch.set_default_device(None)
    tag = Path(model_dir).parent.name
    print(f"{tag}: rank {comm.rank}/{comm.size} {layout} {','.join(switches)} meta-default OK", flush=True)


def main() -> None:
    args = sys.argv[1:]
    assert len(args) % 4 == 0, f"argv: (model_dir ref.pt layout switches) repeated, got {args}"
    for i in range(0, len(args), 4):   # several models share one launch: rank start-up once
        model_dir, ref_path, layout, switches = args[i:i + 4]
        job(model_dir, ref_path, layout, switches.split(",") if switches else [])


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from mpi_util import run_worker

    run_worker(main)
