"""The checks of scripts/gpu-check.sh (run that; this file is its Python half).

    python scripts/gpu_check.py --part kernels,comm [--device auto|cuda|cpu] [--dry-run]   # one per rank (mpirun)
    python scripts/gpu_check.py --part serve [--ranks N] [--dry-run]                      # launches splash-serve

- kernels: each attention kernel this device runs (cuda: flashinfer + triton; hip: aiter + triton; cpu: triton
  under the interpreter) against the torch reference kernel on the same paged cache — decode and mixed
  prefill + decode steps, DeepSeek/GLM dims (512 latent + 64 rope, 16 heads, bf16 KV, 64-token pages; --dry-run:
  tiny dims) — max |LSE| error, relative |õ| error, and which path ran (vendor kernel or Triton fallback);
- timing: decode attention of B requests × C tokens per kernel against the HBM floor, bytes of KV read /
  the hardware profile's kv_read_bytes_per_s (b200/h200/bw1000 by device name, or --hbm-gbs);
- comm: the torch.distributed communicator (splash.distributed.torch_comm.TorchCommunicator) on this device:
  all-reduce, all-gather(v), all-to-all(v) with uneven splits, broadcast, fp8/int8 as bytes, against the values every rank can compute;
- serve: splash-serve on `--ranks` ranks of this machine (preset gpu-smoke-mla: 512 + 64 dims, so the vendor
  kernel runs; --dry-run: tiny-mla on cpu) — the same greedy completion pinned in each layout, and a long one
  while POST /v1/layout switches live through every layout: every answer must equal TP's.
Prints one table row per check and PASS/FAIL; exit 1 on any FAIL.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
ROWS: list[tuple[str, str, str]] = []


def row(check: str, detail: str, ok: bool | None) -> None:
    ROWS.append((check, detail, "info" if ok is None else "PASS" if ok else "FAIL"))


def parse(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="gpu-check", description=__doc__.split("\n\n")[0])
    p.add_argument("--part", default="kernels,comm,serve", help="comma-separated: kernels, comm, serve")
    p.add_argument("--device", default="auto", choices=("auto", "cuda", "hip", "cpu"))
    p.add_argument("--dry-run", action="store_true", help="tiny shapes on CPU (what CI runs)")
    p.add_argument("--ranks", type=int, default=1, help="ranks for the serve smoke (mpirun -n)")
    p.add_argument("--hbm-gbs", type=float, default=None, help="HBM bandwidth for the floor (default: profile)")
    p.add_argument("--batch", type=int, default=64, help="decode timing: requests")
    p.add_argument("--context", type=int, default=4096, help="decode timing: tokens per request")
    p.add_argument("--json", default=None, help="also write the rows here")
    args = p.parse_args(argv)
    bad = set(args.part.split(",")) - {"kernels", "comm", "serve"}
    if bad:
        p.error(f"unknown --part {', '.join(sorted(bad))}")
    if args.ranks < 1 or args.batch < 1 or args.context < 1:
        p.error("--ranks, --batch and --context must be positive")
    return args


def backend_of(args):
    import backends
    name = "cpu" if args.dry_run else args.device
    return backends.get_backend(name, int(os.environ.get("OMPI_COMM_WORLD_LOCAL_RANK",
                                                         os.environ.get("MPI_LOCALRANKID", 0))))


def kernel_names(backend) -> list[str]:
    import backends
    return [k for k in backends.ATTENTION[backend.name] if k != "torch" and not backends.missing_packages(k)]


def make_state(device, batch: int, context: int, dc: int, dr: int, heads: int, page: int, mixed: bool, seed=0):
    """A paged bf16 cache holding `batch` requests of `context` tokens (random pages), their step metadata and
    absorbed queries; `mixed` makes the first request a 7-token prefill chunk."""
    import torch

    from splash.attention.batch import StepRequest
    from splash.attention.metadata import build_metadata
    from splash.kv.page_table import PageTable
    from splash.kv.paged_cache import PagedLatentCache

    g = torch.Generator(device="cpu").manual_seed(seed)
    per = -(-context // page)
    cache = PagedLatentCache(1, batch * per + 1, page, dc, dr, "bfloat16", device=device)
    cache.ckv[0].copy_(torch.randn(cache.ckv[0].shape, generator=g))
    cache.kpe[0].copy_(torch.randn(cache.kpe[0].shape, generator=g))
    tables, order = PageTable(page, device=device), torch.randperm(batch * per, generator=g).tolist()
    reqs = []
    for b in range(batch):
        n = 7 if mixed and b == 0 else 1
        reqs.append(StepRequest(f"r{b}", context - n, n))
        tables.append(f"r{b}", [(j, order[b * per + j]) for j in range(per)])
    meta = build_metadata(reqs, tables)
    q = torch.randn(meta.num_rows, heads, dc + dr, generator=g).to(device)
    return cache, meta, q[..., :dc].contiguous(), q[..., dc:].contiguous()


def run_kernel(name, scale, state):
    from splash.attention.kernels import make_kernel
    cache, meta, ql, qr = state
    k = make_kernel(name, scale)
    k.plan(meta)
    o, lse = k.run(0, ql, qr, cache)
    return k, o, lse


def check_kernels(args, backend) -> None:
    dims = dict(dc=32, dr=8, heads=4, page=16) if args.dry_run else dict(dc=512, dr=64, heads=16, page=64)
    scale = 1 / (128 + 64) ** 0.5
    for mixed in (False, True):
        state = make_state(backend.device, 3 if args.dry_run else 8, 40 if args.dry_run else 1000, **dims, mixed=mixed)
        _, o_ref, lse_ref = run_kernel("torch", scale, state)
        for name in kernel_names(backend):
            try:
                k, o, lse = run_kernel(name, scale, state)
            except Exception as e:  # noqa: BLE001 — a kernel that fails is a FAIL row, not a crash
                row(f"attention {name}", f"{'mixed' if mixed else 'decode'}: {type(e).__name__}: {e}", False)
                continue
            err_l = float((lse - lse_ref).abs().max())
            err_o = float((o - o_ref).abs().max() / o_ref.abs().max().clamp_min(1e-30))
            paths = getattr(k, "paths", {name: 1})
            row(f"attention {name}", f"{'mixed' if mixed else 'decode'} via {','.join(paths)}: |dLSE| {err_l:.1e}, "
                f"|do|/|o| {err_o:.1e}", err_l < 2e-2 and err_o < 2e-2)
    time_decode(args, backend, dims, scale)


def hbm_bytes_per_s(args, backend) -> tuple[float, str]:
    from splash.costmodel.profile import load_profile
    if args.hbm_gbs:
        return args.hbm_gbs * 1e9, "--hbm-gbs"
    name = "cpu"
    if backend.is_gpu:
        import torch
        dev = torch.cuda.get_device_name(backend.device).upper()
        name = next((p for key, p in (("B200", "b200"), ("H200", "h200"), ("BW", "bw1000")) if key in dev), None)
        if name is None:
            return 0.0, f"no profile for {dev} (give --hbm-gbs)"
    return load_profile(name).kv_read_bytes_per_s, f"{name} profile"


def time_decode(args, backend, dims, scale) -> None:
    import torch
    batch, ctx = (4, 256) if args.dry_run else (args.batch, args.context)
    state = make_state(backend.device, batch, ctx, **dims, mixed=False)
    kv_bytes = batch * ctx * (dims["dc"] + dims["dr"]) * 2
    bw, src = hbm_bytes_per_s(args, backend)
    for name in ["torch"] + kernel_names(backend):
        if args.dry_run and name != "torch":
            continue   # the interpreter's speed says nothing
        k, _, _ = run_kernel(name, scale, state)
        iters = 3 if args.dry_run else 20
        backend.synchronize()
        t0 = time.perf_counter()
        for _ in range(iters):
            k.run(0, state[2], state[3], state[0])
        backend.synchronize()
        dt = (time.perf_counter() - t0) / iters
        floor = kv_bytes / bw if bw else float("nan")
        row(f"decode time {name}", f"B={batch} C={ctx}: {dt * 1e6:.0f} us, floor {floor * 1e6:.0f} us ({src}), "
            f"{dt / floor:.1f}x floor" if bw else f"{dt * 1e6:.0f} us ({src})", None)


def check_comm(args, backend) -> None:
    import torch
    import torch.distributed as dist

    from splash.distributed import init_dist
    from splash.distributed.launch import init_torch_distributed
    from splash.distributed.torch_comm import TorchCommunicator
    ctx = init_dist()
    if not dist.is_initialized():
        init_torch_distributed(ctx, "nccl" if backend.is_gpu else "gloo")
    dev, T, r = backend.device, ctx.world_size, ctx.rank
    comm = TorchCommunicator(ctx.comm, dev)
    x = torch.arange(6, dtype=torch.float32, device=dev).view(3, 2) + r
    ok = {"all_reduce": torch.equal(comm.all_reduce(x).cpu(), sum(torch.arange(6.).view(3, 2) + i for i in range(T)))}
    rows = comm.all_gatherv(x[:r % 3 + 1], [i % 3 + 1 for i in range(T)]).cpu()
    ok["all_gatherv"] = torch.equal(rows, torch.cat([(torch.arange(6.).view(3, 2) + i)[:i % 3 + 1] for i in range(T)]))
    send = [(i + r) % 2 + 1 for i in range(T)]
    src = torch.full((sum(send), 4), float(r), device=dev)
    got = comm.all_to_allv(src, send, [(r + i) % 2 + 1 for i in range(T)]).cpu()
    ok["all_to_allv"] = torch.equal(got[:, 0], torch.cat([torch.full(((r + i) % 2 + 1,), float(i)) for i in range(T)]))
    f8 = torch.tensor([[0.5, -2.0]], device=dev).to(torch.float8_e4m3fn)
    ok["fp8 bytes"] = torch.equal(comm.all_gather(f8).float().cpu(), torch.tensor([[0.5, -2.0]] * T))
    i8 = torch.tensor([[-7, 9]], dtype=torch.int8, device=dev)
    ok["int8 bcast"] = torch.equal(comm.broadcast(i8 + r, root=0).cpu(), torch.tensor([[-7, 9]], dtype=torch.int8))
    row("comm TorchCommunicator", f"{T} rank(s) on {backend.device}: " + ", ".join(
        f"{k} {'ok' if v else 'WRONG'}" for k, v in ok.items()), all(ok.values()))


def main(argv=None) -> int:
    args = parse(argv)
    parts = args.part.split(",")
    backend = backend_of(args)
    rank = int(os.environ.get("PMI_RANK", os.environ.get("OMPI_COMM_WORLD_RANK", 0)))
    if "kernels" in parts:
        check_kernels(args, backend)
    if "comm" in parts:
        check_comm(args, backend)
    if ("kernels" in parts or "comm" in parts) and int(os.environ.get("PMI_SIZE", os.environ.get(
            "OMPI_COMM_WORLD_SIZE", 1))) > 1:   # under mpirun: every rank's rows, printed by rank 0
        from splash.distributed import init_dist
        ctx = init_dist()
        everyone = ctx.comm.all_gather_obj(list(ROWS))
        ROWS[:] = [(f"[rank {r}] {c}", d, res) for r, rows in enumerate(everyone) for c, d, res in rows]
    if "serve" in parts and rank == 0:
        from gpu_check_serve import check_serve
        check_serve(args, backend, row)
    if rank == 0:
        width = max((len(c) for c, _, _ in ROWS), default=5)
        for c, d, res in ROWS:
            print(f"{c:<{width}}  {res:<4}  {d}")
        if args.json:
            Path(args.json).write_text(json.dumps([dict(check=c, detail=d, result=res) for c, d, res in ROWS]))
    failed = any(res == "FAIL" for _, _, res in ROWS)
    if rank == 0:
        print("gpu-check:", "FAIL" if failed else "PASS")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
