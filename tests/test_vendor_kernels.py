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

from backends.cuda import flashinfer_mla as fi
from backends.hip import aiter_mla as ai
from splash.attention.kernels import make_kernel
from splash.attention.kernels.external import fused_pages, lse_to_natural, pad_heads, remap_tables

DECODE = [(9, 1), (2, 1), (0, 1), (21, 1)]


def test_flashinfer_paths():
    assert fi.choose_path(9, "bfloat16", 512, 64, 64, False, True) == ("wrapper", None)
    assert fi.choose_path(10, "bfloat16", 512, 64, 64, False, True) == ("trtllm-gen", None)
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
    assert ai.choose_path("bfloat16", 512, 64, 16, 64, False, True) is None
    assert ai.choose_path("bfloat16", 512, 64, 8, 1, False, True) is None          # padded to 16 heads
    for args, why in [(("bfloat16", 512, 64, 16, 64, False, False), "prefill rows"),
                      (("int8", 512, 64, 16, 64, False, True), "KV dtype int8"),
                      (("bfloat16", 512, 0, 64, 64, False, True), "latent/rope dims 512/0"),
                      (("bfloat16", 512, 64, 256, 64, False, True), "256 heads"),
                      (("bfloat16", 512, 64, 16, 16, False, True), "page size 16"),
                      (("bfloat16", 512, 64, 16, 64, True, True), "CP step")]:
        assert ai.choose_path(*args).startswith(why)


def test_lse_base_conversion():
    s = torch.randn(5, 3, 40) * 4
    base2 = torch.log2(torch.exp2(s / torch.log(torch.tensor(2.0))).sum(-1))   # what a base-2 kernel reports
    assert torch.allclose(lse_to_natural(base2, base2=True), torch.logsumexp(s, -1), atol=1e-4)
    assert torch.equal(lse_to_natural(s, base2=False), s)


@pytest.mark.parametrize("bs", [1, 4, 16])
def test_fused_pages_and_tables_attend_like_the_pool(bs):
    """Attending through the fused [P, page, d_c + d_r] buffer and the renumbered block tables (the contract of
    trtllm-gen / AITER: request b's j-th page is tables[b, j], kv_len tokens) gives the dense reference."""
    cache, bm, _, reqs, meta, q = make_state("bfloat16", bs, DECODE, dc=16, dr=4)
    indptr, indices, _ = meta.csr()
    kv = fused_pages(cache, 0, indices, torch.float32)
    tables = remap_tables(indptr, meta.num_reqs)
    assert kv.shape == (len(indices), bs, 20) and tables.shape[0] == len(reqs)
    o_ref, lse_ref = dense_reference(cache, bm, reqs, q)
    for b, n in enumerate(meta.kv_len.tolist()):
        pages = tables[b, :-(-n // bs)].long()
        keys = kv[pages].reshape(-1, 20)[:n]
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
                                         (ai.AiterMLAKernel, "aiter", "prefill rows")])
def test_wrappers_fall_back_to_triton_exactly(monkeypatch, cls, pkg, why):
    """Without a GPU every layer takes the fallback: our Triton kernel (interpreter), which matches the dense
    reference; the reason is recorded."""
    pytest.importorskip("triton")
    _stub(monkeypatch, pkg)
    kernel = cls(SCALE)
    check(kernel, make_state("bfloat16", 4, TINY, dc=16, dr=4), atol=0.06, rel_o=0.012)   # bf16 operands
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
    cache, bm, tables, reqs, meta, q = make_state("bfloat16", 64, specs, dc=512, dr=64, heads=16)
    ref = make_kernel("torch", SCALE)
    ref.plan(meta)
    o_ref, lse_ref = ref.run(0, q[..., :512], q[..., 512:], cache)
    dev = torch.device("cuda")
    cache.ckv, cache.kpe = [t.to(dev) for t in cache.ckv], [t.to(dev) for t in cache.kpe]
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
    every kernel: the vendor wrappers hand it to the fallback, whatever the shape (NoPE here)."""
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
    assert torch.equal(o, want[0]) and torch.equal(lse, want[1])
    assert list(kernel.fallback.reasons) == [SPARSE_REASON]
