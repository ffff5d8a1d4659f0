"""Process bootstrap: MPICH's waiting ranks yield where a node has more ranks than cores."""

import json
import os
import subprocess
import sys

import pytest

from splash.distributed.launch import YIELD_ENV, yield_when_oversubscribed

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.parametrize("var", ["MPI_LOCALNRANKS", "OMPI_COMM_WORLD_LOCAL_SIZE"])
def test_more_ranks_than_cores_makes_waiting_ranks_yield(var):
    env = {var: "4"}
    assert yield_when_oversubscribed(env, cores=2)
    assert {k: env[k] for k in YIELD_ENV} == YIELD_ENV


@pytest.mark.parametrize("env", [{"MPI_LOCALNRANKS": "2"}, {"MPI_LOCALNRANKS": "1"}, {}, {"MPI_LOCALNRANKS": "x"}])
def test_a_core_per_rank_or_no_launcher_sets_nothing(env):
    before = dict(env)
    assert not yield_when_oversubscribed(env, cores=2)
    assert env == before


def test_a_value_the_user_set_is_kept():
    env = {"MPI_LOCALNRANKS": "8", "MPIR_CVAR_ENABLE_HEAVY_YIELD": "0"}
    assert yield_when_oversubscribed(env, cores=2)
    assert env["MPIR_CVAR_ENABLE_HEAVY_YIELD"] == "0" and env["MPIR_CVAR_CH4_PROGRESS_THROTTLE"] == "1"


PROBE = """
import json, os
from splash.distributed import init_dist
ctx = init_dist()
rows = ctx.comm.all_gather_obj([ctx.rank, ctx.local_size, ctx.waits_yield, {k: os.environ.get(k) for k in %r}])
if ctx.rank == 0:
    print(json.dumps(rows), flush=True)
""" % (sorted(YIELD_ENV),)


def test_ranks_under_mpiexec_that_outnumber_the_cores_yield():
    ranks = (os.cpu_count() or 1) + 1  # the launcher's own count of ranks here is what decides
    env = {k: v for k, v in os.environ.items() if k not in YIELD_ENV}  # tests/conftest.py sets them for every rank
    env["PYTHONPATH"] = ROOT
    out = subprocess.run(["mpiexec", "-n", str(ranks), sys.executable, "-c", PROBE], env=env, capture_output=True,
                         text=True, timeout=120, check=True).stdout
    rows = json.loads(out.splitlines()[-1])
    assert [r[0] for r in rows] == list(range(ranks))
    for _, local, waits, seen in rows:
        assert local == ranks and waits and seen == YIELD_ENV
