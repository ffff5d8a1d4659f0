"""FP8 block-scaled and INT8 weights on real ranks (mpiexec -n 2 / -n 4): every layout gives transformers' greedy
tokens on the dequantised checkpoint, and a run whose layout walks all 12 switch directions (live and blocking)
keeps its tokens, reassembles the stored weights and scales bit for bit, receives exactly the manifest's weight
bytes and holds exactly the memory model's weight bytes on every rank before, between and after the switches.
The tiny model's KV-B has 56 rows per head and Q-B 32, so head shards start inside 128-row scale blocks.
GLM-5.3-Flash (glm5_next: KDA, KPool MLA-DSA, mHC, MoE) walks the same 12 directions with FP8 and INT8 weights
(KDA q/k/v/o head shards with their scale blocks; KDA gates dense under FP8, INT8 too under INT8): tokens equal
the unswitched one-rank engine on the dequantised checkpoint (test_glm5_next checks that against transformers)."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from hf_glm5_next import QUANT_KEEP, make_tiny_glm5_next  # noqa: E402
from hf_models import VARIANTS, hf_greedy, load_hf, make_tiny_deepseek, random_prompts  # noqa: E402
from quant_ckpt import write_quantized  # noqa: E402

WORKER = "tests/distributed/quant_worker.py"
QMODEL = dict(VARIANTS["moe_yarn"], hidden_size=160, intermediate_size=288, q_lora_rank=136, kv_lora_rank=48,
              qk_nope_head_dim=24, v_head_dim=32)


def reference(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("quant_dist")
    src = make_tiny_deepseek(d / "src", **QMODEL)
    dirs = {"plain": (src, src), "fp8": write_quantized(src, d, "fp8", spread_seed=3),
            "int8": write_quantized(src, d, "w8a8")}
    prompts = random_prompts([3, 17, 30, 1], seed=1)
    max_tokens = [16] * len(prompts)
    tokens = {k: hf_greedy(load_hf(deq), prompts, 16) for k, (_, deq) in dirs.items()}
    ref = {"dirs": {k: (str(q), str(dq)) for k, (q, dq) in dirs.items()}, "prompts": prompts,
           "max_tokens": max_tokens, "tokens": tokens}
    torch.save(ref, d / "ref.pt")
    return d / "ref.pt"


def glm5_reference(tmp_path_factory) -> Path:
    from splash.distributed import SingleRankCommunicator
    from splash.engine.llm import LLM
    from splash.engine.sampling import SamplingParams

    d = tmp_path_factory.mktemp("quant_dist_glm5")
    src = make_tiny_glm5_next(d / "src", index_topk=8)
    # fp8: KDA gates dense (QUANT_KEEP); int8: the gates quantised too (their head rows travel with scales)
    dirs = {"glm5_fp8": write_quantized(src, d, "fp8", spread_seed=3, keep=QUANT_KEEP),
            "glm5_int8": write_quantized(src, d, "w8a8", keep=QUANT_KEEP[:1])}
    prompts, max_tokens = random_prompts([3, 17, 30, 1], seed=1), [16, 5, 16, 9]
    sp = [SamplingParams(max_tokens=m, temperature=0, ignore_eos=True) for m in max_tokens]
    tokens = {k: [o.token_ids for o in LLM(str(deq), block_size=4, max_num_batched_tokens=16,
                                           comm=SingleRankCommunicator()).generate(prompts, sp)]
              for k, (_, deq) in dirs.items()}
    ref = {"dirs": {k: (str(q), str(dq)) for k, (q, dq) in dirs.items()}, "prompts": prompts,
           "max_tokens": max_tokens, "tokens": tokens}
    torch.save(ref, d / "ref.pt")
    return d / "ref.pt"


SWITCH_RUNS = {2: ["fp8:live", "int8:blocking", "plain:live"], 4: ["int8:live", "fp8:blocking"]}
GLM5_RUNS = ["glm5_fp8:live", "glm5_int8:live"]   # 2 ranks


_REFS: dict[str, Path] = {}   # built once, for both rank counts


def launch_jobs(nprocs: int, tmp_path_factory, tiny_ckpt) -> list[tuple[str, ...]]:
    """This file's job at `nprocs` ranks, run in tests/distributed/conftest.py's shared launch: the layouts (fp8,
    int8), the SWITCH_RUNS of that rank count and (2 ranks) GLM5_RUNS, in turn (the lines name their scheme)."""
    for name, make in (("moe", reference), ("glm5", glm5_reference)):
        if name not in _REFS:
            _REFS[name] = make(tmp_path_factory)
    moe = str(_REFS["moe"])
    args = [moe, "layouts", "fp8,int8", moe, "switch", ",".join(SWITCH_RUNS[nprocs])]
    if nprocs == 2:
        args += [str(_REFS["glm5"]), "switch", ",".join(GLM5_RUNS)]
    return [(WORKER, *args)]


@pytest.fixture(scope="module")
def launches(shared_launches):
    """`launches(nprocs) -> stdout` of the shared launch of that rank count; a failing run aborts it, so every
    test of that rank count then fails with its output."""
    def get(nprocs: int) -> str:
        res = shared_launches(nprocs)
        assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
        return res.stdout
    return get


@pytest.mark.parametrize("nprocs", [2, 4])
def test_every_layout_matches_dequantised_reference(launches, nprocs):
    out = launches(nprocs)
    for scheme in ("fp8", "int8"):
        for layout in ("tp", "dp_attn", "cp", "dop"):
            for r in range(nprocs):
                assert f"rank {r}: layouts {scheme} {layout} OK" in out, out


@pytest.mark.parametrize("nprocs", [2, 4])
def test_all_switch_directions_keep_stored_weights(launches, nprocs):
    out = launches(nprocs)
    for run in SWITCH_RUNS[nprocs]:
        scheme, mode = run.split(":")
        for r in range(nprocs):
            assert f"rank {r}: switch {scheme} {mode} OK (12 directions)" in out, out


def test_glm5_next_quantised_switches_keep_tokens(launches):
    out = launches(2)
    for run in GLM5_RUNS:
        scheme, mode = run.split(":")
        for r in range(2):
            assert f"rank {r}: switch {scheme} {mode} OK (12 directions)" in out, out
