"""Absorbed MLA building blocks shared by every layout (torch reference, fp32 math): per head h,
q̃_h = [q_nope_h · W_UK_h ; q_rope_h], score_h(t) = q̃_h · [c_kv(t) ; k_rope(t)] × scale, õ_h = Σ_t p_h(t) c_kv(t),
LSE_h = log Σ_t exp(score_h(t)), o_h = õ_h · W_UV_hᵀ, then O. The `parts` argument of the fused functions names
which outputs of the CPU kernel `mla_project` they stand for.
"""
from __future__ import annotations

import torch

from splash.attention import dsa, kpool
from splash.models.config import ModelConfig
from splash.models.linear import linear, matmul
from splash.models.norm import rms_norm
from splash.models.rope import Rope, rotate
from splash.models.weights import AttnWeights
from splash.native import fast_path


def _absorb(cfg: ModelConfig, rope: Rope, w: AttnWeights, qa: torch.Tensor, cos: torch.Tensor,
            sin: torch.Tensor) -> torch.Tensor:
    """Q-A output (normed; x itself without q_lora) [n, q_in] -> absorbed queries q̃ [n, H_local, d_c + d_r]."""
    q = linear(qa, w.q_b).view(qa.shape[0], len(w.heads), cfg.qk_head_dim)
    return _absorb_heads(q, w.uk(), cfg.qk_nope_head_dim, cos, sin, rope.interleave)   # w.uk(): dequantised once


@fast_path("absorb_rope")
def _absorb_heads(q: torch.Tensor, uk: torch.Tensor, d_nope: int, cos: torch.Tensor, sin: torch.Tensor,
                  interleave: bool) -> torch.Tensor:
    """Q-B's output [n, H, d_nope + d_r] and W_UK [H, d_nope, d_c] -> q̃ = [q_nope · W_UK ; RoPE(q_rope)]."""
    q_nope, q_pe = q.split([d_nope, q.shape[2] - d_nope], dim=-1)
    q_lat = matmul(q_nope.transpose(0, 1), uk).transpose(0, 1)  # [n, H, d_c]; bmm beats einsum here
    return torch.cat([q_lat, rotate(q_pe, cos, sin, interleave)], dim=-1)


