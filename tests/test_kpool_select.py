"""GLM-5.3-Flash's KPool selection on the paged cache (splash.attention.kpool) against a per-row brute force over
positions: the chosen pools + the tail, as physical slots in `meta.sparse`, for ragged prefill + decode batches,
pools that straddle pages (P not dividing the block size) and CP's position shards (every rank's candidates,
the global top-k, each rank keeping the slots it holds: their union is one rank's selection); the KPool vectors
stored in each KV dtype's form."""
from __future__ import annotations

import random

import pytest
import torch

from splash.attention import kpool
from splash.attention.batch import StepRequest
from splash.attention.metadata import build_metadata
from splash.kv.block_manager import BlockManager
from splash.kv.page_table import PageTable
from splash.kv.paged_cache import PagedLatentCache
from splash.models.indexer import index_scores
from splash.models.kpool import KPoolWeights, pool_keys

D, H = 8, 3
SPECS = [(0, 13), (21, 1), (3, 1), (40, 1), (9, 6), (0, 2)]   # (start, new rows): prefill chunks and decode


def weights(P: int, g: torch.Generator) -> KPoolWeights:
    z = torch.zeros(1)
    return KPoolWeights(wq_b=z, wk=z, k_norm=z, k_norm_bias=z, weights_proj=z, n_heads=H, head_dim=D, rope_dim=0,
                        interleave=False, ape=torch.randn(P, D, generator=g), gate=z)


