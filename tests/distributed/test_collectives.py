"""Collectives on real ranks (mpiexec -n 2|4), plus the single-rank paths in-process."""

from __future__ import annotations

import re

import pytest
import torch
from mpi_util import mpiexec_path

from splash.distributed import DistContext, Handle, SingleRankCommunicator, init_dist, make_communicator

WORKER = "tests/distributed/collectives_worker.py"
needs_mpi = pytest.mark.skipif(mpiexec_path() is None, reason="mpiexec not found")


def _assert_ok(proc, nprocs: int, mode: str) -> None:
    assert proc.returncode == 0, f"rc={proc.returncode}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    # Every rank reached the end (ranks' lines may interleave, so match anywhere).
    done = {int(r) for r in re.findall(rf"rank (\d+)/{nprocs}: {mode} OK", proc.stdout)}
    assert done == set(range(nprocs)), proc.stdout


KINDS = {2: "mpi,mpi-device,torch", 4: "mpi,torch"}   # per rank count, checked in turn by one launch


def launch_jobs(nprocs: int, tmp_path_factory, tiny_ckpt) -> list[tuple[str, ...]]:
    """This file's worker job at `nprocs` ranks: KINDS[nprocs] in turn (rank start-up once per rank count, not per
    kind), run in tests/distributed/conftest.py's shared launch."""
    return [(WORKER, "collectives", KINDS[nprocs])]


@needs_mpi
@pytest.mark.parametrize("kind", ["mpi", "torch"])
@pytest.mark.parametrize("nprocs", [2, 4])
def test_collectives_real_ranks(shared_launches, nprocs, kind):
    """The same checks on the MPI communicator and on the torch.distributed one (gloo on CPU)."""
    _assert_ok(shared_launches(nprocs), nprocs, f"collectives {kind}")


@needs_mpi
def test_mpi_communicator_moves_device_tensors_through_host_memory(shared_launches):
    """Ranks that share one GPU (NCCL refuses them) use the MPI communicator: handed GPU tensors (a stand-in that,
    like a CUDA tensor, cannot be viewed as numpy), every collective gives the same bytes, on the device."""
    _assert_ok(shared_launches(2), 2, "collectives mpi-device")


def test_init_dist_without_mpirun():
    ctx = init_dist()
    assert (ctx.rank, ctx.world_size, ctx.local_rank) == (0, 1, 0)
    assert isinstance(ctx.comm, SingleRankCommunicator)


def test_single_rank_communicator():
    comm = SingleRankCommunicator()
    assert (comm.rank, comm.size) == (0, 1)
    x = torch.arange(12, dtype=torch.float32).reshape(4, 3).to(torch.bfloat16)
    assert torch.equal(comm.all_reduce(x), x)
    assert torch.equal(comm.all_gather(x), x)
    assert comm.all_gather(torch.tensor(5)).tolist() == [5]
    assert torch.equal(comm.all_gatherv(x), x)
    assert torch.equal(comm.all_gatherv(x, [4]), x)
    assert torch.equal(comm.all_to_allv(x, [4]), x)
    assert torch.equal(comm.all_to_allv(x, [4], [4]), x)
    assert torch.equal(comm.broadcast(x), x)
    assert comm.broadcast_obj({"a": 1}) == {"a": 1}
    assert comm.all_gather_obj("o") == ["o"]
    assert comm.gather_counts(7) == [7] and comm.exchange_counts([3]) == [3]
    comm.barrier()
    for h in (comm.iall_gatherv(x), comm.iall_to_allv(x, [4])):
        assert isinstance(h, Handle) and h.test()
        assert torch.equal(h.wait(), x)
    empty = torch.empty(0, 3, dtype=torch.float8_e4m3fn)
    assert comm.all_to_allv(empty, [0]).shape == (0, 3)


def test_single_rank_rejects_bad_counts():
    comm = SingleRankCommunicator()
    x = torch.zeros(4, 3)
    with pytest.raises(ValueError):
        comm.all_to_allv(x, [3])
    with pytest.raises(ValueError):
        comm.all_to_allv(x, [2, 2])
    with pytest.raises(ValueError):
        comm.all_gatherv(x, [5])


def test_make_communicator_single_rank_and_errors():
    ctx = init_dist()
    assert make_communicator("mpi", ctx) is ctx.comm and make_communicator("torch", ctx) is ctx.comm
    with pytest.raises(ValueError, match="'nccl2' is not one of mpi, torch"):
        make_communicator("nccl2", ctx)
    two = DistContext(rank=0, world_size=2, local_rank=0, comm=SingleRankCommunicator())
    if not torch.cuda.is_available():  # asks for NCCL before any rendezvous
        with pytest.raises(RuntimeError, match="needs NCCL/RCCL"):
            make_communicator("torch", two, "cuda")


def test_torch_communicator_one_rank_in_process():
    """A TorchCommunicator over a one-rank gloo group (what a one-GPU check builds on nccl) passes the same
    tensor checks as the real-rank runs."""
    import torch.distributed as dist
    from collectives_worker import DTYPES, TENSOR_CHECKS
    from mpi4py import MPI

    from splash.distributed import MPICommunicator, TorchCommunicator, init_torch_distributed

    ctx = init_dist()
    init_torch_distributed(ctx, "gloo")
    try:
        comm = TorchCommunicator(MPICommunicator(MPI.COMM_WORLD.Dup()))
        assert (comm.rank, comm.size, comm.backend) == (0, 1, "gloo")
        for dt in DTYPES:
            for check in TENSOR_CHECKS:
                check(comm, dt)
        comm.barrier()
    finally:
        dist.destroy_process_group()
