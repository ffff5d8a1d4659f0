"""SPLASH's CPU kernels (splash.native): the paged MLA decode kernel and the packed grouped expert GEMM against
torch, the packed stack's round trip, and the fallbacks (no compiler, more than one thread)."""
from __future__ import annotations

import pytest
import torch
from test_attention_kernels import RAGGED, SCALE, check, make_state

from splash import native
from splash.attention.kernels.torch_mla import TorchMLAKernel
from splash.native import packed
from splash.models.linear import grouped_linear

needs_native = pytest.mark.skipif(native.lib() is None, reason="no AVX2/FMA CPU or no C compiler")


def _both(state):
    """(native õ, LSE), (torch-path õ, LSE) of one step."""
    cache, _, _, _, meta, q = state
    dc = cache.kv_lora_rank
    out = []
    for use in (True, False):
        k = TorchMLAKernel(SCALE)
        k.plan(meta)
        orig = native.enabled
        native.enabled = (lambda: False) if not use else orig
        try:
            out.append(k.run(0, q[..., :dc], q[..., dc:], cache))
        finally:
            native.enabled = orig
        if use:
            assert k._native_args, "the decode rows did not go through the native kernel"
    return out


@needs_native
@pytest.mark.parametrize("bs", [1, 16, 64])
@pytest.mark.parametrize("heads,dc,dr", [(2, 32, 8), (11, 48, 16), (8, 16, 0)])
def test_native_decode_matches_torch_and_dense(bs, heads, dc, dr):
    """Ragged decode rows mixed with prefill chunks, heads not a multiple of 8, NoPE (d_r = 0)."""
    state = make_state("float32", bs, RAGGED + [(300, 1), (0, 1)], dc=dc, dr=dr, heads=heads, seed=bs)
    check(TorchMLAKernel(SCALE), state, atol=2e-5)
    (o, lse), (o_t, lse_t) = _both(state)
    assert torch.equal(torch.isinf(lse), torch.isinf(lse_t))
    assert torch.allclose(o, o_t, atol=2e-5, rtol=2e-5) and torch.allclose(lse, lse_t, atol=2e-5, rtol=2e-5)


@needs_native
@pytest.mark.parametrize("world,rank", [(2, 1), (4, 3)])
def test_native_decode_cp_pages(world, rank):
    """CP's non-contiguous pages, and requests holding no page here (õ = 0, LSE = -inf)."""
    state = make_state("float32", 4, RAGGED + [(2, 1), (90, 1)], world=world, rank=rank)
    check(TorchMLAKernel(SCALE), state, atol=2e-5)
    (o, lse), (o_t, lse_t) = _both(state)
    assert torch.isinf(lse).any() and torch.equal(torch.isinf(lse), torch.isinf(lse_t))
    assert torch.allclose(o, o_t, atol=2e-5, rtol=2e-5)


def _stack(E=5, N=48, K=40, seed=0):
    return torch.randn(E, N, K, generator=torch.Generator().manual_seed(seed))


@needs_native
def test_packed_grouped_gemm_matches_torch():
    w = _stack()
    p = packed.pack_experts(w.clone())
    assert isinstance(p, packed.PackedExperts) and p.shape == w.shape and len(p) == 5
    assert torch.equal(p.unpacked(), w) and torch.equal(p[3], w[3])
    counts = torch.tensor([3, 0, 7, 1, 4])
    x = torch.randn(int(counts.sum()), 40)
    ref = grouped_linear(x, w, counts)
    got = grouped_linear(x, p, counts)
    assert torch.allclose(got, ref, atol=1e-5, rtol=1e-5)
    assert torch.equal(grouped_linear(x[:3], p, torch.tensor([3, 0, 0, 0, 0])), got[:3])  # batch-invariant rows


@needs_native
def test_packed_stack_falls_back_with_more_threads():
    """Packed at load (one thread), run later with two: the plain stack's (weight's) GEMMs, same result."""
    w = _stack(seed=1)
    p = packed.pack_experts(w.clone())
    counts = torch.tensor([2, 2, 0, 1, 3])
    x = torch.randn(8, 40)
    one = grouped_linear(x, p, counts)
    torch.set_num_threads(2)
    try:
        assert not native.enabled()
        assert packed.pack_experts(w) is w            # not packed while the kernels are off
        two = grouped_linear(x, p, counts)
    finally:
        torch.set_num_threads(1)
    assert torch.allclose(one, two, atol=1e-5, rtol=1e-5)
    lin = torch.randn(32, 40)
    pl = packed.pack_linear(lin.clone())    # a packed linear likewise: its unpacked weight's GEMM
    torch.set_num_threads(2)
    try:
        got = packed.packed_linear(x, pl)
    finally:
        torch.set_num_threads(1)
    assert isinstance(pl, packed.PackedLinear) and torch.allclose(got, x @ lin.T, atol=1e-5, rtol=1e-5)


