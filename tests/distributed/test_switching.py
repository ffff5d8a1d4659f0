"""Live and blocking layout switches on real ranks (mpiexec -n 2 / -n 4) change no token and leak no block:
all 12 directions at a random step (incl. mid-prefill), random chains over 64 steps (fp32, fp8, int8 KV),
a switch that does not fit the headroom is deferred while the run continues, and switches between layouts
of different KV dtypes (fp32/bf16/fp8/int8) convert the pool layer by layer.

Parametrised by architecture: the DSA models (DeepSeek-V3.2; GLM-5.x with a shared indexer layer; top-k 8 below
the context) run the 12 directions (their indexer keys move with their KV blocks) and the KV-dtype conversions
(indexer keys re-stored as FP8/INT8 + scale) on a lighter batch of 24 greedy tokens (32 in the layouts test); GLM-5.3-Flash runs the 12 directions against
its unswitched one-rank engine and checks its per-request KDA state byte-exact across each switch. At block size
16 (the server's default) both DSA models switch into and out of CP with exact index-score ties in the batch."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from hf_models import DSA_VARIANTS, VARIANTS, hf_greedy, load_hf, make_tiny_deepseek, random_prompts  # noqa: E402
from hf_glm5_next import VARIANTS as GLM_VARIANTS  # noqa: E402
from hf_glm5_next import make_tiny_glm5_next  # noqa: E402
from mpi_util import run_mpi  # noqa: E402

WORKER = "tests/distributed/switch_worker.py"
DIRECTIONS = [f"{s}->{d}" for s in ("tp", "dp_attn", "cp", "dop") for d in ("tp", "dp_attn", "cp", "dop") if s != d]


# checkpoint variant -> (prompt lengths, max tokens, greedy steps)
CASES = {"moe_yarn": ([3, 17, 9, 30, 1, 12], [24, 5, 24, 24, 13, 24], 24),
         "v32_sparse": ([5, 19, 1], [24, 7, 24], 24), "glm_sparse": ([5, 19, 1], [24, 7, 24], 24)}


def _reference(tmp_path_factory, variant: str) -> tuple[Path, Path]:
    d = tmp_path_factory.mktemp(f"switching_{variant}")
    model_dir = make_tiny_deepseek(d / "model", **{**VARIANTS, **DSA_VARIANTS}[variant])
    lengths, max_tokens, steps = CASES[variant]
    prompts = random_prompts(lengths, seed=1)
    ref = {"prompts_a": prompts, "max_tokens_a": max_tokens,
           "tokens_a": hf_greedy(load_hf(model_dir), prompts, steps)}
    torch.save(ref, d / "ref.pt")
    return model_dir, d / "ref.pt"


@pytest.fixture(scope="module")
def refs(tmp_path_factory):
    """`refs(variant) -> (model_dir, ref.pt)`, built once per module."""
    cache: dict[str, tuple[Path, Path]] = {}

    def get(variant: str) -> tuple[Path, Path]:
        if variant not in cache:
            cache[variant] = _reference(tmp_path_factory, variant)
        return cache[variant]
    return get


@pytest.fixture(scope="module")
def glm5_reference(tmp_path_factory) -> tuple[Path, Path]:
    """GLM-5.3-Flash (KDA + NoPE MLA-DSA + mHC), index_topk below the contexts. The reference is the unswitched
    one-rank engine (test_layouts_dist and test_glm5_next check that equals transformers; transformers' KDA
    fallback would make this fixture slow); a smaller batch that still runs past the latest switch step."""
    from splash.distributed import SingleRankCommunicator
    from splash.engine.llm import LLM
    from splash.engine.sampling import SamplingParams

    d = tmp_path_factory.mktemp("switching_glm5")
    model_dir = make_tiny_glm5_next(d / "model", **GLM_VARIANTS["topk_low"])
    prompts, max_tokens = random_prompts([3, 17, 30, 1], seed=1), [16, 5, 16, 9]
    llm = LLM(str(model_dir), block_size=4, max_num_batched_tokens=16, comm=SingleRankCommunicator())
    outs = llm.generate(prompts, [SamplingParams(max_tokens=m, temperature=0, ignore_eos=True) for m in max_tokens])
    torch.save({"prompts_a": prompts, "max_tokens_a": max_tokens, "tokens_a": [o.token_ids for o in outs]},
               d / "ref.pt")
    return model_dir, d / "ref.pt"


GLM5_LAYOUTS = ("tp", "dp_attn", "cp", "dop")
GLM5_MODES = {2: ("directions", "states"), 4: ("states",)}   # per rank count

# Block size 16 (the server's default) with exact index-score ties under CP. Token 258 (<|user|>, the tiny
# models' pad_token_id) has a zero embedding row, so at its rows layer 0's indexer query is 0 and every key scores
# exactly 0: the top-k is decided by the tie rule alone. Prompt 0 is the one that diverged on the server (it
# generates 258 at position 22 on v32_sparse: 23 positions, top-k 8, the second block's rank holds only 7 of
# them: decoded under CP after dp_attn->cp); prompt 3 ends in 258 at position 20 (the tie decides its first
# token; prefilled under CP before cp->dop: glm_sparse diverged there), prompt 1 has it mid-prompt. The reference
# is the unswitched one-rank engine at the same block size, not transformers: splash breaks exact ties towards
# the earlier position in every layout, transformers' torch.topk its own way (test_dsa_vs_hf checks one rank
# against transformers on tie-free prompts).
TIE_PROMPTS = [[8, 9, 10, 11, 12], [*range(40, 51), 258, *range(60, 67)], [97], [*range(60, 80), 258]]
TIE_MAX_TOKENS, TIE_DIRECTIONS = [24, 16, 16, 16], "cp->dop,dp_attn->cp"  # live at step 9, blocking at 1


@pytest.fixture(scope="module")
def tie_refs(tmp_path_factory):
    """`tie_refs(variant) -> (model_dir, ref.pt)`: TIE_PROMPTS' tokens from one rank at block size 16; cached."""
    from splash.distributed import SingleRankCommunicator
    from splash.engine.llm import LLM
    from splash.engine.sampling import SamplingParams

    cache: dict[str, tuple[Path, Path]] = {}

    def get(variant: str) -> tuple[Path, Path]:
        if variant not in cache:
            d = tmp_path_factory.mktemp(f"ties_{variant}")
            model_dir = make_tiny_deepseek(d / "model", **DSA_VARIANTS[variant])
            llm = LLM(str(model_dir), block_size=16, max_num_batched_tokens=16, comm=SingleRankCommunicator())
            outs = llm.generate(TIE_PROMPTS, [SamplingParams(max_tokens=m, temperature=0, ignore_eos=True)
                                              for m in TIE_MAX_TOKENS])
            torch.save({"prompts_a": TIE_PROMPTS, "max_tokens_a": TIE_MAX_TOKENS,
                        "tokens_a": [o.token_ids for o in outs]}, d / "ref.pt")
            cache[variant] = model_dir, d / "ref.pt"
        return cache[variant]
    return get


