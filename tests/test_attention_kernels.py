"""Paged MLA attention kernels (splash.attention.kernels) against a dense reference, and the page tables and
metadata they read: ragged batches, page sizes 1/16/64, CP-style non-contiguous pages, mixed prefill + decode,
every KV format; the torch kernel's chunked split-KV with bounded scratch; the Triton kernel under the
interpreter (TRITON_INTERPRET=1, tiny shapes — the interpreter is slow)."""
from __future__ import annotations

import random

import pytest
import torch
from hf_models import hf_greedy, random_prompts

from splash.attention.batch import StepRequest
from splash.attention.kernels import make_kernel
from splash.attention.kernels.torch_mla import TorchMLAKernel
from splash.attention.metadata import build_metadata
from splash.kv import quant
from splash.kv.block_manager import BlockManager
from splash.kv.page_table import PageTable
from splash.kv.paged_cache import PagedLatentCache

SCALE = 0.37


def make_state(kv_dtype: str, bs: int, specs: list[tuple[int, int]], world: int = 1, rank: int = 0,
               dc: int = 32, dr: int = 8, heads: int = 2, seed: int = 0, fused: bool | None = None,
               rope_fp8: bool = False):
    """Requests (start_pos, num_new) with their KV for every position < end written on the blocks this rank
    holds (all, or CP's round-robin from anchor i % world); physical pages shuffled; a tiny page table that
    must grow. `fused`: a bf16 pool in the GPU's fused layout, `rope_fp8`: an fp8 pool's rope key in e4m3
    (splash.kv.paged_cache). Returns (cache, bm, tables, reqs, meta, q)."""
    rng = random.Random(seed)
    g = torch.Generator().manual_seed(seed)
    need = sum(-(-(s + n) // bs) for s, n in specs) + 3
    cache = PagedLatentCache(1, need, bs, dc, dr, kv_dtype, fused=fused, rope_fp8=rope_fp8)
    bm, tables = BlockManager(need, bs), PageTable(bs, rows=1, cols=1)
    rng.shuffle(bm._free)
    reqs = [StepRequest(f"r{i}", s, n, owner=i % world) for i, (s, n) in enumerate(specs)]

    def mine(q: StepRequest, b: int) -> bool:
        return (b + q.owner) % world == rank

    for q in reqs:
        blocks = [b for b in range(-(-q.end_pos // bs)) if mine(q, b)]
        for part in ([b for b in blocks if b * bs < q.start_pos], blocks):  # history first, then the new tokens
            new = bm.ensure(q.req_id, part)
            if new:
                tables.append(q.req_id, new)
        t = bm.table(q.req_id)
        pos = [p for p in range(q.end_pos) if (p // bs) in t]
        if pos:
            slots = torch.tensor([t[p // bs] * bs + p % bs for p in pos])
            cache.write(0, slots, torch.randn(len(pos), dc, generator=g) * 2, torch.randn(len(pos), dr, generator=g))
    meta = build_metadata(reqs, tables, None if world == 1 else (world, rank))
    w, row = [], 0  # write rows and slots from the block manager's dict tables
    for q in reqs:
        for p in range(q.start_pos, q.end_pos):
            if mine(q, p // bs):
                w.append((row, bm.table(q.req_id)[p // bs] * bs + p % bs))
            row += 1
    assert meta.write_rows.tolist() == [r for r, _ in w] and meta.write_slots.tolist() == [s for _, s in w]
    q = torch.randn(meta.num_rows, heads, dc + dr, generator=g)
    return cache, bm, tables, reqs, meta, q


def dense_reference(cache, bm, reqs, q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per query row: every held key at a position <= the row's, read (dequantised) from the pool, softmax."""
    bs, dc = cache.block_size, cache.kv_lora_rank
    o = torch.zeros(q.shape[0], q.shape[1], dc)
    lse = torch.full(q.shape[:2], float("-inf"))
    r = 0
    for req in reqs:
        t = bm.table(req.req_id)
        for i in range(req.num_new):
            p = req.start_pos + i
            pos = [x for x in range(p + 1) if (x // bs) in t]
            if pos:
                c, k = cache.read(0, torch.tensor([t[x // bs] * bs + x % bs for x in pos]))
                s = (q[r + i, :, :dc] @ c.T + q[r + i, :, dc:] @ k.T) * SCALE
                lse[r + i] = torch.logsumexp(s, -1)
                o[r + i] = torch.softmax(s, -1) @ c
        r += req.num_new
    return o, lse


def check(kernel, state, atol=1e-4, rel_o=None):
    cache, bm, _, reqs, meta, q = state
    kernel.plan(meta)
    dc = cache.kv_lora_rank
    o, lse = kernel.run(0, q[..., :dc], q[..., dc:], cache)
    o_ref, lse_ref = dense_reference(cache, bm, reqs, q)
    assert o.dtype == lse.dtype == torch.float32 and o.shape == o_ref.shape and lse.shape == lse_ref.shape
    assert torch.equal(torch.isinf(lse), torch.isinf(lse_ref))
    fin = torch.isfinite(lse_ref)
    assert torch.allclose(lse[fin], lse_ref[fin], atol=atol, rtol=atol), (lse - lse_ref).abs()[fin].max()
    if rel_o is None:
        assert torch.allclose(o, o_ref, atol=atol, rtol=atol), (o - o_ref).abs().max()
    else:
        assert (o - o_ref).abs().max() <= rel_o * o_ref.abs().max(), (o - o_ref).abs().max() / o_ref.abs().max()
    assert torch.equal(o[~fin], torch.zeros_like(o[~fin]))


RAGGED = [(0, 5), (37, 1), (3, 1), (0, 1), (70, 1), (12, 9), (129, 1)]  # prefill chunks and decode rows mixed


@pytest.mark.parametrize("bs", [1, 16, 64])
@pytest.mark.parametrize("kv_dtype", quant.KV_DTYPES)
def test_torch_kernel_matches_dense(kv_dtype, bs):
    check(TorchMLAKernel(SCALE), make_state(kv_dtype, bs, RAGGED))


@pytest.mark.parametrize("world,rank", [(2, 0), (2, 1), (4, 3)])
def test_torch_kernel_cp_pages(world, rank):
    """CP: a rank holds every world-th block from the request's anchor; some requests hold nothing here."""
    check(TorchMLAKernel(SCALE), make_state("float32", 4, RAGGED + [(2, 1)], world=world, rank=rank))


def scratch_bound(k: TorchMLAKernel, heads: int, d_c: int, d_r: int) -> int:
    """The most bytes one chunk of the kernel's planned step may allocate (what `chunk_pages` bounds)."""
    bs = k.meta.block_size
    return max(len(g.reqs) * k.chunk_pages(g, heads, d_c, d_r, bs) * (bs * (8 * (d_c + d_r) + g.q * (8 * heads + 1))
                                                                      + 16) for g in k.groups)


def test_chunked_split_kv_is_exact_and_bounded():
    """A tiny scratch budget forces one page per chunk and many chunks: same result; the chunk buffers stay
    within the kernel's stated bound and do not grow with context."""
    peaks = []
    for ctx in (40, 400):
        st = make_state("int8", 4, [(ctx, 1), (ctx // 2, 1), (ctx - 7, 6)], seed=ctx)
        k = TorchMLAKernel(SCALE, scratch_bytes=1, index_cache_bytes=0)
        check(k, st)
        assert 0 < k.peak_scratch_bytes <= scratch_bound(k, 2, 32, 8)
        peaks.append(k.peak_scratch_bytes)
    assert peaks[0] == peaks[1]
    big = TorchMLAKernel(SCALE)
    check(big, make_state("float32", 4, [(400, 1), (200, 1)]))
    assert big.peak_scratch_bytes <= scratch_bound(big, 2, 32, 8)


@pytest.mark.parametrize("kv_dtype", ["float32", "int8"])
def test_nope_rope_width_zero(kv_dtype):
    """NoPE (GLM-5.3-Flash's MLA layers): q_rope [N, H, 0] over a pool whose rope key is zero-width, one chunk
    and many chunks; the Triton kernel's is below."""
    state = make_state(kv_dtype, 4, RAGGED, dc=16, dr=0)
    assert state[0].kpe[0].shape[-1] == 0 and state[5].shape[-1] == 16
    check(TorchMLAKernel(SCALE), state)
    check(TorchMLAKernel(SCALE, scratch_bytes=1, index_cache_bytes=0), state)


@pytest.mark.parametrize("kv_dtype", ["bfloat16", "fp8_e4m3", "int8"])
def test_auto_compute_keeps_fp32_queries_exact_on_bf16_hosts(monkeypatch, kv_dtype):
    """On a CPU with bf16 units, "auto" feeds bf16 GEMM inputs only to a model that computes in bf16: fp32
    queries over a quantised pool stay exact (so its tokens are the same in every layout)."""
    import splash.attention.kernels.torch_mla as tm
    monkeypatch.setattr(tm, "bf16_units", lambda: True)
    k = TorchMLAKernel(SCALE)
    check(k, make_state(kv_dtype, 16, RAGGED))
    assert k._dtype(torch.zeros(1, dtype=torch.bfloat16)) == torch.bfloat16


def test_bf16_compute_within_tolerance():
    """bf16 GEMM inputs (the path used on CPUs with bf16 units), fp32 softmax and accumulation. Measured over 5
    seeds: max |Δõ| / max |õ| 0.0067-0.0082, max |ΔLSE| 0.029-0.039; bounds ~1.5x that."""
    for seed in (0, 1):
        check(TorchMLAKernel(SCALE, compute_dtype="bfloat16"), make_state("bfloat16", 16, RAGGED, seed=seed),
              atol=0.06, rel_o=0.012)


def test_page_table_and_csr():
    _, bm, tables, reqs, meta, _ = make_state("float32", 4, RAGGED, world=2, rank=1)
    indptr, indices, logical = meta.csr()
    assert indptr.tolist()[0] == 0 and len(indptr) == len(reqs) + 1
    for i, q in enumerate(reqs):
        t = sorted(bm.table(q.req_id).items())
        seg = slice(indptr[i], indptr[i + 1])
        assert indices[seg].tolist() == [p for _, p in t] and logical[seg].tolist() == [b for b, _ in t]
        assert int(meta.kv_len[i]) == sum(1 for x in range(q.end_pos) if (x // 4) in bm.table(q.req_id))
    assert meta.qo_indptr.tolist() == [0, 5, 6, 7, 8, 9, 18, 19]
    # release frees the row for reuse; a rewrite replaces it (as a switch does)
    row = tables.row("r0")
    tables.release("r0")
    assert tables.row("new") == row and tables.num_pages("new") == 0
    tables.rewrite("new", {5: 9, 1: 3})
    assert tables.pages[row, :2].tolist() == [3, 9] and tables.logical[row, :2].tolist() == [1, 5]
    tables.append("new", [(2, 7)])  # out of order: the row is rebuilt sorted
    assert tables.logical[row, :3].tolist() == [1, 2, 5] and int(tables.npages[row]) == 3
    with torch.inference_mode():  # grown inside a step (inference mode), updated outside it
        for i in range(40):
            tables.append(f"x{i}", [(0, i)])
        tables.flush()
    tables.release("x3")
    tables.append("x4", [(1, 2)])
    tables.flush()
    assert int(tables.npages[tables.row("x4")]) == 2


def test_unknown_kernel_is_an_error():
    with pytest.raises(ValueError, match="not installed"):
        make_kernel("flashinfer", 1.0)


# ---- Triton (interpreter on CPU) ---------------------------------------------------------------------------
TINY = [(0, 3), (9, 1), (2, 1), (5, 1)]


def _triton():
    pytest.importorskip("triton")
    pytest.importorskip("numpy")
    return make_kernel("triton", SCALE)


def _tol(kv_dtype: str) -> dict:
    """The Triton kernel's tolerance: exact fp32 products over an fp32 pool; over bf16 / fp8 / int8 pools bf16
    operands into the matrix units (fp32 accumulate) — the bound of the torch kernel's bf16 compute above."""
    return dict(atol=2e-4) if kv_dtype == "float32" else dict(atol=0.06, rel_o=0.012)


@pytest.mark.parametrize("kv_dtype", quant.KV_DTYPES)
def test_triton_kernel_matches_dense(kv_dtype):
    check(_triton(), make_state(kv_dtype, 4, TINY, dc=16, dr=4), **_tol(kv_dtype))


@pytest.mark.parametrize("kv_dtype", ["float32", "fp8_e4m3"])
def test_triton_kernel_decode_splits_merge_exactly(kv_dtype):
    """A decode-only step over long rows takes several splits (merged by mla_merge); 32 heads = two head blocks
    of 16 where the cap is 16."""
    k = _triton()
    check(k, make_state(kv_dtype, 4, [(70, 1), (9, 1), (33, 1)], dc=16, dr=4, heads=32), **_tol(kv_dtype))
    assert k.longest == 72 and k.launches["mla_merge"] == 1        # 18 pages of 4 = 5 key blocks of 16: 5 splits


def test_triton_split_count_bounds_the_scratch():
    from splash.attention.kernels.triton_mla import split_count
    from splash.layouts.device_budget import ATTN_SCRATCH_BYTES
    assert split_count(16384, 128, 512, False, 4096, 8) == 1        # a prefill chunk: one split, no partials
    assert split_count(3, 16, 512, True, 4096, 8) == 8
    assert split_count(3, 16, 512, True, 2, 8) == 2                  # no more splits than key blocks
    for rows in (1, 16, 64, 512):
        s = split_count(rows, 128, 512, True, 4096, 8)
        assert s == 1 or rows * 128 * s * 513 * 4 <= ATTN_SCRATCH_BYTES


@pytest.mark.parametrize("bs", [1, 16, 64])
def test_triton_kernel_page_sizes_and_cp(bs):
    check(_triton(), make_state("float32", bs, TINY + [(20, 1)], dc=16, dr=4), atol=2e-4)
    check(_triton(), make_state("bfloat16", bs, TINY, world=2, rank=1, dc=16, dr=4), **_tol("bfloat16"))


@pytest.mark.parametrize("kv_dtype", ["float32", "fp8_e4m3"])
def test_triton_kernel_nope(kv_dtype):
    """Rope width 0 (GLM-5.3-Flash): the kernel skips the rope term; CP pages too."""
    check(_triton(), make_state(kv_dtype, 4, TINY, dc=16, dr=0), **_tol(kv_dtype))
    check(_triton(), make_state(kv_dtype, 4, TINY, world=2, rank=0, dc=16, dr=0), **_tol(kv_dtype))


def test_engine_with_triton_matches_transformers(tiny_ckpt, hf_ref, comm):
    """`attention_backend="triton"` through the whole engine (interpreter): chunked prefill mixed with decode,
    prompts over several pages, against transformers' greedy tokens."""
    pytest.importorskip("triton")
    from splash.engine.llm import LLM
    from splash.engine.sampling import SamplingParams

    prompts = random_prompts([6, 2], seed=8)
    want = hf_greedy(hf_ref("moe_yarn"), prompts, 4)
    llm = LLM(str(tiny_ckpt("moe_yarn")), block_size=4, max_num_batched_tokens=5, attention_backend="triton",
              comm=comm)
    outs = llm.generate(prompts, SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
    assert llm.runner.attn.name == "triton" and [o.token_ids for o in outs] == want


def test_chunk_spans_are_balanced():
    """ceil(pages / C) chunks, none above C, sizes differing by at most one page, covering every page in order."""
    from splash.attention.kernels.torch_mla import chunk_spans
    for pages, C in ((128, 107), (10, 3), (7, 7), (1, 5), (2048, 55)):
        spans = chunk_spans(pages, C)
        sizes = [n for _, n in spans]
        assert len(spans) == -(-pages // C) and max(sizes) <= C and max(sizes) - min(sizes) <= 1
        assert [j for j, _ in spans] == [sum(sizes[:i]) for i in range(len(sizes))] and sum(sizes) == pages


# ---- Triton sparse (DSA) kernel: mla_sparse against dsa.sparse_attend (interpreter) -----------------------------
def select_slots(meta, K: int, seed: int = 0, none_row: int = 0):
    """A DSA selection on layer 0 as the indexer leaves it: each row's K entries drawn (with repeats: a slot may be
    selected twice) from the slots its request holds; entries at positions past the row's, and a quarter more, are
    invalid (padding, a CP rank's lost candidates) with slot 0; row `none_row` selects nothing."""
    from splash.attention.dsa import SparseSelection, held_slots
    g = torch.Generator().manual_seed(seed)
    slots, pos, held = held_slots(meta, torch.arange(meta.num_reqs))
    n = meta.num_rows
    idx = torch.randint(0, slots.shape[1], (n, K), generator=g)
    valid = (held[meta.row_req].gather(1, idx) & (pos[meta.row_req].gather(1, idx) <= meta.q_pos[:, None])
             & (torch.rand(n, K, generator=g) > 0.25))
    if none_row is not None:
        valid[none_row] = False
    meta.sparse[0] = SparseSelection(slots[meta.row_req].gather(1, idx) * valid, valid)
    return meta.sparse[0]


def _sparse_tol(kv_dtype: str) -> dict:
    """fp32 pools: exact fp32 products (to 1e-5); bf16 / fp8 / int8: the dense kernel's bf16-operand tolerance."""
    return {} if kv_dtype == "float32" else _tol(kv_dtype)


def check_sparse(state, K: int, splits: bool = False, seed: int = 0, table: str | None = None, **tol):
    """The Triton kernel on a layer with a selection: its sparse kernel ran (split partials merged when `splits`)
    and equals dsa.sparse_attend over the same slots; a row with no valid slot: õ = 0, LSE = −inf."""
    from splash.attention.dsa import sparse_attend
    cache, _, _, _, meta, q = state
    dc = cache.kv_lora_rank
    sel = select_slots(meta, K, seed)
    k = _triton()
    k.table = table or k.table
    k.plan(meta)
    o, lse = k.run(0, q[..., :dc], q[..., dc:], cache)
    o_ref, lse_ref = sparse_attend(q[..., :dc], q[..., dc:], cache, 0, sel, SCALE)
    assert k.launches["mla_sparse"] == 1 and not k.launches["mla_split"]
    assert (k.launches["mla_merge"] == 1) == splits
    fin = torch.isfinite(lse_ref)
    assert torch.equal(torch.isinf(lse), ~fin) and not fin[0].any() and fin[1:].any()
    assert torch.equal(o[~fin], torch.zeros_like(o[~fin]))
    atol, rel_o = tol.get("atol", 1e-5), tol.get("rel_o")     # fp32 pools: the same fp32 sums in another order
    assert torch.allclose(lse[fin], lse_ref[fin], atol=atol, rtol=atol), (lse - lse_ref).abs()[fin].max()
    if rel_o is None:
        assert torch.allclose(o, o_ref, atol=atol, rtol=atol), (o - o_ref).abs().max()
    else:
        assert (o - o_ref).abs().max() <= rel_o * o_ref.abs().max(), (o - o_ref).abs().max() / o_ref.abs().max()
    return sel


SPARSE_DECODE = [(70, 1), (9, 1), (33, 1), (50, 1)]   # decode-only: a selection of K > 16 takes several splits


@pytest.mark.parametrize("kv_dtype", quant.KV_DTYPES)
@pytest.mark.parametrize("K,heads", [(5, 3), (37, 20)])   # K under one block / over two, not a multiple of 16
def test_triton_sparse_kernel_matches_sparse_attend_mixed(kv_dtype, K, heads):
    """A mixed step (prefill chunk + decode rows: one split) over every KV format; 20 heads = two head blocks where
    the cap is 16, one masked block of 32 elsewhere; duplicate slots count twice, as in sparse_attend."""
    sel = check_sparse(make_state(kv_dtype, 4, TINY, dc=16, dr=4, heads=heads), K, **_sparse_tol(kv_dtype))
    rows = [s[v].tolist() for s, v in zip(sel.slots, sel.valid)]
    assert K < 16 or any(len(r) > len(set(r)) for r in rows)        # the draw did select some slot twice


@pytest.mark.parametrize("kv_dtype", quant.KV_DTYPES)
def test_triton_sparse_kernel_decode_splits_merge(kv_dtype):
    """A decode-only step: 37 selected entries = 3 blocks = 3 splits, merged by the dense kernel's mla_merge."""
    check_sparse(make_state(kv_dtype, 4, SPARSE_DECODE, dc=16, dr=4, heads=2), 37, splits=True, seed=1,
                 **_sparse_tol(kv_dtype))


@pytest.mark.parametrize("kv_dtype,fused,rope_fp8,dr", [("bfloat16", True, False, 4), ("fp8_e4m3", None, True, 4),
                                                        ("bfloat16", True, False, 0), ("fp8_e4m3", None, False, 0)])
def test_triton_sparse_kernel_gpu_pool_layouts(kv_dtype, fused, rope_fp8, dr):
    """The GPU's pools: bf16 fused [blocks, page, d_c + d_r] (strided latent and rope), fp8 with an e4m3 rope key
    (SM90), and NoPE (rope width 0, GLM-5.3-Flash), each in a mixed and a decode-only step."""
    for specs, splits in ((TINY, False), (SPARSE_DECODE, True)):
        check_sparse(make_state(kv_dtype, 4, specs, dc=16, dr=dr, heads=4, fused=fused, rope_fp8=rope_fp8), 21,
                     splits=splits, **_sparse_tol(kv_dtype))


@pytest.mark.parametrize("kv_dtype,fused,rope_fp8", [("bfloat16", True, False), ("fp8_e4m3", None, True)])
def test_triton_kernels_with_the_sm90_launch_table(kv_dtype, fused, rope_fp8):
    """The launches an SM90 GPU takes (32 keys per step, 4 warps, 2 stages; timed on an H200) over its pools, in the
    interpreter: dense mixed and decode-only (split partials merged) and sparse, against the references."""
    from splash.attention.kernels.triton_mla import LAUNCH, launch_config
    assert LAUNCH["sm_90"][kv_dtype][2] == 32 != LAUNCH["cuda"][kv_dtype][2]
    pools = dict(dc=16, dr=4, fused=fused, rope_fp8=rope_fp8)
    for specs, heads, merged in ((TINY, 20, 0), ([(70, 1), (9, 1), (33, 1)], 32, 1)):
        k = _triton()
        k.table = "sm_90"
        check(k, make_state(kv_dtype, 4, specs, heads=heads, **pools), **_tol(kv_dtype))
        assert k.launches["mla_merge"] == merged
        assert k.last_launch == (*launch_config("sm_90", heads, kv_dtype), 3 if merged else 1)   # 72 keys: 3 × 32
    for specs, splits in ((TINY, False), (SPARSE_DECODE, True)):
        check_sparse(make_state(kv_dtype, 4, specs, heads=4, **pools), 37, splits=splits, table="sm_90",
                     **_sparse_tol(kv_dtype))


def test_triton_sparse_kernel_empty_selection():
    """A selection of width 0 (nothing to attend here): õ = 0 and LSE = −inf without a launch."""
    from splash.attention.dsa import SparseSelection
    cache, _, _, _, meta, q = make_state("float32", 4, TINY, dc=16, dr=4)
    meta.sparse[0] = SparseSelection(torch.zeros(meta.num_rows, 0, dtype=torch.long),
                                     torch.zeros(meta.num_rows, 0, dtype=torch.bool))
    k = _triton()
    k.plan(meta)
    o, lse = k.run(0, q[..., :16], q[..., 16:], cache)
    assert not k.launches and torch.equal(o, torch.zeros_like(o)) and torch.isinf(lse).all() and (lse < 0).all()
