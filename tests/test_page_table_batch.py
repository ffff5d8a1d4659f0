"""The batched page paths (`ensure_step_pages`: `BlockManager.append_blocks` / `ensure_many` and
`PageTable.append_pages` / `append_many`) give exactly the tables and block ids of the per-request path
(`BlockManager.ensure` + `PageTable.append`), over random decode/prefill steps with releases, CP filtering,
refills of held blocks and repeated requests; OutOfBlocks allocates nothing."""
from __future__ import annotations

import random

import pytest
import torch

from splash.attention.batch import StepRequest
from splash.kv.block_manager import BlockManager, OutOfBlocks
from splash.kv.page_table import PageTable, ensure_step_pages


def per_request(bm, tables, reqs, keep=None):
    bs = tables.block_size
    for q in reqs:
        if q.num_new == 0 or (q.num_new == 1 and q.start_pos % bs):
            continue
        blocks = list(range(q.start_pos // bs, (q.end_pos - 1) // bs + 1))
        new = bm.ensure(q.req_id, [b for b in blocks if keep is None or keep(q, b)])
        if new:
            tables.append(q.req_id, new)


def snapshot(bm, tables):
    tables.flush()
    rows = {}
    for req in tables.requests():
        r, n = tables.row(req), tables.num_pages(req)
        assert int(tables.npages[r]) == n
        rows[req] = (tables.logical[r, :n].tolist(), tables.pages[r, :n].tolist())
        assert dict(zip(*rows[req])) == bm.table(req)
    return rows, {q: dict(bm.table(q)) for q in bm.requests() if bm.table(q)}, list(bm._free)


@pytest.mark.parametrize("world", [1, 2])
@pytest.mark.parametrize("seed", range(4))
def test_batched_step_pages_match_per_request(world, seed):
    rng, bs = random.Random(seed), 4
    keep = None if world == 1 else (lambda q, b: (b + q.owner) % world == 0)
    states = [(BlockManager(400, bs), PageTable(bs, rows=1, cols=1)) for _ in range(2)]
    lens: dict[str, int] = {}
    for step in range(60):
        for i in range(rng.randint(0, 2)):           # new requests start with a prefill chunk
            lens[f"s{step}r{i}"] = 0
        reqs = []
        for rid, n in list(lens.items()):
            if rng.random() < 0.07:                    # finished
                for bm, tables in states:
                    bm.release(rid)
                    tables.release(rid)
                del lens[rid]
                continue
            k = rng.randint(2, 9) if n == 0 or rng.random() < 0.1 else 1
            reqs.append(StepRequest(rid, n, k, owner=hash(rid) % world))
            lens[rid] = n + k
        if step % 17 == 5 and reqs:                    # a switch refilled a block ahead of the decode token
            q = reqs[0]
            for bm, tables in states:
                blk = q.end_pos // bs + 1
                tables.append(q.req_id, bm.ensure(q.req_id, [blk]))
        per_request(*states[0], reqs, keep)
        ensure_step_pages(*states[1], reqs, keep)
        assert snapshot(*states[0]) == snapshot(*states[1])


def test_append_blocks_declines_repeats_and_held_blocks():
    bm = BlockManager(8, 4)
    bm.ensure("a", [0])
    bm.ensure("b", [0])
    free = list(bm._free)
    assert bm.append_blocks(["a", "a"], [1, 2]) is None and bm.append_blocks(["a"], [0]) is None
    assert bm.append_blocks(["a", "c"], [1, 0]) is None   # "c" holds nothing yet
    assert bm._free == free
    assert bm.append_blocks(["b", "a"], [1, 1]) == [free[-1], free[-2]]


def test_out_of_blocks_allocates_nothing():
    bm, tables = BlockManager(5, 4), PageTable(4)
    ensure_step_pages(bm, tables, [StepRequest("a", 0, 8), StepRequest("b", 0, 4)])
    free, held = list(bm._free), {q: dict(bm.table(q)) for q in bm.requests()}
    for reqs in ([StepRequest("a", 8, 1), StepRequest("b", 4, 1), StepRequest("c", 0, 8)],   # 4 > 2 free
                 [StepRequest("a", 8, 1), StepRequest("b", 4, 1), StepRequest("c", 0, 1),
                  StepRequest("d", 0, 1)]):
        with pytest.raises(OutOfBlocks):
            ensure_step_pages(bm, tables, reqs)
        assert bm._free == free and {q: dict(bm.table(q)) for q in bm.requests()} == held
    with pytest.raises(OutOfBlocks) as e:
        bm.ensure_many([("a", [2, 3]), ("x", [0, 0, 1])])
    assert (e.value.needed, e.value.free) == (4, 2) and bm._free == free


def test_decode_pages_written_inside_inference_mode():
    bm, tables = BlockManager(64, 2), PageTable(2, rows=1, cols=1)
    reqs = [StepRequest(f"r{i}", 0, 3) for i in range(5)]
    with torch.inference_mode():
        ensure_step_pages(bm, tables, reqs)
        for pos in range(3, 12):
            ensure_step_pages(bm, tables, [StepRequest(q.req_id, pos, 1) for q in reqs])
        tables.flush()
    for q in reqs:
        r = tables.row(q.req_id)
        assert tables.logical[r, :6].tolist() == list(range(6)) and int(tables.npages[r]) == 6
        assert tables.pages[r, :6].tolist() == [bm.table(q.req_id)[b] for b in range(6)]


def test_append_pages_outside_the_decode_case_and_release_with_pages_queued():
    """`append_pages` given a request without a row, or a page not past its row's end, takes `append_many`'s path:
    the per-request path's table; releasing a request whose pages are still queued drops them, the rest land."""
    def build(batched: bool) -> dict:
        t = PageTable(4, rows=4, cols=4)
        t.append("a", [(0, 10)])
        t.flush()
        for reqs, logical, phys in ((["a", "b"], [1, 0], [11, 20]), (["a"], [0], [12])):
            if batched:
                t.append_pages(reqs, logical, phys)
            else:
                for q, b, p in zip(reqs, logical, phys):
                    t.append(q, [(b, p)])
        t.append("c", [(0, 30), (1, 31)])
        t.release("c")
        t.flush()
        return {q: (t.logical[t.row(q), :t.num_pages(q)].tolist(), t.pages[t.row(q), :t.num_pages(q)].tolist())
                for q in t.requests()}

    got = build(True)
    assert got == build(False) and sorted(got) == ["a", "b"] and got["b"] == ([0], [20])
