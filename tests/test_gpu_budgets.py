"""Budget invariants of the GPU path, checked on CPU for each shipped GPU config (b200, h200, dcu) and an 8-rank
GLM-5.3 and GLM-5.3-Flash at their max batched tokens: the attention kernels' scratch and the vendor workspaces
are inside the device memory budget, the kernel's int32 quantities stay in range (its larger offsets are int64:
tests/test_triton_aot.py), and no attention kernel reads the device from the host per layer."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from test_attention_kernels import SCALE
from test_vendor_kernels import FI_DECODE, _state

import backends
from backends.cuda import flashinfer_mla as fi
from backends.hip import aiter_mla as ai
from splash.attention.kernels.triton_mla import MAX_SPLITS, split_count
from splash.cli import check
from splash.cli.args import build_config
from splash.costmodel.profile import load_profile
from splash.layouts.device_budget import ATTN_SCRATCH_BYTES, device_memory_budget
from splash.engine.runner import resolve_layout_kv_dtypes
from splash.layouts.layout import RankAttention, heads_fit, rank_attention
from splash.sim.presets import load_sim_model

ROOT = Path(__file__).resolve().parents[1]
INT32_MAX = 2**31 - 1


def _shipped() -> list[tuple[str, object, object, int]]:
    """(name, ServeConfig, ModelConfig, ranks): the shipped GPU configs, and GLM-5.3 / -Flash on 8 ranks with
    the h200 config's scheduler (16,384 batched tokens, 512 sequences)."""
    out = []
    for name in ("b200", "h200", "dcu"):
        cfg = build_config(["--config", str(ROOT / "configs" / f"{name}.yaml")])
        world = check._world(cfg, load_profile(cfg.hardware_profile))[0]
        out.append((name, cfg, check._model(cfg)[0], world))
    h200 = out[1][1]
    for preset in ("glm-5.3", "glm-5.3-flash"):
        out.append((f"{preset} x8", h200, load_sim_model(preset).cfg, 8))
    return out