CHAINS = [(2, "float32"), (4, "float32"), (2, "fp8_e4m3"), (2, "int8"), (4, "int8")]
# the moe_yarn cases over MPI, per rank count: directions, the CHAINS of that rank count, KV-dtype conversion and
# (2 ranks) the deferred switch
MOE_MODES = {2: "directions+chain+convert+defer", 4: "directions+chain+convert"}


def _jobs(nprocs: int) -> list[tuple[str, str, list[str]]]:
    """(tag, reference, worker arguments) of every job at `nprocs` ranks; each job's lines name its tag. DSA cases
    are spread over the rank counts to keep the suite short (both layouts tests run each at -n 2 and -n 4);
    communicator torch: the layers' and switches' collectives on torch.distributed (gloo), control on MPI, each
    direction in one mode there (live and blocking alternate)."""
    kv = ",".join(kv for n, kv in CHAINS if n == nprocs)
    glm5 = ("glm5_next", "glm5_next", ["+".join(GLM5_MODES[nprocs]), "layouts=" + ",".join(GLM5_LAYOUTS)])
    if nprocs == 4:
        return [("moe_yarn", "moe_yarn", [MOE_MODES[4], kv, "mpi"]),
                ("glm_sparse", "glm_sparse", ["directions", "float32", "mpi"]), glm5]
    ties = [(f"ties_{v}", f"ties_{v}", ["directions", "float32", "mpi", "alternate", f"directions={TIE_DIRECTIONS}",
                                         "block_size=16"]) for v in ("v32_sparse", "glm_sparse")]
    # glm5_next last: its KDA state-landing log (switch_worker.record_state_landings) stays installed once set
    return [("moe_yarn", "moe_yarn", [MOE_MODES[2], kv, "mpi"]),
            ("v32_sparse", "v32_sparse", ["directions", "float32", "mpi"]), ("glm_sparse", "glm_sparse", ["convert"]),
            *ties, ("moe_yarn_torch", "moe_yarn", ["directions", "float32", "torch", "alternate"]), glm5]


