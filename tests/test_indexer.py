"""splash.models.indexer against transformers' DeepseekV32Indexer (half-split rope) and GlmMoeDsaIndexer
(interleaved rope): keys, and the top-k selection of a causal prefill with top-k above and below its length.

The comparison is of selected *sets*: 16 indexer heads make exact score ties (possible only where every
head's ReLU is zero, or by coincidence) vanishingly rare, so both sides pick the same positions."""
from __future__ import annotations

import pytest
import torch

from splash.models.indexer import (NO_KEY, index_scores, indexer_keys, indexer_queries, load_indexer,
                                   select_topk_keys)
from splash.models.rope import Rope

ARCHS = {"deepseek_v32": False, "glm_moe_dsa": True}  # model_type -> indexer rope interleaved


def _hf(model_type: str, topk: int):
    from transformers import DeepseekV32Config, GlmMoeDsaConfig
    from transformers.models.deepseek_v32.modeling_deepseek_v32 import DeepseekV32Indexer, DeepseekV32RotaryEmbedding
    from transformers.models.glm_moe_dsa.modeling_glm_moe_dsa import GlmMoeDsaIndexer, GlmMoeDsaRotaryEmbedding

    kw = dict(hidden_size=64, q_lora_rank=48, qk_rope_head_dim=8, index_n_heads=16, index_head_dim=32,
              index_topk=topk, num_hidden_layers=1, num_attention_heads=4, kv_lora_rank=32,
              qk_nope_head_dim=16, v_head_dim=16, rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    if model_type == "deepseek_v32":
        cfg = DeepseekV32Config(**kw)
        mod, rot = DeepseekV32Indexer(cfg, 0), DeepseekV32RotaryEmbedding(cfg)
    else:
        cfg = GlmMoeDsaConfig(**kw)
        mod, rot = GlmMoeDsaIndexer(cfg, 0), GlmMoeDsaRotaryEmbedding(cfg)
    torch.manual_seed(3)
    with torch.no_grad():
        for p in mod.parameters():
            p.copy_(torch.randn_like(p) * 0.3)
    return cfg, mod.eval(), rot


def _ours(mod, interleave: bool):
    sd = {("idx." + k): v for k, v in mod.state_dict().items()}
    return load_indexer(sd.__getitem__, "idx.", mod.n_heads, mod.head_dim, mod.qk_rope_head_dim, interleave)


@pytest.mark.parametrize("model_type", sorted(ARCHS))
@pytest.mark.parametrize("topk", [7, 64])
def test_topk_matches_hf(model_type, topk):
    from splash.models.config import model_config_from_dict

    cfg, mod, rot = _hf(model_type, topk)
    T = 29
    torch.manual_seed(4)
    x, q_resid = torch.randn(1, T, 64), torch.randn(1, T, 48)
    pos = torch.arange(T)[None]
    causal = torch.ones(T, T, dtype=torch.bool).tril()
    ref = mod(x, q_resid, rot(x, pos), causal[None], pos)[0]            # [T, min(topk, T)] int32
    w = _ours(mod, ARCHS[model_type])
    mc = model_config_from_dict({**cfg.to_dict(), "model_type": "deepseek_v3", "vocab_size": 8,
                                 "intermediate_size": 8})
    cos, sin = Rope(mc).cos_sin(pos[0])
    keys = indexer_keys(w, x[0], cos, sin)
    q, hw = indexer_queries(w, q_resid[0], x[0], cos, sin)
    scores = index_scores(q[None], hw[None], keys[None], w.softmax_scale)[0]
    idx, ok = select_topk_keys(scores, causal, topk)[:2]
    assert idx.shape == ref.shape
    for s in range(T):
        want = {int(t) for t in ref[s] if t <= s}
        assert {int(t) for t, v in zip(idx[s], ok[s]) if v} == want, s
        assert len(want) == min(topk, s + 1)
    i2, ok2, keys = select_topk_keys(scores, causal, topk)
    assert torch.equal(i2, idx) and torch.equal(ok2, ok)
    assert (keys[~ok] == NO_KEY).all() and (keys[ok] != NO_KEY).all()


@pytest.mark.parametrize("model_type", sorted(ARCHS))
def test_keys_match_hf_parts(model_type):
    """k = rope(LayerNorm(W_k x)) with the model's rope convention, checked against HF's own functions."""
    from transformers.models.deepseek_v32 import modeling_deepseek_v32 as v32
    from transformers.models.glm_moe_dsa import modeling_glm_moe_dsa as glm

    cfg, mod, rot = _hf(model_type, 8)
    x = torch.randn(1, 5, 64)
    pos = torch.arange(5)[None]
    cos_f, sin_f = rot(x, pos)
    k = mod.k_norm(mod.wk(x)).unsqueeze(2)
    kr, kp = k.split([8, 24], dim=-1)
    if model_type == "deepseek_v32":
        kr, _ = v32.apply_rotary_pos_emb(kr, kr, cos_f, sin_f, unsqueeze_dim=2)
    else:
        kr, _ = glm.apply_rotary_pos_emb_interleave(kr, kr, cos_f, sin_f, unsqueeze_dim=2)
    ref = torch.cat([kr, kp], dim=-1)[0, :, 0]
    w = _ours(mod, ARCHS[model_type])
    half = cos_f.shape[-1] // 2
    ours = indexer_keys(w, x[0], cos_f[0, :, :half], sin_f[0, :, :half])
    assert torch.allclose(ours, ref, atol=1e-5)


def test_nope_indexer_passes_keys_unrotated():
    d = 16
    w = load_indexer({"p.wq_b.weight": torch.randn(2 * d, 8), "p.wk.weight": torch.randn(d, 12),
                      "p.k_norm.weight": torch.ones(d), "p.k_norm.bias": torch.zeros(d),
                      "p.weights_proj.weight": torch.randn(2, 12)}.__getitem__, "p.", 2, d, 0, True)
    x = torch.randn(3, 12)
    k = indexer_keys(w, x, torch.empty(3, 0), torch.empty(3, 0))
    assert torch.allclose(k, torch.nn.functional.layer_norm(x @ w.wk.T, (d,), eps=1e-6), atol=1e-6)


def test_ties_break_by_position_in_any_order():
    """Exact ties (a zero query scores every key 0; -0.0 equals 0.0) go to the earlier position whatever order
    the positions come in; distinct scores keep their order, negatives included."""
    scores = torch.tensor([[0.0, -0.0, 0.0, 0.0, -1.5, 2.0, 0.0, -0.0],
                           [-3.0, -1.0, -2.0, -1.0, -0.5, -7.0, -1.0, -4.0]])
    visible = torch.ones_like(scores, dtype=torch.bool)
    visible[0, 0] = False
    want = [{5, 1, 2, 3}, {4, 1, 3, 6}]
    shuffled = torch.randperm(8, generator=torch.Generator().manual_seed(3))
    for perm in (torch.arange(8), shuffled, torch.arange(7, -1, -1)):
        idx, ok = select_topk_keys(scores[:, perm], visible[:, perm], 4, positions=perm)[:2]
        assert [set(perm[i[o]].tolist()) for i, o in zip(idx, ok)] == want, perm
    assert torch.equal(select_topk_keys(torch.zeros(1, 23), torch.ones(1, 23, dtype=torch.bool), 8)[0].sort().values,
                       torch.arange(8)[None])
