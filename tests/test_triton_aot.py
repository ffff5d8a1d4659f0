"""Our Triton MLA kernels compiled ahead of time for sm_90, sm_100, sm_120, gfx942, gfx950 and gfx90a on this CPU (Triton compiles
for a GPUTarget without the device): every launch shape TritonMLAKernel can choose for 8…128 heads per rank and
each KV format of the dense kernel (mla_split), and the largest tile per launch of the DSA layers' sparse kernel
(mla_sparse), fits the target's shared memory, spills no registers, keeps argument offsets int64 and, for
bf16 / fp8 / int8 pools, runs its products on the matrix units. The compiles run in a subprocess (the test
session's Triton is in interpreter mode); Triton's cache makes reruns take seconds (first run ~2-3 min)."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("triton")
from splash.attention.kernels import triton_aot as aot  # noqa: E402
from splash.attention.kernels.triton_mla import MEASURED, launch_config  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def compiled() -> list[dict]:
    env = dict(os.environ, TRITON_INTERPRET="0", TRITON_DEFAULT_FP_FUSION="1", PYTHONPATH=ROOT)
    out = subprocess.run([sys.executable, "-m", "splash.attention.kernels.triton_aot"], env=env, cwd=ROOT,
                         capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]
    return [json.loads(line) for line in out.stdout.splitlines()]


@pytest.mark.timeout(900)   # a cold Triton cache compiles ~105 kernels (~2-3 min on 2 cores)
def test_every_planned_launch_compiles_within_the_target(compiled):
    for row in compiled:
        assert row["shared"] <= row["shared_limit"], row
        # spills only where the launch was timed fastest on that hardware (triton_mla.MEASURED)
        timed = row["kernel"] != "mla_merge" and \
            row["kv_dtype"].split("+")[0] in MEASURED.get(aot.target_table(row["target"]), ())
        assert row["spill_bytes"] == 0 or timed, row
        assert row["narrow_offsets"] == [], row
        if row["kernel"] in ("mla_split", "mla_sparse") and row["kv_dtype"] != "float32":
            assert row["matrix_ops"] > 0, row      # mma / wgmma (PTX) or MFMA (AMDGCN)


@pytest.mark.timeout(900)
def test_the_planner_only_picks_compiled_launches(compiled):
    """Each (target, heads 8…128, KV dtype, dims, page size a GPU config allows) the kernel can be asked for maps to
    a launch compiled above: of mla_split exactly; of mla_sparse (any page size: it reads physical slots) one with
    the same warps, keys per step and stages and a tile at least as large (head block, rope width), which bounds
    its shared memory and spills (triton_aot.sparse_shapes; the smaller tiles' matrix units: mla_split's rows)."""
    from splash.config.serve_config import GPU_BLOCK_SIZES
    done = {(r["kernel"], r["target"], r["kv_dtype"], r["head_block"], r["num_warps"], r["block_n"], r["num_stages"],
             r["d_c"], r["d_r"], r["page"])
            for r in compiled if r["kernel"] in ("mla_split", "mla_sparse")}
    sparse = {(r["target"], r["kv_dtype"], r["num_warps"], r["block_n"], r["num_stages"], r["d_c"]):
              (r["head_block"], r["d_r"]) for r in compiled if r["kernel"] == "mla_sparse"}
    assert {r["target"] for r in compiled} == set(aot.TARGETS)
    for target in aot.TARGETS:
        for kv in aot.pool_formats(target):
            for h in aot.HEADS_PER_RANK:
                for dc, dr in aot.DIMS:
                    bh, *launch = launch_config(aot.target_table(target), h, kv.split("+")[0])
                    big_bh, big_dr = sparse[(target, kv, *launch, dc)]
                    assert bh <= big_bh and dr <= big_dr, (target, kv, h, dr)
                    for page in GPU_BLOCK_SIZES:
                        assert ("mla_split", target, kv, bh, *launch, dc, dr, page) in done
    for kernel in ("mla_split", "mla_sparse"):
        assert ("sm_90", aot.ROPE_FP8_POOL) in {(r["target"], r["kv_dtype"]) for r in compiled if r["kernel"] == kernel}


def test_narrow_offset_check_catches_int32_row_offsets(tmp_path):
    """The offset check itself: row × width in int32 straight off the argument is flagged, int64 is not."""
    code = f"""
import triton, triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from splash.attention.kernels.triton_aot import narrow_argument_offsets

@triton.jit
def k(X, W, WIDE: tl.constexpr):
    row = tl.program_id(0)
    if WIDE:
        row = row.to(tl.int64)
    tl.store(X + row * W + tl.arange(0, 16), 1.0)

