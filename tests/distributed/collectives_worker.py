"""Run under `mpiexec -n N`: checks every collective against values every rank can rebuild.

Usage: collectives_worker.py collectives [mpi|torch|mpi-device]: every check on the MPI communicator or on the
torch.distributed one (gloo here, started by init_torch_distributed's MPI rendezvous); mpi-device: the MPI
communicator handed GPU tensors (device_standin.OnDevice), each result required back on the device.
Exits non-zero (MPI Abort) on any mismatch.
"""

from __future__ import annotations

import dataclasses
import gc
import math
import sys
import traceback

import torch
from device_standin import OnDevice, on_device

from splash.distributed import (
    Communicator,
    DistContext,
    MPICommunicator,
    TorchCommunicator,
    init_dist,
    make_communicator,
)

DTYPES = [torch.float32, torch.bfloat16, torch.float8_e4m3fn, torch.int8, torch.int64]
TRAIL = (5, 3)


def rand_bytes(shape: tuple[int, ...], dtype: torch.dtype, *seed: int) -> torch.Tensor:
    """Deterministic random bit patterns (any dtype) from a seed tuple."""
    g = torch.Generator().manual_seed(sum(s * 1_000_003**i for i, s in enumerate((7, *seed))))
    nbytes = math.prod(shape) * torch.empty(0, dtype=dtype).element_size()
    return torch.randint(0, 256, (nbytes,), generator=g, dtype=torch.uint8).view(dtype).reshape(shape)


def small_ints(shape: tuple[int, ...], dtype: torch.dtype, *seed: int) -> torch.Tensor:
    """Integers in [-3, 3]: sums over <= 4 ranks are exact in every tested dtype."""
    g = torch.Generator().manual_seed(sum(s * 1_000_003**i for i, s in enumerate((11, *seed))))
    return torch.randint(-3, 4, shape, generator=g).to(torch.float32).to(dtype)


