"""splash.attention.dsa alone: sparse MLA over selected slots equals dense masked attention over the same keys
(every KV format), and CP's global top-k over per-rank candidates picks exactly the single-rank top-k (exact
ties included: they break towards the earlier position in both)."""
from __future__ import annotations

import pytest
import torch

from splash.attention.dsa import SparseSelection, global_topk, sparse_attend
from splash.kv.paged_cache import PagedLatentCache
from splash.models.indexer import select_topk_keys


def attend_dense(q: torch.Tensor, kv: torch.Tensor, valid: torch.Tensor, d_c: int,
                 scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Dense latent attention over explicit keys (the reference sparse_attend is tested against).

    q [B, Q, H, D]; kv [B, S, D] (D = d_c + d_r, fp32); valid [B, Q, S] bool.
    Returns õ [B, Q, H, d_c] and natural-log LSE [B, Q, H]; rows with no valid key give õ = 0, LSE = -inf.
    """
    scores = torch.einsum("bqhd,bsd->bqhs", q.float(), kv) * scale
    scores = scores.masked_fill(~valid[:, :, None, :], float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    safe = torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse))
    p = torch.exp(scores - safe[..., None])
    o = torch.einsum("bqhs,bsc->bqhc", p, kv[..., :d_c])
    return o, lse


@pytest.mark.parametrize("kv_dtype", ["float32", "bfloat16", "fp8_e4m3", "int8"])
def test_sparse_attend_equals_dense_over_selected(kv_dtype):
    torch.manual_seed(0)
    dc, dr, bs, nb, H, n, K = 32, 8, 4, 12, 3, 5, 6
    cache = PagedLatentCache(1, nb, bs, dc, dr, kv_dtype, index_dim=16, index_layers=[0])
    slots = torch.randperm(nb * bs)[:20]
    cache.write(0, slots, torch.randn(20, dc), torch.randn(20, dr))
    sel_idx = torch.stack([torch.randperm(20)[:K] for _ in range(n)])
    valid = torch.rand(n, K) > 0.3
    valid[-1] = False                                   # a row that selects nothing here
    sel = SparseSelection(slots[sel_idx] * valid, valid)
    ql, qr = torch.randn(n, H, dc), torch.randn(n, H, dr)
    o, lse = sparse_attend(ql, qr, cache, 0, sel, 0.3, scratch_bytes=1)   # one row per chunk
    c, k = cache.read(0, slots)
    kv = torch.cat([c, k], dim=-1)[None].expand(n, -1, -1)                # [n, 20, D]
    vis = torch.zeros(n, 20, dtype=torch.bool)
    vis.scatter_(1, sel_idx, valid)
    ref_o, ref_lse = attend_dense(torch.cat([ql, qr], -1)[:, None], kv, vis[:, None], dc, 0.3)
    assert torch.allclose(o, ref_o[:, 0], atol=1e-5) and torch.equal(torch.isinf(lse), torch.isinf(ref_lse[:, 0]))
    fin = torch.isfinite(lse)
    assert torch.allclose(lse[fin], ref_lse[:, 0][fin], atol=1e-5)
    assert (o[-1] == 0).all() and torch.isinf(lse[-1]).all()


class _FakeGroup:
    """Two 'ranks' in one process: all_gather stacks what each rank contributes (set before the call)."""

    def __init__(self, parts, rank):
        self.parts, self.rank, self.size = parts, rank, len(parts)

    def all_gather(self, t):
        return torch.stack(self.parts)


@pytest.mark.parametrize("ties", [False, True])
def test_global_topk_is_the_single_rank_topk(ties):
    """Also with exact ties (rows of all-zero scores, as a zero query gives, and few distinct values): the
    candidates carry their positions, so the global choice is the one-rank choice, not an artefact of the
    order in which the ranks' candidates are concatenated."""
    torch.manual_seed(1)
    n, T, k = 7, 30, 5
    scores = torch.randn(n, T)
    if ties:
        scores[:3] = 0.0
        scores[3:] = torch.randint(-2, 2, (n - 3, T)).float()
    owner = (torch.arange(T) // 4) % 2               # positions split over two ranks, block round-robin
    vis = torch.ones(n, T, dtype=torch.bool)
    idx, _ = select_topk_keys(scores, vis, k)[:2]
    want = torch.zeros(n, T, dtype=torch.bool).scatter_(1, idx, True)
    got = torch.zeros(n, T, dtype=torch.bool)
    local = []
    for r in (1, 0):                                  # each rank sees its shard in its own order
        pos = torch.nonzero(owner == r).squeeze(1).flip(0)
        i, _, keys = select_topk_keys(scores[:, pos], vis[:, pos], k, positions=pos)
        local.append((pos[i], keys))
    local.reverse()
    keys = [kk for _, kk in local]
    for r in range(2):
        mine = global_topk(keys[r], _FakeGroup(keys, r), k)
        for row in range(n):
            got[row, local[r][0][row][mine[row]]] = True
    assert torch.equal(got, want)
