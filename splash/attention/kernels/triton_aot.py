"""Ahead-of-time compiles of our Triton MLA kernels for the GPU targets we ship for, on any machine (no GPU).

    TRITON_INTERPRET=0 python -m splash.attention.kernels.triton_aot      # one JSON line per compile

Triton compiles for a `GPUTarget` without the device, so on CPU we know a launch's shared memory per block (against
the target's limit), register spills (NVIDIA: cuobjdump's STACK; AMD: the private segment) and whether its products
run on the matrix units (mma / wgmma / tcgen05.mma in PTX, v_mfma in AMDGCN), for every launch shape
TritonMLAKernel can choose: `mla_split` (`planned_shapes`), the DSA layers' `mla_sparse` (`sparse_shapes`: the
largest tile of each launch) and `mla_merge`; tests/test_triton_aot.py checks them all.
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
from concurrent.futures import ProcessPoolExecutor

from splash.layouts.memory import ROPE_FP8_SM_MAJOR, rope_fp8_pool

# name → (backend, arch, warp size, shared memory per block in bytes): H100/H200, B200, RTX 50xx / RTX PRO
# Blackwell (sm_120: 99 KiB per block, no wgmma: mma.sync), MI300, MI350 (gfx950: 160 KiB LDS), MI200
TARGETS = {"sm_90": ("cuda", 90, 32, 232448), "sm_100": ("cuda", 100, 32, 232448),
           "sm_120": ("cuda", 120, 32, 101376),
           "gfx942": ("hip", "gfx942", 64, 65536), "gfx950": ("hip", "gfx950", 64, 163840),
           "gfx90a": ("hip", "gfx90a", 64, 65536)}
HEADS_PER_RANK = range(8, 129)
KV_DTYPES = ("float32", "bfloat16", "fp8_e4m3", "int8")
DIMS = ((512, 64), (512, 0))     # (d_c, d_r): DeepSeek-V3.x / GLM-5.x; GLM-5.3-Flash (NoPE)
MATRIX_OPS = re.compile(r"wgmma\.mma_async|mma\.sync|tcgen05\.mma|v_mfma")
ROPE_FP8_POOL = "fp8_e4m3+rope_fp8"   # an fp8 pool whose rope key is e4m3 too (FlashInfer's FP8 MLA on SM90)
# where some kernel's pools store such a key (splash.layouts.memory.rope_fp8_pool, the pool's own decision): sm_90
ROPE_FP8_TARGETS = tuple(t for t in TARGETS if any(rope_fp8_pool(k, t) for k in ROPE_FP8_SM_MAJOR))


def pool_formats(target: str) -> tuple[str, ...]:
    """The KV pool formats our kernel can meet on `target`: each KV dtype, and on SM90 the fp8 pool with an e4m3
    rope key (the Triton kernel runs there for what FlashInfer's FP8 path does not take: CP steps)."""
    return KV_DTYPES + ((ROPE_FP8_POOL,) if target in ROPE_FP8_TARGETS else ())


def target_table(target: str) -> str:
    """The LAUNCH table TritonMLAKernel uses on `target`'s GPUs."""
    from splash.attention.kernels.triton_mla import launch_table
    vendor, arch = TARGETS[target][:2]
    return launch_table(vendor, arch // 10 if vendor == "cuda" else None)


def planned_shapes(target: str) -> list[tuple]:
    """(pool format, head block, num_warps, keys per step, num_stages, d_c, d_r, page size) for every launch the
    kernel can choose on `target`, over every page size a GPU config allows (GPU_BLOCK_SIZES refuses any other)."""
    from splash.attention.kernels.triton_mla import launch_config
    from splash.config.serve_config import GPU_BLOCK_SIZES
    table = target_table(target)
    return sorted({(kv, *launch_config(table, h, kv.split("+")[0]), dc, dr, page)
                   for kv in pool_formats(target) for h in HEADS_PER_RANK for dc, dr in DIMS
                   for page in GPU_BLOCK_SIZES})


# each kernel's pointer arguments beyond the pool's (QL, QR, CKV, KPE, SCALE first, OPART, LPART last) and its scalars
_INDEX_ARGS = {"mla_split": {"PAGES": "*i32", "LOGICAL": "*i32", "NUM_PAGES": "*i32", "ROW_REQ": "*i64",
                             "REQ_ROWS": "*i64", "QPOS": "*i64"},
               "mla_sparse": {"SLOTS": "*i64", "VALID": "*u8"}}   # SparseSelection's slots; its mask as bytes
_SCALARS = {"mla_split": {"H": "i32", "PCOLS": "i32", "tokens_per_split": "i32", "sm_scale": "fp32"},
            "mla_sparse": {"H": "i32", "K": "i32", "slots_per_split": "i32", "sm_scale": "fp32"}}


def _signature(pool: str, kernel: str = "mla_split") -> dict[str, str]:
    kv_dtype = pool.split("+")[0]
    ckv = {"float32": "*fp32", "bfloat16": "*i16", "fp8_e4m3": "*u8", "int8": "*i8"}[kv_dtype]
    kpe = "*u8" if pool == ROPE_FP8_POOL else "*fp32" if kv_dtype == "float32" else "*i16"
    q = "*fp32" if kv_dtype == "float32" else "*bf16"      # TritonMLAKernel.run casts the queries so
    return dict(QL=q, QR=q, CKV=ckv, KPE=kpe, SCALE="*fp32", **_INDEX_ARGS[kernel], OPART="*fp32", LPART="*fp32",
                **_SCALARS[kernel])


def row_strides(kv_dtype: str, dc: int, dr: int) -> tuple[int, int]:
    """The pool's token strides TritonMLAKernel.run passes for a `kv_dtype` layer (splash.kv.paged_cache)."""
    from splash.kv.paged_cache import FUSED_DTYPES
    row = dc + dr if kv_dtype in FUSED_DTYPES else None
    return row or dc, (row or dr) if dr else 1


def narrow_argument_offsets(ttir: str, args) -> list[str]:
    """Pointer arithmetic straight off a kernel argument (or its broadcast) with i32 offsets: the form that wraps
    past 2^31 elements. Offsets added after an i64 base are tile-local (< the tile's width) and may stay i32."""
    from_arg = {f"%{a}": a for a in args}
    for name, src in re.findall(r"(%[\w.]+) = tt\.splat (%[\w.]+) : !tt\.ptr", ttir):
        if src in from_arg:
            from_arg[name] = from_arg[src]
    bad = []
    for base, off_type in re.findall(r"tt\.addptr (%[\w.]+), %[\w.]+ : [^,]+, (tensor<[^>]*>|i\d+)", ttir):
        if base in from_arg and "i64" not in off_type:
            bad.append(f"{from_arg[base]}: {off_type}")
    return bad


def _spill_bytes(target: str, asm: dict) -> int:
    if "cubin" in asm:
        import triton
        tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
        with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
            f.write(asm["cubin"])
            f.flush()
            out = subprocess.run([tool, "-res-usage", f.name], capture_output=True, text=True, check=True).stdout
        return sum(int(x) + int(y) for x, y in re.findall(r"STACK:(\d+) SHARED:\d+ LOCAL:(\d+)", out))
    return max(int(x) for x in re.findall(r"\.private_segment_fixed_size:\s*(\d+)", asm["amdgcn"]))


def _compile(target: str, kernel, sig: dict[str, str], const: dict, **options):
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    backend, arch, warp, limit = TARGETS[target]
    k = triton.compile(ASTSource(kernel, sig, const), target=GPUTarget(backend, arch, warp), options=options)
    return k, dict(narrow_offsets=narrow_argument_offsets(k.asm["ttir"], sig), target=target,
                   shared=k.metadata.shared, shared_limit=limit, spill_bytes=_spill_bytes(target, k.asm))


def _pool_args(pool: str, dc: int, dr: int) -> tuple[str, bool, bool, int, int]:
    """(KV dtype, rope_bf16, rope_fp8, latent / rope token strides) of a `pool` format, as TritonMLAKernel._pool
    finds them in the GPU's pools."""
    kv_dtype, rope_fp8 = pool.split("+")[0], pool == ROPE_FP8_POOL
    return kv_dtype, kv_dtype != "float32" and not rope_fp8, rope_fp8, *row_strides(kv_dtype, dc, dr)


def compile_split(target: str, pool: str, bh: int, warps: int, bn: int, stages: int | None, dc: int, dr: int,
                  page: int, kernel: str = "mla_split") -> dict:
    """Compile `mla_split` (or with kernel="mla_sparse", the sparse kernel, which takes no page size) for one launch
    shape over a `pool` format of `page`-token pages; its resources and matrix-unit count."""
    from splash.attention.kernels import triton_mla as tm
    kv_dtype, *fmt = _pool_args(pool, dc, dr)
    if kernel == "mla_split":
        const = tm.split_constants(kv_dtype, dc, dr, bh, bn, page, 1, *fmt)
    else:
        const = tm.sparse_constants(kv_dtype, dc, dr, bh, bn, 1, *fmt)
    k, row = _compile(target, getattr(tm, kernel), _signature(pool, kernel), const, **tm.launch_options(warps, stages))
    text = k.asm.get("ptx") or k.asm["amdgcn"]
    return dict(row, kernel=kernel, kv_dtype=pool, head_block=bh, num_warps=warps, block_n=bn, num_stages=stages,
                d_c=dc, d_r=dr, page=page if kernel == "mla_split" else None,
                matrix_ops=len(MATRIX_OPS.findall(text)))


def sparse_shapes(target: str) -> list[tuple]:
    """(pool format, head block, num_warps, keys per step, num_stages, d_c, d_r) of the `mla_sparse` launches compiled
    for `target`: of the dense kernel's launches (the same LAUNCH table) less the page size (selected slots are
    physical, any page), for each pool format and (warps, keys, stages, d_c) only the largest tile: the largest head
    block and rope width. The smaller launches are the same code on smaller tiles (d_r = 0 prunes the rope code),
    which need no more shared memory or registers; `mla_split` is compiled at every tile, matrix units included."""
    worst: dict[tuple, tuple] = {}
    for kv, bh, warps, bn, stages, dc, dr, _page in planned_shapes(target):
        key = (kv, warps, bn, stages, dc)
        seen = worst.get(key, (bh, dr))
        worst[key] = (max(seen[0], bh), max(seen[1], dr))
    return sorted((kv, bh, warps, bn, stages, dc, dr) for (kv, warps, bn, stages, dc), (bh, dr) in worst.items())


def compile_merge(target: str, splits: int = 8, dc: int = 512) -> dict:
    from splash.attention.kernels import triton_mla as tm
    sig = {"OPART": "*fp32", "LPART": "*fp32", "O": "*fp32", "LSE": "*fp32"}
    const = dict(DC=dc, BDC=tm.pow2(dc, 1), NSPLIT=splits, BS=tm.pow2(splits, 1))
    return dict(_compile(target, tm.mla_merge, sig, const)[1], kernel="mla_merge", splits=splits)


def _run(job: tuple) -> dict:
    if job[0] == "merge":
        return compile_merge(job[1])
    if job[0] == "sparse":
        return compile_split(*job[1:], page=None, kernel="mla_sparse")
    return compile_split(*job[1:])


def jobs(targets=tuple(TARGETS)) -> list[tuple]:
    out = [("merge", t) for t in targets]
    out += [("split", t, *shape) for t in targets for shape in planned_shapes(t)]
    return out + [("sparse", t, *shape) for t in targets for shape in sparse_shapes(t)]


def main(argv: list[str]) -> int:
    if os.environ.get("TRITON_INTERPRET") != "0":
        print("set TRITON_INTERPRET=0: the interpreter's kernels cannot be compiled", file=sys.stderr)
        return 2
    targets = argv or list(TARGETS)
    with ProcessPoolExecutor(max_workers=min(4, os.cpu_count() or 1)) as pool:
        for row in pool.map(_run, jobs(targets)):
            print(json.dumps(row), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