def check(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    """Exact (bitwise) equality of dtype, shape and contents."""
    assert got.dtype == want.dtype, f"{what}: dtype {got.dtype} != {want.dtype}"
    assert got.shape == want.shape, f"{what}: shape {tuple(got.shape)} != {tuple(want.shape)}"
    u8 = lambda t: t.contiguous().reshape(-1).view(torch.uint8)  # noqa: E731
    assert torch.equal(u8(got), u8(want)), f"{what}: values differ"


def gv_count(r: int) -> int:
    return (3 * r) % 4  # rank 0 sends 0 rows


def a2a_count(src: int, dst: int, n: int) -> int:
    """Rows src sends to dst; the last rank sends and receives nothing."""
    if src == n - 1 or dst == n - 1:
        return 0
    return (src + 2 * dst + 1) % 3


def reduce_ref(shape, dtype, n: int, salt: int) -> torch.Tensor:
    total = sum(small_ints(shape, dtype, r, salt).to(torch.float32) for r in range(n))
    return total.to(torch.int64) if dtype == torch.int64 else total.to(dtype)


def check_all_reduce(comm: Communicator, dt: torch.dtype) -> None:
    r, n = comm.rank, comm.size
    x = small_ints((4, *TRAIL), dt, r, 1)
    before = x.clone()
    check(comm.all_reduce(x), reduce_ref((4, *TRAIL), dt, n, 1), f"all_reduce {dt}")
    check(x, before, f"all_reduce {dt} left input untouched")
    xt = small_ints((6, 4), dt, r, 2).t()  # non-contiguous
    check(comm.all_reduce(xt), reduce_ref((6, 4), dt, n, 2).t(), f"all_reduce non-contig {dt}")
    check(comm.all_reduce(small_ints((), dt, r, 3)), reduce_ref((), dt, n, 3), f"all_reduce 0-d {dt}")
    check(comm.all_reduce(small_ints((0, 3), dt, r, 4)), reduce_ref((0, 3), dt, n, 4), f"all_reduce empty {dt}")


def check_all_gather(comm: Communicator, dt: torch.dtype) -> None:
    r, n = comm.rank, comm.size
    want = torch.cat([rand_bytes((2, *TRAIL), dt, q, 5) for q in range(n)])
    check(comm.all_gather(rand_bytes((2, *TRAIL), dt, r, 5)), want, f"all_gather {dt}")
    want0 = torch.stack([rand_bytes((), dt, q, 6) for q in range(n)])
    check(comm.all_gather(rand_bytes((), dt, r, 6)), want0, f"all_gather 0-d {dt}")


def check_all_gatherv(comm: Communicator, dt: torch.dtype) -> None:
    r, n = comm.rank, comm.size
    counts = [gv_count(q) for q in range(n)]
    for trail, salt in ((TRAIL, 7), ((), 8)):
        want = torch.cat([rand_bytes((c, *trail), dt, q, salt) for q, c in enumerate(counts)])
        mine = rand_bytes((counts[r], *trail), dt, r, salt)
        check(comm.all_gatherv(mine), want, f"all_gatherv {dt} trail={trail}")
        check(comm.all_gatherv(mine, counts), want, f"all_gatherv counts {dt} trail={trail}")
    empty = comm.all_gatherv(torch.empty((0, *TRAIL), dtype=dt))
    check(empty, torch.empty((0, *TRAIL), dtype=dt), f"all_gatherv all-empty {dt}")
    assert comm.gather_counts(counts[r]) == counts, "gather_counts"


def a2a_case(comm: Communicator, dt: torch.dtype, salt: int):
    """(input, send_counts, recv_counts, expected output) for this rank."""
    r, n = comm.rank, comm.size
    send = [a2a_count(r, d, n) for d in range(n)]
    recv = [a2a_count(s, r, n) for s in range(n)]
    x = torch.cat([rand_bytes((c, *TRAIL), dt, r, d, salt) for d, c in enumerate(send)])
    want = torch.cat([rand_bytes((c, *TRAIL), dt, s, r, salt) for s, c in enumerate(recv)])
    return x, send, recv, want


def check_all_to_allv(comm: Communicator, dt: torch.dtype) -> None:
    x, send, recv, want = a2a_case(comm, dt, 9)
    assert comm.exchange_counts(send) == recv, "exchange_counts"
    check(comm.all_to_allv(x, send), want, f"all_to_allv {dt}")
    check(comm.all_to_allv(x, send, recv), want, f"all_to_allv recv_counts {dt}")


def check_broadcast(comm: Communicator, dt: torch.dtype) -> None:
    r, n = comm.rank, comm.size
    root = n - 1
    mine = rand_bytes((3, *TRAIL), dt, r, 10)
    check(comm.broadcast(mine, root=root), rand_bytes((3, *TRAIL), dt, root, 10), f"broadcast {dt}")
    check(mine, rand_bytes((3, *TRAIL), dt, r, 10), f"broadcast {dt} left input untouched")


def check_async(comm: Communicator, dt: torch.dtype) -> None:
    r, n = comm.rank, comm.size
    counts = [gv_count(q) for q in range(n)]
    x, send, recv, want_a2a = a2a_case(comm, dt, 12)
    # Temporaries: the handles must keep their send buffers alive.
    handles = [
        comm.iall_gatherv(rand_bytes((counts[r], *TRAIL), dt, r, 13).clone()),
        comm.iall_to_allv(x.clone(), send, recv),
        comm.iall_to_allv(x.clone(), send),
    ]
    del x
    gc.collect()
    for _ in range(1_000_000):
        if all(h.test() for h in handles):
            break
    wants = [
        torch.cat([rand_bytes((c, *TRAIL), dt, q, 13) for q, c in enumerate(counts)]),
        want_a2a,
        want_a2a,
    ]
    for i, (h, want) in enumerate(zip(handles, wants)):
        got = h.wait()
        check(got, want, f"async #{i} {dt}")
        assert h.test() and h.wait() is got, f"async #{i} {dt}: wait not idempotent"


def check_objects(ctx: DistContext) -> None:
    comm, r, n = ctx.comm, ctx.rank, ctx.world_size
    from mpi4py import MPI

    assert (r, n) == (MPI.COMM_WORLD.Get_rank(), MPI.COMM_WORLD.Get_size()), "init_dist rank/size"
    assert ctx.local_rank == r, "local_rank (all ranks on one node)"
    assert (comm.rank, comm.size) == (r, n), "comm rank/size"
    got = comm.broadcast_obj({"from": r, "x": [r] * 3} if r == 1 else None, root=1)
    assert got == {"from": 1, "x": [1, 1, 1]}, f"broadcast_obj: {got}"
    assert comm.all_gather_obj(("r", r)) == [("r", q) for q in range(n)], "all_gather_obj"
    comm.barrier()


def _from_device(r: torch.Tensor) -> torch.Tensor:
    assert isinstance(r, OnDevice), f"a collective of device tensors returned a {type(r).__name__} on {r.device}"
    return r.cpu()


class _HostHandle:
    def __init__(self, h) -> None:
        self.h, self.got = h, None

    def test(self) -> bool:
        return self.h.test()

    def wait(self) -> torch.Tensor:
        if self.got is None:
            self.got = _from_device(self.h.wait())
        return self.got


class ViaDevice(Communicator):
    """The checks' view of `inner` handed device tensors: inputs go in as OnDevice, results must come back so."""

    def __init__(self, inner: Communicator) -> None:
        self.inner, self.rank, self.size = inner, inner.rank, inner.size

    def all_reduce(self, t):
        return _from_device(self.inner.all_reduce(on_device(t)))

    def all_gather(self, t):
        return _from_device(self.inner.all_gather(on_device(t)))

    def all_gatherv(self, t, counts=None):
        return _from_device(self.inner.all_gatherv(on_device(t), counts))

    def all_to_allv(self, t, send_counts, recv_counts=None):
        return _from_device(self.inner.all_to_allv(on_device(t), send_counts, recv_counts))

    def broadcast(self, t, root=0):
        return _from_device(self.inner.broadcast(on_device(t), root))

    def iall_gatherv(self, t, counts=None):
        return _HostHandle(self.inner.iall_gatherv(on_device(t), counts))

    def iall_to_allv(self, t, send_counts, recv_counts=None):
        return _HostHandle(self.inner.iall_to_allv(on_device(t), send_counts, recv_counts))

    def broadcast_obj(self, obj, root=0):
        return self.inner.broadcast_obj(obj, root)

    def all_gather_obj(self, obj):
        return self.inner.all_gather_obj(obj)

    def barrier(self) -> None:
        self.inner.barrier()


TENSOR_CHECKS = (check_all_reduce, check_all_gather, check_all_gatherv, check_all_to_allv, check_broadcast,
                 check_async)


def run_collectives(ctx: DistContext, kind: str = "mpi") -> None:
    ctx = dataclasses.replace(ctx, comm=make_communicator(kind.removesuffix("-device"), ctx))
    want = {"mpi": MPICommunicator, "torch": TorchCommunicator, "mpi-device": MPICommunicator}[kind]
    assert isinstance(ctx.comm, want), f"{kind}: got {type(ctx.comm).__name__}"
    check_objects(ctx)
    seq = _torch_collectives() if kind == "torch" else 0
    comm = ViaDevice(ctx.comm) if kind.endswith("-device") else ctx.comm
    for dt in DTYPES:
        for fn in TENSOR_CHECKS:
            fn(comm, dt)
    ctx.comm.barrier()
    if kind == "torch":
        import torch.distributed as dist

        assert dist.get_backend() == "gloo", dist.get_backend()
        ran = _torch_collectives() - seq  # the tensors really went through gloo, not MPI
        assert ran >= 15 * len(DTYPES), f"only {ran} collectives on the torch group"
        dist.destroy_process_group()


def _torch_collectives() -> int:
    """How many collectives the default torch.distributed group has run."""
    import torch.distributed as dist

    return dist.distributed_c10d._get_default_group()._get_sequence_number_for_group()


def main() -> None:
    mode = sys.argv[1] if len(sys.argv) > 1 else "collectives"
    ctx = init_dist()
    # argv[2]: communicator kinds joined by "," (one launch checks each in turn; "torch" last: it ends its group)
    for kind in (sys.argv[2].split(",") if len(sys.argv) > 2 else ["mpi"]):
        try:
            {"collectives": run_collectives}[mode](ctx, kind)
        except BaseException:
            traceback.print_exc()
            print(f"rank {ctx.rank}: FAILED", file=sys.stderr, flush=True)
            from mpi4py import MPI

            MPI.COMM_WORLD.Abort(1)
        print(f"rank {ctx.rank}/{ctx.world_size}: {mode} {kind} OK", flush=True)


if __name__ == "__main__":
    main()