def test_not_packed_when_unsuitable():
    assert packed.pack_experts(_stack(N=40)).shape == (5, 40, 40)          # width not a multiple of 16
    assert isinstance(packed.pack_experts(_stack(N=40)), torch.Tensor)
    assert isinstance(packed.pack_experts(_stack().bfloat16()), torch.Tensor)


def test_no_compiler_means_torch_paths(tmp_path, monkeypatch, caplog):
    """A compiler that fails: lib() is None with a warning, and SPLASH_NATIVE=0 turns the kernels off."""
    monkeypatch.setattr(native, "_lib", False)
    monkeypatch.setenv("CC", "/bin/false")
    monkeypatch.setenv("SPLASH_NATIVE_CACHE", str(tmp_path))
    if native.cpu_supported():
        with caplog.at_level("WARNING"):
            assert native.lib() is None and not native.enabled()
        assert "unavailable" in caplog.text and not list(tmp_path.iterdir())
    monkeypatch.setattr(native, "_lib", False)
    monkeypatch.delenv("CC")
    monkeypatch.setenv("SPLASH_NATIVE", "0")
    assert native.lib() is None


@needs_native
def test_packed_linear_and_row_ops_match_torch():
    """PackedLinear (strided input rows too), RMSNorm (strided rows), RoPE (both pair layouts, [n, d] and
    [n, H, d] views), SwiGLU: each within fp32 rounding of its torch expression."""
    from splash.native import ops
    g = torch.Generator().manual_seed(3)
    w = torch.randn(48, 40, generator=g)
    p = packed.pack_linear(w.clone())
    assert isinstance(p, packed.PackedLinear) and p.shape == w.shape and torch.equal(p.unpacked(), w)
    x = torch.randn(13, 56, generator=g)[:, 8:48]
    assert torch.allclose(packed.packed_linear(x, p), x @ w.T, atol=1e-5, rtol=1e-5)
    xs, nw = torch.randn(9, 80, generator=g)[:, :64], torch.randn(64, generator=g)
    ref = xs * xs.pow(2).mean(-1, keepdim=True).add(1e-6).rsqrt() * nw
    assert torch.allclose(ops.rms_norm(xs, nw, 1e-6), ref, atol=1e-5, rtol=1e-5)
    q = torch.randn(9, 3, 24, generator=g)[..., 8:]
    cos, sin = torch.randn(9, 8, generator=g), torch.randn(9, 8, generator=g)
    for inter in (True, False):
        x1, x2 = (q[..., 0::2], q[..., 1::2]) if inter else (q[..., :8], q[..., 8:])
        c, s = cos[:, None], sin[:, None]
        ref = torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1)
        assert torch.allclose(ops.rope(q, cos, sin, inter), ref, atol=1e-6)
        assert torch.allclose(ops.rope(q[:, 1], cos, sin, inter), ref[:, 1], atol=1e-6)
    h = torch.randn(7, 32, generator=g) * 4
    ref = torch.nn.functional.silu(h[:, :16]) * h[:, 16:]
    assert torch.allclose(ops.swiglu(h, 16), ref, atol=1e-5, rtol=1e-5)
    assert ops.swiglu(h, 16, limit=10.0) is None   # swiglu_limit: torch's
    assert ops.swiglu(h.bfloat16(), 16) is None and ops.rms_norm(xs.T, nw[:9], 1e-6) is None   # torch's then


@needs_native
def test_native_decode_refuses_a_page_outside_the_pool():
    """A page id past the pool is an error of the step, not a read out of bounds."""
    cache, _, tables, _, meta, q = make_state("float32", 4, [(20, 1), (9, 1)])
    k = TorchMLAKernel(SCALE)
    k.plan(meta)
    with torch.inference_mode():   # the page table is made in inference mode
        meta.pages[meta.req_rows[1], 0] = cache.ckv[0].shape[0] + 5
    with pytest.raises(RuntimeError, match="outside the pool"):
        k.run(0, q[..., :32], q[..., 32:], cache)


