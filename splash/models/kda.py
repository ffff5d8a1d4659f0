"""KDA (Kimi Delta Attention) linear-attention layers of GLM-5.3-Flash — torch reference, fp32 state math.

Per head h (d = linear_head_dim), for the tokens of one request in order:
  [q ; k ; v] = silu(causal depthwise conv_K([x Wqᵀ ; x Wkᵀ ; x Wvᵀ]))   (conv state: the last K−1 inputs)
  g = lower_bound · sigmoid(exp(A_log_h) · (f_b(f_a(x)) + dt_bias))     per channel (log-decay ≤ 0)
  β = sigmoid(x b_projᵀ)_h;  q ← l2norm(q)/√d,  k ← l2norm(k)
  S ← S · exp(g)[:, None];  S ← S + k (β (v − kᵀS))ᵀ;  o = qᵀ S          (recurrent state S [d, d])
  out = (RMSNorm(o) · sigmoid(g_b(g_a(x)))) Woᵀ.
A prefill (several rows of a request) runs the recurrence chunk-parallel (`chunk_recurrence`, UT transform),
a decode row token by token (`_recurrence`, also the chunked form's test reference).
Every quantity is per head, so a rank holding heads H_r computes exactly their part; O over H_r is a partial
sum (all-reduced by the caller). A request's state — S for its heads and the conv inputs of its channels —
is one fp32 tensor [H_r, d·d + 3·d·(K−1)] per layer (splash.kv.recurrent), the same bytes in every layout.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from splash.models.linear import linear
from splash.models.qweight import RowStack, is_quantized, owned, take_cols, take_rows

CHUNK = 16  # tokens per chunk of the chunk-parallel prefill (`chunk_recurrence`); 1: prefill token by token too


@dataclass
class KDAWeights:
    """Plain tensors, or QuantWeights of the head rows / columns (splash.models.qweight); conv, dt_bias, A_log and
    o_norm stay plain."""
    qkv: torch.Tensor       # [3 * H_l * d, hidden]: q, k, v rows of the local heads (quantised: RowStack [q; k; v])
    conv: torch.Tensor      # [3, H_l * d, K] fp32 depthwise conv taps (q, k, v channels of the local heads)
    f_a: torch.Tensor       # [d, hidden] (common)
    f_b: torch.Tensor       # [H_l * d, d]
    dt_bias: torch.Tensor   # [H_l * d] fp32
    a_log: torch.Tensor     # [H_l] fp32
    b: torch.Tensor         # [H_l, hidden]
    g_a: torch.Tensor       # [d, hidden] (common)
    g_b: torch.Tensor       # [H_l * d, d]
    o_norm: torch.Tensor    # [d] (common)
    o: torch.Tensor         # [hidden, H_l * d]
    heads: range
    head_dim: int

    @property
    def num_heads(self) -> int:
        return len(self.heads)


def kda_from_full(get, prefix: str, heads: range, head_dim: int) -> KDAWeights:
    """A rank's KDA weights for `heads` from a full-tensor getter (disk names of transformers' Glm5Next)."""
    d, h0, h1 = head_dim, heads.start * head_dim, heads.stop * head_dim

    def rows(name: str) -> torch.Tensor:
        return take_rows(get(prefix + name), h0, h1)

    q, k, v = (rows(f"{c}_proj.weight") for c in "qkv")
    qkv = RowStack([q, k, v]) if any(is_quantized(t) for t in (q, k, v)) else torch.cat([q, k, v])
    conv = torch.stack([get(prefix + f"{c}_conv1d.weight")[h0:h1, 0].float() for c in "qkv"])
    return KDAWeights(qkv=qkv, conv=conv.contiguous(), f_a=get(prefix + "f_a_proj.weight"),
                      f_b=rows("f_b_proj.weight"), dt_bias=rows("dt_bias").float(),
                      a_log=owned(get(prefix + "A_log")[heads.start:heads.stop].float()),
                      b=take_rows(get(prefix + "b_proj.weight"), heads.start, heads.stop),
                      g_a=get(prefix + "g_a_proj.weight"), g_b=rows("g_b_proj.weight"),
                      o_norm=get(prefix + "o_norm.weight"), o=take_cols(get(prefix + "o_proj.weight"), h0, h1),
                      heads=heads, head_dim=d)


def state_width(head_dim: int, conv_kernel: int) -> int:
    """fp32 values of one head's state: recurrent [d, d] then conv inputs [3, d, K−1]."""
    return head_dim * head_dim + 3 * head_dim * (conv_kernel - 1)


def _l2norm(x: torch.Tensor) -> torch.Tensor:
    return x / torch.sqrt((x * x).sum(-1, keepdim=True) + 1e-6)


