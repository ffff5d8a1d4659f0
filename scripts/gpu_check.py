"""The checks of scripts/gpu-check.sh (run that; this file is its Python half).

    python scripts/gpu_check.py --part kernels,comm [--device auto|cuda|cpu] [--dry-run]   # one per rank (mpirun)
    python scripts/gpu_check.py --part serve [--ranks N] [--dry-run]                      # launches splash-serve

- kernels: each attention kernel this device runs (cuda: flashinfer + triton; hip: aiter + triton; cpu: triton
  under the interpreter) against the torch reference kernel on the same paged cache — decode and mixed
  prefill + decode steps, DeepSeek/GLM dims (512 latent + 64 rope, 64-token pages; --dry-run: tiny dims), 16, 64
  and 128 heads, bf16, fp8 and int8 KV, requests of different page counts (odd ones, the widest 15 pages), and DSA
  (sparse) steps at 64 heads, each row attending 256 selected slots — max |LSE| error, relative |õ| error, and
  which path ran (vendor kernel or Triton fallback; on a DSA layer the Triton sparse kernel);
- timing: decode attention of B requests × C tokens per kernel against the HBM floor, bytes of KV read /
  the hardware profile's kv_read_bytes_per_s (b200/h200/bw1000 by device name, or --hbm-gbs);
- comm: the communicator splash-serve would use on this device — torch.distributed (TorchCommunicator: NCCL, one
  rank per GPU), or MPI through host memory when there are more ranks than GPUs (--ranks above the GPU count; NCCL
  refuses two ranks on one GPU): all-reduce, all-gather(v), all-to-all(v) with uneven splits, broadcast, fp8/int8
  as bytes, against the values every rank can compute;
- serve: splash-serve on `--ranks` ranks of this machine (preset gpu-smoke-mla: 512 + 64 dims, so the vendor
  kernel runs; --dry-run: tiny-mla on cpu; `--communicator mpi` when ranks share GPUs) — the same greedy
  completion pinned in each layout, and a long one while POST /v1/layout switches live through every layout
  (scripts/gpu_check_serve.py says what it must equal).
Each row is printed as its check ends (under mpirun, per rank); an exception inside a check is that check's FAIL
row. At the end: the PASS/FAIL/SKIP table, the rows appended to --json, exit 1 on any FAIL. At one rank the checks
that need two (collectives across GPUs, layouts that differ across ranks) are SKIP rows saying so.
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
RESULTS = ("PASS", "FAIL", "SKIP", "info")
RANK = int(os.environ.get("PMI_RANK", os.environ.get("OMPI_COMM_WORLD_RANK", os.environ.get("PMIX_RANK", 0))))
SIZE = int(os.environ.get("PMI_SIZE", os.environ.get("OMPI_COMM_WORLD_SIZE", 1)))


def row(check: str, detail: str, ok: bool | str | None) -> None:
    """Record one row and print it now (a later hang or crash cannot lose it): ok True/False → PASS/FAIL,
    "SKIP" → SKIP, None → info."""
    res = ok if isinstance(ok, str) else "info" if ok is None else "PASS" if ok else "FAIL"
    ROWS.append((check, detail, res))
    prefix = f"[rank {RANK}] " if SIZE > 1 else ""
    print(f"{prefix}{check:<44}  {res:<4}  {detail}", flush=True)


def guarded(check: str, fn, *args) -> None:
    """Run one check; an exception (no nvcc for a JIT, an OOM, a vendor error) is a FAIL row, not a lost table."""
    try:
        fn(*args)
    except Exception as e:  # noqa: BLE001
        row(check, f"{type(e).__name__}: {str(e)[:300]}", False)


def parse(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="gpu-check", description=__doc__.split("\n\n")[0])
    p.add_argument("--part", default="kernels,comm,serve", help="comma-separated: kernels, comm, serve")
    p.add_argument("--device", default="auto", choices=("auto", "cuda", "hip", "cpu"))
    p.add_argument("--dry-run", action="store_true", help="tiny shapes on CPU (what CI runs)")
    p.add_argument("--ranks", type=int, default=1, help="ranks for the serve smoke (mpirun -n)")
    p.add_argument("--hbm-gbs", type=float, default=None, help="HBM bandwidth for the floor (default: profile)")
    p.add_argument("--batch", type=int, default=64, help="decode timing: requests")
    p.add_argument("--context", type=int, default=4096, help="decode timing: tokens per request")
    p.add_argument("--json", default=None, help="append the rows to this JSON file (gpu-check.sh: gpu-check.json)")
    p.add_argument("--summary", default=None, metavar="JSON", help="print the table of a rows file and exit")
    args = p.parse_args(argv)
    bad = set(args.part.split(",")) - {"kernels", "comm", "serve"}
    if bad:
        p.error(f"unknown --part {', '.join(sorted(bad))}")
    if args.ranks < 1 or args.batch < 1 or args.context < 1:
        p.error("--ranks, --batch and --context must be positive")
    return args


def backend_of(args):
    """The backend on this rank's GPU: the node-local rank comes from the project's launcher (MPI's shared-memory
    split, the same for every MPI), and get_backend makes that GPU current (torch.cuda.set_device), so Triton and
    vendor kernels launch where the tensors are."""
    import backends
    from splash.distributed import init_dist
    ctx = init_dist()
    return backends.get_backend("cpu" if args.dry_run else args.device, ctx.local_rank, local_size=ctx.local_size)


def kernel_names(backend) -> list[str]:
    import backends
    return [k for k in backends.ATTENTION[backend.name] if k != "torch" and not backends.missing_packages(k)]


def make_state(device, batch: int, context: int, dc: int, dr: int, heads: int, page: int, mixed: bool,
               kv_dtype: str = "bfloat16", ragged: bool = True, seed=0):
    """A paged `kv_dtype` cache holding `batch` requests (the longest `context` tokens, the others shorter by a
    page and 3 tokens each, so page counts differ and include odd ones; random pages), their step metadata and
    absorbed queries; `mixed` makes the first request a 7-token prefill chunk; `ragged=False`: all `context`."""
    import torch

    from splash.attention.batch import StepRequest
    from splash.attention.kernels import kv_rope_fp8
    from splash.attention.metadata import build_metadata
    from splash.kv.page_table import PageTable
    from splash.kv.paged_cache import PagedLatentCache

    g = torch.Generator(device="cpu").manual_seed(seed)
    lens = [max(8, context - b * (page + 3)) if ragged else context for b in range(batch)]
    pages = [-(-n // page) for n in lens]
    # the pool as the engine builds it on this device: bf16 fused on a GPU, and on SM90 an fp8 pool's rope key in
    # e4m3 (what FlashInfer's FP8 MLA reads; the torch and Triton kernels read it too)
    cache = PagedLatentCache(1, sum(pages) + 1, page, dc, dr, kv_dtype, device=device,
                             rope_fp8=kv_rope_fp8("flashinfer", device))
    tables, order = PageTable(page, device=device), torch.randperm(sum(pages), generator=g).tolist()
    reqs, at = [], 0
    for b, (n_tok, n_pg) in enumerate(zip(lens, pages)):
        n = 7 if mixed and b == 0 else 1
        reqs.append(StepRequest(f"r{b}", n_tok - n, n))
        tables.append(f"r{b}", [(j, order[at + j]) for j in range(n_pg)])
        slots = torch.tensor([order[at + p // page] * page + p % page for p in range(n_tok)], device=device)
        cache.write(0, slots, torch.randn(n_tok, dc, generator=g).to(device),
                    torch.randn(n_tok, dr, generator=g).to(device))
        at += n_pg
    meta = build_metadata(reqs, tables)
    q = torch.randn(meta.num_rows, heads, dc + dr, generator=g).to(device)
    return cache, meta, q[..., :dc].contiguous(), q[..., dc:].contiguous()


def with_selection(state, k: int, seed: int = 1):
    """`state` with a DSA top-k selection on its layer: each query row attends `k` random slots among the keys it
    sees (a third of the rows leave their last 3 entries unselected, as a CP rank's lost candidates do)."""
    import torch

    from splash.attention.dsa import SparseSelection, held_slots
    cache, meta, ql, qr = state
    dev = meta.q_pos.device
    slots, pos, held = held_slots(meta, torch.arange(meta.num_reqs, device=dev))
    sees = held[meta.row_req] & (pos[meta.row_req] <= meta.q_pos[:, None])
    score = torch.rand(sees.shape, generator=torch.Generator(device="cpu").manual_seed(seed)).to(dev)
    idx = score.masked_fill(~sees, -1.0).topk(min(k, sees.shape[1]), dim=1).indices
    valid = sees.gather(1, idx)
    valid[::3, -3:] = False
    meta.sparse[0] = SparseSelection(slots[meta.row_req].gather(1, idx) * valid, valid)
    return state


def run_kernel(name, scale, state):
    from splash.attention.kernels import make_kernel
    cache, meta, ql, qr = state
    k = make_kernel(name, scale)
    k.plan(meta)
    o, lse = k.run(0, ql, qr, cache)
    return k, o, lse


HEADS = (16, 64, 128)                       # per rank: a TP shard, a DP-attn / DOP owner, all of DeepSeek's
KV_DTYPES = ("bfloat16", "fp8_e4m3", "int8")   # vendor paths (bf16, SM90 fp8), Triton's fp8 (shipped configs), int8 (dcu)
TOPK = 256                                  # sparse (DSA) rows: keys each query row selects (V3.2 / GLM-5: 2048)


def check_kernels(args, backend) -> None:
    dims = dict(dc=32, dr=8, page=16) if args.dry_run else dict(dc=512, dr=64, page=64)
    batch, ctx = (3, 40) if args.dry_run else (8, 936)          # widest request: 3 / 15 pages (odd)
    scale = 1 / (128 + 64) ** 0.5
    for kv in KV_DTYPES:
        for heads in HEADS:
            for mixed in (False, True):
                case = f"{kv} H={heads} {'mixed' if mixed else 'decode'}"
                guarded(f"attention {case}", check_case, backend, scale, case,
                        make_state(backend.device, batch, ctx, heads=heads, **dims, mixed=mixed, kv_dtype=kv))
        for mixed in (False, True):   # DSA layers: every kernel attends the selected slots (vendors: via Triton)
            case = f"{kv} H={HEADS[1]} sparse {'mixed' if mixed else 'decode'}"
            k = 8 if args.dry_run else TOPK
            guarded(f"attention {case}", lambda c=case, m=mixed: check_sparse_case(backend, scale, c, with_selection(
                make_state(backend.device, batch, ctx, heads=HEADS[1], **dims, mixed=m, kv_dtype=kv), k)))
    guarded("decode time", time_decode, args, backend, dict(dims, heads=HEADS[0]), scale)


def check_case(backend, scale, case, state) -> None:
    _, o_ref, lse_ref = run_kernel("torch", scale, state)
    for name in kernel_names(backend):
        try:
            k, o, lse = run_kernel(name, scale, state)
        except Exception as e:  # noqa: BLE001 — a kernel that fails is a FAIL row, not a crash
            row(f"attention {name} {case}", f"{type(e).__name__}: {str(e)[:300]}", False)
            continue
        paths = getattr(k, "paths", {name: 1})
        err, close = compare(o, lse, o_ref, lse_ref)
        row(f"attention {name} {case}", f"via {','.join(paths)}: {err}", close)


def compare(o, lse, o_ref, lse_ref) -> tuple[str, bool]:
    """A kernel's (õ, LSE) against the reference's: the max |ΔLSE| over the reference's finite entries and the max
    |Δõ| relative to max |õ|, as text, and whether both are within the bf16-input tolerance."""
    fin = lse_ref.isfinite()
    err_l = float((lse - lse_ref)[fin].abs().max())
    err_o = float((o - o_ref).abs().max() / o_ref.abs().max().clamp_min(1e-30))
    return f"|dLSE| {err_l:.1e}, |do|/|o| {err_o:.1e}", err_l < 6e-2 and err_o < 2e-2


def sparse_reference(scale, state):
    """fp32 attention of each query row over exactly its selected keys, read back from the cache (õ, LSE)."""
    import torch
    cache, meta, ql, qr = state
    sel = meta.sparse[0]
    c, k = cache.read(0, sel.slots)                                      # [N, K, dc], [N, K, dr]
    s = (torch.einsum("nhc,nkc->nhk", ql.float(), c) + torch.einsum("nhr,nkr->nhk", qr.float(), k)) * scale
    s = s.masked_fill(~sel.valid[:, None, :], float("-inf"))
    lse = torch.logsumexp(s, dim=-1)
    return torch.einsum("nhk,nkc->nhc", torch.softmax(s, dim=-1), c), lse


def sparse_path(name: str, k) -> tuple[str, bool]:
    """Which path attended a DSA layer, and whether it is the one `name` must take: the torch kernel its
    dsa.sparse_attend; triton, and a vendor kernel through its Triton fallback, our sparse kernel (mla_sparse) —
    never a vendor path, which attends every page."""
    if name == "torch":
        return "dsa.sparse_attend", True
    vendor = set(getattr(k, "paths", {})) - {"triton"}
    if vendor:
        return f"vendor ran: {','.join(sorted(vendor))}", False
    triton = k if hasattr(k, "launches") else getattr(getattr(k, "fallback", None), "kernel", None)
    ran = getattr(triton, "launches", {}).get("mla_sparse", 0) > 0
    return ("via triton mla_sparse" if ran else "the Triton sparse kernel did not run"), ran


def check_sparse_case(backend, scale, case, state) -> None:
    """Every kernel on a DSA layer (torch: dsa.sparse_attend; triton, and flashinfer / aiter through their Triton
    fallback: the Triton sparse kernel mla_sparse) against `sparse_reference`; a vendor kernel must not have run
    its own (dense) path on it, nor a Triton one its dense kernel."""
    o_ref, lse_ref = sparse_reference(scale, state)
    for name in ["torch"] + kernel_names(backend):
        k, o, lse = run_kernel(name, scale, state)
        path, right = sparse_path(name, k)
        err, close = compare(o, lse, o_ref, lse_ref)
        row(f"attention {name} {case}", f"{path}: {err}", right and close)


def hbm_bytes_per_s(args, backend) -> tuple[float, str]:
    from splash.costmodel.profile import load_profile, profile_for_device
    if args.hbm_gbs:
        return args.hbm_gbs * 1e9, "--hbm-gbs"
    name = "cpu"
    if backend.is_gpu:
        import torch
        dev = torch.cuda.get_device_name(backend.device)
        name = profile_for_device(dev)
        if name is None:
            return 0.0, f"no profile for {dev} (give --hbm-gbs)"
    return load_profile(name).kv_read_bytes_per_s, f"{name} profile"


def time_decode(args, backend, dims, scale) -> None:
    batch, ctx = (4, 256) if args.dry_run else (args.batch, args.context)
    state = make_state(backend.device, batch, ctx, **dims, mixed=False, ragged=False)
    kv_bytes = batch * ctx * (dims["dc"] + dims["dr"]) * 2
    bw, src = hbm_bytes_per_s(args, backend)
    for name in ["torch"] + kernel_names(backend):
        if args.dry_run and name != "torch":
            continue   # the interpreter's speed says nothing
        guarded(f"decode time {name}", _time_one, args, backend, state, name, scale, batch, ctx, kv_bytes, bw, src)


def _time_one(args, backend, state, name, scale, batch, ctx, kv_bytes, bw, src) -> None:
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
    dev, T, r = backend.device, ctx.world_size, ctx.rank
    from gpu_check_serve import shares_gpus
    if shares_gpus(backend, T):   # NCCL refuses two ranks on one GPU: what splash-serve then runs, MPI via host
        comm = ctx.comm
    else:
        if not dist.is_initialized():
            init_torch_distributed(ctx, "nccl" if backend.is_gpu else "gloo")
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
    row("comm collectives", f"{T} rank(s) on {backend.device}, {type(comm).__name__}: " + ", ".join(
        f"{k} {'ok' if v else 'WRONG'}" for k, v in ok.items()), all(ok.values()))


def main(argv=None) -> int:
    args = parse(argv)
    if args.summary:
        return summary(args.summary)
    parts = args.part.split(",")
    backend = backend_of(args)
    if "kernels" in parts:
        check_kernels(args, backend)
    if "comm" in parts:
        guarded("comm collectives", check_comm, args, backend)
        if SIZE == 1:
            row("comm across ranks", "1 rank: the collectives across GPUs need >= 2 (mpirun -n N, N GPUs)", "SKIP")
    if SIZE > 1 and ("kernels" in parts or "comm" in parts):   # under mpirun: every rank's rows, to rank 0
        from splash.distributed import init_dist
        everyone = init_dist().comm.all_gather_obj(list(ROWS))
        ROWS[:] = [(f"[rank {r}] {c}", d, res) for r, rows in enumerate(everyone) for c, d, res in rows]
    if "serve" in parts and RANK == 0:
        from gpu_check_serve import check_serve
        guarded("serve", check_serve, args, backend, row)
        if args.ranks == 1:
            row("serve layouts across ranks", "1 rank: DP-attn, CP and DOP place work differently only on >= 2 "
                "(--ranks N)", "SKIP")
    if RANK != 0:
        return 1 if any(res == "FAIL" for _, _, res in ROWS) else 0
    if not args.json:
        return table(ROWS)
    path = Path(args.json)   # gpu-check.sh: both halves append here, then --summary prints the one table
    old = json.loads(path.read_text()) if path.exists() else []
    path.write_text(json.dumps(old + [dict(check=c, detail=d, result=res) for c, d, res in ROWS], indent=1))
    return 1 if any(res == "FAIL" for _, _, res in ROWS) else 0


def table(rows) -> int:
    """The PASS/FAIL/SKIP table; 1 when any row failed."""
    width = max((len(c) for c, _, _ in rows), default=5)
    print("\n== gpu-check results")
    for c, d, res in rows:
        print(f"{c:<{width}}  {res:<4}  {d}")
    counts = {r: sum(res == r for _, _, res in rows) for r in RESULTS}
    failed = counts["FAIL"] > 0
    print("gpu-check:", "FAIL" if failed else "PASS", "(" + ", ".join(f"{n} {r}" for r, n in counts.items()) + ")")
    return 1 if failed else 0


def summary(path: str) -> int:
    rows = [(r["check"], r["detail"], r["result"]) for r in json.loads(Path(path).read_text())]
    return table(rows)


if __name__ == "__main__":
    sys.exit(main())
