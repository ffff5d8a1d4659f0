"""The DSA lightning indexer (DeepSeek-V3.2, GLM-5.x): its weights, per-token keys, scores and top-k selection.

Per layer with an indexer (``indexer_types[l] == "full"``; a "shared" layer reuses the previous full layer's
selection and has no indexer weights), with H_i = index_n_heads, d_i = index_head_dim, d_r = the rotated part:

- key of token t:    k(t) = rope(LayerNorm(W_k · x_t)) [d_i]   — one key per token, stored in the paged cache
- queries of row s:  q_h(s) = rope(W_qb · q_resid_s) [H_i, d_i] (q_resid = normed Q-A output, as MLA's Q-B input)
- head weights:      w_h(s) = (W_w · x_s)_h · H_i^-1/2   (W_w kept in fp32, as the checkpoints do)
- score:             I(s, t) = Σ_h w_h(s) · ReLU(q_h(s) · k(t) · d_i^-1/2)
- selection:         the top-k positions t ≤ s by I(s, t) (every visible position when fewer than k)

The rope is applied to the first d_r dims of q and k, half-split for DeepSeek-V3.2 and interleaved for GLM-5.x
(transformers' DeepseekV32Indexer / GlmMoeDsaIndexer); d_r = 0 is a NoPE indexer. All math is fp32. The
reference's Hadamard rotation (orthogonal: dot products unchanged) and FP8 scoring (storage precision) are
dropped; the cache stores the keys in its KV dtype. The functions take plain tensors, so every layout calls them
on the rows it holds.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from splash.models.linear import linear
from splash.models.rope import rotate_torch

K_NORM_EPS = 1e-6  # the indexer's k LayerNorm epsilon (fixed in the reference implementations)


@dataclass
class IndexerWeights:
    wq_b: torch.Tensor          # [H_i * d_i, q_lora_rank]  (or a quantised weight: splash.models.qweight)
    wk: torch.Tensor            # [d_i, hidden]
    k_norm: torch.Tensor        # [d_i] LayerNorm weight
    k_norm_bias: torch.Tensor   # [d_i] LayerNorm bias
    weights_proj: torch.Tensor  # [H_i, hidden] fp32
    n_heads: int
    head_dim: int
    rope_dim: int               # leading dims of q and k that are rotated (0: NoPE indexer)
    interleave: bool            # rope pairs (x0, x1), (x2, x3)... (GLM) or halves (DeepSeek-V3.2)

    @property
    def softmax_scale(self) -> float:
        return self.head_dim ** -0.5


def indexer_shapes(prefix: str, hidden: int, q_in: int, n_heads: int, head_dim: int) -> dict[str, tuple[int, ...]]:
    """Checkpoint tensor name -> shape the config implies (prefix e.g. "model.layers.0.self_attn.indexer.")."""
    return {prefix + "wq_b.weight": (n_heads * head_dim, q_in), prefix + "wk.weight": (head_dim, hidden),
            prefix + "k_norm.weight": (head_dim,), prefix + "k_norm.bias": (head_dim,),
            prefix + "weights_proj.weight": (n_heads, hidden)}


def load_indexer(get, prefix: str, n_heads: int, head_dim: int, rope_dim: int, interleave: bool) -> IndexerWeights:
    """One layer's indexer weights from a tensor getter ``get(name) -> tensor`` (common state: every rank holds
    all of it in every layout)."""
    wp = get(prefix + "weights_proj.weight")
    wp = wp.float() if isinstance(wp, torch.Tensor) else wp.dequant().float()
    return IndexerWeights(wq_b=get(prefix + "wq_b.weight"), wk=get(prefix + "wk.weight"),
                          k_norm=get(prefix + "k_norm.weight").float(), k_norm_bias=get(prefix + "k_norm.bias").float(),
                          weights_proj=wp, n_heads=n_heads, head_dim=head_dim, rope_dim=rope_dim, interleave=interleave)


def _rotate(w: IndexerWeights, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rope on the first `rope_dim` dims of x [n, ..., d_i]; cos/sin [n, rope_dim / 2]."""
    if w.rope_dim == 0:
        return x
    return torch.cat([rotate_torch(x[..., :w.rope_dim], cos, sin, w.interleave), x[..., w.rope_dim:]], dim=-1)


