"""The vendor attention kernels' boundary (backends/cuda/flashinfer_mla.py, backends/hip/aiter_mla.py,
splash/attention/kernels/external.py) on CPU: which path each step takes, the LSE-base conversion, the fused
page buffer + renumbered block tables (checked by attending through them with the torch reference), head padding,
and the Triton fallback behind each wrapper. On a GPU with the packages installed the real kernels are compared
with the torch reference (skipped here)."""
from __future__ import annotations

import importlib.machinery
import sys
import types

import pytest
import torch
from test_attention_kernels import SCALE, TINY, check, dense_reference, make_state

import backends
from backends.cuda import flashinfer_mla as fi
from backends.hip import aiter_mla as ai
from splash.attention.kernels import make_kernel
from splash.attention.kernels.external import block_tables, pad_heads
from splash.layouts.layout import RankAttention

DECODE = [(9, 1), (2, 1), (0, 1), (21, 1)]


def test_flashinfer_table_width_and_heads():
    """trtllm-gen's block tables: a multiple of 128 tokens (3 pages of 64 → 4); its head gap 64 < h < 128 → 128."""
    assert [fi.aligned_width(p, 64) for p in (1, 2, 3, 4, 5)] == [2, 2, 4, 4, 6]
    assert [fi.aligned_width(p, 32) for p in (1, 3, 4, 5)] == [4, 4, 4, 8]
    assert [fi.trtllm_heads(h) for h in (16, 48, 64, 65, 96, 127, 128)] == [16, 48, 64, 128, 128, 128, 128]
    assert fi.wrapper_backend(9) == "fa3" and fi.wrapper_backend(8) == fi.wrapper_backend(10) == "fa2"


def test_flashinfer_paths():
    assert fi.choose_path(9, "bfloat16", 512, 64, 64, False, True) == ("wrapper", None)
    assert fi.choose_path(10, "bfloat16", 512, 64, 64, False, True) == ("trtllm-gen", None)
    assert fi.choose_path(12, "bfloat16", 512, 64, 64, False, True) == ("wrapper", None)    # SM120: no trtllm-gen
    assert fi.choose_path(10, "bfloat16", 512, 64, 64, False, False) == ("wrapper", None)   # prefill rows
    assert fi.choose_path(10, "bfloat16", 512, 64, 16, False, True) == ("wrapper", None)    # page size
    assert fi.choose_path(9, "bfloat16", 512, 0, 64, False, True) == ("wrapper", None)      # NoPE
    for args, why in [((9, "fp8_e4m3", 512, 64, 64, False, True), "KV dtype fp8_e4m3"),
                      ((9, "bfloat16", 512, 64, 64, True, True), "CP step"),
                      ((9, "bfloat16", 32, 8, 64, False, True), "latent/rope dims 32/8"),
                      ((7, "bfloat16", 512, 64, 64, False, True), "compute capability 7")]:
        path, reason = fi.choose_path(*args)
        assert path is None and reason.startswith(why), reason


def test_aiter_paths():
    assert ai.choose_path("gfx942", "bfloat16", 512, 64, 16, 64, False, True) is None
    assert ai.choose_path("gfx942", "bfloat16", 512, 64, 8, 1, False, True) is None
    assert ai.choose_path("gfx950", "bfloat16", 512, 64, 64, 64, False, True) is None
    for args, why in [(("gfx942", "bfloat16", 512, 64, 16, 64, False, False), "prefill rows"),
                      (("gfx942", "int8", 512, 64, 16, 64, False, True), "KV dtype int8"),
                      (("gfx942", "bfloat16", 512, 0, 64, 64, False, True), "latent/rope dims 512/0"),
                      (("gfx942", "bfloat16", 512, 64, 256, 64, False, True), "256 heads"),
                      (("gfx942", "bfloat16", 512, 64, 16, 16, False, True), "page size 16"),
                      (("gfx942", "bfloat16", 512, 64, 16, 64, True, True), "CP step"),
                      (("gfx936", "bfloat16", 512, 64, 16, 64, False, True), "arch gfx936"),
                      (("cpu", "bfloat16", 512, 64, 16, 64, False, True), "arch cpu")]:
        assert ai.choose_path(*args).startswith(why)


