"""GLM-5.3-Flash (glm5_next text model) on one rank against transformers' Glm5NextForConditionalGeneration.

Variants: index_topk below the contexts (KPool selection matters) and above them (every complete pool is
selected). Comparison: prefill logits against HF's full no-cache forward; greedy tokens against HF's cached
``generate`` — the same way our engine runs (chunked prefill + one-token decode, each query selecting over the
history ≤ its position), so ties in the top-k, were there any, would be broken over the same candidates.
"""
from __future__ import annotations

import dataclasses
import shutil

import pytest
import torch
from hf_glm5_next import QUANT_KEEP, VARIANTS, load_hf_glm5_next, make_tiny_glm5_next
from hf_models import hf_greedy, hf_logits, random_prompts
from quant_ckpt import write_quantized
from safetensors.torch import load_file, save_file

from splash.attention.batch import StepBatch, StepRequest
from splash.engine.llm import LLM
from splash.engine.runner import ModelRunner
from splash.engine.sampling import SamplingParams
from splash.kv import quant
from splash.models.config import ConfigError, load_model_config, model_config_from_dict
from splash.models.loader import open_checkpoint
from splash.models.qweight import QuantWeight, RowStack, is_quantized
from splash.models.weights import resident_bytes
from splash.switching.manifest import ReqState, plan_switch


@pytest.fixture(scope="module")
def glm5(tmp_path_factory):
    root = tmp_path_factory.mktemp("glm5")
    cache: dict[str, tuple] = {}

    def get(variant: str):
        if variant not in cache:
            d = make_tiny_glm5_next(root / variant, **VARIANTS[variant])
            cache[variant] = (d, load_hf_glm5_next(d))
        return cache[variant]
    return get


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_prefill_logits_match_hf(variant, glm5, comm):
    path, hf = glm5(variant)
    prompt = random_prompts([37], seed=1)[0]
    cfg, get = open_checkpoint(path)
    runner = ModelRunner(cfg, get, comm, "tp", "float32", 4, 64)
    n = len(prompt)
    ours = runner.step(StepBatch([StepRequest("a", 0, n)], torch.tensor(prompt), torch.arange(n), list(range(n))))
    assert rel_err(ours, hf_logits(hf, prompt)) < 1e-4


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_greedy_matches_hf_generate(variant, glm5, comm):
    """32 greedy tokens, chunked prefill (16-token budget), up to 4 running requests, blocks of 4."""
    path, hf = glm5(variant)
    prompts = random_prompts([3, 40, 17], seed=3)
    ref = hf_greedy(hf, prompts, 32)
    llm = LLM(str(path), block_size=4, max_num_batched_tokens=16, max_num_seqs=4, comm=comm)
    outs = llm.generate(prompts, SamplingParams(max_tokens=32, temperature=0, ignore_eos=True))
    assert [o.token_ids for o in outs] == ref
    bm = llm.runner.bm   # (the prefix cache is on: blocks no request holds may stay cached)
    assert not bm.requests() and bm.num_free + bm.num_evictable == bm.num_blocks
    assert not llm.runner.states.requests()


def test_config_fields(glm5):
    cfg = load_model_config(glm5("topk_low")[0])
    hy = cfg.hybrid
    assert cfg.model_type == "glm5_next" and cfg.qk_rope_head_dim == 0 and cfg.index_topk == 8
    assert [cfg.is_linear_layer(i) for i in range(4)] == [True, False, False, True]
    assert [cfg.is_moe_layer(i) for i in range(4)] == [False, True, True, True]
    assert hy.indexer_types == ("full", "full", "shared", "full") and hy.index_kpool == 4 and hy.hc_mult == 4


def test_config_errors():
    base = dict(model_type="glm5_next", vocab_size=8, hidden_size=8, intermediate_size=8, num_hidden_layers=2,
                num_attention_heads=2, kv_lora_rank=4, q_lora_rank=4, qk_rope_head_dim=0, qk_nope_head_dim=4,
                v_head_dim=4, index_topk=8, index_kpool=4)
    model_config_from_dict({"text_config": base, "model_type": "glm5_next"})
    with pytest.raises(ConfigError, match="index_topk"):
        model_config_from_dict({**base, "index_topk": 6})
    with pytest.raises(ConfigError, match="indexer_types"):
        model_config_from_dict({**base, "layer_types": ["linear_attention", "indexed_attention"],
                                "indexer_types": ["full", "shared"]})
    with pytest.raises(ConfigError, match="qk_rope_head_dim"):
        model_config_from_dict({**base, "qk_rope_head_dim": 8})


