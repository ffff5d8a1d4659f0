"""DSA models (DeepSeek-V3.2, GLM-5.x) on one rank against transformers' DeepseekV32ForCausalLM /
GlmMoeDsaForCausalLM: prefill logits and greedy tokens, with top-k below the context (sparse: the indexer's
selection decides what MLA attends), above it (dense), and with GLM's "shared" indexer layers.

How the comparison is made: prefill logits are compared with transformers' full (no-cache) forward — both
select, for each row s, the top-k of the positions t <= s. Greedy tokens are compared with transformers'
cached `generate`, whose decode step scores the new token against the cached indexer keys exactly as ours does;
its full forward over the generated sequence would compute the same sets except at exact score ties (where
torch.topk's order over a different layout of the scores may break them differently). The tiny models use 16
indexer heads, so a tie (which needs every head's ReLU to vanish, or a coincidence) does not occur in them
unless the zero-embedding pad token (258) is fed or generated: its layer-0 indexer query is 0, every key scores 0,
and splash then takes the earliest positions (splash.models.indexer.order_keys) where transformers' torch.topk
picks its own; these prompts never reach it (checked; test_switching's block-16 case covers ties, against one rank).
"""
from __future__ import annotations

import dataclasses

import pytest
import torch
from hf_models import DSA_VARIANTS, hf_greedy, hf_logits, random_prompts

from splash.attention.batch import StepBatch, StepRequest
from splash.engine.runner import ModelRunner
from splash.models.loader import open_checkpoint

RTOL = 1e-4


def rel_err(ours: torch.Tensor, ref: torch.Tensor) -> float:
    return float((ours - ref).abs().max() / ref.abs().max())


def make_runner(path, comm, kv_dtype="float32", block_size=4, num_blocks=64, attention_backend="torch",
                **cfg_changes) -> ModelRunner:
    cfg, get = open_checkpoint(path)
    return ModelRunner(dataclasses.replace(cfg, **cfg_changes), get, comm, "tp", kv_dtype, block_size, num_blocks,
                       attention_backend=attention_backend)


@pytest.mark.parametrize("variant", sorted(DSA_VARIANTS))
def test_prefill_logits_match_hf(variant, tiny_ckpt, hf_ref, comm):
    prompt = random_prompts([29], seed=1)[0]
    runner = make_runner(tiny_ckpt(variant), comm)
    n = len(prompt)
    ours = runner.step(StepBatch([StepRequest("a", 0, n)], torch.tensor(prompt), torch.arange(n), list(range(n))))
    assert rel_err(ours, hf_logits(hf_ref(variant), prompt)) < RTOL


@pytest.mark.parametrize("variant", ["v32_sparse", "glm_sparse"])
def test_triton_sparse_kernel_prefill_logits_match_hf(variant, tiny_ckpt, hf_ref, comm):
    """The engine on `attention_backend="triton"` (interpreter): every layer of the prefill is sparse (top-k 8 <
    29 positions), attended by the Triton sparse kernel over an fp32 pool, and the logits are transformers'."""
    pytest.importorskip("triton")
    prompt = random_prompts([29], seed=1)[0]
    runner = make_runner(tiny_ckpt(variant), comm, attention_backend="triton")
    n = len(prompt)
    ours = runner.step(StepBatch([StepRequest("a", 0, n)], torch.tensor(prompt), torch.arange(n), list(range(n))))
    assert runner.attn.name == "triton" and runner.attn.launches == {"mla_sparse": runner.cfg.num_hidden_layers}
    assert rel_err(ours, hf_logits(hf_ref(variant), prompt)) < RTOL


@pytest.mark.parametrize("variant", sorted(DSA_VARIANTS))
def test_greedy_matches_hf_generate(variant, tiny_ckpt, hf_ref, comm):
    """Two requests batched (one prefill chunked across steps), 32 greedy tokens each, vs HF cached generate."""
    prompts = random_prompts([13, 21], seed=5)
    runner = make_runner(tiny_ckpt(variant), comm)
    seqs = [list(p) for p in prompts]
    reqs = [StepRequest("a", 0, 13), StepRequest("b", 0, 10)]
    logits = runner.step(StepBatch.build(reqs, [seqs[0], seqs[1][:10]], [True, False]))
    seqs[0].append(int(logits[0].argmax()))
    logits = runner.step(StepBatch.build([StepRequest("b", 10, 11)], [seqs[1][10:]], [True]))
    seqs[1].append(int(logits[0].argmax()))
    for _ in range(31):
        reqs = [StepRequest(r, len(s) - 1, 1) for r, s in zip("ab", seqs)]
        logits = runner.step(StepBatch.build(reqs, [[s[-1]] for s in seqs], [True, True]))
        for i, s in enumerate(seqs):
            s.append(int(logits[i].argmax()))
    ref = hf_greedy(hf_ref(variant), prompts, 32)
    assert [s[len(p):] for s, p in zip(seqs, prompts)] == ref


def test_sparse_selection_is_used(tiny_ckpt, comm):
    """With top-k below the context the step metadata carries a per-layer selection (shared layer = its source's),
    and the logits differ from a dense run of the same weights (so the selection matters)."""
    path = tiny_ckpt("glm_sparse")
    prompt = random_prompts([20], seed=2)[0]
    runner = make_runner(path, comm)
    n = len(prompt)
    batch = StepBatch([StepRequest("a", 0, n)], torch.tensor(prompt), torch.arange(n), [n - 1])
    sparse = runner.step(batch)
    sel = runner.executor.meta.sparse
    assert sel[0] is not None and sel[1] is sel[0] and sel[2] is not sel[0]
    assert int(sel[0].valid.sum(-1).max()) == 8
    dense = make_runner(path, comm, index_topk=10 ** 6)
    assert rel_err(sparse, dense.step(batch)) > 1e-3


@pytest.mark.parametrize("kv_dtype", ["bfloat16", "fp8_e4m3"])
def test_indexer_keys_stored_in_kv_dtype(kv_dtype, tiny_ckpt, comm):
    """Indexer keys live in the KV pool's format (FP8 keys + fp32 scale per token under fp8) beside the latent,
    only in layers that run an indexer; the model still follows transformers' greedy tokens closely."""
    runner = make_runner(tiny_ckpt("glm_sparse"), comm, kv_dtype)
    c = runner.cache
    assert c.ikey[1] is None and c.ikey[0] is not None
    if kv_dtype == "fp8_e4m3":
        assert c.ikey[0].dtype == torch.float8_e4m3fn and c.iscale[0].shape[-1] == 1
    else:
        assert c.ikey[0].dtype == torch.bfloat16 and c.iscale[0] is None
    prompt = random_prompts([12], seed=3)[0]
    n = len(prompt)
    runner.step(StepBatch([StepRequest("a", 0, n)], torch.tensor(prompt), torch.arange(n), [n - 1]))
    slots = runner.executor.meta.write_slots
    keys = c.read_index(0, slots)
    assert keys.shape == (n, 16) and torch.isfinite(keys).all() and keys.abs().sum() > 0