@needs_native
@pytest.mark.parametrize("E,G,tg,k", [(16, 4, 2, 4), (256, 8, 4, 8), (64, 1, 1, 6)])
def test_moe_route_sort_match_torch(E, G, tg, k, monkeypatch):
    """DeepSeek-V3 routing and the experts' row order: the kernels against the torch expressions they replace
    (the same experts; weights within an ulp, as their sum runs in another order)."""
    import types

    from splash.models import ffn
    from splash.native import ops
    cfg = types.SimpleNamespace(n_group=G, topk_group=tg, num_experts_per_tok=k, norm_topk_prob=True,
                                routed_scaling_factor=2.5, n_routed_experts=E)
    g = torch.Generator().manual_seed(E)
    w = types.SimpleNamespace(router=torch.randn(E, 64, generator=g), bias=torch.randn(E, generator=g) * 0.1)
    x = torch.randn(37, 64, generator=g)
    fast = [ffn.route(cfg, w, x)]
    fast += [ffn.sort_rows(*fast[0], E)]
    for name in ("moe_route", "moe_sort"):
        monkeypatch.setattr(ops, name, lambda *a: None)
    idx, wt = ffn.route(cfg, w, x)
    (i1, o1), (i2, o2) = fast[0][0].sort(-1), idx.sort(-1)
    assert torch.equal(i1, i2)
    torch.testing.assert_close(fast[0][1].gather(1, o1), wt.gather(1, o2), rtol=3e-7, atol=0)
    order = ffn.sort_rows(*fast[0], E)
    assert all(torch.equal(a, b) for a, b in zip(fast[1], order))


PACKABLE = dict(model_type="deepseek_v3", vocab_size=64, hidden_size=64, intermediate_size=64, num_hidden_layers=1,
                num_attention_heads=4, kv_lora_rank=32, q_lora_rank=48, qk_rope_head_dim=16, qk_nope_head_dim=16,
                v_head_dim=16)   # Q-B 32 rows a head, Q-A 48 rows, KV-A 48: every projection whole strips


def _attn(cfg, heads):
    from splash.models.weights import attention_from_full, expected_shapes
    g = torch.Generator().manual_seed(1)
    sd = {k: torch.randn(*s, generator=g) * 0.2 if len(s) == 2 else torch.rand(s, generator=g) + 0.5
          for k, s in sorted(expected_shapes(cfg).items())}
    return attention_from_full(cfg, sd.__getitem__, "model.layers.0.self_attn.", heads)


@needs_native
def test_packed_projections_fused_and_moved(monkeypatch):
    """Q-B, O and [Q-A ; KV-A] load packed (Q-A / KV-A strip views of the stack); `mla_project` gives
    query_and_latent's, latent_query's and new_latent_kv's outputs bit for bit; a replicate-then-discard round
    trip (the switch executor's weight transfer) gives each rank's packed shard back bit for bit, with the stack
    carried over."""
    from splash.attention import mla
    from splash.models.config import model_config_from_dict
    from splash.models.rope import Rope
    from splash.native import ops
    from splash.switching import weights_transfer as wt
    cfg = model_config_from_dict(PACKABLE)
    shards = [_attn(cfg, range(2 * r, 2 * r + 2)) for r in range(2)]
    w = shards[0]
    assert all(isinstance(p, packed.PackedLinear) for p in (w.q_b, w.o, w.qkv_a, w.q_a, w.kv_a))
    assert w.q_a.packed.untyped_storage().data_ptr() == w.qkv_a.packed.untyped_storage().data_ptr()
    rope, x = Rope(cfg), torch.randn(5, cfg.hidden_size)
    cos, sin = rope.cos_sin(torch.arange(5) + 3)
    steps = (lambda: mla.query_and_latent(cfg, rope, w, x, cos, sin),   # TP, DP-attn
             lambda: mla.latent_query(cfg, rope, w, x, cos, sin),       # CP, DOP
             lambda: mla.new_latent_kv(cfg, rope, w, x, cos, sin))
    fused = [f() for f in steps]
    monkeypatch.setattr(ops, "mla_project", lambda *a, **k: None)
    assert all(torch.equal(a, b) for f, got in zip(steps, fused) for a, b in zip(got, f()))
    full = wt.unpack_full(w, torch.cat([wt.pack_shard(s) for s in shards]), 2, 4)
    assert torch.equal(full.q_b.packed, _attn(cfg, range(4)).q_b.packed)
    assert torch.equal(full.o.packed, _attn(cfg, range(4)).o.packed)
    for r in range(2):
        back = wt.slice_heads(full, range(2 * r, 2 * r + 2), cfg.qk_head_dim)
        for name in ("q_b", "o"):
            assert torch.equal(getattr(back, name).packed, getattr(shards[r], name).packed)
        assert torch.equal(back.w_uv, shards[r].w_uv) and back.qkv_a is w.qkv_a