for wide in (False, True):
    c = triton.compile(ASTSource(k, {{"X": "*fp32", "W": "i32"}}, {{"WIDE": wide}}), target=GPUTarget("hip", "gfx942", 64))
    print(len(narrow_argument_offsets(c.asm["ttir"], ["X", "W"])))
"""
    env = dict(os.environ, TRITON_INTERPRET="0", TRITON_DEFAULT_FP_FUSION="1", PYTHONPATH=ROOT)
    (tmp_path / "narrow.py").write_text(code)
    out = subprocess.run([sys.executable, str(tmp_path / "narrow.py")], env=env, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["1", "0"]


@pytest.mark.parametrize("kernel", ["mla_split", "mla_sparse"])
@pytest.mark.parametrize("kv_dtype", aot.KV_DTYPES + (aot.ROPE_FP8_POOL,))
def test_runtime_launch_matches_the_compiled_signature(monkeypatch, kv_dtype, kernel):
    """What TritonMLAKernel passes to mla_split (a dense layer) or mla_sparse (a layer with a DSA selection) —
    pointer dtypes, constexprs: token strides of the GPU's pools, the e4m3 rope key — over a pool in the GPU's
    layout is what the AOT check compiled."""
    import torch
    from test_attention_kernels import SCALE, TINY, make_state, select_slots

    from splash.attention.kernels import triton_mla as tm
    pool, kv_dtype = kv_dtype, kv_dtype.split("+")[0]
    want = aot._signature(pool, kernel)
    names = {torch.float32: "*fp32", torch.bfloat16: "*bf16", torch.int16: "*i16", torch.uint8: "*u8",
             torch.int8: "*i8", torch.int32: "*i32", torch.int64: "*i64"}
    seen = []
    real = getattr(tm, kernel)

    class Spy:
        def __getitem__(self, grid):
            def launch(*args, **kw):
                seen.append(({p: names[a.dtype] for p, a in zip(want, args) if isinstance(a, torch.Tensor)}, kw))
                return real[grid](*args, **kw)
            return launch

    monkeypatch.setattr(tm, kernel, Spy())
    cache, _, _, _, meta, q = make_state(kv_dtype, 4, TINY, dc=16, dr=4, fused=True,
                                         rope_fp8=pool == aot.ROPE_FP8_POOL)
    if kernel == "mla_sparse":
        select_slots(meta, 5)
    k = tm.TritonMLAKernel(SCALE)
    k.plan(meta)
    k.run(0, q[..., :16], q[..., 16:], cache)
    (ptrs, kw), = seen
    assert ptrs == {p: t for p, t in want.items() if t.startswith("*")}
    assert (kw["BH"], kw["num_warps"], kw["BN"], kw.get("num_stages")) == launch_config("cuda", 2, kv_dtype)
    assert kw["EMULATED"] is True
    assert (kw["ROW_C"], kw["ROW_R"]) == aot.row_strides(kv_dtype, 16, 4)
    assert kw["ROPE_FP8"] == (pool == aot.ROPE_FP8_POOL)
    assert ("PAGE" in kw) == (kernel == "mla_split")


def test_every_gpu_page_size_is_in_the_compile_set():
    """The page sizes a GPU config may choose are exactly those compiled for every target (no others are allowed:
    tests/test_serve_config.py::test_gpu_page_size_is_one_the_kernels_were_compiled_for)."""
    from splash.config.serve_config import GPU_BLOCK_SIZES
    for target in aot.TARGETS:
        assert {shape[-1] for shape in aot.planned_shapes(target)} == set(GPU_BLOCK_SIZES)


def test_compiling_in_interpreter_mode_is_refused(monkeypatch, capsys):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert aot.main(["sm_90"]) == 2 and "set TRITON_INTERPRET=0" in capsys.readouterr().err


def test_the_kernel_takes_its_launch_table_from_the_gpu(monkeypatch):
    """SM90 GPUs launch the H200-timed table, other NVIDIA GPUs the spill-free one, AMD its own; the AOT check
    compiles each target with the table its GPUs take."""
    import torch

    from splash.attention.kernels import triton_mla as tm
    monkeypatch.setattr(tm, "INTERPRETED", False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    for major, table in ((9, "sm_90"), (10, "cuda"), (12, "cuda"), (8, "cuda")):
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None, m=major: (m, 0))
        assert tm.TritonMLAKernel(1.0).table == table
    monkeypatch.setattr(torch.version, "hip", "6.4")
    assert tm.TritonMLAKernel(1.0).table == "hip"
    assert {t: aot.target_table(t) for t in aot.TARGETS} == {
        "sm_90": "sm_90", "sm_100": "cuda", "sm_120": "cuda", "gfx942": "hip", "gfx950": "hip", "gfx90a": "hip"}