def _conv(w: KDAWeights, mixed: torch.Tensor, conv_state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """mixed [n, 3, H_l, d] new conv inputs; conv_state [3, H_l, d, K−1] -> (silu(conv) [n, 3, H_l, d], new state)."""
    km1 = conv_state.shape[-1]
    seq = torch.cat([conv_state, mixed.permute(1, 2, 3, 0)], dim=-1)          # [3, H_l, d, K-1+n]
    taps = w.conv.view(3, w.num_heads, w.head_dim, -1)                          # [3, H_l, d, K]
    windows = seq.unfold(-1, km1 + 1, 1)                                        # [3, H_l, d, n, K]
    out = (windows * taps[..., None, :]).sum(-1)                                # [3, H_l, d, n]
    return F.silu(out).permute(3, 0, 1, 2), seq[..., seq.shape[-1] - km1:].contiguous()


def _recurrence(q, k, v, g, beta, s):
    """Gated delta rule, token by token (decode, and the reference of `chunk_recurrence`).
    q,k,v,g [n, H, d]; beta [n, H]; s [H, d, d] -> (o [n, H, d], s)."""
    out = torch.empty_like(v)
    for t in range(q.shape[0]):
        s = s * g[t].exp()[..., None]
        mem = (s * k[t][..., None]).sum(-2)                                     # [H, d]
        delta = (v[t] - mem) * beta[t][..., None]
        s = s + k[t][..., None] * delta[..., None, :]
        out[t] = (s * q[t][..., None]).sum(-2)
    return out, s


def chunk_recurrence(q, k, v, g, beta, s, chunk: int = CHUNK):
    """Gated delta rule over chunks of `chunk` tokens (prefill): the same contract and results as
    `_recurrence`, within fp32 rounding. Within a chunk (per head; G_t = Σ_{j≤t} g_j per channel, D_ti =
    exp(G_t − G_i) for i ≤ t), writing S_t = diag(e^{G_t}) S_0 + Σ_{i≤t} diag(D_ti) k_i u_iᵀ turns the delta
    rule into one unit lower-triangular system for all the chunk's updates u (the UT transform):
      (I + diag(β) A) U = diag(β) (V − (K ⊙ e^G) S_0),   A_ti = Σ_c k_t k_i D_ti (i < t)
      O = (Q ⊙ e^G) S_0 + B U,                           B_ti = Σ_c q_t k_i D_ti (i ≤ t)
      S_C = diag(e^{G_C}) S_0 + (K ⊙ D_C·)ᵀ U.
    G is summed in float64 (no cancellation at fp32 when differences are taken) and no exponent leaves
    ±SPAN/2 (`_pair_products`), so no term over- or underflows however strong the decay."""
    out = torch.empty_like(v)
    for c0 in range(0, q.shape[0], chunk):
        sl = slice(c0, c0 + chunk)
        out[sl], s = _chunk(q[sl], k[sl], v[sl], g[sl], beta[sl], s)
    return out, s


SPAN = 80.0  # largest per-channel decay |G_C − G_1| in a chunk for the factored form (e^{±SPAN/2} ≪ fp32 max)


def _pair_products(q, k, cum):
    """(A, B) before masking: Σ_c k_t k_i e^{G_t − G_i} and Σ_c q_t k_i e^{G_t − G_i} for every t, i [H, C, C].
    Factored around the chunk's mid decay m (e^{G_t − m} · e^{m − G_i}: two matmuls, every factor within
    e^{±SPAN/2}); a chunk whose decay spans more than SPAN in some channel takes the pairwise form instead."""
    span = cum[:, 0] - cum[:, -1]                                               # [H, d] ≥ 0
    if float(span.max()) <= SPAN:
        mid = (cum[:, :1] + cum[:, -1:]) / 2
        up, down = (cum - mid).exp().float(), (mid - cum).exp().float()        # e^{G_t − m}, e^{m − G_i}
        kr = (k * down).transpose(1, 2)                                         # [H, d, i]
        return torch.matmul(k * up, kr), torch.matmul(q * up, kr)
    C = q.shape[1]
    above = ~torch.ones(C, C, dtype=torch.bool, device=q.device).tril()
    diff = (cum.unsqueeze(2) - cum.unsqueeze(1)).float()                        # [H, t, i, d]: G_t − G_i
    kd = k.unsqueeze(1) * diff.masked_fill_(above[None, :, :, None], float("-inf")).exp_()
    return (kd * k.unsqueeze(2)).sum(-1), (kd * q.unsqueeze(2)).sum(-1)


def _chunk(q, k, v, g, beta, s):
    q, k, v, g = (t.transpose(0, 1) for t in (q, k, v, g))                    # [H, C, d]
    beta = beta.T.unsqueeze(-1)                                                 # [H, C, 1]
    C = q.shape[1]
    incl = torch.ones(C, C, dtype=torch.bool, device=q.device).tril()          # i <= t
    cum = g.double().cumsum(1)                                                  # G_t, exact to fp32's rounding
    a, b = _pair_products(q, k, cum)
    a, b = a * incl.tril(-1), b * incl                                          # A: i < t, B: i ≤ t
    gam = cum.exp().float()                                                     # e^{G_t}
    rhs = beta * (v - torch.matmul(k * gam, s))
    lower = torch.eye(C, device=q.device) + beta * a
    u = torch.linalg.solve_triangular(lower, rhs, upper=False, unitriangular=True)
    o = torch.matmul(q * gam, s) + torch.matmul(b, u)
    k_end = k * (cum[:, -1:] - cum).exp().float()                               # k_i ⊙ e^{G_C − G_i}
    s = gam[:, -1, :, None] * s + torch.matmul(k_end.transpose(1, 2), u)
    return o.transpose(0, 1), s


def forget_gate(w: KDAWeights, x: torch.Tensor, lower_bound: float | None) -> torch.Tensor:
    """Per-channel log-decay g [n, H_l, d] (fp32)."""
    n = x.shape[0]
    f = linear(linear(x, w.f_a), w.f_b).float() + w.dt_bias
    f = f.view(n, w.num_heads, w.head_dim)
    rate = w.a_log.exp().view(1, -1, 1)
    if lower_bound is not None:
        return lower_bound * torch.sigmoid(rate * f)
    return -rate * torch.where(f > 20.0, f, torch.log1p(torch.exp(f)))


def kda_rows(w: KDAWeights, x: torch.Tensor, state: torch.Tensor, eps: float,
             lower_bound: float | None) -> tuple[torch.Tensor, torch.Tensor]:
    """One request's new rows x [n, hidden] (in position order) with its state [H_l, width] -> (pre-O output
    [n, H_l * d], updated state). The state is replaced, never modified in place."""
    n, H, d = x.shape[0], w.num_heads, w.head_dim
    rec = state[:, :d * d].view(H, d, d)
    conv_state = state[:, d * d:].view(H, 3, d, -1).transpose(0, 1)
    mixed = linear(x, w.qkv).float().view(n, 3, H, d)
    act, conv_new = _conv(w, mixed, conv_state)
    q, k, v = act.unbind(1)
    q, k = _l2norm(q) * d ** -0.5, _l2norm(k)
    g = forget_gate(w, x, lower_bound)
    beta = torch.sigmoid(linear(x, w.b).float())
    if n == 1 or CHUNK == 1:
        o, rec = _recurrence(q, k, v, g, beta, rec)
    else:
        o, rec = chunk_recurrence(q, k, v, g, beta, rec, CHUNK)
    gate = linear(linear(x, w.g_a), w.g_b).float().view(n, H, d)
    o = o * torch.rsqrt(o.pow(2).mean(-1, keepdim=True) + eps) * w.o_norm.float() * torch.sigmoid(gate)
    new_state = torch.cat([rec.reshape(H, d * d), conv_new.transpose(0, 1).reshape(H, -1)], dim=1)
    return o.reshape(n, H * d).to(x.dtype), new_state


def kda_forward(w: KDAWeights, x: torch.Tensor, spans: list[range], states: list[torch.Tensor], eps: float,
                lower_bound: float | None, cuts: list[list[int]] | None = None
                ) -> tuple[torch.Tensor, list[torch.Tensor], list[list[torch.Tensor]]]:
    """Rows x [N, hidden] in per-request `spans` with their states -> (this rank's partial O output [N, hidden],
    new states in span order, per span its states after each of `cuts[i]` rows: prefix-cache snapshots)."""
    pre = torch.empty(x.shape[0], w.num_heads * w.head_dim, dtype=x.dtype, device=x.device)
    new, taken = [], []
    for i, (rr, st) in enumerate(zip(spans, states)):
        got, at = [], rr.start
        for c in (cuts[i] if cuts else ()):
            if rr.start + c > at:
                pre[at:rr.start + c], st = kda_rows(w, x[at:rr.start + c], st, eps, lower_bound)
                at = rr.start + c
            got.append(st)
        if rr.stop > at:
            pre[at:rr.stop], st = kda_rows(w, x[at:rr.stop], st, eps, lower_bound)
        new.append(st)
        taken.append(got)
    return linear(pre, w.o), new, taken