def test_manifest_moves_recurrent_state(glm5):
    """TP → DP-attn on 2 ranks: each owner gathers the other rank's KDA head half of its requests; DP-attn →
    DOP scatters halves; TP ↔ DOP keeps (both head-sharded)."""
    cfg = load_model_config(glm5("topk_low")[0])
    reqs = {"a": ReqState(10, 0), "b": ReqState(5, 1), "new": ReqState(0, 0)}
    m = plan_switch("tp", "dp_attn", cfg, 2, reqs, 4, 4, "float32")
    owners = m.owners
    moves = {(mv.req, mv.h0, mv.h1, mv.src_rank, mv.dst_rank) for mv in m.state_moves}
    assert moves == {(r, h, h + 4, 1 - owners[r], owners[r]) for r in ("a", "b")
                     for h in ((4,) if owners[r] == 0 else (0,))}
    assert m.action("recurrent_state") == "all_to_all" and m.action("linear_proj") == "all_gather"
    dp = {"a": ReqState(10, 0), "b": ReqState(5, 1)}
    m = plan_switch("dp_attn", "dop", cfg, 2, dp, 4, 4, "float32")
    assert {(mv.req, mv.h0, mv.src_rank, mv.dst_rank) for mv in m.state_moves} == {("a", 4, 0, 1), ("b", 0, 1, 0)}
    m = plan_switch("tp", "dop", cfg, 2, dp, 4, 4, "float32")
    assert m.state_moves == () and m.action("recurrent_state") == "keep"
    # totals count only what moves: KV blocks × the 2 MLA layers' block bytes (keys in the full-indexer one only),
    # not the per-layer figure × all 4 layers; plus the KDA state heads (bytes really sent: switch_worker states)
    from splash.layouts.memory import kv_block_bytes
    m = plan_switch("dp_attn", "tp", cfg, 2, dp, 4, 4, "float32")
    blk = kv_block_bytes(cfg, "float32", 4)
    assert blk < m.kv_block_bytes_layer * 2
    for r in range(2):
        n = sum(mv.dst_rank == r for mv in m.moves)
        heads = sum(mv.h1 - mv.h0 for mv in m.state_moves if mv.dst_rank == r)
        assert n and m.kv_recv_total[r] == n * blk and m.weight_recv_total[r] == 0
        assert m.total_recv_bytes[r] == n * blk + heads * m.state_bytes_per_head > n * blk


@pytest.mark.parametrize("kv_dtype", ["float32", "bfloat16", "fp8_e4m3", "int8"])
def test_pool_equals_memory_model(kv_dtype, glm5, comm):
    """One pool layer per MLA layer: the latent (no rope key) and, in the full-indexer layer only, the KPool
    key + pool gate logits per token in the KV dtype's form (FP8/INT8 + an fp32 scale per 128, as DSA's keys);
    the allocated bytes equal the memory model's per layer and per block, and the engine's capacity uses them."""
    from splash.engine.llm import LLM
    from splash.layouts.memory import kv_block_bytes, kv_bytes_per_token_layer

    path = glm5("topk_low")[0]
    cfg, get = open_checkpoint(path)
    runner = ModelRunner(cfg, get, comm, "tp", kv_dtype, 4, 37)
    c = runner.cache
    assert c.num_layers == 2 and [c.ikey[j] is not None for j in range(2)] == [True, False]  # layer 2 is shared
    assert c.nbytes() == kv_block_bytes(cfg, kv_dtype, 4) * 37
    for layer, j in runner.family.pool_layers.items():
        assert c.block_bytes(j) == kv_bytes_per_token_layer(cfg, kv_dtype, layer) * 4
    assert kv_bytes_per_token_layer(cfg, kv_dtype, 0) == 0  # KDA layer: per-request state instead
    keys = {"float32": 2 * 16 * 4, "bfloat16": 2 * 16 * 2, "fp8_e4m3": 2 * (16 + 4), "int8": 2 * (16 + 4)}[kv_dtype]
    assert kv_bytes_per_token_layer(cfg, kv_dtype, 1) - kv_bytes_per_token_layer(cfg, kv_dtype, 2) == keys
    if quant.is_quantized(kv_dtype):
        assert c.ikey[0].dtype == c.ckv[0].dtype and c.iscale[0].shape[-1] == 2  # key and gates scaled apart
        llm = LLM(str(path), kv_cache_dtype=kv_dtype, kv_cache_memory_bytes=1 << 18, block_size=4, max_num_seqs=4,
                  comm=comm)
        blk = kv_block_bytes(cfg, kv_dtype, 4)
        assert blk == llm.runner.cache.nbytes() // llm.runner.cache.num_blocks
        assert llm.runner.cache.num_blocks == max(llm.engine.ledger.capacity.values())