@pytest.fixture(scope="module")
def launches(refs, glm5_reference, tie_refs):
    """`launches(nprocs) -> stdout` of the one launch that runs every _jobs(nprocs) job in turn (rank start-up
    once per rank count, not per case; each line names its job's tag). Each test asserts its own OK lines; a
    failing job aborts the launch, so every test of that rank count then fails with its output."""
    cache: dict[int, object] = {}

    def reference(name: str) -> tuple[Path, Path]:
        if name == "glm5_next":
            return glm5_reference
        return tie_refs(name.removeprefix("ties_")) if name.startswith("ties_") else refs(name)

    def get(nprocs: int) -> str:
        if nprocs not in cache:
            args = []
            for tag, ref, job in _jobs(nprocs):
                args += [*(["::"] if args else []), *map(str, reference(ref)), *job, f"tag={tag}"]
            cache[nprocs] = run_mpi(nprocs, WORKER, *args, timeout=280)   # under pytest-timeout's 300 s
        res = cache[nprocs]
        assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
        return res.stdout
    return get


@pytest.mark.parametrize("nprocs,modes", list(GLM5_MODES.items()))
def test_glm5_next_directions_and_state(launches, nprocs, modes):
    """glm5_next: all 12 directions, live and blocking, keep the unswitched tokens and free the pools (2 ranks;
    4-rank tokens in every layout are test_layouts_dist's, kept short for the suite's time); the per-request KDA
    state is byte-exact across each switch and lands where the destination puts it (2 and 4 ranks)."""
    out = launches(nprocs)
    for s in GLM5_LAYOUTS:
        for d in GLM5_LAYOUTS:
            if s != d:
                for mode in ("live", "blocking"):
                    for r in range(nprocs):
                        for what in modes:
                            line = f"rank {r}: glm5_next: {s}->{d} {mode} OK" if what == "directions" else \
                                f"rank {r}: glm5_next: state {s}->{d} {mode} OK"
                            assert line in out, out


@pytest.mark.parametrize("variant,nprocs,communicator", [("moe_yarn", 2, "mpi"), ("moe_yarn", 4, "mpi"),
                                                         ("v32_sparse", 2, "mpi"), ("glm_sparse", 4, "mpi"),
                                                         ("moe_yarn", 2, "torch")])
def test_all_directions_live_and_blocking(launches, variant, nprocs, communicator):
    torch_run = communicator == "torch"
    out = launches(nprocs)
    tag = f"{variant}_torch" if torch_run else variant
    kind = {"mpi": "MPICommunicator", "torch": "TorchCommunicator"}[communicator]
    for i, d in enumerate(DIRECTIONS):
        for mode in (("live", "blocking")[i % 2],) if torch_run else ("live", "blocking"):
            for r in range(nprocs):
                assert f"rank {r}: {tag}: {d} {mode} OK ({kind})" in out, out


@pytest.mark.parametrize("variant", ["v32_sparse", "glm_sparse"])
def test_cp_directions_at_block_16_with_exact_ties(tie_refs, launches, variant):
    """Into and out of CP at block size 16 (2 ranks; each direction in one mode, for the suite's time), with
    exact index-score ties: CP's global top-k picks the one-rank positions (order keys carry the position)."""
    _, ref = tie_refs(variant)
    if variant == "v32_sparse":
        assert 258 in torch.load(ref)["tokens_a"][0], "prompt 0 no longer generates the zero-embedding token"
    out = launches(2)
    for i, d in enumerate(TIE_DIRECTIONS.split(",")):
        for r in range(2):
            assert f"rank {r}: ties_{variant}: {d} {('live', 'blocking')[i % 2]} OK" in out, out


@pytest.mark.parametrize("nprocs,kv_dtype", CHAINS)
def test_random_switch_chain(launches, nprocs, kv_dtype):
    out = launches(nprocs)
    for mode in ("live", "blocking"):
        assert f"rank 0: moe_yarn: chain {kv_dtype} {mode} OK" in out, out


@pytest.mark.parametrize("variant,nprocs", [("moe_yarn", 2), ("moe_yarn", 4), ("glm_sparse", 2)])
def test_switch_between_kv_dtypes_converts(launches, variant, nprocs):
    """tp float32 -> dop fp8 -> tp -> cp int8 -> dp_attn bf16 -> tp -> dop -> dp_attn, live and blocking, from
    mid-prefill: against an unswitched run converted at the same boundaries (up to rounding; DSA selections and
    tokens the same but for near-tie flips, pinned and printed); no block leaks."""
    out = launches(nprocs)
    for mode in ("live", "blocking"):
        for r in range(nprocs):
            assert f"rank {r}: {variant}: convert {mode} OK" in out, out


def test_switch_without_headroom_is_deferred(launches):
    out = launches(2)
    assert "rank 0: moe_yarn: defer OK" in out, out