def _latent(cfg: ModelConfig, rope: Rope, w: AttnWeights, kv: torch.Tensor, cos: torch.Tensor,
            sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """KV-A output [n, d_c + d_r] -> (normed latent c_kv [n, d_c], rotated k_rope [n, d_r])."""
    c, k_pe = kv.split([cfg.kv_lora_rank, cfg.qk_rope_head_dim], dim=-1)
    return rms_norm(c, w.kv_a_norm, cfg.rms_norm_eps), rotate(k_pe, cos, sin, rope.interleave)


def latent_query(cfg: ModelConfig, rope: Rope, w: AttnWeights, x: torch.Tensor, cos: torch.Tensor,
                 sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [n, hidden] -> (absorbed queries q̃ [n, H_local, d_c + d_r] for this rank's heads, the normed Q-A output
    [n, q_lora] the DSA indexer reads)."""
    return tuple(_query(cfg, rope, w, x, cos, sin, parts=1))


@fast_path("mla_project")
def _query(cfg: ModelConfig, rope: Rope, w: AttnWeights, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
           parts: int) -> tuple[torch.Tensor, torch.Tensor]:
    qa = x if w.q_a is None else rms_norm(linear(x, w.q_a), w.q_a_norm, cfg.rms_norm_eps)
    return _absorb(cfg, rope, w, qa, cos, sin), qa


@fast_path("mla_project")
def _new_latent(cfg: ModelConfig, rope: Rope, w: AttnWeights, x: torch.Tensor, cos: torch.Tensor,
                sin: torch.Tensor, parts: int) -> tuple[torch.Tensor, torch.Tensor]:
    return _latent(cfg, rope, w, linear(x, w.kv_a), cos, sin)


def new_latent_kv(cfg: ModelConfig, rope: Rope, w: AttnWeights, x: torch.Tensor, cos: torch.Tensor,
                  sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [n, hidden] -> (c_kv [n, d_c] normed latent, k_rope [n, d_r] rotated)."""
    return tuple(_new_latent(cfg, rope, w, x, cos, sin, parts=2))


def query_and_latent(cfg: ModelConfig, rope: Rope, w: AttnWeights, x: torch.Tensor, cos: torch.Tensor,
                     sin: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """`latent_query` and `new_latent_kv` of the same rows, with Q-A and KV-A as one GEMM on [Q-A ; KV-A]
    -> (q̃, c_kv, k_rope, normed Q-A output)."""
    if w.q_a is None:
        q, qa = latent_query(cfg, rope, w, x, cos, sin)
        return q, *new_latent_kv(cfg, rope, w, x, cos, sin), qa
    return tuple(_query_and_latent(cfg, rope, w, x, cos, sin, parts=3))


@fast_path("mla_project")
def _query_and_latent(cfg: ModelConfig, rope: Rope, w: AttnWeights, x: torch.Tensor, cos: torch.Tensor,
                      sin: torch.Tensor, parts: int) -> tuple[torch.Tensor, ...]:
    qa, kv = linear(x, w.qkv_a).split([w.q_a.shape[0], w.kv_a.shape[0]], dim=-1)
    qa = rms_norm(qa, w.q_a_norm, cfg.rms_norm_eps)
    return (_absorb(cfg, rope, w, qa, cos, sin), *_latent(cfg, rope, w, kv, cos, sin), qa)


def out_projection(w: AttnWeights, o_lat: torch.Tensor) -> torch.Tensor:
    """õ [n, H_local, d_c] -> this rank's partial O output [n, hidden] (sum over ranks for sharded heads)."""
    return linear(_uv_heads(o_lat, w.uv_t()), w.o)


@fast_path("uv_heads")
def _uv_heads(o_lat: torch.Tensor, uv_t: torch.Tensor) -> torch.Tensor:
    """õ [n, H, d_c] and W_UV transposed [H, d_c, d_v] -> O's input [n, H * d_v] (head h: õ_h @ W_UV_hᵀ)."""
    o = matmul(o_lat.to(uv_t.dtype).transpose(0, 1), uv_t)  # [H, n, d_v]
    return o.transpose(0, 1).reshape(o_lat.shape[0], o_lat.shape[1] * uv_t.shape[2])


def store_and_select(r, layer: int, meta, c: torch.Tensor, kpe: torch.Tensor, key_in: tuple, q_in: tuple,
                     cp_comm=None) -> int:
    """Write the new latent KV of the rows this rank stores to the layer's pool layer, then, for a DSA or KPool
    layer, their indexer vectors and the step's selection for the rows it attends (splash.attention.dsa /
    kpool.select_layer: key_in = (x, cos, sin), q_in = (x, q_resid, cos, sin)); -> the pool layer."""
    cl = r.family.pool_layer(layer)
    r.cache.write(cl, meta.write_slots, c, kpe)
    if r.family.index_vectors == 2:   # KPool: an indexer key and pool gate logits per token
        kpool.select_layer(r, layer, cl, meta, key_in[0], q_in[:2], cp_comm)
    elif r.cfg.has_dsa:
        dsa.select_layer(r, layer, meta, key_in, q_in, cp_comm)
    return cl


def attend(kernel, layer: int, q: torch.Tensor, cache, d_c: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Absorbed queries q̃ [n, H, d_c + d_r] of the planned rows -> (õ [n, H, d_c], natural-log LSE [n, H]) over
    this rank's paged cache, through the step's attention kernel (splash.attention.kernels)."""
    return kernel.run(layer, q[..., :d_c], q[..., d_c:], cache)


def merge_partials(o: torch.Tensor, lse: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact combine of partial attention over disjoint key sets: o [R, n, H, d_c], lse [R, n, H] (natural log,
    -inf where a part saw no key) -> (õ [n, H, d_c], LSE [n, H])."""
    total = torch.logsumexp(lse, dim=0)
    safe = torch.where(torch.isfinite(total), total, torch.zeros_like(total))
    w = torch.exp(lse - safe[None])
    return (w[..., None] * o).sum(dim=0), total


def sum_over_ranks(comm, out: torch.Tensor) -> torch.Tensor:
    """Head-sharded layouts (TP, DOP): every rank's partial O output over its heads -> the full output."""
    return comm.all_reduce(out) if comm.size > 1 else out


def merge_over_ranks(comm, o: torch.Tensor, lse: torch.Tensor) -> torch.Tensor:
    """CP: every rank's partial õ [n, H, d_c] / LSE [n, H] over its own positions -> the exact õ over all of them
    (one all-gather of [õ ; LSE] per row, then `merge_partials`)."""
    if comm.size == 1:
        return o
    n, h, dc = o.shape
    parts = comm.all_gather(torch.cat([o.reshape(n, h * dc), lse], dim=1).contiguous()).view(comm.size, n, h * dc + h)
    return merge_partials(parts[..., :h * dc].reshape(-1, n, h, dc), parts[..., h * dc:])[0]
