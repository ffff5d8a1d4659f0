"""Shared fixtures: tiny random DeepSeek-V3 checkpoints (built once per session) and their HF reference models.

    def test_x(tiny_ckpt, hf_ref):
        path = tiny_ckpt("moe_yarn")          # Path to a checkpoint dir (VARIANTS in tests/hf_models.py)
        path = tiny_ckpt("big", hidden_size=96)  # any name + DeepseekV3Config overrides (cached by name)
        model = hf_ref("moe_yarn")            # DeepseekV3ForCausalLM loaded from that dir (cached)
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Callable

import pytest
import torch

# The Triton attention kernel runs in Triton's interpreter on a machine without a GPU; the switch must be set
# before anything imports triton (transformers' DeepSeek-V3 module does), so it is set here, first.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
from hf_models import DSA_VARIANTS, VARIANTS, load_hf, make_tiny_deepseek

# MPICH's ranks busy-poll while they wait in a collective; on this 2-core host the tests' two- and four-rank jobs
# share the cores with each other and with the other xdist worker, so a waiting rank that spins takes the core the
# rank it waits for needs. These make a waiting rank sleep briefly instead (measured: the whole suite 611.6 ->
# 518.5 s, its CPU 1,020 -> 790 s; docs/benchmarks.md "Session 23 (lead)"). Rank processes inherit them through
# os.environ; other MPI libraries ignore them.
os.environ.setdefault("MPIR_CVAR_ENABLE_HEAVY_YIELD", "1")
os.environ.setdefault("MPIR_CVAR_CH4_PROGRESS_THROTTLE", "1")

# The tiny models are latency-bound: one thread avoids OpenMP spin-waits on this shared 2-core machine, where a
# second thread that is descheduled by another process makes every small op wait (measured: 100x slower steps).
torch.set_num_threads(1)

try:  # keep test output clean of "Writing model shards" / "Loading weights" progress bars
    from transformers.utils import logging as _hf_logging

    _hf_logging.disable_progress_bar()
    _hf_logging.set_verbosity_error()
except ImportError:  # pragma: no cover - transformers is a test dependency
    pass


@pytest.fixture(scope="session")
def tiny_ckpt(tmp_path_factory) -> Callable[..., Path]:
    """`tiny_ckpt(name, **overrides) -> Path`: a checkpoint written once per session under a tmp dir.

    With no overrides, `name` must be one of `hf_models.VARIANTS`; with overrides, `name` just names the cache
    entry (the same name must always come with the same overrides)."""
    root = tmp_path_factory.mktemp("tiny_ckpts")
    cache: dict[str, Path] = {}

    def get(name: str, **overrides) -> Path:
        if name not in cache:
            kw = overrides if overrides else {**VARIANTS, **DSA_VARIANTS}[name]
            cache[name] = make_tiny_deepseek(root / name, **kw)
        return cache[name]

    return get


@pytest.fixture(scope="session")
def hf_ref(tiny_ckpt) -> Callable[[str], torch.nn.Module]:
    """`hf_ref(name) -> DeepseekV3ForCausalLM` (fp32, eval) loaded from `tiny_ckpt(name)`; cached."""
    cache: dict[str, torch.nn.Module] = {}

    def get(name: str) -> torch.nn.Module:
        if name not in cache:
            cache[name] = load_hf(tiny_ckpt(name))
        return cache[name]

    return get


@pytest.fixture
def comm():
    from splash.distributed.communicator import SingleRankCommunicator

    return SingleRankCommunicator()



@pytest.fixture
def torch_kernels(monkeypatch):
    """Only torch's kernels (splash.native off, so weights load unpacked): for tests that compare two forms of the
    same weights at the last fp32 bits, where one form (quantised: dequantised per call) always runs torch's GEMM."""
    from splash import native
    monkeypatch.setattr(native, "enabled", lambda: False)


# Under pytest-xdist (`make test` runs `-n 2`) every test that starts ranks (mpiexec: the distributed and server
# suites, gpu-check's two-rank launch) is one unit that one worker runs in order, so no two MPI jobs busy-poll the 2
# cores at once (measured: splitting the server suite off as a second unit cost 12% more CPU in spinning ranks); the
# other tests go a file at a time (module fixtures built once) to whichever worker is free. (xdist's own
# `--dist loadgroup` marks do not reach its scheduler under pytest 9.2: it rewrites `item._nodeid`, which pytest
# no longer reads.)
RANK_TESTS = ("tests/test_gpu_check.py::test_two_ranks_run_the_collectives_and_print_per_rank_rows",)
# the server suite's files that run the app, the engine loop or the watchdog in this process (no mpiexec)
IN_PROCESS = frozenset(f"tests/server/{f}.py" for f in ("test_hardening2", "test_hardening_units",
                                                        "test_server_sampling", "test_server_units", "test_watchdog"))


def _xdist_unit(nodeid: str) -> str:
    file = nodeid.split("::", 1)[0]
    folder = Path(file).parent.name
    ranks = (folder in ("distributed", "server") and file not in IN_PROCESS) or nodeid.startswith(RANK_TESTS)
    return "ranks" if ranks else file


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    from xdist.scheduler import LoadScopeScheduling

    class RanksInOrder(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return _xdist_unit(nodeid)

    return RanksInOrder(config, log)