@needs_native
def test_fused_moe_and_mlp_match_unfused(monkeypatch):
    """moe_experts (gather, both expert GEMMs, SwiGLU, weighted sum) and mlp_packed (both GEMMs, SwiGLU) give the
    unfused path's bits."""
    import types

    from splash.models import ffn
    from splash.models.weights import MLPWeights, MoEWeights
    from splash.native import ops
    g = torch.Generator().manual_seed(0)
    E, H, inter = 16, 64, 32
    cfg = types.SimpleNamespace(n_group=4, topk_group=2, num_experts_per_tok=4, norm_topk_prob=True,
                                routed_scaling_factor=2.5, n_routed_experts=E)
    r = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    shared = MLPWeights(gate=None, up=None, down=packed.pack_linear(r(H, inter)),
                        gate_up=packed.pack_linear(r(2 * inter, H)))
    w = MoEWeights(router=r(E, H), bias=r(E) * 0.1, gate_up=packed.pack_experts(r(E, 2 * inter, H)),
                   down=packed.pack_experts(r(E, H, inter)), shared=shared)
    x = r(37, H)
    fused, fused_mlp = ffn.moe(cfg, w, x), ffn.mlp(shared, x)
    assert torch.equal(ffn.mlp(shared, x[3:5]), fused_mlp[3:5])   # a row does not depend on its batch
    monkeypatch.setattr(ops, "moe_experts", lambda *a: None)
    assert torch.equal(fused, ffn.moe(cfg, w, x))
    monkeypatch.setattr(ops, "mlp_packed", lambda *a, **k: None)
    assert torch.equal(fused_mlp, ffn.mlp(shared, x)) and torch.equal(fused, ffn.moe(cfg, w, x))


@needs_native
def test_wrong_arguments_are_errors_not_memory_corruption():
    """Each kernel checks its arguments before C sees a pointer: a wrongly shaped, typed, strided or ranged argument
    is a ValueError naming the op (the schema rejects a wrong kind of argument), not a read past a buffer."""
    g = torch.Generator().manual_seed(5)
    r = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    ops = torch.ops.splash
    from splash.native import ops as _registered  # noqa: F401
    x, cos, sin = r(4, 64), r(4, 8), r(4, 8)
    bad = [
        (lambda: ops.rms_norm(x, r(56), 1e-6), "weight must have 64"),                 # norm weight too short
        (lambda: ops.rms_norm(x.double(), r(64).double(), 1e-6), "float32"),
        (lambda: ops.rope(r(4, 2, 16), r(3, 8), r(3, 8), True), r"cos must be \[4, 8\]"),   # fewer rows of cos
        (lambda: ops.swiglu(r(4, 20)), "multiple of 8"),
        (lambda: ops.moe_route(r(4, 16), r(8), 4, 2, 4, True, 1.0), "bias must have 16"),
        (lambda: ops.moe_sort(torch.tensor([[0, 99]]), r(1, 2), 16), r"experts in \[0, 16\)"),
        (lambda: ops.uv_heads(r(4, 2, 32), r(2, 16, 16)), r"uv_t must be \[2, 32"),
        (lambda: ops.absorb_rope(r(4, 2, 24), r(2, 8, 32), cos, sin, 16, True), r"w_uk must be \[2, 16"),
        (lambda: ops.linear_packed(x, r(3, 40, 16)), r"packed \[..., N/16, 64, 16\]"),   # K mismatch
        (lambda: ops.grouped_gemm(x, r(2, 3, 64, 16), torch.tensor([3, 9])), "sum to at most"),
        (lambda: ops.grouped_gemm(x, r(2, 3, 64, 16), torch.tensor([3, 1], dtype=torch.int32)), "int64"),
        (lambda: ops.moe_experts(x, torch.tensor([0, 7]), torch.tensor([1, 1]), r(2), r(2, 2, 64, 16),
                                 r(2, 4, 16, 16)), r"tok must lie in \[0, 4\)"),
        (lambda: ops.mla_project(x, r(2, 64, 16), r(16), r(0), r(0), r(16), cos, sin, 3, 2, 8, 16, 1e-6, True),
         r"wa must have 48 output columns"),
    ]
    for call, msg in bad:
        with pytest.raises(ValueError, match=msg):
            call()
    from splash.models.norm import rms_norm   # model code's call: the route refuses it, torch's shape error follows
    with pytest.raises(RuntimeError, match="must match the size"):   # (the kernel would have read past the weight)
        rms_norm(x, r(56), 1e-6)
    with pytest.raises(RuntimeError, match="eps"):   # the schema: eps is a float, not a tensor or a name
        ops.rms_norm(x, r(64), "1e-6")
    with pytest.raises(RuntimeError, match="weight"):
        ops.rms_norm(x, 1e-6)