def rank_state(vecs: dict, kv_dtype: str, bs: int, world: int, rank: int, seed: int):
    """This rank's cache (the blocks it holds: all, or CP's round-robin from anchor i % world; shuffled pages)
    with every held position's stored vectors, its metadata, and slot -> (request, position)."""
    rng = random.Random(seed + rank)
    reqs = [StepRequest(f"r{i}", s, n, owner=i % world) for i, (s, n) in enumerate(SPECS)]
    need = sum(-(-(s + n) // bs) for s, n in SPECS) + 2
    cache = PagedLatentCache(1, need, bs, 4, 0, kv_dtype, index_dim=D, index_layers=[0], index_parts=2)
    bm, tables = BlockManager(need, bs), PageTable(bs, rows=1, cols=1)
    rng.shuffle(bm._free)
    where = {}
    for q in reqs:
        blocks = [b for b in range(-(-q.end_pos // bs)) if world == 1 or (b + q.owner) % world == rank]
        if blocks:
            tables.append(q.req_id, bm.ensure(q.req_id, blocks))
        t = bm.table(q.req_id)
        pos = [p for p in range(q.end_pos) if p // bs in t]
        slots = [t[p // bs] * bs + p % bs for p in pos]
        where.update({s: (q.req_id, p) for s, p in zip(slots, pos)})
        if pos:
            cache.write_index(0, torch.tensor(slots), torch.stack([vecs[q.req_id][p] for p in pos]))
    return cache, reqs, build_metadata(reqs, tables, None if world == 1 else (world, rank)), where


def pool_scores(stored, w, q, hw, reqs) -> list[tuple[str, int, torch.Tensor]]:
    """Per query row: (request, position, the scores of its complete pools, brute force over positions)."""
    P, out, row = w.pool, [], 0
    for req in reqs:
        for p in range(req.start_pos, req.end_pos):
            n = (p + 1) // P
            keys = pool_keys(w, stored[req.req_id][:n * P].view(n, P, 2 * D))
            s = index_scores(q[row].view(1, 1, H, D), hw[row].view(1, 1, H), keys[None], w.softmax_scale)[0, 0]
            out.append((req.req_id, p, s))
            row += 1
    return out


def check_row(got: set, req: str, p: int, scores: torch.Tensor, P: int, k: int) -> None:
    """`got` is the tail + min(k, pools) whole complete pools, none scoring below a pool left out (ties free)."""
    n = scores.numel()
    assert {t for r, t in got if r == req} == {t for _, t in got}, "another request's position"
    pos = {t for _, t in got}
    tail = set(range(n * P, p + 1))
    assert tail <= pos and all(t < n * P for t in pos - tail), (p, sorted(pos))
    chosen = sorted({t // P for t in pos - tail})
    assert all(set(range(j * P, (j + 1) * P)) <= pos for j in chosen) and len(chosen) == min(k, n), (p, chosen)
    if len(chosen) < n:
        left = [j for j in range(n) if j not in chosen]
        assert scores[chosen].min() >= scores[left].max(), (p, scores, chosen)


def selected(meta, where, layer: int = 0) -> list[set[tuple[str, int]]]:
    sel = meta.sparse[layer]
    return [{where[s] for s, ok in zip(sl.tolist(), v.tolist()) if ok} for sl, v in zip(sel.slots, sel.valid)]


class _Gathered:
    """CP's all-gather of candidate scores, every rank's already computed (one process plays all ranks)."""

    def __init__(self, parts, rank):
        self.parts, self.size, self.rank = parts, len(parts), rank

    def all_gather(self, t):
        return torch.cat(self.parts)


def run_select(states, w, q, hw, topk, world):
    """Every rank's local candidates, then (CP) the global top-k over all of them; sets meta.sparse[0]."""
    K = min(topk // w.pool, (int(states[0][2].q_pos.max()) + 1) // w.pool)
    cands = [kpool.local_candidates(c, 0, m, w, q, hw, K, True) for c, _, m, _ in states]
    for rank, ((_, _, meta, _), (slots, valid, vals)) in enumerate(zip(states, cands)):
        if world > 1:
            chosen = kpool.global_topk(vals, _Gathered([v for _, _, v in cands], rank), topk // w.pool)
            valid[:, :K * w.pool] &= chosen.repeat_interleave(w.pool, dim=1)
        meta.sparse[0] = kpool.SparseSelection(slots * valid, valid)


@pytest.mark.parametrize("bs,P,world,kv_dtype", [(4, 4, 1, "float32"), (6, 4, 1, "float32"), (2, 4, 1, "bfloat16"),
                                                 (8, 4, 2, "float32"), (4, 2, 3, "float32"), (4, 4, 1, "fp8_e4m3")])
def test_selection_matches_brute_force(bs, P, world, kv_dtype):
    g = torch.Generator().manual_seed(bs * 10 + P + world)
    w = weights(P, g)
    vecs = {f"r{i}": torch.randn(s + n, 2 * D, generator=g) for i, (s, n) in enumerate(SPECS)}
    states = [rank_state(vecs, kv_dtype, bs, world, r, seed=bs) for r in range(world)]
    stored = {}  # the vectors as the pool gives them back (quantised formats round them)
    for cache, _, _, where in states:
        for slot, (req, p) in where.items():
            stored.setdefault(req, {})[p] = cache.read_index(0, torch.tensor([slot]))[0]
    stored = {req: torch.stack([ps[p] for p in range(len(ps))]) for req, ps in stored.items()}
    if kv_dtype == "float32":
        assert all(torch.equal(stored[r], vecs[r]) for r in vecs)
    else:
        assert all(0 < (stored[r] - vecs[r]).abs().max() < 0.1 * vecs[r].abs().max() for r in vecs)
    n = states[0][2].num_rows
    q, hw = torch.randn(n, H, D, generator=g), torch.randn(n, H, generator=g)
    topk = 2 * P
    assert kpool.needs_selection(states[0][2], topk, P, True)
    run_select(states, w, q, hw, topk, world)
    want = pool_scores(stored, w, q, hw, states[0][1])
    got = [set() for _ in want]
    for _, _, meta, where in states:
        for i, sel in enumerate(selected(meta, where)):
            assert not got[i] & sel, f"row {i}: two ranks attend the same position"
            got[i] |= sel
    for g_row, (req, p, scores) in zip(got, want):
        check_row(g_row, req, p, scores, P, topk // P)


@pytest.mark.parametrize("bs,P,world", [(4, 2, 1), (4, 2, 3), (8, 4, 2)])
def test_exact_ties_pick_the_earliest_pools_in_every_layout(bs, P, world):
    """A zero indexer query (e.g. a zero-embedding token) scores every pool exactly 0: one rank and CP's global
    top-k over position shards must both take the earliest pools (indexer.order_keys), not whatever torch.topk
    leaves at a tie — otherwise a switch into or out of CP changes the tokens."""
    g = torch.Generator().manual_seed(7 + world)
    w = weights(P, g)
    vecs = {f"r{i}": torch.randn(s + n, 2 * D, generator=g) for i, (s, n) in enumerate(SPECS)}
    states = [rank_state(vecs, "float32", bs, world, r, seed=bs) for r in range(world)]
    n = states[0][2].num_rows
    q, hw = torch.zeros(n, H, D), torch.randn(n, H, generator=g)
    topk = 2 * P
    run_select(states, w, q, hw, topk, world)
    got = [set() for _ in range(n)]
    for _, _, meta, where in states:
        for i, sel in enumerate(selected(meta, where)):
            got[i] |= sel
    rows = [(q.req_id, p) for q in states[0][1] for p in range(q.start_pos, q.end_pos)]
    for (req, p), sel in zip(rows, got):
        pools = (p + 1) // P
        want = set(range(min(topk // P, pools) * P)) | set(range(pools * P, p + 1))
        assert {t for _, t in sel} == want, (req, p, sorted(t for _, t in sel))