@pytest.mark.parametrize("name,cfg,mcfg,world", _shipped(), ids=lambda v: v if isinstance(v, str) else "")
def test_kernel_scratch_and_workspaces_fit_the_budget(name, cfg, mcfg, world):
    c, s = cfg.cache, cfg.scheduler
    profile = load_profile(cfg.hardware_profile)
    runs = rank_attention(cfg.layout.allowed_layouts, mcfg.num_attention_heads, world,
                          resolve_layout_kv_dtypes(cfg.kv_dtype, c.layout_kv_dtypes))
    dims = (mcfg.kv_lora_rank, mcfg.qk_rope_head_dim)
    ws = backends.attention_workspace_bytes(cfg.attention_backend, runs, min(s.max_num_seqs, s.max_num_batched_tokens),
                                            profile.device_arch, dims, c.block_size)
    worst = backends.attention_workspace_bytes(cfg.attention_backend, runs,
                                               min(s.max_num_seqs, s.max_num_batched_tokens), "", dims, c.block_size)
    assert ws <= worst                                                   # an unknown arch: every arch's paths
    args = (mcfg, world, int(profile.memory_bytes), c.gpu_memory_utilization, 1, "fp8_e4m3", c.block_size,
            s.max_num_batched_tokens, s.max_num_seqs)
    with_ws = device_memory_budget(*args, attention_workspace_bytes=ws)
    without = device_memory_budget(*args)
    # fp8 KV in every case: FlashInfer's FP8 wrapper on SM90 (one workspace, no trtllm-gen's), our Triton kernel
    # on SM100 and the DCU (no vendor workspace)
    assert ws == (fi.WORKSPACE_BYTES if profile.device_arch == "sm_90" else 0), ws
    assert with_ws.kv_blocks > 0
    assert with_ws.scratch_bytes == without.scratch_bytes + ws          # the vendor workspaces are counted
    b = with_ws
    assert b.weight_bytes + b.scratch_bytes + b.graph_bytes + b.switch_headroom_bytes + b.kv_pool_bytes \
        <= b.usable_bytes                                                # and the pool shrank to make room
    assert b.kv_pool_bytes + b.switch_headroom_bytes <= without.kv_pool_bytes + without.switch_headroom_bytes
    heads = mcfg.num_attention_heads
    per_rank = {heads // world if heads_fit("tp", heads, world) else heads, heads}   # TP shard; DP-attn/CP/DOP
    max_len = cfg.model.max_model_len or mcfg.max_position_embeddings
    for h in per_rank:
        for rows, decode_only in ((s.max_num_batched_tokens, False), (s.max_num_seqs, True)):
            splits = split_count(rows, h, mcfg.kv_lora_rank, decode_only, max_len, MAX_SPLITS)   # ≥ any block count
            partials = 0 if splits == 1 else rows * h * splits * (mcfg.kv_lora_rank + 1) * 4
            assert partials <= ATTN_SCRATCH_BYTES, (name, h, rows, splits)
    # what the kernel keeps in int32: token positions and page columns (bounded by the context), tile offsets;
    # row, slot and output offsets are int64 (tests/test_triton_aot.py checks every argument offset)
    assert max_len < INT32_MAX and -(-max_len // c.block_size) < INT32_MAX


MI300X_BYTES = 192 << 30


def _aiter_cases() -> list[tuple[str, object, object, int, int]]:
    """(name, ServeConfig, ModelConfig, ranks, device bytes) for AITER: each shipped config that runs it (none
    names it today: dcu runs Triton), and GLM-5.3 on 8 MI300X (192 GiB) under the hip config with aiter and
    the h200 config's scheduler (512 sequences, 16,384 batched tokens)."""
    out = [(n, cfg, m, w, int(load_profile(cfg.hardware_profile).memory_bytes))
           for n, cfg, m, w in _shipped() if cfg.attention_backend == "aiter"]
    mi300 = build_config(["--config", str(ROOT / "configs" / "dcu.yaml"), "--attention-backend", "aiter",
                          "--max-num-seqs", "512", "--max-num-batched-tokens", "16384"])
    return out + [("glm-5.3 x8 mi300x", mi300, load_sim_model("glm-5.3").cfg, 8, MI300X_BYTES)]


@pytest.mark.parametrize("name,cfg,mcfg,world,device", _aiter_cases(), ids=lambda v: v if isinstance(v, str) else "")
def test_aiter_split_buffers_in_the_budget(name, cfg, mcfg, world, device):
    """mla_decode_fwd's per-call split buffers (fp32 partials and LSE at up to 16 splits, aiter's pick) are
    counted for the step's most decode rows and the widest head launch any allowed layout gives a rank."""
    c, s = cfg.cache, cfg.scheduler
    rows = min(s.max_num_seqs, s.max_num_batched_tokens)
    runs = rank_attention(cfg.layout.allowed_layouts, mcfg.num_attention_heads, world,
                          dict.fromkeys(cfg.layout.allowed_layouts, "bfloat16"))   # AITER reads bf16 KV only
    heads = [run.heads for run in runs]
    ws = backends.attention_workspace_bytes("aiter", runs, rows)
    widest = max(ai.decode_heads("gfx942", h) or 0 for h in heads)
    assert widest and ws == ai.call_buffer_bytes(rows, widest, ai.MAX_KV_SPLITS)
    assert all(ws >= ai.call_buffer_bytes(rows, ai.decode_heads(arch, h), k) for arch in ai.DECODE_HEADS
               for h in heads if ai.decode_heads(arch, h) for k in range(1, ai.MAX_KV_SPLITS + 1))
    args = (mcfg, world, device, c.gpu_memory_utilization, 1, "bfloat16", c.block_size, s.max_num_batched_tokens,
            s.max_num_seqs)
    b = device_memory_budget(*args, attention_workspace_bytes=ws)
    assert b.kv_blocks > 0 and b.scratch_bytes == device_memory_budget(*args).scratch_bytes + ws
    assert b.weight_bytes + b.scratch_bytes + b.graph_bytes + b.switch_headroom_bytes + b.kv_pool_bytes \
        <= b.usable_bytes


def test_sm90_capacity_is_the_pools_real_bytes(monkeypatch):
    """On an SM90 device FlashInfer's pools keep an fp8 layer's rope key in e4m3 (64 B a token a layer, not 128):
    the budget's block is the bytes that pool really allocates, start sizes the pool with it, and --check
    prints that capacity. Off SM90 the rope key stays bf16, and so does the count."""
    from splash.attention import kernels
    from splash.engine.build import kv_blocks_per_layout
    from splash.kv.paged_cache import PagedLatentCache
    from splash.layouts.memory import kv_block_bytes
    from splash.server import startup
    cfg = _shipped()[1][1]                                            # h200: DeepSeek-V3.2, fp8 KV, flashinfer
    mcfg, world, dev = check._model(cfg)[0], 8, int(load_profile("h200").memory_bytes)
    indexed = [i for i in range(mcfg.num_hidden_layers) if mcfg.has_indexer(i)]
    for arch, rope_fp8 in (("sm_90", True), ("sm_100", False)):
        pool = PagedLatentCache(mcfg.num_hidden_layers, 1, 64, mcfg.kv_lora_rank, mcfg.qk_rope_head_dim, "fp8_e4m3",
                                index_dim=mcfg.index_head_dim, index_layers=indexed,
                                rope_fp8=kernels.rope_fp8_pool("flashinfer", arch))
        assert pool.rope_fp8 == rope_fp8 and (pool.kpe[0].element_size() == 1) == rope_fp8
        b = startup.device_budget(cfg, mcfg, world, dev, 0, 1, arch)
        assert b.block_bytes == pool.nbytes()
    bf16_rope = kv_block_bytes(mcfg, "fp8_e4m3", 64)
    assert bf16_rope - pool_sm90_bytes(mcfg) == 64 * mcfg.num_hidden_layers * 64   # 64 B a token a layer

    class H200:                                                       # start on an SM90 rank (splash-serve)
        device = "cuda:0"

        def memory_info(self):
            return dev - (3 << 30), dev
    monkeypatch.setattr(kernels, "device_arch", lambda device: "sm_90")
    budget = startup.kv_budget_bytes(cfg, mcfg, world, H200(), 1)
    assert budget == startup.device_budget(cfg, mcfg, world, dev, 3 << 30, 1, "sm_90").kv_pool_bytes
    assert budget % pool_sm90_bytes(mcfg) == 0
    blocks = kv_blocks_per_layout(mcfg, world, "fp8_e4m3", 64, budget, 1, weight_quant=mcfg.quantization,
                                  rope_fp8=kernels.kv_rope_fp8("flashinfer", "cuda:0"))
    assert blocks["dop"] == budget // pool_sm90_bytes(mcfg) > budget // bf16_rope   # the pool holds it all
    lines, _ = check.report(cfg)
    kv_line = next(line for line in lines if line.startswith("KV "))
    assert "rope key in e4m3" in kv_line


def pool_sm90_bytes(mcfg) -> int:
    from splash.layouts.memory import kv_block_bytes
    return kv_block_bytes(mcfg, "fp8_e4m3", 64, rope_fp8=True)


def test_workspaces_only_for_the_paths_that_run():
    """A vendor workspace is charged only where that vendor's own path choice runs a launch: not for launches our
    Triton kernel takes (fp8 KV on SM100, int8, NoPE on trtllm-gen, CP steps; on AMD: fp8 KV, NoPE dims, Hygon
    archs, pages AITER does not take), and AITER's split buffers at the head launch of the device's own arch."""
    ws, fi_ws = backends.attention_workspace_bytes, fi.WORKSPACE_BYTES

    def runs(*specs):
        return tuple(RankAttention(h, kv, cp) for h, kv, cp in specs)
    tp, cp = runs((16, "bfloat16", False)), runs((128, "bfloat16", True))
    assert ws("flashinfer", tp, 512, "sm_90") == fi_ws                       # FA3 wrapper only
    assert ws("flashinfer", tp, 512, "sm_100") == 2 * fi_ws                  # + trtllm-gen's zeroed one
    assert ws("flashinfer", tp, 512, "sm_100", (512, 0)) == fi_ws            # NoPE: no trtllm-gen decode
    assert ws("flashinfer", tp, 512, "sm_100", page_size=16) == fi_ws        # pages trtllm-gen does not take
    assert ws("flashinfer", runs((16, "fp8_e4m3", False)), 512, "sm_90") == fi_ws
    assert ws("flashinfer", runs((16, "fp8_e4m3", False)), 512, "sm_100") == 0   # Triton there
    assert ws("flashinfer", runs((16, "int8", False)), 512, "") == 0
    assert ws("flashinfer", cp, 512, "sm_100") == 0                          # CP steps run Triton
    assert ws("flashinfer", tp, 512, "") == 2 * fi_ws                        # unknown arch: any
    wide = runs((16, "bfloat16", False), (64, "bfloat16", False))
    assert ws("aiter", wide, 512, "gfx942") == ai.call_buffer_bytes(512, 128)   # 64 heads launch as 128 there
    assert ws("aiter", wide, 512, "gfx950") == ai.call_buffer_bytes(512, 64)
    assert ws("aiter", wide, 512, "") == ai.call_buffer_bytes(512, 128)
    for args in ((wide, 512, "gfx936"), (wide, 512, "gfx90a"), (runs((64, "fp8_e4m3", False)), 512, "gfx942"),
                 (wide, 512, "gfx942", (512, 0)), (wide, 512, "gfx942", (512, 64), 16), (cp, 512, "gfx942"),
                 (wide, 0, "gfx942")):
        assert ws("aiter", *args) == 0, args
    # the shipped DCU config's model (GLM-5.3-Flash: NoPE, fp8 KV) under aiter on MI300X: nothing charged
    from splash.server import startup
    dcu = build_config(["--config", str(ROOT / "configs" / "dcu.yaml"), "--attention-backend", "aiter"])
    mcfg = check._model(dcu)[0]
    a = startup.device_budget(dcu, mcfg, 8, MI300X_BYTES, 0, 1, "gfx942")
    dcu_triton = build_config(["--config", str(ROOT / "configs" / "dcu.yaml")])
    assert a.scratch_bytes == startup.device_budget(dcu_triton, mcfg, 8, MI300X_BYTES, 0, 1, "gfx942").scratch_bytes


def _count_host_reads(monkeypatch) -> list[str]:
    """Record each host read of a tensor's value (.item(), .tolist(), int()/float()/bool() of a tensor) made from
    our attention code (backends/, splash/attention/), by caller."""
    seen: list[str] = []
    ours = (str(ROOT / "backends"), str(ROOT / "splash" / "attention"))
    for meth in ("item", "tolist", "__int__", "__float__", "__bool__", "__index__"):
        real = getattr(torch.Tensor, meth)

        def spy(self, *a, _real=real, _meth=meth, **k):
            f = sys._getframe(1)
            if f.f_code.co_filename.startswith(ours):
                seen.append(f"{Path(f.f_code.co_filename).name}:{f.f_lineno} {_meth}")
            return _real(self, *a, **k)
        monkeypatch.setattr(torch.Tensor, meth, spy)
    return seen


@pytest.mark.parametrize("kernel", ["flashinfer-sm90", "flashinfer-sm90-fp8", "flashinfer-sm100", "aiter", "triton",
                                    "triton-sparse"])
def test_no_host_read_per_layer(monkeypatch, kernel):
    """plan() may read the step's sizes from the device once; run() — once per layer — never does (a host read
    per layer stalls the GPU 61 times a step); on a DSA layer (triton-sparse) neither does the sparse kernel's."""
    from vendor_standins import install_aiter, install_flashinfer
    pytest.importorskip("triton")
    if kernel.startswith("flashinfer"):
        install_flashinfer(monkeypatch)
        k = fi.FlashInferMLAKernel(SCALE, sm_major=10 if kernel.endswith("100") else 9)
        want = {"flashinfer-sm90": "wrapper", "flashinfer-sm90-fp8": "wrapper-fp8", "flashinfer-sm100": "trtllm-gen"}
    elif kernel == "aiter":
        install_aiter(monkeypatch, "gfx942")
        k = ai.AiterMLAKernel(SCALE, arch="gfx942")
    else:
        from splash.attention.kernels.triton_mla import TritonMLAKernel
        k = TritonMLAKernel(SCALE)
    kv = "fp8_e4m3" if kernel.startswith("triton") or kernel == "flashinfer-sm90-fp8" else "bfloat16"
    cache, _, _, _, meta, q = _state(kv, FI_DECODE[3], 16, rope_fp8=kernel.endswith("fp8"))
    if kernel == "triton-sparse":
        from test_attention_kernels import select_slots
        select_slots(meta, 20)
    reads = _count_host_reads(monkeypatch)
    k.plan(meta)
    k.run(0, q[..., :512], q[..., 512:], cache)     # the step's first layer may build per-step state
    first = list(reads)
    assert 1 <= len(first) <= 2, first             # the once-per-step read is seen (the spy works)
    for _ in range(3):                               # every further layer: none
        k.run(0, q[..., :512], q[..., 512:], cache)
    assert reads == first, reads[len(first):]
    if kernel.startswith("triton"):
        assert set(k.launches) == {"mla_sparse" if kernel == "triton-sparse" else "mla_split", "mla_merge"}
    if kernel.startswith("flashinfer"):
        assert k.paths == {want[kernel]: 4}                # the vendor path ran (not the fallback)