@needs_native
def test_decode_kernel_checks_its_page_table():
    """mla_decode's per-row arrays index the page table and the output: a page-table row or a query row past
    them is refused, and q̃'s two parts must be views with one set of strides."""
    cache, _, _, _, meta, q = make_state("float32", 4, [(20, 1), (9, 1)])
    k = TorchMLAKernel(SCALE)
    k.plan(meta)
    k.run(0, q[..., :32], q[..., 32:], cache)
    rows, prow, npg, qpos, pages, logical = k._native_args["args"].tensors
    args = [rows, prow, npg, qpos, pages, logical, q[..., :32], q[..., 32:], cache.ckv[0], cache.kpe[0], SCALE]
    for i, t, msg in ((1, prow + pages.shape[0], "page_rows must lie"), (0, rows + 2, "rows must lie"),
                      (2, npg.long(), "int32"), (6, q[..., :32].contiguous(), "views of one")):
        with pytest.raises(ValueError, match=msg):
            torch.ops.splash.mla_decode(*args[:i], t, *args[i + 1:])


def _variants(t: torch.Tensor) -> list[torch.Tensor]:
    """`t`, and tensors like it wrong in one way each: another dtype, a row fewer or more, a column fewer (a strided
    view and a copy), a last dim at stride 2, a dim more or fewer, the same shape not contiguous."""
    out = [t, t.double() if t.is_floating_point() else t.int() if t.dtype == torch.int64 else t.long()]
    if t.dim():
        out += [t[:-1], torch.cat([t, t[:1]]), torch.stack([t, t], -1)[..., 0], t.unsqueeze(0), t.reshape(-1)]
        out += [t[..., :-1], t[..., :-1].contiguous()] if t.shape[-1] > 1 else []
        out += [t.transpose(0, -1).contiguous().transpose(0, -1)] if t.dim() > 1 else []
    return out


class _Refused(Exception):
    pass