def test_aiter_head_table():
    """Heads pad to the next size the arch ships (aiter's mla_asm.csv): 48/96/112 → 128; 64 → 128 on gfx942
    (no one-row 64-head kernel there), 64 on gfx950; 12 → 16."""
    assert [ai.decode_heads("gfx942", h) for h in (8, 12, 16, 24, 32, 48, 64, 96, 112, 128, 129)] == \
        [8, 16, 16, 32, 32, 128, 128, 128, 128, 128, None]
    assert [ai.decode_heads("gfx950", h) for h in (48, 64, 80)] == [64, 64, 128]
    assert ai.decode_heads("gfx936", 16) is None


@pytest.mark.parametrize("bs", [1, 4, 16])
def test_fused_pool_and_block_tables_attend_like_the_pool(bs):
    """A bf16 layer's pool is one [blocks, page, d_c + d_r] tensor with ckv / kpe as views of it; attending
    through it with the requests' own page tables padded to 128 tokens (the contract of trtllm-gen / AITER:
    request b's j-th page is tables[b, j], kv_len tokens) gives the dense reference."""
    cache, bm, _, reqs, meta, q = make_state("bfloat16", bs, DECODE, dc=16, dr=4, fused=True)
    kv = cache.fused[0]
    assert kv.shape == (cache.num_blocks, bs, 20) and kv.is_contiguous()
    assert cache.ckv[0].data_ptr() == kv.data_ptr() and cache.kpe[0].data_ptr() == kv[..., 16:].data_ptr()
    widest = int(meta.num_pages.max())
    tables = block_tables(meta, fi.aligned_width(widest, bs))
    assert tables.shape[0] == len(reqs) and tables.dtype == torch.int32
    assert tables.shape[1] >= widest and (tables.shape[1] * bs) % fi.TRTLLM_TABLE_TOKENS == 0
    o_ref, lse_ref = dense_reference(cache, bm, reqs, q)
    for b, n in enumerate(meta.kv_len.tolist()):
        pages = tables[b, :-(-n // bs)].long()
        keys = kv[pages].reshape(-1, 20)[:n].float()
        s = (q[b] @ keys.T) * SCALE
        assert torch.allclose(torch.logsumexp(s, -1), lse_ref[b], atol=1e-4)
        assert torch.allclose(torch.softmax(s, -1) @ keys[:, :16], o_ref[b], atol=1e-4)


def test_pad_heads():
    q = torch.randn(3, 5, 8)
    p, h = pad_heads(q, 16)
    assert h == 5 and p.shape == (3, 16, 8) and torch.equal(p[:, :5], q) and not p[:, 5:].any()
    assert pad_heads(p, 16)[0] is p


def _stub(monkeypatch, name: str) -> None:
    for mod in (name, f"{name}.mla"):
        m = types.ModuleType(mod)
        m.__spec__ = importlib.machinery.ModuleSpec(mod, None)
        monkeypatch.setitem(sys.modules, mod, m)


@pytest.mark.parametrize("cls,pkg,why", [(fi.FlashInferMLAKernel, "flashinfer", "compute capability 0"),
                                         (ai.AiterMLAKernel, "aiter", "arch cpu")])
def test_wrappers_fall_back_to_triton_exactly(monkeypatch, cls, pkg, why):
    """Without a GPU every layer takes the fallback: our Triton kernel (interpreter), which matches the dense
    reference; the reason is recorded."""
    pytest.importorskip("triton")
    _stub(monkeypatch, pkg)
    kernel = cls(SCALE)
    check(kernel, make_state("bfloat16", 4, TINY, dc=16, dr=4, fused=True), atol=0.06, rel_o=0.012)   # bf16 operands
    assert kernel.paths == {"triton": 1}
    assert [r for r in kernel.fallback.reasons][0].startswith(why)


def test_make_kernel_names_the_missing_package():
    for name, pkg in (("flashinfer", "flashinfer"), ("aiter", "aiter")):
        if importlib.util.find_spec(pkg) is None:
            with pytest.raises(ValueError, match=f"needs {pkg}"):
                make_kernel(name, SCALE)


def _gpu_kernel(name: str, pkg: str):
    if not torch.cuda.is_available() or importlib.util.find_spec(pkg) is None:
        pytest.skip(f"needs a GPU and {pkg}")
    return make_kernel(name, SCALE)


@pytest.mark.parametrize("name,pkg", [("flashinfer", "flashinfer"), ("aiter", "aiter")])
@pytest.mark.parametrize("specs", [DECODE, TINY])
def test_vendor_kernel_matches_torch_on_gpu(name, pkg, specs):
    kernel = _gpu_kernel(name, pkg)
    cache, bm, tables, reqs, meta, q = make_state("bfloat16", 64, specs, dc=512, dr=64, heads=16, fused=True)
    ref = make_kernel("torch", SCALE)
    ref.plan(meta)
    o_ref, lse_ref = ref.run(0, q[..., :512], q[..., 512:], cache)
    dev = torch.device("cuda")
    cache.fused = [t.to(dev) for t in cache.fused]           # the GPU's layout: ckv / kpe views of one pool
    cache.ckv, cache.kpe = [t[..., :512] for t in cache.fused], [t[..., 512:] for t in cache.fused]
    tables.pages, tables.logical, tables.npages = (t.to(dev) for t in (tables.pages, tables.logical, tables.npages))
    from splash.attention.metadata import build_metadata
    meta = build_metadata(reqs, tables)
    kernel.plan(meta)
    qd = q.to(dev)
    o, lse = kernel.run(0, qd[..., :512], qd[..., 512:], cache)
    assert torch.allclose(lse.cpu(), lse_ref, atol=2e-2) and (o.cpu() - o_ref).abs().max() < 3e-2 * o_ref.abs().max()


@pytest.mark.parametrize("cls,pkg", [(fi.FlashInferMLAKernel, "flashinfer"), (ai.AiterMLAKernel, "aiter")])
def test_wrappers_send_sparse_layers_to_the_sparse_path(monkeypatch, cls, pkg):
    """A layer with a top-k selection (DSA / KPool, `meta.sparse[layer]`) attends only the selected slots behind
    every kernel: the vendor wrappers hand it to the fallback, whatever the shape (NoPE here), whose Triton sparse
    kernel (mla_sparse) equals dsa.sparse_attend within the bf16-operand tolerance."""
    from splash.attention.dsa import SparseSelection, sparse_attend
    from splash.attention.kernels.external import SPARSE_REASON

    pytest.importorskip("triton")
    _stub(monkeypatch, pkg)
    cache, bm, _, reqs, meta, q = make_state("bfloat16", 4, DECODE, dc=16, dr=0)
    slots = torch.stack([torch.tensor([bm.table(r.req_id)[0] * 4 + i for i in (0, 1, 0)]) for r in reqs])
    meta.sparse[0] = SparseSelection(slots, torch.tensor([[True, True, False]] * len(reqs)))
    kernel = cls(SCALE)
    kernel.plan(meta)
    o, lse = kernel.run(0, q, q[..., :0], cache)
    want = sparse_attend(q, q[..., :0], cache, 0, meta.sparse[0], SCALE)
    assert torch.allclose(lse, want[1], atol=0.06) and (o - want[0]).abs().max() <= 0.012 * want[0].abs().max()
    assert list(kernel.fallback.reasons) == [SPARSE_REASON]
    assert kernel.fallback.kernel.launches == {"mla_sparse": 1}


# ---- vendor conformance: our calls against the vendors' recorded signatures and preconditions ----------------

def test_cuda_extra_pins_the_recorded_flashinfer():
    """pyproject's [cuda] extra pins the range whose signatures backends/cuda/flashinfer_api.json records."""
    import os
    import tomllib

    from packaging.specifiers import SpecifierSet

    from backends.cuda import flashinfer_api
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    extra = tomllib.load(open(os.path.join(root, "pyproject.toml"), "rb"))["project"]["optional-dependencies"]
    pins = [d for d in extra["cuda"] if d.startswith("flashinfer-python")]
    assert pins == [f"flashinfer-python{flashinfer_api.TESTED}"]
    assert flashinfer_api.load()["flashinfer_version"] in SpecifierSet(flashinfer_api.TESTED)


def test_recorded_flashinfer_signatures_match_an_installed_tree():
    """When a flashinfer source tree is on this machine (installed, or FLASHINFER_SRC), the record equals it."""
    import importlib.util
    import os

    from backends.cuda import flashinfer_api
    root = os.environ.get("FLASHINFER_SRC")
    if root is None:
        spec = importlib.util.find_spec("flashinfer")
        if spec is None or spec.origin is None:
            pytest.skip("no flashinfer source here (set FLASHINFER_SRC to an unpacked wheel to check)")
        root = os.path.dirname(os.path.dirname(spec.origin))
    assert flashinfer_api.extract(root)["calls"] == flashinfer_api.load()["calls"]


def _state(kv_dtype: str, specs, heads: int, seed: int = 0, rope_fp8: bool = False):
    """DeepSeek/GLM dims (512 + 64), pages of 64, the GPU's pool layout (a bf16 pool fused); queries scaled so
    scores spread like a real model's (|s| ~ 2 with the tests' softmax scale, not ~20), where the bf16 tolerance
    below means something."""
    *rest, q = make_state(kv_dtype, 64, specs, dc=512, dr=64, heads=heads, seed=seed, fused=True,
                          rope_fp8=rope_fp8)
    return (*rest, q * 0.1)


FI_DECODE = {1: [(9, 1), (30, 1), (63, 1)], 3: [(140, 1), (150, 1), (70, 1)]}   # widest request: 1 / 3 pages


@pytest.mark.parametrize("sm", [9, 10])
@pytest.mark.parametrize("pages", [1, 3])
@pytest.mark.parametrize("heads", [48, 64, 96, 128])
def test_flashinfer_through_strict_standin(monkeypatch, sm, pages, heads):
    """Our FlashInfer wrapper, run through a stand-in that binds each call to flashinfer 0.7.4's recorded
    signature and enforces its preconditions (explicit backend and LSE base, aligned block tables, trtllm-gen's
    head gap), gives the dense reference: decode steps (trtllm-gen on SM100, FA3 on SM90) and a step with
    prefill rows (the wrapper)."""
    from vendor_standins import install_flashinfer
    install_flashinfer(monkeypatch)
    for specs, want in ((FI_DECODE[pages], "trtllm-gen" if sm == 10 else "wrapper"),
                        (FI_DECODE[pages][:2] + [(0, 3)], "wrapper")):
        kernel = fi.FlashInferMLAKernel(SCALE, sm_major=sm)
        check(kernel, _state("bfloat16", specs, heads, seed=heads + pages), atol=0.06, rel_o=0.012)
        assert kernel.paths == {want: 1}


@pytest.mark.parametrize("pages", [1, 3])
@pytest.mark.parametrize("heads", [48, 64, 96, 128])
def test_flashinfer_fp8_kv_through_strict_standin(monkeypatch, pages, heads):
    """FP8 KV on SM90 runs FlashInfer's scaled FP8 MLA: the wrapper planned with kv-per-tensor scales, run with our
    per-token latent scales as `ckv_scale_arr` and the e4m3 rope pool with `kpe_scale` — bound to flashinfer
    0.7.4's recorded signature, through a stand-in enforcing its FP8 preconditions and dequantising as it does —
    and gives the dense reference over the same stored bytes (bf16-operand tolerance), decode and prefill."""
    from vendor_standins import install_flashinfer
    install_flashinfer(monkeypatch)
    for specs in (FI_DECODE[pages], FI_DECODE[pages][:2] + [(0, 3)]):
        kernel = fi.FlashInferMLAKernel(SCALE, sm_major=9)
        state = _state("fp8_e4m3", specs, heads, seed=heads + pages, rope_fp8=True)
        assert state[0].kpe[0].dtype == torch.float8_e4m3fn
        check(kernel, state, atol=0.06, rel_o=0.012)
        assert kernel.paths == {"wrapper-fp8": 1} and kernel.wrapper.plan_args["kv_data_type"] == torch.float8_e4m3fn


@pytest.mark.parametrize("sm,rope_fp8,why", [(10, False, "KV dtype fp8_e4m3 on SM10x"),
                                             (9, False, "KV dtype fp8_e4m3 with a bf16 rope key")])
def test_flashinfer_fp8_kv_elsewhere_runs_triton(monkeypatch, sm, rope_fp8, why):
    """FP8 KV where FlashInfer has no path for our scales (SM100; a bf16 rope key) runs our Triton kernel
    (interpreter here), which matches the reference; the reason is recorded once."""
    pytest.importorskip("triton")
    from vendor_standins import install_flashinfer
    install_flashinfer(monkeypatch)
    kernel = fi.FlashInferMLAKernel(SCALE, sm_major=sm)
    check(kernel, _state("fp8_e4m3", [(70, 1), (9, 1)], 64, rope_fp8=rope_fp8), atol=0.06, rel_o=0.012)
    assert kernel.paths == {"triton": 1} and next(iter(kernel.fallback.reasons)).startswith(why)


def test_triton_reads_an_fp8_rope_pool():
    """The Triton kernel (the SM90 fallback for CP steps) over an fp8 pool whose rope key is e4m3 (interpreter)."""
    pytest.importorskip("triton")
    from splash.attention.kernels.triton_mla import TritonMLAKernel
    check(TritonMLAKernel(SCALE), _state("fp8_e4m3", [(70, 1), (0, 5), (130, 1)], 16, rope_fp8=True), atol=0.06,
          rel_o=0.012)


def test_fp8_rope_key_error():
    """The e4m3 rope key (one fixed per-tensor scale) against the bf16 one, on the same fp8 latent: the stored
    rope values' relative error is e4m3's rounding (≤ 2^-4), and attention's õ / LSE move little."""
    outs, bf16 = [], None
    for rope_fp8 in (False, True):
        cache, bm, _, reqs, meta, q = _state("fp8_e4m3", [(300, 1), (70, 1)], 16, rope_fp8=rope_fp8)
        outs.append(dense_reference(cache, bm, reqs, q))
        if rope_fp8:
            slots = torch.arange(64 * 5)
            k8, k16 = cache.read(0, slots)[1], bf16.read(0, slots)[1]
            held = k16.abs() > 2 ** -6
            assert ((k8 - k16)[held].abs() / k16[held].abs()).max() <= 2 ** -4
        bf16 = cache
    (o16, l16), (o8, l8) = outs
    assert (o8 - o16).abs().max() <= 0.02 * o16.abs().max() and (l8 - l16).abs().max() <= 0.02


def test_flashinfer_standin_rejects_what_flashinfer_rejects(monkeypatch):
    """The stand-in fails the calls the old wrapper made: backend auto, unaligned 3-page tables, 96 heads on
    trtllm-gen, implicit LSE base, positional plan() — so the tests above can fail."""
    import vendor_standins as vs
    mla = vs.install_flashinfer(monkeypatch)
    q, kv = torch.zeros(2, 1, 64, 576, dtype=torch.bfloat16), torch.zeros(6, 1, 64, 576, dtype=torch.bfloat16)
    ok = dict(query=q, kv_cache=kv, workspace_buffer=torch.zeros(8), qk_nope_head_dim=128, kv_lora_rank=512,
              qk_rope_head_dim=64, block_tables=torch.zeros(2, 4, dtype=torch.int32),
              seq_lens=torch.tensor([130, 5]), max_seq_len=130, bmm1_scale=0.1, bmm2_scale=1.0,
              backend="trtllm-gen", return_lse=True, return_lse_base="basee")
    mla.trtllm_batch_decode_with_kv_cache_mla(**ok)
    for bad in (dict(backend="auto"), dict(block_tables=torch.zeros(2, 3, dtype=torch.int32)),
                dict(query=torch.zeros(2, 1, 96, 576, dtype=torch.bfloat16)), dict(return_lse_base=None),
                dict(not_a_parameter=1)):
        with pytest.raises((vs.VendorPrecondition, TypeError)):
            mla.trtllm_batch_decode_with_kv_cache_mla(**{**ok, **bad})
    with pytest.raises(vs.VendorPrecondition):
        mla.BatchMLAPagedAttentionWrapper(torch.zeros(8), backend="auto")
    w = mla.BatchMLAPagedAttentionWrapper(torch.zeros(8), backend="fa3")
    with pytest.raises(vs.VendorPrecondition):
        w.plan(torch.zeros(2), torch.zeros(2), torch.zeros(1), torch.zeros(1), 16, 512, 64, 64, True, 0.1,
               torch.bfloat16, torch.bfloat16)


@pytest.mark.parametrize("arch", ["gfx942", "gfx950"])
@pytest.mark.parametrize("pages", [1, 3])
@pytest.mark.parametrize("heads", [16, 48, 64, 96, 128])
def test_aiter_through_strict_standin(monkeypatch, arch, pages, heads):
    """Our AITER wrapper through a stand-in holding aiter's per-arch head table (a head count it ships no kernel
    for raises, as the real build does) and its unwritten-LSE cases: õ matches the dense reference; the LSE is
    the reference's where aiter writes it and NaN where it may not — never the vendor's stale buffer."""
    from vendor_standins import install_aiter
    install_aiter(monkeypatch, arch)
    kernel = ai.AiterMLAKernel(SCALE, arch=arch)
    cache, bm, _, reqs, meta, q = _state("bfloat16", FI_DECODE[pages], heads, seed=heads)
    kernel.plan(meta)
    o, lse = kernel.run(0, q[..., :512], q[..., 512:], cache)
    o_ref, lse_ref = dense_reference(cache, bm, reqs, q)
    assert kernel.paths == {"aiter": 1}
    assert (o - o_ref).abs().max() <= 0.012 * o_ref.abs().max()
    if ai.decode_heads(arch, heads) in ai.LSE_UNWRITTEN_HEADS:
        assert lse.isnan().all()
    else:
        assert torch.allclose(lse, lse_ref, atol=0.06, rtol=0.06)


@pytest.mark.parametrize("arch,heads,splits", [("gfx942", 64, 16), ("gfx942", 32, 1), ("gfx942", 32, 16),
                                                ("gfx950", 8, 1), ("gfx950", 64, 3)])
def test_aiter_call_buffers_counted(monkeypatch, arch, heads, splits):
    """What mla_decode_fwd allocates per call (the stand-in allocates as aiter's non-persistent decode does, at
    the split count aiter picks) is call_buffer_bytes exactly, and the budget's worst case covers every pick."""
    from vendor_standins import install_aiter
    mla = install_aiter(monkeypatch, arch, splits=splits)
    kernel = ai.AiterMLAKernel(SCALE, arch=arch)
    cache, _, _, _, meta, q = _state("bfloat16", FI_DECODE[3], heads)
    kernel.plan(meta)
    kernel.run(0, q[..., :512], q[..., 512:], cache)
    rows = q.shape[0]
    assert mla.allocated == [ai.call_buffer_bytes(rows, ai.decode_heads(arch, heads), splits)]
    assert mla.allocated[0] > 0
    launch = RankAttention(heads, "bfloat16", False)
    assert backends.attention_workspace_bytes("aiter", (launch,), rows, arch) >= mla.allocated[0]
    assert ai.call_buffer_bytes(rows, 128) == 4 * rows * (16 * 128 * 513 + 128 + 2) + 4   # the 16-split ceiling


def test_aiter_standin_rejects_unshipped_heads(monkeypatch):
    """The stand-in answers 48 heads (the old multiple-of-16 padding) as aiter does, so the test above can fail."""
    from vendor_standins import install_aiter
    mla = install_aiter(monkeypatch, "gfx942")
    q, kv, o = (torch.zeros(1, 48, 576, dtype=torch.bfloat16), torch.zeros(1, 64, 1, 576, dtype=torch.bfloat16),
                torch.zeros(1, 48, 512, dtype=torch.bfloat16))
    one = torch.tensor([0, 1], dtype=torch.int32)
    with pytest.raises(RuntimeError, match="cannot get heuristic kernel"):
        mla.mla_decode_fwd(q, kv, o, one, one, one[:1], torch.tensor([3]), 1, page_size=64, sm_scale=0.1,
                           return_lse=True)


def test_aiter_fp8_kv_runs_triton(monkeypatch):
    pytest.importorskip("triton")
    from vendor_standins import install_aiter
    install_aiter(monkeypatch, "gfx942")
    kernel = ai.AiterMLAKernel(SCALE, arch="gfx942")
    check(kernel, _state("fp8_e4m3", [(70, 1), (9, 1)], 64), atol=0.06, rel_o=0.012)
    assert kernel.paths == {"triton": 1} and next(iter(kernel.fallback.reasons)).startswith("KV dtype fp8_e4m3")


@pytest.mark.parametrize("vendor", ["trtllm-gen", "aiter"])
def test_vendor_calls_read_the_pool_in_place(monkeypatch, vendor):
    """trtllm-gen and AITER are handed the layer's fused pool itself (same storage, every block) and the
    requests' own pages: no per-layer gather or concatenation of the step's KV. One vendor call per layer."""
    import vendor_standins as vs
    seen = []
    if vendor == "aiter":
        mla = vs.install_aiter(monkeypatch, "gfx942")
        real, name, key = mla.mla_decode_fwd, "mla_decode_fwd", "kv_buffer"
        kernel = ai.AiterMLAKernel(SCALE, arch="gfx942")
    else:
        mla = vs.install_flashinfer(monkeypatch)
        real, name, key = mla.trtllm_batch_decode_with_kv_cache_mla, "trtllm_batch_decode_with_kv_cache_mla", \
            "kv_cache"
        kernel = fi.FlashInferMLAKernel(SCALE, sm_major=10)

    def spy(*args, **kwargs):
        seen.append(kwargs.get(key, args[1] if len(args) > 1 else None))
        return real(*args, **kwargs)
    monkeypatch.setattr(mla, name, spy)
    cache, bm, _, reqs, meta, q = _state("bfloat16", FI_DECODE[3] + [(20, 1)], 16)
    kernel.plan(meta)
    for layer in (0, 0):
        o, lse = kernel.run(layer, q[..., :512], q[..., 512:], cache)
    o_ref, lse_ref = dense_reference(cache, bm, reqs, q)
    assert len(seen) == 2
    for kv in seen:
        assert kv.data_ptr() == cache.fused[0].data_ptr() and kv.shape[0] == cache.num_blocks
    assert (o - o_ref).abs().max() <= 0.012 * o_ref.abs().max()
    if vendor != "aiter":
        assert torch.allclose(lse, lse_ref, atol=0.06, rtol=0.06)


def test_flashinfer_logs_the_path_once_per_layer_kind(monkeypatch, caplog):
    """The path of each layer kind (KV dtype, dense or sparse) is logged once, however many layers and steps run it."""
    import logging

    from vendor_standins import install_flashinfer
    install_flashinfer(monkeypatch)
    kernel = fi.FlashInferMLAKernel(SCALE, sm_major=9)
    caplog.set_level(logging.INFO, logger="splash.attention")
    for kv in ("fp8_e4m3", "bfloat16"):
        cache, _, _, _, meta, q = _state(kv, FI_DECODE[1], 16, rope_fp8=True)
        for _ in range(2):                      # two steps of three layers
            kernel.plan(meta)
            for _ in range(3):
                kernel.run(0, q[..., :512], q[..., 512:], cache)
    said = [r.getMessage() for r in caplog.records if r.name == "splash.attention"]
    assert said == ["flashinfer attention: wrapper-fp8 for fp8_e4m3 layers (16 heads)",
                    "flashinfer attention: wrapper for bfloat16 layers (16 heads)"]
    assert kernel.paths == {"wrapper-fp8": 6, "wrapper": 6}


def _flashinfer_tree(root, calls: dict, version: str = "0.7.4") -> None:
    """A flashinfer source tree under `root` whose CALLS have the signatures `calls` gives (overloads decorated
    `@overload`, methods in their class, defaults as the recorded source), beside a dist-info naming `version`."""
    import os

    from backends.cuda import flashinfer_api

    def sig(params, method):
        out, marked = ["self"] if method else [], False
        for i, (name, kind, default) in enumerate(params):
            if kind == "kwonly" and not marked:
                out.append("*")
            marked = marked or kind in ("varargs", "kwonly")
            out.append({"varargs": "*", "varkw": "**"}.get(kind, "") + name
                       + (f"={default}" if default is not None else ""))
            if kind == "posonly" and (i + 1 == len(params) or params[i + 1][1] != "posonly"):
                out.append("/")
        return ", ".join(out)

    files: dict[str, dict] = {}
    for call, (path, cls, name) in flashinfer_api.CALLS.items():
        rec, ind = calls[call], "    " if cls else ""
        defs = [f"{ind}@overload\n{ind}def {name}({sig(p, bool(cls))}): ...\n" for p in rec["overloads"]]
        defs.append(f"{ind}def {name}({sig(rec['impl'], bool(cls))}):\n{ind}    return None\n")
        files.setdefault(path, {}).setdefault(cls, []).extend(defs)
    for path, by_cls in files.items():
        src = ["from typing import overload\n"]
        for cls, defs in by_cls.items():
            src.append((f"class {cls}:\n" if cls else "") + "".join(defs))
        full = os.path.join(root, "flashinfer", path)
        os.makedirs(os.path.dirname(full), exist_ok=True)
        with open(full, "w") as f:
            f.write("\n".join(src))
    os.makedirs(os.path.join(root, f"flashinfer_python-{version}.dist-info"))


def test_the_flashinfer_recorder_reads_back_a_tree_with_the_recorded_signatures(tmp_path, capsys):
    """`python -m backends.cuda.flashinfer_api TREE [--check]` (how the record is re-read for a new release): on a
    tree written from the record it gives the record, byte for byte as committed, and --check passes; one
    parameter renamed in the tree, --check fails naming that call."""
    import copy

    from backends.cuda import flashinfer_api
    want = flashinfer_api.load()
    _flashinfer_tree(tmp_path / "same", want["calls"])
    assert flashinfer_api.main([str(tmp_path / "same")]) == 0
    assert capsys.readouterr().out == open(flashinfer_api.RECORD).read()
    assert flashinfer_api.main([str(tmp_path / "same"), "--check"]) == 0
    assert "same signatures" in capsys.readouterr().out

    changed = copy.deepcopy(want["calls"])
    changed["BatchMLAPagedAttentionWrapper.run"]["impl"][0][0] = "query"
    _flashinfer_tree(tmp_path / "new", changed, version="0.8.0")
    assert flashinfer_api.main([str(tmp_path / "new"), "--check"]) == 1
    out = capsys.readouterr().out
    assert "flashinfer 0.8.0 vs recorded 0.7.4: differs in BatchMLAPagedAttentionWrapper.run" in out
    assert flashinfer_api.main([]) == 2
    # --help is the usage, and a folder without flashinfer/ an error naming it (both were tracebacks: the first
    # argument was read as the tree)
    assert flashinfer_api.main(["--help"]) == 0 and "--check" in capsys.readouterr().out
    assert flashinfer_api.main([str(tmp_path / "missing"), "--check"]) == 2
    assert "holds no flashinfer/ package" in capsys.readouterr().err