def test_memory_model_counts_state(glm5, comm):
    """The KDA state the runner holds per request equals the memory model's, per layout; capacity reserves it."""
    from splash.layouts.memory import kv_block_bytes, kv_capacity_tokens, recurrent_state_bytes

    path = glm5("topk_low")[0]
    cfg, get = open_checkpoint(path)
    runner = ModelRunner(cfg, get, comm, "tp", "float32", 4, 37)
    prompts = random_prompts([5, 9], seed=5)
    reqs = [StepRequest(f"r{i}", 0, len(p)) for i, p in enumerate(prompts)]
    runner.step(StepBatch.build(reqs, prompts, [True, True]))
    assert runner.states.nbytes() == 2 * recurrent_state_bytes(cfg, "tp", 1)
    # 2 KDA layers x 8 heads x (8*8 + 3*8*3) fp32
    assert recurrent_state_bytes(cfg, "tp", 1) == 2 * 8 * (64 + 72) * 4
    assert recurrent_state_bytes(cfg, "tp", 2) * 2 == recurrent_state_bytes(cfg, "dp_attn", 2)
    assert recurrent_state_bytes(cfg, "dp_attn", 2) == recurrent_state_bytes(cfg, "cp", 2)
    budget = 1 << 20
    plain = kv_capacity_tokens(cfg, "dop", 2, budget, 4, "float32", 4)
    held = kv_capacity_tokens(cfg, "dop", 2, budget, 4, "float32", 4, state_requests=16)
    blk = kv_block_bytes(cfg, "float32", 4)
    assert plain.blocks_per_rank - held.blocks_per_rank == -(-16 * recurrent_state_bytes(cfg, "dop", 2) // blk) \
        or plain.blocks_per_rank - held.blocks_per_rank == 16 * recurrent_state_bytes(cfg, "dop", 2) // blk


def test_state_snapshot_is_the_state_of_its_tokens(glm5, comm):
    """A prefix-cache snapshot taken inside a prefill piece is the KDA state of exactly the tokens before its
    boundary (what a later request computing only those tokens holds), is restored as a copy, goes when dropped, and
    the budget reserves one slot per running request for snapshots when the cache is on."""
    from splash.engine.build import hybrid_states
    from splash.layouts.memory import recurrent_state_bytes
    from splash.kv.recurrent import SnapshotPoint

    cfg, get = open_checkpoint(glm5("topk_low")[0])
    runner = ModelRunner(cfg, get, comm, "tp", "float32", 4, 64)
    prompt = random_prompts([13], seed=3)[0]
    runner.states.plan_snapshots([SnapshotPoint("a", 8, 77)])
    runner.step(StepBatch.build([StepRequest("a", 0, 13)], [prompt], [True]))
    runner.states.plan_snapshots([])
    runner.step(StepBatch.build([StepRequest("b", 0, 8)], [prompt[:8]], [True]))
    torch.testing.assert_close(runner.states.snapshots[77], runner.states.get("b"), rtol=1e-5, atol=1e-6)
    assert sum(t.nbytes for t in runner.states.snapshots.values()) == recurrent_state_bytes(cfg, "tp", 1)
    runner.states.restore("c", 77)
    runner.states.get("c").zero_()
    assert runner.states.snapshots[77].abs().sum() > 0          # the request's copy, not the snapshot itself
    runner.states.drop_snapshots([77])
    with pytest.raises(KeyError, match="no KDA state snapshot"):
        runner.states.restore("d", 77)
    assert hybrid_states(cfg, 16, True) == 32 and hybrid_states(cfg, 16, False) == 16


def _prefill(path, comm, quantization=None, layout="tp"):
    cfg, get = open_checkpoint(path, quantization=quantization)
    runner = ModelRunner(cfg, get, comm, layout, "float32", 4, 64)
    prompt = random_prompts([37], seed=1)[0]
    n = len(prompt)
    return runner, runner.step(StepBatch([StepRequest("a", 0, n)], torch.tensor(prompt), torch.arange(n),
                                         list(range(n)))), prompt


def _check_stored_forms(runner, fmt: str, dense_gates: bool = True) -> None:
    """KDA q/k/v/o, MLA, indexer and FFN/MoE projections quantised; KDA gates (`dense_gates`: else quantised
    too), router and mHC plain."""
    kda_w, mla = runner.weights.layers[0].attn, runner.weights.layers[1]
    assert isinstance(kda_w.qkv, RowStack) and all(isinstance(p, QuantWeight) for p in kda_w.qkv.parts)
    for w in (kda_w.o, mla.attn.q_b, mla.attn.kv_b, mla.attn.o, mla.indexer.wq_b, mla.indexer.wk,
              runner.weights.layers[0].ffn.down):
        assert isinstance(w, QuantWeight) and w.fmt == fmt
    assert is_quantized(mla.ffn.gate_up) and mla.ffn.router.dtype == torch.float32
    for w in (kda_w.f_a, kda_w.f_b, kda_w.g_a, kda_w.g_b, kda_w.b):
        assert isinstance(w, torch.Tensor) == dense_gates
    assert isinstance(mla.hc_attn.fn, torch.Tensor)
    assert runner.weight_quant == fmt


@pytest.mark.parametrize("scheme,keep", [("fp8", QUANT_KEEP), ("w8a8", QUANT_KEEP), ("w8a8", QUANT_KEEP[:1])])
def test_quantized_checkpoint(scheme, keep, glm5, comm, tmp_path, torch_kernels):
    """FP8 block-scaled / compressed-tensors INT8 checkpoints (tests/quant_ckpt.py; KDA gates and the vision
    tower kept dense as QUANT_KEEP says, or the gates quantised too) stay quantised; logits equal the engine on
    the dequantised checkpoint (1e-6) and transformers there (1e-4)."""
    src = glm5("topk_low")[0]
    qdir, ddir = write_quantized(src, tmp_path, scheme, spread_seed=3 if scheme == "fp8" else None, keep=keep)
    runner, logits, prompt = _prefill(qdir, comm)
    _check_stored_forms(runner, "fp8" if scheme == "fp8" else "int8", dense_gates=keep == QUANT_KEEP)
    ref_runner, ref, _ = _prefill(ddir, comm)
    assert torch.allclose(logits, ref, rtol=0, atol=1e-6)
    assert rel_err(logits, hf_logits(load_hf_glm5_next(ddir), prompt)) < 1e-4
    assert resident_bytes(runner.weights) < resident_bytes(ref_runner.weights) / 2


@pytest.mark.parametrize("fmt", ["fp8", "int8"])
def test_quantization_at_load(fmt, glm5, comm, tmp_path, torch_kernels):
    """`quantization=` quantises the plain checkpoint's projections (not KDA's gates); the logits equal the
    engine on exactly those weights dequantised, written as a plain checkpoint."""
    src = glm5("topk_low")[0]
    runner, logits, _ = _prefill(src, comm, fmt)
    _check_stored_forms(runner, fmt)
    _, get = open_checkpoint(src, quantization=fmt)
    sd = {n: (get(n).dequant() if isinstance(get(n), QuantWeight) else t)
          for n, t in load_file(str(src / "model.safetensors")).items()}
    shutil.copytree(src, tmp_path / "ref")
    save_file(sd, str(tmp_path / "ref" / "model.safetensors"), metadata={"format": "pt"})
    assert torch.allclose(logits, _prefill(tmp_path / "ref", comm)[1], rtol=0, atol=1e-6)


def test_family_description(glm5):
    """The hybrid family: pool layers are the MLA layers in order, state rows the KDA layers, KDA heads shard as
    attention heads do, its full-indexer MLA layers keep two vectors per token; a dense family keeps every layer's
    KV in its own pool layer and adds no weights."""
    from splash.models.family import describe
    from splash.models.presets import preset_config

    cfg = load_model_config(glm5("topk_low")[0])
    fam = describe(cfg)
    mla = [i for i in range(cfg.num_hidden_layers) if not cfg.is_linear_layer(i)]
    lin = [i for i in range(cfg.num_hidden_layers) if cfg.is_linear_layer(i)]
    assert mla and lin and fam.recurrent
    assert dict(fam.pool_layers) == {l: j for j, l in enumerate(mla)} and fam.pool_layer(lin[0]) is None
    assert dict(fam.state_rows) == {l: j for j, l in enumerate(lin)} and fam.state_row(mla[0]) is None
    assert (fam.attention_heads, fam.linear_heads) == (cfg.num_attention_heads, cfg.hybrid.linear_num_heads)
    hy = cfg.hybrid
    d, K = hy.linear_head_dim, hy.linear_conv_kernel_dim   # fp32 recurrent [d, d] + conv inputs 3·d·(K−1) a head
    assert fam.linear.state_bytes_per_head == 4 * (d * d + 3 * d * (K - 1)) * len(lin)
    assert fam.index_layers == {i for i in mla if hy.indexer_types[i] == "full"} and fam.index_vectors == 2
    dense = describe(preset_config("tiny-mla"))
    assert not dense.recurrent and dense.linear_heads == 0 and dense.linear is None and not dense.layer_extra
    listed = dataclasses.replace(preset_config("tiny-mla"), eos_token_id=[1, 2])   # built by hand: unhashable
    assert describe(listed).pool_layers == dense.pool_layers
    assert [dense.pool_layer(i) for i in range(dense.num_pool_layers)] == list(range(dense.num_pool_layers))