@needs_native
def test_routes_send_the_kernels_only_what_the_checks_accept(monkeypatch):
    """A route tests its arguments in one expression and calls the C directly, without the op's checks (they cost
    the tiny model's decode step ~25%). With the checks put back in front of every C call, each route gets valid
    arguments and every one-argument variant of them (`_variants`, packed weights included): it either returns None
    (torch's path) or passes arguments the checks accept — a route whose test missed a condition fails here."""
    import dataclasses
    import types

    from splash.models.config import model_config_from_dict
    from splash.models.rope import Rope
    from splash.native import ops
    for name, run in list(vars(ops.kernels).items()):
        def spy(*a, _run=run, _check=getattr(ops.checked, name).check, _name=name):
            try:
                _check(*a)
            except ValueError as e:
                raise _Refused(f"route {_name} passed what its checks refuse: {e}") from e
            return _run(*a)
        monkeypatch.setattr(ops.kernels, name, spy)
    g = torch.Generator().manual_seed(7)
    r = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    lin, exp = packed.PackedLinear.of_strips, lambda p: packed.PackedExperts(None, p)   # each checks its tensor
    cfg = model_config_from_dict(PACKABLE)
    w = _attn(cfg, range(2))
    rope = Rope(cfg)
    cos, sin = rope.cos_sin(torch.arange(4) + 3)

    def attn(t, parts):
        a = dataclasses.replace(w, q_a_norm=t["qn"], kv_a_norm=t["kn"], w_uk=t["uk"], q_b=lin(t["qb"]),
                                qkv_a=lin(t["wa"]), q_a=lin(t["wa"]) if parts == 1 else w.q_a)
        return ops.mla_project(cfg, rope, a, t["x"], t["cos"], t["sin"], parts)
    state = make_state("float32", 4, [(20, 1), (9, 1), (30, 3)])
    kernel = TorchMLAKernel(SCALE)
    kernel.plan(state[4])
    q, cache = state[5], state[0]
    kernel.run(0, q[..., :32], q[..., 32:], cache)
    names = ("rows", "prow", "npg", "qpos", "pages", "logical")
    dec = dict(zip(names, kernel._native_args["args"].tensors))
    idx = torch.tensor([[0, 3], [5, 3], [1, 7], [3, 0]])
    cases = [
        (lambda t: ops.rms_norm(t["x"], t["w"], 1e-6), {"x": r(4, 64), "w": r(64)}),
        (lambda t: ops.rope(t["x"], t["cos"], t["sin"], True), {"x": r(4, 2, 16), "cos": r(4, 8), "sin": r(4, 8)}),
        (lambda t: ops.rope(t["x"], t["cos"], t["sin"], False), {"x": r(4, 16), "cos": r(4, 8), "sin": r(4, 8)}),
        (lambda t: ops.swiglu(t["h"], 16), {"h": r(4, 32)}),
        (lambda t: ops.moe_route(t["s"], t["b"], 4, 2, 4, True, 2.5), {"s": r(4, 16).sigmoid(), "b": r(16)}),
        (lambda t: ops.moe_sort(t["i"], t["w"], 8), {"i": idx, "w": r(4, 2)}),
        (lambda t: ops.absorb_rope(t["q"], t["uk"], 16, t["cos"], t["sin"], True),
         {"q": r(4, 2, 24), "uk": r(2, 16, 32), "cos": r(4, 4), "sin": r(4, 4)}),
        (lambda t: ops.uv_heads(t["o"], t["uv"]), {"o": r(4, 2, 32), "uv": r(2, 32, 16)}),
        (lambda t: ops.linear_packed(t["x"], lin(t["p"])), {"x": r(4, 64), "p": r(3, 64, 16)}),
        (lambda t: ops.mlp_packed(types.SimpleNamespace(gate_up=lin(t["gu"]), down=lin(t["d"])), t["x"]),
         {"x": r(4, 64), "gu": r(4, 64, 16), "d": r(2, 32, 16)}),
        (lambda t: ops.grouped_gemm(t["x"], exp(t["p"]), t["c"]),
         {"x": r(4, 64), "p": r(2, 3, 64, 16), "c": torch.tensor([1, 3])}),
        (lambda t: ops.moe_experts(t["x"], types.SimpleNamespace(gate_up=exp(t["gu"]), down=exp(t["d"])), t["c"],
                                   t["tok"], t["w"], None),
         {"x": r(4, 64), "gu": r(2, 4, 64, 16), "d": r(2, 4, 32, 16), "c": torch.tensor([3, 2]),
          "tok": torch.tensor([0, 1, 3, 1, 2]), "w": r(5)}),
        *[(lambda t, p=p: attn(t, p), {"x": r(4, 64), "cos": cos, "sin": sin, "qn": w.q_a_norm, "kn": w.kv_a_norm,
                                        "uk": w.w_uk, "qb": w.q_b.packed, "wa": (w.qkv_a if p == 3 else w.q_a).packed})
          for p in (3, 1)],
        (lambda t: ops.mla_decode(ops.decode_rows(*(t[k] for k in names)), t["ql"], t["qr"], t["ckv"], t["kpe"],
                                  SCALE),
         {**dec, "ql": q[..., :32], "qr": q[..., 32:], "ckv": cache.ckv[0], "kpe": cache.kpe[0]}),
    ]
    for call, base in cases:
        assert call(base) is not None   # valid arguments reach the kernel
        for key in base:
            for v in _variants(base[key]):
                try:
                    call({**base, key: v})
                except ValueError:   # a packed weight's or decode_rows' checks, the C code's own index checks, or
                    pass             # mla_decode's checks naming the argument
