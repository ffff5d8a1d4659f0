"""Quantised weights in stored form: shard → all-gather round trips are bit-exact where head boundaries do not
fall on 128-row blocks (GLM-5.x KV-B: 448 rows per head), shards carry exactly the scale blocks they touch, the
switch payload equals the memory model, and linear layers on the stored form equal the dequantised reference."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from splash.layouts.memory import matrix_bytes, projection_shard_bytes
from splash.models.config import model_config_from_dict
from splash.models.linear import linear
from splash.models.qweight import FP8, INT8, QuantWeight, cat_cols, cat_rows, quantize
from splash.models.weights import attention_from_full, expected_shapes, resident_bytes
from splash.switching import weights_transfer as wt


def _random(rows: int, cols: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    # rows of very different magnitude so a scale taken from the wrong block or row shows
    return torch.randn(rows, cols, generator=g) * 10.0 ** (torch.rand(rows, 1, generator=g) * 4 - 2)


def _same(a: QuantWeight, b: QuantWeight) -> bool:
    return (a.fmt == b.fmt and (a.row_off, a.col_off) == (b.row_off, b.col_off) and a.data.shape == b.data.shape
            and torch.equal(a.data.view(torch.uint8), b.data.view(torch.uint8)) and torch.equal(a.scale, b.scale))


# (heads, rows per head, columns, world, unaligned). GLM-5.x KV-B (192 + 256 rows per head; one 128-column block
# here, rows are what is sharded) is aligned at T = 8 (28 blocks per rank) but not at 64 ranks (3.5 blocks);
# DeepSeek-V3 Q-B (192 rows per head) is not at 128 ranks; the tiny test model's KV-B (56 rows per head) is not
# at 2 and 4 ranks.
SHARDINGS = [(64, 448, 128, 8, False), (64, 448, 128, 64, True), (128, 192, 128, 128, True),
             (8, 56, 160, 2, True), (8, 56, 160, 4, True)]


@pytest.mark.parametrize("fmt", [FP8, INT8])
@pytest.mark.parametrize("heads,per_head,dc,world,unaligned", SHARDINGS)
def test_head_shard_gather_round_trip(fmt, heads, per_head, dc, world, unaligned):
    """Every rank's head shard carries exactly the scale blocks its rows touch (shared partial blocks included)
    and dequantises as the full weight's rows; the shards concatenated in rank order are the original values
    and scales bit for bit."""
    full = quantize(_random(heads * per_head, dc, world), fmt, torch.float32)
    ref = full.dequant()
    shards = []
    for r in range(world):
        r0, r1 = r * heads // world * per_head, (r + 1) * heads // world * per_head
        s = full.rows(r0, r1)
        if fmt == FP8:
            assert s.scale.shape[0] == -(-r1 // 128) - r0 // 128 and s.row_off == r0 % 128
            assert torch.equal(s.scale, full.scale[r0 // 128: -(-r1 // 128)])
        assert torch.equal(s.dequant(), ref[r0:r1])
        assert s.data.numel() + s.scale.numel() * 4 == matrix_bytes(r1 - r0, dc, 1, fmt, row0=r0)
        shards.append(s)
    if fmt == FP8:
        assert any(s.row_off for s in shards) == unaligned  # boundaries inside a 128-row block or not
    assert _same(cat_rows(shards), full)


@pytest.mark.parametrize("fmt", [FP8, INT8])
def test_column_shards_round_trip(fmt):
    """O is column-sharded: 12 heads × 80 columns over 3 and 6 ranks (boundaries inside 128-column blocks)."""
    full = quantize(_random(200, 12 * 80, 5), fmt, torch.bfloat16)
    for world in (3, 6):
        per = 12 // world * 80
        shards = [full.cols(r * per, (r + 1) * per) for r in range(world)]
        for r, s in enumerate(shards):
            assert torch.equal(s.dequant(), full.dequant()[:, r * per:(r + 1) * per])
        assert _same(cat_cols(shards), full)


@pytest.mark.parametrize("fmt", [FP8, INT8])
def test_linear_on_stored_form(fmt):
    """linear() on the stored form equals the GEMM on the dequantised weight exactly (fp32 and bf16), and the
    dequantised weight is within the format's rounding of the original: fp8 e4m3 ≤ 2^-4 relative per element
    (half the subnormal step near zero), int8 ≤ half a step (row amax / 254)."""
    w = _random(300, 260, 1)
    x = torch.randn(7, 260)
    for dtype in (torch.float32, torch.bfloat16):
        q = quantize(w, fmt, dtype)
        assert torch.equal(linear(x.to(dtype), q), x.to(dtype) @ q.dequant().T)
    q = quantize(w, fmt, torch.float32)
    deq = q.dequant()
    if fmt == INT8:
        assert ((deq - w).abs() <= w.abs().amax(1, keepdim=True) / 254 * (1 + 1e-5)).all()
    else:  # half an e4m3 ulp (2^-4 relative), or half the subnormal step 2^-9 of the block's scale
        s = q.scale.repeat_interleave(128, 0)[:300].repeat_interleave(128, 1)[:, :260]
        assert ((deq - w).abs() <= (w.abs() / 16 + s * 2 ** -10) * (1 + 1e-5)).all()


GLM_LIKE = dict(model_type="deepseek_v3", vocab_size=64, hidden_size=160, intermediate_size=128,
                num_hidden_layers=1, num_attention_heads=8, kv_lora_rank=160, q_lora_rank=136,
                qk_rope_head_dim=8, qk_nope_head_dim=24, v_head_dim=32)  # KV-B 56 rows/head, Q-B 32, O 32 cols


def _getter(cfg, fmt, seed=0):
    sd = {k: _random(*s, seed + i) if len(s) == 2 else torch.ones(s)
          for i, (k, s) in enumerate(sorted(expected_shapes(cfg).items()))}
    return lambda k: quantize(sd[k], fmt, torch.float32) if k.endswith("proj.weight") or \
        k.endswith("mqa.weight") else sd[k]


@pytest.mark.parametrize("fmt", [FP8, INT8])
@pytest.mark.parametrize("world", [2, 4, 8])
def test_projection_all_gather_payload(fmt, world):
    """pack_shard of every rank, concatenated as the all-gather delivers it, unpacks to the replicated weights
    bit for bit; slice_heads of those gives each rank's shard back; the payload per rank is what the memory
    model and the manifest count (projection_shard_bytes)."""
    cfg = model_config_from_dict(GLM_LIKE)
    get = _getter(cfg, fmt)
    full = attention_from_full(cfg, get, "model.layers.0.self_attn.", range(8))
    per = 8 // world
    shards = [attention_from_full(cfg, get, "model.layers.0.self_attn.", range(r * per, (r + 1) * per))
              for r in range(world)]
    packed = [wt.pack_shard(s) for s in shards]
    for r, p in enumerate(packed):
        assert p.numel() == projection_shard_bytes(cfg, range(r * per, (r + 1) * per), 4, fmt)
    got = wt.unpack_full(shards[1], torch.cat(packed), world, 8)
    for a, b in ((got.q_b, full.q_b), (got.kv_b, full.kv_b), (got.o, full.o)):
        assert _same(a, b)
    assert got.qkv_a is shards[1].qkv_a and got.heads == range(8)  # common state carried, not copied
    for r in range(world):
        back = wt.slice_heads(got, range(r * per, (r + 1) * per), cfg.qk_head_dim)
        for a, b in ((back.q_b, shards[r].q_b), (back.kv_b, shards[r].kv_b), (back.o, shards[r].o)):
            assert _same(a, b)
        assert torch.equal(back.uk(), shards[r].uk()) and torch.equal(back.uv_t(), shards[r].uv_t())


def test_switch_keeps_one_stacked_qkv_a():
    """A switch carries the stacked [Q-A ; KV-A] over (rebuilt, the next step would stack a second copy while
    the old views keep the first alive). Plain weights, a round trip through all-gather and discard: resident
    bytes unchanged and the stack is the same tensor."""
    cfg = model_config_from_dict(GLM_LIKE)
    sd = {k: _random(*s, i) if len(s) == 2 else torch.ones(s)
          for i, (k, s) in enumerate(sorted(expected_shapes(cfg).items()))}
    shards = [attention_from_full(cfg, sd.__getitem__, "model.layers.0.self_attn.", range(r * 4, r * 4 + 4))
              for r in range(2)]
    before = resident_bytes(shards[0])
    full = wt.unpack_full(shards[0], torch.cat([wt.pack_shard(s) for s in shards]), 2, 8)
    back = wt.slice_heads(full, range(0, 4), cfg.qk_head_dim)
    assert back.qkv_a is shards[0].qkv_a
    assert resident_bytes(back) == before
    assert resident_bytes(dataclasses.replace(back, qkv_a=None)) == before  # the views alone keep the stack
