"""KDA prefill: the chunk-parallel gated delta rule (UT transform) equals the token-by-token recurrence within fp32
rounding — outputs and final state, for both forget-gate forms (lower-bounded sigmoid, and softplus with decays
far beyond fp32's exp range inside one chunk), lengths that are not a multiple of the chunk, and a prefill
continued by decode steps from the chunked state."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from splash.models.kda import _l2norm, _recurrence, chunk_recurrence


def inputs(n: int, H: int, d: int, gate: str, seed: int = 0):
    g = torch.Generator().manual_seed(seed)

    def r(*shape):
        return torch.randn(*shape, generator=g)
    q, k = _l2norm(r(n, H, d)) * d ** -0.5, _l2norm(r(n, H, d))
    decay = -5.0 * torch.sigmoid(r(n, H, d)) if gate == "lower_bound" else -F.softplus(4 * r(n, H, d)) * 4
    return q, k, r(n, H, d), decay, torch.sigmoid(r(n, H)), r(H, d, d)


def close(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


@pytest.mark.parametrize("n,H,d,chunk", [(1, 2, 4, 16), (37, 8, 8, 16), (64, 3, 16, 16), (50, 2, 32, 7),
                                         (40, 4, 8, 64)])
@pytest.mark.parametrize("gate", ["lower_bound", "softplus"])
def test_chunked_equals_token_by_token(n, H, d, chunk, gate):
    q, k, v, g, beta, s0 = inputs(n, H, d, gate)
    o_ref, s_ref = _recurrence(q, k, v, g, beta, s0)
    o, s = chunk_recurrence(q, k, v, g, beta, s0, chunk)
    assert torch.isfinite(o).all() and torch.isfinite(s).all()
    assert close(o, o_ref) < 2e-6 and close(s, s_ref) < 2e-6


def test_chunked_prefill_then_decode():
    q, k, v, g, beta, s0 = inputs(45, 4, 16, "lower_bound", seed=1)
    o_ref, s_ref = _recurrence(q, k, v, g, beta, s0)
    o, s = chunk_recurrence(q[:40], k[:40], v[:40], g[:40], beta[:40], s0)
    outs = [o]
    for t in range(40, 45):
        o_t, s = _recurrence(q[t:t + 1], k[t:t + 1], v[t:t + 1], g[t:t + 1], beta[t:t + 1], s)
        outs.append(o_t)
    assert close(torch.cat(outs), o_ref) < 2e-6 and close(s, s_ref) < 2e-6


def test_factored_and_pairwise_forms_agree(monkeypatch):
    """A chunk whose decay spans ≤ SPAN uses two matmuls around its mid decay, a wider one the pairwise form:
    both give the token-by-token result (forced here on the same inputs)."""
    from splash.models import kda

    q, k, v, g, beta, s0 = inputs(48, 4, 16, "lower_bound", seed=2)
    o_ref, s_ref = _recurrence(q, k, v, g, beta, s0)
    for span in (kda.SPAN, 0.0):
        monkeypatch.setattr(kda, "SPAN", span)
        o, s = chunk_recurrence(q, k, v, g, beta, s0, 16)
        assert close(o, o_ref) < 2e-6 and close(s, s_ref) < 2e-6, span