def indexer_keys(w: IndexerWeights, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Hidden states x [n, hidden] (the layer's normed input) -> indexer keys [n, d_i] fp32."""
    k = torch.nn.functional.layer_norm(linear(x, w.wk).float(), (w.head_dim,), w.k_norm, w.k_norm_bias,
                                       K_NORM_EPS)
    return _rotate(w, k, cos, sin)


def indexer_queries(w: IndexerWeights, q_resid: torch.Tensor, x: torch.Tensor, cos: torch.Tensor,
                    sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """q_resid [n, q_lora] (normed Q-A output) and x [n, hidden] -> (queries [n, H_i, d_i] fp32,
    head weights [n, H_i] fp32 including the H_i^-1/2 factor)."""
    n = x.shape[0]
    q = linear(q_resid, w.wq_b).float().view(n, w.n_heads, w.head_dim)
    hw = (x.float() @ w.weights_proj.T) * (w.n_heads ** -0.5)
    return _rotate(w, q, cos, sin), hw


def index_scores(q: torch.Tensor, head_w: torch.Tensor, keys: torch.Tensor, scale: float) -> torch.Tensor:
    """I(s, t) = Σ_h w_h(s) ReLU(q_h(s) · k(t) × scale) for groups of query rows against their keys.

    q [G, Q, H, d], head_w [G, Q, H], keys [G, T, d] -> scores [G, Q, T] fp32 (scale: ``softmax_scale``)."""
    G, Q, H, d = q.shape
    s = torch.bmm(q.reshape(G, Q * H, d).float(), keys.float().transpose(1, 2)).mul_(scale).relu_()
    return torch.bmm(head_w.reshape(G * Q, 1, H).float(), s.view(G * Q, H, -1)).view(G, Q, -1)


_LOW = 1 << 32                              # positions go in the low 32 bits of an order key
NO_KEY = torch.iinfo(torch.int64).min       # the order key of an invisible position


def order_keys(scores: torch.Tensor, positions: torch.Tensor, visible: torch.Tensor) -> torch.Tensor:
    """int64 keys of the selection's total order: higher score first, the earlier position among exactly equal
    scores (so a tie breaks the same way whatever order the positions come in: one rank's history, a CP rank's
    shard, the all-gathered candidates). Invisible positions get NO_KEY. scores fp32, positions < 2^32."""
    s = scores.float() + 0.0                                    # -0.0 -> +0.0: equal scores, equal keys
    b = s.view(torch.int32)
    ordered = (b ^ ((b >> 31) & 0x7FFFFFFF)).long()             # monotonic in the float's value
    key = ordered * _LOW + (_LOW - 1 - positions.long())
    return key.masked_fill(~visible, NO_KEY)


def select_topk_keys(scores: torch.Tensor, visible: torch.Tensor, k: int,
                     positions: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Top-k of `scores` [..., T] among `visible` [..., T] -> (indices [..., min(k, T)] into T, valid, their order
    keys: NO_KEY where invalid; what a CP rank sends as candidates, splash.attention.dsa.global_topk). A row with
    fewer than k visible positions gets all of them and invalid padding. Exact ties break towards the earlier
    position (`positions` [..., T], broadcastable; default: T's order) by order_keys, not as torch.topk happens
    to (transformers' indexer uses it)."""
    kk = min(k, scores.shape[-1])
    if positions is None:
        positions = torch.arange(scores.shape[-1], device=scores.device)
    keys, idx = order_keys(scores, positions.expand_as(scores), visible).topk(kk, dim=-1)
    return idx, visible.gather(-1, idx), keys
